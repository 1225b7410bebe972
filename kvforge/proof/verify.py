"""Evidence per patch: each fix's Checks fail before it and pass after it; the suite passes at the end.

For patch N of a series (Kind fix) the tree before it is the base plus patches 1..N-1 and the tree
after it adds patch N. Every Checks test must fail or error before (a test file that does not exist
yet counts as failing) and pass after. A fix with no Checks, or whose Checks already pass before
it, proves nothing: it is "unproven" and verify fails. refactor and test patches are held to
pass-to-pass only: every Checks test passes on the fully patched tree, and no test of the target's
selection fails there that does not fail on the base too: each selected test id that fails on the
patched tree is run on the base (once per base, env and selection in a cache: testrun.save_baseline);
fail on both is the base's state (pre-existing, shown, not blamed), fail on the patched tree only
is a new failure and fails verify.

pytest runs once per tree state with every node needed there (patch N's "after" and patch N+1's
"before" share a run); outcomes come from the JUnit XML each run writes.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from kvforge.core.errors import EXIT_TESTS
from kvforge.core import evidence
from kvforge.git import gitutil
from kvforge.env.components import contexts, describe_layer, run_each
from kvforge.env.venv import target_env
from kvforge.core.outcome import Done, Outcome
from kvforge.core.render import table
from kvforge.git.trees import open_stack
from kvforge.proof.testrun import (RunResult, against_base, compare, compare_lines, run_properties, run_pytest, selection,
                      summary_line, unique)

PLATFORM = "cpu"
VERB = {"passed": "passes", "failed": "fails", "error": "errors", "skipped": "is skipped",
        "missing": "is not in the tree"}


@dataclass
class CheckResult:
    node: str
    before: str | None  # passed | failed | error | skipped | missing; None: not run (refactor/test)
    after: str | None
    before_seconds: float = 0.0
    after_seconds: float = 0.0
    before_how: str = "in tree"  # in tree | from the patch (its new test file on the old tree) | absent
    before_message: str = ""  # why it failed before (the evidence), or "" when it passed
    after_message: str = ""
    before_kind: str | None = None  # behaviour | absent-api | absent-test; None when it did not fail


@dataclass
class PatchVerdict:
    n: int
    name: str
    fix_id: str
    kind: str
    status: str  # proven | unproven | failing | pass-to-pass
    reason: str = ""
    in_base: bool = False
    commit: str = ""
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status in ("proven", "pass-to-pass")

    def behaviour_before(self) -> int:
        return sum(c.before_kind == "behaviour" for c in self.checks)

    def fail_before(self) -> tuple[int, int]:
        return sum(c.before in ("failed", "error", "missing") for c in self.checks), len(self.checks)

    def pass_after(self) -> tuple[int, int]:
        return sum(c.after == "passed" for c in self.checks), len(self.checks)


@dataclass
class VerifyReport:
    target: str
    component: str
    platform: str
    base_ref: str
    base: str
    base_source: str
    series: str
    series_dir: str
    env: str
    origin: str = "series"  # the series files, or "--from REV (sha)"
    patches: list[PatchVerdict] = field(default_factory=list)
    regression: dict = field(default_factory=dict)
    runs: list[dict] = field(default_factory=list)
    ok: bool = False
    seconds: float = 0.0
    report: str = ""
    layer: dict | None = None  # built on another component: its tree and the stand-ins (kvforge/env/components.py)

    def to_json(self) -> dict:
        data = asdict(self)
        for p, v in zip(data["patches"], self.patches):
            p["fail_before"], p["pass_after"] = list(v.fail_before()), list(v.pass_after())
            p["behaviour_before"] = v.behaviour_before()
        return data

    def problems(self) -> list[str]:
        out = [f"{p.name}: {p.status}: {p.reason}" for p in self.patches if not p.ok]
        if not self.regression.get("ok"):
            out.append(f"regression suite: {self.regression.get('reason', 'failed')}")
        return out


TEST_NAME = re.compile(r"(^|/)(test_[^/]*\.py|[^/]*_test\.py|conftest\.py)$")


def test_side(path: str) -> bool:
    """A file of the test suite: under a top-level tests/ directory, or a pytest module or conftest."""
    return path.startswith("tests/") or bool(TEST_NAME.search(path))


def test_changes(stack, n: int) -> tuple[list[str], list[str]]:
    """The test-side files patch n adds or changes (as it leaves them) and those it deletes."""
    out = gitutil.run(stack.worktree, "diff", "--name-status", "--no-renames", "-z", stack.commits[n - 1],
                      stack.commits[n]).stdout.split("\0")
    written: list[str] = []
    removed: list[str] = []
    for status, path in zip(out[::2], out[1::2]):
        if test_side(path):
            (removed if status == "D" else written).append(path)
    return written, removed


@dataclass
class Run:
    """One pytest run: the tree after patch n (0: the base), with patch `tests_of`'s test-side files laid
    over it when set (the patch's tests on the code before it: its fail-before)."""
    n: int
    nodes: list[str]
    tests_of: int | None = None
    overlay: list[str] = field(default_factory=list)  # written as they are after patch tests_of
    remove: list[str] = field(default_factory=list)  # deleted by patch tests_of

    @property
    def name(self) -> str:
        return f"state-{self.n}" + (f"-tests-{self.tests_of}" if self.tests_of else "")


def plan(patches, final_nodes: list[str], stack=None, prove: Sequence[int] | None = None
         ) -> tuple[list[Run], dict[int, int], dict[int, int]]:
    """The pytest runs, in tree order, and for each proven patch n the index of its before and after run.

    Patch n's Checks run before it on the tree before it with the patch's test-side changes laid over
    it (its new or changed test modules, conftest and helpers under tests/, as the patch leaves them;
    the files it deletes removed): the old code with the new test, so a test the patch adds to an existing
    module runs there too and must show the bug. The "before" of patch n shares state n-1's run (the
    "after" of patch n-1) when that run needs nothing else, or when the patch only adds new test modules
    (which no other test sees); otherwise it is a run of its own, so patch n-1 is judged on its own tests.
    `prove`: the patches to prove (default all Kind fix); the others' Checks run only in the final state.
    """
    size = len(patches)
    wanted = set(range(1, size + 1) if prove is None else prove)
    fixes = [n for n, p in enumerate(patches, 1) if p.kind == "fix" and p.checks and n in wanted]
    plain: dict[int, list[str]] = {n: [] for n in range(size + 1)}
    for n in fixes:
        plain[n] += patches[n - 1].checks
    plain[size] += final_nodes
    shared: dict[int, Run] = {}  # state n-1's run carrying patch n's tests
    extra: dict[int, Run] = {}  # patch n's own before run at state n-1
    for n in fixes:
        checks = list(patches[n - 1].checks)
        written, removed = test_changes(stack, n) if stack is not None else ([], [])
        if not written and not removed:
            plain[n - 1] += checks
            continue
        new_only = not removed and all(not stack.has(n - 1, f) and not f.endswith("conftest.py") for f in written)
        if new_only or not plain[n - 1]:
            shared[n - 1] = Run(n - 1, checks, n, written, removed)
        else:
            extra[n] = Run(n - 1, checks, n, written, removed)
    runs: list[Run] = []
    before: dict[int, int] = {}
    after: dict[int, int] = {}
    for s in range(size + 1):
        main = shared.get(s)
        if main is not None:
            main.nodes = unique(plain[s] + main.nodes)
            before[s + 1] = len(runs)
            runs.append(main)
        elif plain[s]:
            if s + 1 in fixes and s + 1 not in extra:
                before[s + 1] = len(runs)
            runs.append(Run(s, unique(plain[s])))
        if plain[s] or main is not None:
            after[s] = len(runs) - 1
        if s + 1 in extra:
            before[s + 1] = len(runs)
            runs.append(extra[s + 1])
    return runs, before, {n: i for n, i in after.items() if n in fixes or n == size}


def judge(n: int, patch, before: RunResult, after: RunResult, in_base: bool, commit: str,
          overlaid: Sequence[str] = (), proven_elsewhere: bool = False) -> PatchVerdict:
    v = PatchVerdict(n, patch.name, patch.fix_id, patch.kind, "pass-to-pass", in_base=in_base, commit=commit)
    if patch.kind != "fix":
        v.reason = f"Kind {patch.kind}: held to the regression suite only"
        return v
    if proven_elsewhere and patch.checks:
        v.reason = "not re-proven in this run (its series' own verify proves it): held to pass-to-pass"
        return v
    if not patch.checks:
        v.status, v.reason = "unproven", "Kind fix with no Checks: nothing shows it fixes anything"
        return v
    outcomes: dict[str, tuple[str, str]] = {}  # node -> (before, after): both ran for a fix with Checks
    for node in patch.checks:
        b, a = outcomes[node] = before.outcome(node), after.outcome(node)
        how = "from the patch" if node.split("::", 1)[0] in overlaid else ("absent" if b == "missing" else "in tree")
        message = before.message_of(node)
        v.checks.append(CheckResult(node, b, a, before.seconds_of(node), after.seconds_of(node),
                                    how, message, after.message_of(node), before_kind=fail_kind(b, message)))
    bug = set(patch.bug_checks)  # the Checks that show the bug (default: all)
    not_after = [c.node for c in v.checks if c.after != "passed"]
    not_before = [c.node for c in v.checks if c.before not in ("failed", "error", "missing")]
    if not_after:
        v.status = "failing"
        v.reason = "; ".join(f"{node} {VERB[outcomes[node][1]]} with the patch" for node in not_after)
    elif not_before:
        v.status = "unproven"
        v.reason = "; ".join(f"{node} already {VERB[outcomes[node][0]]} before the patch" for node in not_before)
        if in_base:
            v.reason += " (the patch is already in the base)"
    elif not any(c.before_kind == "behaviour" and c.node in bug for c in v.checks):
        v.status = "unproven"
        shown = [c for c in v.checks if c.node in bug]
        what = "Checks" if len(bug) == len(v.checks) else "Bug-Checks"
        v.reason = (f"no {what} test fails before the patch for a behavioural reason: each fails only because "
                    "the API or the test is not there yet (" + "; ".join(
                        f"{c.node.split('::')[-1]}: {c.before_message or c.before_kind}" for c in shown[:3]) + ")")
    else:
        v.status = "proven"
    return v


# A fail-before that only shows the interface is new: the import, attribute, keyword, config field or
# command-line option the test uses does not exist yet. It proves the API is new, not that behaviour
# changed. An AttributeError on None is a behaviour (a bug's symptom), not a missing API.
ABSENT_API = re.compile(
    r"^(ImportError|ModuleNotFoundError|NameError)\b|cannot import name|No module named"
    r"|^AttributeError: (?!'NoneType').*has no attribute|unexpected keyword argument"
    r"|validation error for \w+Config|Extra inputs are not permitted|^SystemExit: 2\b"
    r"|^fixture '.*' not found|^TypeError: .*takes \d+ positional arguments? but \d+ (were|was) given"
    r"|missing \d+ required (positional|keyword-only) arguments?")


def fail_kind(before: str | None, message: str) -> str | None:
    """Why a Checks test did not pass before its patch: behaviour | absent-api | absent-test (None: it passed)."""
    if before == "missing":
        return "absent-test"
    if before not in ("failed", "error"):
        return None
    if message.startswith("collection error"):
        message = message.split(": ", 1)[-1]
    return "absent-api" if ABSENT_API.search(message.strip()) else "behaviour"


def verify_target(ctx, prove: Sequence[int] | None = None) -> VerifyReport:
    """Prove ctx's series (the series files, or the commits of --from) patch by patch on CPU.

    `prove`: only these patches (1-based; -1 the last) are proven fail-before/pass-after; the others are held to
    pass-to-pass (their Checks pass on the patched tree), as `kvforge pick --verify` asks of a series
    `kvforge verify` proved before.
    """
    say = ctx.progress
    start = time.monotonic()
    target, comp = ctx.target, ctx.component
    stack = open_stack(ctx)
    patches = stack.series.patches
    if prove is not None:  # -1: the last patch
        prove = [n if n > 0 else len(patches) + 1 + n for n in prove]
    all_checks = unique(c for p in patches for c in p.checks)
    final_nodes = selection(comp, PLATFORM, all_checks, target.path)
    env = target_env(ctx, base=stack.base)
    env.check()
    report = VerifyReport(target.name, comp.name, PLATFORM, stack.base.ref, stack.base.commit, stack.base.source,
                          stack.digest, str(comp.series_dir), env.key, stack.origin,
                          layer=env.layer.to_json() if env.layer else None)
    partial = "" if prove is None else "patch-" + "-".join(str(n) for n in sorted(prove))
    rdir = evidence.attachments(ctx.cache, stack.key, "verify", partial)
    runs, before_of, after_of = plan(patches, final_nodes, stack, prove)
    selectors = list(comp.tests[PLATFORM])
    results: list[RunResult] = []
    size = len(patches)
    say(f"verifying {len(patches)} patches of {target.name} on {stack.base.ref} ({stack.base.commit[:12]}), "
        f"series {stack.digest}: {len(runs)} pytest runs, env {env.key}")
    with stack.lock(say):
        for run in runs:
            n = run.n
            commit = stack.checkout(n)
            state = ("base" if n == 0 else f"after-{n}") + (f"+tests-of-{run.tests_of}" if run.tests_of else "")
            say(f"[{n}/{size}] {stack.label(n)} ({commit[:12]}): {len(run.nodes)} selectors")
            if run.tests_of:
                stack.overlay(run.tests_of, run.overlay)
                for path in run.remove:
                    (stack.worktree / path).unlink(missing_ok=True)
                say(f"[{n}/{size}] with the test-side files of patch {run.tests_of} (its tests on the old tree): "
                    + ", ".join(run.overlay + [f"{f} (deleted)" for f in run.remove]))
            result = run_pytest(env, stack.worktree, run.nodes, rdir / f"{run.name}.xml",
                                run_properties(target, comp, stack, PLATFORM, state, commit), stack.label(n), commit)
            results.append(result)
            say(f"[{n}/{size}] " + (summary_line(result) if result.exit_code is not None
                                    else "nothing to run: the tests are not in this tree yet"))
        empty = RunResult("", "", [])
        final = results[after_of[size]] if size in after_of else empty
        cmp = against_base(ctx, stack, env, final, selectors, all_checks, rdir) if patches else \
            compare(final, final, selectors, all_checks, "same tree")
    report.runs = [r.to_json() | {"state": run.n, "tests_of": run.tests_of, "overlay": run.overlay + run.remove}
                   for run, r in zip(runs, results)]
    for n, p in enumerate(patches, 1):
        if n in before_of:
            b = runs[before_of[n]]
            report.patches.append(judge(n, p, results[before_of[n]], results[after_of[n]], stack.in_base(n),
                                        stack.commits[n], b.overlay if b.tests_of == n else []))
        else:
            report.patches.append(judge(n, p, empty, empty, stack.in_base(n), stack.commits[n],
                                        proven_elsewhere=prove is not None))
    c = final.counts()
    absent = final.not_in_tree + final.missing
    failing_checks = [n for n in all_checks if final.outcome(n) in ("failed", "error")]
    reason = ""
    if final.exit_code is None or not final.cases:
        reason = "no tests ran"
    elif cmp.new or failing_checks:
        reason = "; ".join(part for part in (
            f"{len(cmp.new)} new failures (not failing on the base): "
            + ", ".join(f["node"] for f in cmp.new[:5]) if cmp.new else "",
            f"{len(failing_checks)} Checks fail: {', '.join(failing_checks[:5])}" if failing_checks else "") if part)
    elif absent:
        reason = f"not in the patched tree: {', '.join(absent[:5])}"
    report.regression = {"selection": selectors, "checks": all_checks, **c,
                         "seconds": round(final.seconds, 2), "junit": str(final.junit) if final.junit else None,
                         "commit": final.commit, "ok": not reason, "reason": reason, "problems": final.problems(50),
                         "compare": cmp.to_json()}
    report.ok = not reason and all(p.ok for p in report.patches)
    report.seconds = time.monotonic() - start
    if partial:  # not the series' evidence (kvforge pr and notes read that): its files stay, no record
        report.report = f"{rdir} (patches {', '.join(map(str, sorted(prove or [])))} only: no verify record)"
        return report
    record = evidence.Record("verify", stack.key, origin=stack.origin, platform=PLATFORM, ok=report.ok,
                             data=report.to_json())
    report.report = str(evidence.save(ctx.cache, record))
    return report


def _frac(pair: tuple[int, int], seconds: float) -> str:
    return f"{pair[0]}/{pair[1]} ({seconds:.1f}s)" if pair[1] else "-"


def verdict(report: VerifyReport) -> tuple[int, str | None]:
    """The exit code and, when not 0, the one-line reason."""
    if report.ok:
        return 0, None
    unproven = sum(p.status == "unproven" for p in report.patches)
    failing = sum(p.status == "failing" for p in report.patches)
    parts = [f"{unproven} unproven" if unproven else "", f"{failing} failing" if failing else "",
             "" if report.regression.get("ok") else "regression suite fails"]
    return EXIT_TESTS, f"verify {report.target}: " + ", ".join(p for p in parts if p)


def render_verify_report(report: VerifyReport) -> str:
    """The text of `kvforge verify`: one row per patch, the regression suite, and OK when all is proven."""
    lines = [f"{report.target}/{report.component}: {report.base_ref} ({report.base[:12]}, {report.base_source}) + "
             f"series {report.series} ({len(report.patches)} patches), env {report.env}, {report.platform}"]
    if report.layer:
        lines.append(describe_layer(report.layer))
    if report.patches:
        rows = []
        for p in report.patches:
            fb = _frac(p.fail_before(), sum(c.before_seconds for c in p.checks))
            if p.checks and all(c.before == "missing" for c in p.checks):
                fb = f"{len(p.checks)}/{len(p.checks)} (absent)"
            pa = _frac(p.pass_after(), sum(c.after_seconds for c in p.checks))
            kinds = [c.before_kind for c in p.checks if c.before_kind]
            why = ", ".join(f"{kinds.count(k)} {k}" for k in ("behaviour", "absent-api", "absent-test")
                            if kinds.count(k)) or "-"
            status = p.status + (" (in base)" if p.in_base else "")
            rows.append([p.n, p.name, p.kind, fb, why, pa, status])
        lines.append(table(["#", "patch", "kind", "fail-before", "why it failed before", "pass-after", "result"], rows))
    else:
        lines.append("nothing to prove: the series is empty")
    if any(c.before_how == "from the patch" for p in report.patches for c in p.checks):
        lines.append("fail-before: a patch's Checks run on the tree before it with the patch's test-side changes "
                     "laid over it (old code, new test)")
    if any(c.before_kind for p in report.patches for c in p.checks):
        lines.append("why: behaviour = an assertion about vLLM's behaviour failed; absent-api = the API the test uses "
                     "does not exist yet (import/attribute/keyword); a fix needs at least one behaviour")
    lines += [f"  {p.n}: {p.reason}" for p in report.patches if not p.ok]
    r = report.regression
    extra = f" + {len(r['checks'])} Checks" if r["checks"] else ""
    where = "the patched tree" if report.patches else "the base tree"
    sel = r["selection"]
    lines.append(f"regression ({', '.join(sel) if len(sel) <= 3 else f'{len(sel)} test modules'}{extra}) on {where}: "
                 f"{r['passed']} passed, {r['failed']} failed, {r['errors']} errors, {r['skipped']} skipped in "
                 f"{r['seconds']:.1f}s" + ("" if r["ok"] else f"  FAILED: {r['reason']}"))
    lines += compare_lines(r.get("compare") or {}, bool(report.patches))
    lines.append(f"report: {report.report} ({len(report.runs)} pytest runs, {report.seconds:.1f}s)")
    if verdict(report)[0] == 0:
        proven = sum(p.status == "proven" for p in report.patches)
        pre = (report.regression.get("compare") or {}).get("pre_existing_failures", 0)
        suite = "no new failures in the regression suite" + (f" ({pre} pre-existing on the base)" if pre else "")
        lines.append(f"verify {report.target}: OK: {proven} fix{'' if proven == 1 else 'es'} proven, {suite}"
                     if report.patches else f"verify {report.target}: OK: nothing to prove, {suite}")
    return "\n".join(lines)


def verify_outcome(report: VerifyReport) -> Done:
    """A report as `kvforge verify` ends: its JSON carries "exit" and "error" (null when all is proven)."""
    code, error = verdict(report)
    return Done({**report.to_json(), "exit": code, "error": error}, render_verify_report(report), code, error)


def verify_command(ctx, component: str | None) -> Outcome:
    """`kvforge verify`: each component of the target (or the one given), in order."""
    return run_each(contexts(ctx, component), lambda c: verify_outcome(verify_target(c)))
