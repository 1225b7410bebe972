"""Running vLLM's own tests on a tree: one pytest process, JUnit XML out, per-node outcomes back.

pytest runs with the test environment's python from the root of a base or patched tree, with
kvforge's small plugin (kvforge/data/pytest-plugin) loaded: it keeps only the selected nodes,
records target, base, series and platform as JUnit properties on every testcase, and notes
selectors that name nothing in this tree. Outcomes are read back from the JUnit XML, never from
pytest's console output.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Sequence
from typing import TextIO

from kvforge.core import evidence
from kvforge.env.components import contexts, describe_layer, run_each
from kvforge.env.venv import Env, target_env
from kvforge.project.platforms import HARDWARE
from kvforge.project.platforms import get as get_platform
from kvforge.core.errors import EXIT_ENV, EXIT_NOT_RUN, EXIT_TESTS, EXIT_USAGE, KvforgeError
from kvforge.core.outcome import Done, Outcome
from kvforge.ci.runner import hardware_command
from kvforge.project.targets import Component, Target
from kvforge.git.trees import open_stack

FAILING = ("failed", "error", "missing")
PYTEST_EXIT = {0: "all passed", 1: "tests failed", 2: "interrupted", 3: "internal error", 4: "usage error",
               5: "no tests ran"}


@dataclass
class Case:
    nodeid: str
    outcome: str  # passed | failed | error | skipped
    seconds: float
    message: str = ""


@dataclass
class RunResult:
    """One pytest process on one tree state."""

    label: str
    commit: str
    selectors: list[str]
    junit: Path | None = None
    log: Path | None = None
    exit_code: int | None = None  # None: nothing to run in this tree
    seconds: float = 0.0
    cases: list[Case] = field(default_factory=list)
    not_in_tree: list[str] = field(default_factory=list)  # selectors whose file is absent: not passed to pytest
    missing: list[str] = field(default_factory=list)  # selectors pytest found nothing for
    collect_errors: list[str] = field(default_factory=list)
    properties: dict[str, list[str]] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
        for c in self.cases:
            out[{"error": "errors"}.get(c.outcome, c.outcome)] += 1
        return out

    def matching(self, selector: str) -> list[Case]:
        return [c for c in self.cases if node_matches(c.nodeid, selector)]

    def outcome(self, selector: str) -> str:
        """passed | failed | error | skipped | missing, for a file, directory or node selector."""
        path = selector.split("::", 1)[0].rstrip("/")
        if selector in self.not_in_tree:
            return "missing"
        if any(ce == path or ce.startswith(path + "/") for ce in self.collect_errors):
            return "error"
        cases = self.matching(selector)
        if not cases:
            return "missing"
        kinds = {c.outcome for c in cases}
        for worst in ("error", "failed"):
            if worst in kinds:
                return worst
        return "passed" if "passed" in kinds else "skipped"

    def message_of(self, selector: str) -> str:
        """Why a selector did not pass: the first failure message, or why it did not run."""
        if self.outcome(selector) == "missing":
            return "not in this tree"
        path = selector.split("::", 1)[0].rstrip("/")
        ce = next((ce for ce in self.collect_errors if ce == path or ce.startswith(path + "/")), None)
        if ce:
            case = next((c for c in self.cases if c.nodeid == ce), None)
            return "collection error" + (f": {case.message}" if case and case.message else "")
        return next((c.message for c in self.matching(selector) if c.outcome != "passed" and c.message), "")

    def seconds_of(self, selector: str) -> float:
        return sum(c.seconds for c in self.matching(selector))

    def problems(self, limit: int = 20) -> list[str]:
        out = [f"{ce}: collection error" for ce in self.collect_errors]
        out += [f"{c.nodeid}: {c.outcome}" + (f" ({c.message})" if c.message else "")
                for c in self.cases if c.outcome in ("failed", "error") and c.nodeid not in self.collect_errors]
        return out[:limit] + ([f"... and {len(out) - limit} more"] if len(out) > limit else [])

    def to_json(self) -> dict:
        return {"label": self.label, "commit": self.commit, "selectors": self.selectors,
                "junit": str(self.junit) if self.junit else None, "log": str(self.log) if self.log else None,
                "pytest_exit": self.exit_code, "seconds": round(self.seconds, 2), **self.counts(),
                "not_in_tree": self.not_in_tree, "missing": self.missing, "collect_errors": self.collect_errors,
                "problems": self.problems(50)}


def node_matches(nodeid: str, selector: str) -> bool:
    """The same rule as the pytest plugin: a path selects everything under it, a node its variants."""
    selector = selector.rstrip("/")
    if "::" not in selector:
        path = nodeid.split("::", 1)[0]
        return path == selector or path.startswith(selector + "/")
    return nodeid == selector or nodeid.startswith(selector + "[") or nodeid.startswith(selector + "::")


def unique(items) -> list[str]:
    seen: dict[str, None] = {}
    for i in items:
        seen.setdefault(i, None)
    return list(seen)


def path_args(selectors: list[str]) -> list[str]:
    """The files and directories to hand pytest: each once, none inside another."""
    paths = unique(s.split("::", 1)[0].rstrip("/") for s in selectors)
    return [p for p in paths if not any(q != p and p.startswith(q + "/") for q in paths)]


def run_pytest(env: Env, tree: Path, selectors: list[str], junit: Path, properties: dict[str, str], label: str,
               commit: str, keyword: str | None = None, echo: TextIO | None = None,
               timeout: float | None = None) -> RunResult:
    """Run the selectors that exist in `tree` in one pytest process; parse its JUnit XML."""
    result = RunResult(label=label, commit=commit, selectors=list(selectors))
    present: list[str] = []
    for s in selectors:
        (present if (tree / s.split("::", 1)[0]).exists() else result.not_in_tree).append(s)
    if not present:
        return result
    junit.parent.mkdir(parents=True, exist_ok=True)
    junit.unlink(missing_ok=True)
    config = junit.with_suffix(".select.json")
    config.write_text(json.dumps({"select": present, "properties": properties}, indent=1), encoding="utf-8")
    log = junit.with_suffix(".log")
    cmd = [str(env.python), "-m", "pytest", "-p", "kvforge_pytest", "-p", "no:cacheprovider", "-q", "-rfE",
           "--color=no", "--rootdir", str(tree), "--junitxml", str(junit), "-o", "junit_family=xunit2",
           "-o", "junit_suite_name=kvforge", "--continue-on-collection-errors", *path_args(present)]
    if keyword:
        cmd += ["-k", keyword]
    timeout = timeout or float(os.environ.get("KVFORGE_TEST_TIMEOUT", "3600"))
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        out.write("$ " + " ".join(cmd) + f"\n(in {tree})\n")
        out.flush()
        try:  # its own process group: a timeout or an interrupt ends pytest and every process it started
            proc = subprocess.Popen(cmd, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    errors="replace", env=env.environ({"KVFORGE_PYTEST_CONFIG": str(config)}),
                                    start_new_session=True)
        except OSError as exc:
            raise KvforgeError(f"{env.python}: cannot start the test environment's python: {exc.strerror}",
                               EXIT_ENV) from None
        fired = threading.Event()

        def kill_group() -> None:
            fired.set()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

        watchdog = threading.Timer(timeout, kill_group)  # also when pytest hangs without printing
        watchdog.daemon = True
        watchdog.start()
        try:
            assert proc.stdout is not None  # stdout=PIPE
            for line in proc.stdout:
                out.write(line)
                if echo is not None:
                    echo.write(line)
                    echo.flush()
            proc.wait()
        except BaseException:
            kill_group()
            proc.wait()
            raise
        finally:
            watchdog.cancel()
        if fired.is_set():
            raise KvforgeError(f"pytest in {tree} ran past {timeout:.0f}s ($KVFORGE_TEST_TIMEOUT); log: {log}",
                               EXIT_TESTS)
    result.seconds = time.monotonic() - start
    result.exit_code = proc.returncode
    result.log = log
    if junit.is_file():
        result.junit = junit
        parse_junit_into(result, junit)
    if proc.returncode not in (0, 1, 5) and not result.cases:
        raise KvforgeError(f"pytest could not run in {tree} (exit {proc.returncode}, "
                           f"{PYTEST_EXIT.get(proc.returncode, '?')}): {startup_failure(log)}; log: {log}", EXIT_ENV)
    return result


def startup_failure(log: Path) -> str:
    """The one line of a pytest log that says why nothing ran (a conftest ImportError, a bad option)."""
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()[2:]
    head = next((ln.strip() for ln in lines if "while loading conftest" in ln or ln.startswith("ERROR:")), None)
    err = next((ln[1:].strip() for ln in lines if ln.startswith("E ") and "Error" in ln), None)
    if not err:
        err = next((ln.strip() for ln in reversed(lines) if "Error" in ln or "error" in ln), None)
    parts = [p for p in (head, err) if p]
    return " ".join(parts) if parts else (lines[-1].strip() if lines else "no output")


def parse_junit(path: Path) -> tuple[list[Case], dict[str, list[str]]]:
    """Testcases (nodeid from kvforge's property; outcome from the child elements) and suite properties."""
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        raise KvforgeError(f"{path}: not valid JUnit XML ({exc})", EXIT_ENV) from None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    cases: list[Case] = []
    props: dict[str, list[str]] = {}
    for suite in suites:
        for p in suite.findall("properties/property"):
            props.setdefault(p.get("name", ""), []).append(p.get("value", ""))
        for tc in suite.findall("testcase"):
            tprops = {p.get("name"): p.get("value") for p in tc.findall("properties/property")}
            nodeid = tprops.get("nodeid")
            if not nodeid:  # a collection error: pytest names it by the module's dotted path
                cls, name = tc.get("classname", ""), tc.get("name", "")
                nodeid = f"{cls}.{name}" if cls else name
            outcome, message = "passed", ""
            for kind, label in (("error", "error"), ("failure", "failed"), ("skipped", "skipped")):
                el = tc.find(kind)
                if el is not None:
                    outcome, message = label, first_line(el)
                    break
            cases.append(Case(nodeid, outcome, float(tc.get("time") or 0.0), message))
    return cases, props


def first_line(el: ET.Element) -> str:
    """The one line that says why: the message, or for pytest's generic "collection failure" the last
    `E   ` line of the report (e.g. the ImportError a test module raised)."""
    lines = (el.get("message") or "").strip().splitlines()[:1]
    message = lines[0] if lines else ""
    if message in ("", "collection failure"):
        errs = [ln[1:].strip() for ln in (el.text or "").splitlines() if ln.startswith("E ")]
        message = errs[-1] if errs else message
    return message[:200]


def parse_junit_into(result: RunResult, path: Path) -> None:
    cases, props = parse_junit(path)
    result.properties = props
    result.missing = props.get("kvforge.missing", [])
    result.collect_errors = props.get("kvforge.collect_error", [])
    dotted = {ce.removesuffix(".py").replace("/", "."): ce for ce in result.collect_errors}
    for c in cases:
        if c.nodeid in dotted:  # map a collection-error testcase back to its file
            c.nodeid = dotted[c.nodeid]
    result.cases = cases


def run_properties(target: Target, comp: Component, stack, platform: str, state: str, commit: str) -> dict[str, str]:
    return {"target": target.name, "component": comp.name, "base": stack.base.commit, "base_ref": stack.base.ref,
            "series": stack.digest, "platform": platform, "state": state, "tree": commit}


# ---------------------------------------------------------------- kvforge test

@dataclass
class TestResult:
    __test__ = False  # not a pytest test class
    target: str
    component: str
    platform: str
    state: str  # base | patched
    base: str
    series: str
    patches: int
    env: str | None = None
    run: RunResult | None = None
    skipped_checks: list[str] = field(default_factory=list)  # --base: Checks the base tree does not have
    command: str | None = None  # cuda/npu: what a runner with the hardware runs
    reason: str = ""
    ok: bool = False
    origin: str = "series"
    record: str | None = None  # the evidence record saved for this run
    compare: dict = field(default_factory=dict)  # cpu, patched, something failed: Comparison.to_json()
    layer: dict | None = None  # built on another component: its tree and the stand-ins (kvforge/env/components.py)

    def to_json(self) -> dict:
        data = {k: v for k, v in self.__dict__.items() if k != "run"}
        data["ran"] = self.run is not None and self.run.exit_code is not None
        if self.run is not None:
            data["run"] = self.run.to_json()
        return data


def selection(comp: Component, platform: str, checks: list[str], where: Path) -> list[str]:
    if platform not in comp.platforms or platform not in comp.tests:
        raise KvforgeError(f"{where}: component {comp.name} has no {platform} tests "
                           f"(platforms: {', '.join(comp.platforms)}; tests: {', '.join(comp.tests) or 'none'})",
                           EXIT_USAGE)
    return unique([*comp.tests[platform], *checks])


def test_target(ctx, platform: str, on_base: bool, keyword: str | None, stream: bool = True) -> TestResult:

    target, comp, say = ctx.target, ctx.component, ctx.progress
    series = ctx.series() if platform != "cpu" or not ctx.from_rev else None
    if series is None:
        stack = open_stack(ctx)
        series = stack.series
    checks = unique(c for p in series.patches for c in p.checks)
    nodes = selection(comp, platform, checks, target.path)
    state = "base" if on_base else "patched"
    if platform != "cpu":
        ok, why = (get_platform(platform).available(ctx.python) if ctx.python
                   else (False, "no --python names the interpreter set up for it"))
        if not ok:
            return TestResult(target.name, comp.name, platform, state, "", series.digest, len(series.patches),
                              command=hardware_command(target, comp, platform,
                                                       list(comp.tests[platform]) if on_base else nodes,
                                                       on_base, python=ctx.python),
                              reason=f"{platform} tests need {HARDWARE[platform]}; {why}")
    stack = open_stack(ctx) if not ctx.from_rev else stack
    env = target_env(ctx, base=stack.base, platform=platform)
    env.check()
    result = TestResult(target.name, comp.name, platform, state, stack.base.commit, stack.digest, stack.size,
                        env=env.key, layer=env.layer.to_json() if env.layer else None)
    n = 0 if on_base else stack.size
    rdir = evidence.attachments(ctx.cache, stack.key, "test", f"{platform}-{state}")
    with stack.lock(say):
        commit = stack.checkout(n)
        if on_base:
            result.skipped_checks = [c for c in checks if c not in comp.tests[platform]
                                     and not (stack.worktree / c.split("::", 1)[0]).exists()]
            nodes = [x for x in nodes if x not in result.skipped_checks]
            for node in result.skipped_checks:
                say(f"skipping {node}: not in the base tree (a patch adds it)")
        say(f"running {len(nodes)} selectors on the {state} tree of {target.name} ({commit[:12]}) with env {env.key}")
        run = run_pytest(env, stack.worktree, nodes, rdir / "junit.xml",
                         run_properties(target, comp, stack, platform, state, commit), state, commit, keyword,
                         sys.stderr if stream else None)
        if not on_base and platform == "cpu" and stack.size and (run.counts()["failed"] or run.counts()["errors"]):
            result.compare = against_base(ctx, stack, env, run, list(comp.tests[platform]), checks, rdir,
                                          platform).to_json()
    result.run = run
    c = run.counts()
    absent = run.not_in_tree + [m for m in run.missing if not keyword]
    failing_checks = [n for n in checks if run.outcome(n) in ("failed", "error")]
    if on_base:  # a Checks test a patch adds to an existing file: not in the base either
        result.skipped_checks += [m for m in absent if m in checks and m not in result.skipped_checks]
        absent = [m for m in absent if m not in checks]
    if run.exit_code is None or run.exit_code == 5 or not run.cases:
        result.reason = "no tests ran"
    elif result.compare and (result.compare["new"] or failing_checks):
        result.reason = (f"{c['failed']} failed, {c['errors']} errors: {result.compare['new_failures']} new (not "
                         f"failing on the base), {len(failing_checks)} of the series' Checks")
    elif (c["failed"] or c["errors"]) and not result.compare:
        result.reason = f"{c['failed']} failed, {c['errors']} errors"
    elif absent:
        result.reason = f"{len(absent)} selected tests are not in the tree: {', '.join(absent[:5])}"
    else:
        result.ok = True
    result.origin = stack.origin
    result.record = str(evidence.save(ctx.cache, evidence.Record("test", stack.key, f"{platform}-{state}",
                                                               stack.origin, platform, result.ok,
                                                               data=result.to_json())))
    return result


test_target.__test__ = False  # type: ignore[attr-defined]  # pytest's marker: not a test function


def summary_line(run: RunResult) -> str:
    c = run.counts()
    absent = len(run.not_in_tree) + len(run.missing)
    return (f"{c['passed']} passed, {c['failed']} failed, {c['errors']} errors, {c['skipped']} skipped in "
            f"{run.seconds:.1f}s" + (f" ({absent} selected not in this tree)" if absent else ""))


def test_verdict(result: TestResult) -> tuple[int, str | None]:
    """The exit code and, when not 0, the one-line reason."""
    if result.command is not None:
        return EXIT_NOT_RUN, (f"not run: {result.reason} (nothing was tested; the command above is for a "
                              f"{result.platform} runner)")
    if not result.ok:
        run = result.run
        return EXIT_TESTS, (f"{result.target} {result.state}: {result.reason}"
                            + (f" (log: {run.log})" if run and run.log else ""))
    return 0, None


def render_test_result(result: TestResult) -> str:
    """The text of `kvforge test`: the command a runner would run, or the failures and a summary."""
    if result.command is not None:
        return f"# {result.target} {result.platform} tests: on a runner with {HARDWARE[result.platform]}:\n" \
               + result.command
    run = result.run
    assert run is not None  # no runner command: pytest ran here
    lines = []
    if result.skipped_checks:
        lines.append(f"skipped {len(result.skipped_checks)} Checks tests the base tree does not have (patches add them)")
    lines += [f"FAILED {p}" for p in run.problems()]
    lines += [f"MISSING {m}: not in this tree" for m in run.not_in_tree + run.missing if m not in result.skipped_checks]
    lines += compare_lines(result.compare, True)
    if result.layer:
        lines.append(describe_layer(result.layer))
    lines.append(f"{result.target} {result.state} ({run.commit[:12]}, series {result.series}, {result.patches} "
                 f"patches), {result.platform}: {summary_line(run)}")
    if run.junit:
        lines.append(f"JUnit XML: {run.junit}")
    return "\n".join(lines)


def outcome_of(result: TestResult) -> Done:
    """A test run as `kvforge test` ends: its JSON carries "exit" and "error" (null when it passed)."""
    code, error = test_verdict(result)
    return Done({**result.to_json(), "exit": code, "error": error}, render_test_result(result), code, error)


def run_command(ctx, component: str | None, platform: str, on_base: bool, keyword: str | None) -> Outcome:
    """`kvforge test`: the tests of each component (`--scan` is selection.scan_target's)."""
    return run_each(contexts(ctx, component, platform),
                    lambda c: outcome_of(test_target(c, platform, on_base, keyword)))


# ---------------------------------------------------------------- base vs patched: whose failure is it

BASE_SERIES = hashlib.sha256(b"").hexdigest()[:16]  # the base alone is the empty series on it


def node_outcome(run: RunResult, nodeid: str) -> str:
    """One test id's outcome in a run: its own case, "error" when its file did not
    collect, "collected" for a file id whose tests ran, else "missing"."""
    path = nodeid.split("::", 1)[0]
    if path in run.collect_errors:
        return "error"
    for c in run.cases:
        if c.nodeid == nodeid:
            return c.outcome
    if "::" not in nodeid and any(c.nodeid.startswith(path + "::") for c in run.cases):
        return "collected"  # a file id (a collection error in the other run) whose tests ran here
    return "missing"


@dataclass
class Comparison:
    """The selection's failures on the patched tree judged against the same tests on the base.

    fail (or error) on both = pre-existing (the base's state, not the series'); fail on patched
    only (passed, skipped or absent on the base) = new: the series broke it; a test the base is
    known to fail that passes patched = fixed. The series' own Checks are not compared: they must
    pass on the patched tree whatever the base does. Only the tests that fail on the patched tree
    are run on the base (and recorded, so the next verify in this cache asks only about new ones)."""

    base_source: str  # run (asked the base now) | cached (all known) | not needed (nothing failed) | same tree
    base_commit: str
    base_counts: dict[str, int]
    base_seconds: float = 0.0
    base_record: str | None = None
    new: list[dict] = field(default_factory=list)  # {"node", "base", "patched", "message"}
    pre_existing: list[str] = field(default_factory=list)
    fixed: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"base_source": self.base_source, "base_commit": self.base_commit, "base": self.base_counts,
                "base_seconds": round(self.base_seconds, 2), "base_record": self.base_record,
                "new_failures": len(self.new), "pre_existing_failures": len(self.pre_existing),
                "fixed_count": len(self.fixed), "new": self.new, "pre_existing": self.pre_existing,
                "fixed": self.fixed}


def judged(nodeid: str, selectors: list[str], checks: Sequence[str]) -> bool:
    """A test of the selection that is not one of the series' Checks."""
    return any(node_matches(nodeid, s) for s in selectors) and not any(node_matches(nodeid, c) for c in checks)


def failing_ids(run: RunResult, selectors: list[str], checks: Sequence[str] = ()) -> list[str]:
    """The selection's test ids (files, for a collection error) that fail or error in `run`."""
    return unique(c.nodeid for c in run.cases
                  if c.outcome in ("failed", "error") and judged(c.nodeid, selectors, checks))


def compare(base: RunResult, patched: RunResult, selectors: list[str], checks: Sequence[str] = (),
            base_source: str = "run") -> Comparison:
    """Per test id of the selection (Checks excluded): pre-existing, new or fixed."""
    cmp = Comparison(base_source, base.commit, base.counts(), base.seconds)
    seen = set()
    for c in patched.cases:
        if c.nodeid in seen or not judged(c.nodeid, selectors, checks):
            continue
        seen.add(c.nodeid)
        before = node_outcome(base, c.nodeid)
        if c.outcome in ("failed", "error"):
            if before in ("failed", "error"):
                cmp.pre_existing.append(c.nodeid)
            else:
                cmp.new.append({"node": c.nodeid, "base": before, "patched": c.outcome, "message": c.message})
        elif c.outcome == "passed" and before in ("failed", "error"):
            cmp.fixed.append(c.nodeid)
    return cmp


def merge(known: RunResult | None, run: RunResult) -> RunResult:
    """Base outcomes known so far plus a new base run: `selectors` is every id the base was asked about."""
    if known is None:
        return run
    cases = {c.nodeid: c for c in known.cases}
    cases.update({c.nodeid: c for c in run.cases})
    return RunResult("base", run.commit, unique([*known.selectors, *run.selectors]), run.junit, run.log,
                     run.exit_code, known.seconds + run.seconds, list(cases.values()),
                     unique([*known.not_in_tree, *run.not_in_tree]), unique([*known.missing, *run.missing]),
                     unique([*known.collect_errors, *run.collect_errors]), run.properties)


def baseline_name(platform: str, env_key: str, selectors: list[str]) -> str:
    """The record name of the base's outcomes: the platform, the env and the selection they belong to."""
    digest = hashlib.sha256("\n".join(selectors).encode()).hexdigest()[:12]
    return f"{platform}-base-{env_key}-{digest}"


def baseline_key(stack) -> evidence.Key:
    return evidence.Key(stack.target, stack.component, stack.base.commit, BASE_SERIES)


def load_baseline(cache, stack, name: str) -> tuple[RunResult, str] | None:
    """The base's recorded outcomes for this selection and env (see save_baseline), and the record's path."""
    rec = evidence.latest(cache, baseline_key(stack), "test", name)
    if rec is None or rec.data.get("base") != stack.base.commit or not {"asked", "cases"} <= rec.data.keys():
        return None  # none, another base, or a record of an older layout: ask the base again
    d = rec.data
    run = RunResult("base", d["base"], d["asked"], exit_code=d.get("pytest_exit"), seconds=d.get("seconds", 0.0),
                    cases=[Case(n, o, 0.0, m) for n, (o, m) in d["cases"].items()],
                    not_in_tree=d.get("not_in_tree", []), missing=d.get("missing", []),
                    collect_errors=d.get("collect_errors", []))
    return run, str(rec.path)


def save_baseline(cache, stack, name: str, run: RunResult, env_key: str, platform: str) -> str:
    """Record the base's outcome per test id asked so far (key: target, component, base commit, the
    empty series; name: platform, env, selection): a later verify in this cache asks the base only
    about ids not in it."""
    c = run.counts()
    data = {"base": stack.base.commit, "base_ref": stack.base.ref, "env": env_key, "platform": platform,
            "asked": run.selectors, "pytest_exit": run.exit_code, "seconds": round(run.seconds, 2), **c,
            "junit": str(run.junit) if run.junit else None,
            "cases": {x.nodeid: [x.outcome, x.message if x.outcome != "passed" else ""] for x in run.cases},
            "not_in_tree": run.not_in_tree, "missing": run.missing, "collect_errors": run.collect_errors}
    rec = evidence.Record("test", baseline_key(stack), name, origin="base", platform=platform,
                          ok=not (c["failed"] or c["errors"]), data=data)
    return str(evidence.save(cache, rec))


def compare_lines(cmp: dict, patched: bool, limit: int = 10) -> list[str]:
    """The base-vs-patched comparison, for people: counts, then the pre-existing and new failures by id."""
    if not cmp:
        return []
    how = {"run": f"the failing tests run on the base in {cmp['base_seconds']:.1f}s",
           "cached": f"their base outcomes recorded earlier: {cmp['base_record']}",
           "not needed": "nothing fails on the patched tree", "same tree": ""}[cmp["base_source"]]
    out = [f"against the base ({cmp['base_commit'][:12]}; {how}): {cmp['new_failures']} new failures, "
           f"{cmp['pre_existing_failures']} pre-existing (the base's state), {cmp['fixed_count']} fixed" if patched else
           f"failures on the base ({cmp['base_commit'][:12]}): {cmp['pre_existing_failures']} (the base's state)"]
    for f in cmp["new"][:limit]:
        out.append(f"  NEW {f['node']}: {f['patched']} (on the base: {f['base']})"
                   + (f" ({f['message']})" if f["message"] else ""))
    for kind, ids in (("pre-existing", cmp["pre_existing"]), ("fixed", cmp["fixed"])):
        out += [f"  {kind} {n}" for n in ids[:limit]]
        if len(ids) > limit:
            out.append(f"  ... and {len(ids) - limit} more {kind} (all in --json)")
    return out


def against_base(ctx, stack, env, final: RunResult, selectors: list[str], checks: list[str], rdir: Path,
                 platform: str = "cpu") -> Comparison:
    """Judge the patched tree's failures against the base: ask the base (checked out in the stack's
    worktree; the caller holds its lock) about each failing test id it has not been asked about in
    this cache (same base, env and selection), record the answers, compare."""
    failing = failing_ids(final, selectors, checks)
    name = baseline_name(platform, env.key, selectors)
    cached = load_baseline(ctx.cache, stack, name)
    known, record = (cached if cached else (None, None))
    ask = [i for i in failing if known is None or i not in known.selectors]
    source = "not needed" if not failing else ("cached" if not ask else "run")
    seconds = 0.0
    if ask:
        commit = stack.checkout(0)
        ctx.say(f"[base] the {len(ask)} selected tests that fail on the patched tree, on the base ({commit[:12]})")
        run = run_pytest(env, stack.worktree, ask, rdir / "base-failing.xml",
                         run_properties(ctx.target, ctx.component, stack, platform, "base", commit), "base", commit)
        ctx.say("[base] " + summary_line(run))
        seconds = run.seconds
        known = merge(known, run)
        record = save_baseline(ctx.cache, stack, name, known, env.key, platform)
    cmp = compare(known or RunResult("base", stack.base.commit, []), final, selectors, checks, source)
    cmp.base_commit, cmp.base_record, cmp.base_seconds = stack.base.commit, record, seconds
    return cmp
