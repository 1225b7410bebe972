"""The Checks without the fix on a new base: the rebase's checks signal and watch's verdict, decided on the
patch's Bug-Checks, each run cached by content (<cache>/results/watch/<key>.json: the base's commit, the patch's
sha256, the environment's key; pytest's log and JUnit XML beside it), a release's rows batched into one pytest
run where their test files are disjoint. Temporary trees under <cache>/trees/.work (.upstream-checks.<pid>.*,
removed afterwards or by the next run once that pid is gone)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvforge.core.errors import KvforgeError
from kvforge.core.fsutil import remove_stale
from kvforge.env.venv import Env, env_spec, target_env, tree_reader
from kvforge.flow.upstream import NewBase, Signal, is_test_path
from kvforge.git import gitutil
from kvforge.project.series import Patch, read_series
from kvforge.proof.testrun import run_pytest
from kvforge.proof.verify import fail_kind

UPSTREAM = "upstream (by behaviour)"
NEEDED = "needed"
UNSURE = "needed?"
BUDGET = "not checked: budget"
RESULT_VERSION = 1  # part of every cache key: a change of what a result holds starts a new cache

# A failure that shows only that the test's API is not in this tree (verify.ABSENT_API), or that it
# changed: a call with another signature. Neither says anything about the fix.
API_DRIFT = re.compile(
    r"missing \d+ required (positional|keyword-only) arguments?|takes (from )?\d+ (to \d+ )?positional "
    r"arguments? but \d+ (was|were) given|got an unexpected keyword argument|got multiple values for argument"
    r"|object is not subscriptable|object is not iterable|cannot unpack non-iterable")
TRACE_LINE = re.compile(r"^(\S+\.py):(\d+): ", re.M)


def failure_kind(outcome: str, message: str) -> str | None:
    """passed -> None; behaviour (evidence about the fix) | api (cannot run here) | absent."""
    kind = fail_kind(outcome, message)
    if kind is None:
        return None
    if kind == "absent-test":
        return "absent"
    if kind == "absent-api" or message.startswith("collection error") or API_DRIFT.search(message):
        return "api"
    return "behaviour"


def judge_checks(outcomes: dict[str, tuple[str, str]], bug: list[str] | None = None) -> Signal:
    """The checks signal from node -> (outcome, message) on the new base without the fix, judged on the nodes
    in `bug` (the patch's Bug-Checks; None: every node)."""
    if bug is not None:
        outcomes = {n: v for n, v in outcomes.items() if n in bug}
    if not outcomes:
        return Signal("checks", None, False, "the patch has no Checks")
    kinds = {n: (o, failure_kind(o, m), m) for n, (o, m) in outcomes.items()}
    passed = [n for n, (o, _, _) in kinds.items() if o == "passed"]
    behaviour = [n for n, (_, k, _) in kinds.items() if k == "behaviour"]
    unknown = [n for n in kinds if n not in passed and n not in behaviour]
    total = len(kinds)

    def short(n: str) -> str:
        return n.split("::")[-1]

    if behaviour:
        first = behaviour[0]
        return Signal("checks", False, True, f"{len(behaviour)} of {total} fail without the fix "
                                             f"({short(first)}: {kinds[first][2][:120]})")
    if passed and not unknown:
        return Signal("checks", True, True, f"all {total} pass on the new base without the fix")
    if passed:
        return Signal("checks", True, False, f"{len(passed)} of {total} pass without the fix; "
                                             f"{len(unknown)} cannot run here")
    first = unknown[0]
    return Signal("checks", None, False, f"none of {total} can run on the new base "
                                         f"({short(first)}: {kinds[first][2][:120] or kinds[first][0]})")


# ---------------------------------------------------------------- one run of the Checks


@dataclass
class Run:
    """The Checks' outcomes on one tree (node -> (outcome, message)), where a failure's line is, and the evidence."""

    outcomes: dict[str, tuple[str, str]] = field(default_factory=dict)
    lines: dict[str, str] = field(default_factory=dict)  # a failing node -> "path:line" of its failure
    env: str | None = None
    log: str | None = None
    junit: str | None = None
    error: str | None = None  # no run: why (no environment, ...)
    cached: bool = False


def _scratch(cache) -> Path:
    scratch = cache.trees / ".work"
    scratch.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):  # what a killed run left (its pid is in the name)
        remove_stale(scratch, r"^\.upstream-checks\.(?P<pid>\d+)\.")
    return scratch


def release_env(ctx_like, nb: NewBase) -> Env:
    env = target_env(ctx_like, base=nb)
    env.check()
    return env


def pytest_run(env: Env, tree: Path, nodes: list[str], state: str, commit: str, keep: Path | None) -> Run:
    """pytest of `nodes` in `tree`; its log and JUnit XML moved to `keep`.{log,xml} (else removed)."""
    junit = tree.parent / f"{tree.name}.xml"
    run = run_pytest(env, tree, nodes, junit, {"state": state, "base": commit}, state, commit)
    out = Run(env=env.key)
    for n in nodes:
        out.outcomes[n] = (run.outcome(n), run.message_of(n))
    out.lines = _failure_lines(junit, tree)
    if keep is not None:
        keep.parent.mkdir(parents=True, exist_ok=True)
        for src, suffix in ((junit, ".xml"), (junit.with_suffix(".log"), ".log")):
            if src.is_file():
                shutil.move(str(src), str(keep.with_suffix(suffix)))
        out.junit, out.log = str(keep.with_suffix(".xml")), str(keep.with_suffix(".log"))
    return out


def _failure_lines(junit: Path, tree: Path) -> dict[str, str]:
    """nodeid -> the "path:line" of its failure's last traceback line in a test file (JUnit XML)."""
    out: dict[str, str] = {}
    try:
        text = junit.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return out
    for case in re.finditer(r"<testcase\b(.*?)</testcase>", text, re.S):
        body = case.group(1)
        node = re.search(r'name="nodeid" value="([^"]+)"', body)
        hits = [m for m in TRACE_LINE.finditer(body) if is_test_path(m.group(1))]
        if node and hits:
            path = hits[-1].group(1).removeprefix(str(tree) + "/")
            out[node.group(1)] = f"{path}:{hits[-1].group(2)}"
    return out


def scratch_tree(cache) -> Path:
    return Path(tempfile.mkdtemp(prefix=f".upstream-checks.{os.getpid()}.", dir=_scratch(cache)))


def remove_tree(tree: Path) -> None:
    shutil.rmtree(tree, ignore_errors=True)
    for leftover in tree.parent.glob(f"{tree.name}.*"):
        with contextlib.suppress(OSError):
            leftover.unlink()


NO_PYTEST = "pytest could not run on the release"  # a Run's error that is kept: the same tree and env fail again


def _without(env: Env, tree: Path, nodes: list[str], commit: str, keep: Path | None) -> Run:
    """pytest_run of the Checks without the fix; pytest that cannot start there (a conftest that does not import
    in this environment, a timeout) is the Run's error, not an exception: it is one row's "cannot tell"."""
    try:
        return pytest_run(env, tree, nodes, "new base without the fix", commit, keep)
    except KvforgeError as exc:
        text = str(exc).replace(f"{tree}/", "").split("; log: ")[0]
        if text.startswith(f"pytest could not run in {tree} "):
            return Run(env=env.key, error=f"{NO_PYTEST} {text.removeprefix(f'pytest could not run in {tree} ')}")
        return Run(env=env.key, error=text)


def kept(run: Run) -> bool:
    """Whether a run's result is cached: it ran, or pytest cannot start in that tree and environment (the same
    again next time); not a missing environment or a timeout (the next run tries again)."""
    return run.error is None or run.error.startswith(NO_PYTEST)


NO_ENV = "no test environment for the new base"
NOT_APPLIED = ("error", "collection error: its test file does not apply to the new base")


def run_in_one_tree(ctx_like, nb: NewBase, patches: list[Patch], keep: Path | None = None) -> list[Run]:
    """The Checks of `patches` on nb with only their test files added (a test file that does not apply: its
    nodes cannot run), in one tree and one pytest, in nb's environment (built on first use): one Run per patch,
    its own nodes' outcomes, sharing the environment, the evidence and a pytest that could not start."""
    tree = scratch_tree(ctx_like.cache)
    try:
        try:
            env = release_env(ctx_like, nb)
        except KvforgeError as exc:
            return [Run(error=f"{NO_ENV}: {exc}") for _ in patches]
        gitutil.export(nb.repo.parent, nb.commit, tree, env={"GIT_DIR": str(nb.repo)})
        refused = [_add_test_files(p, tree) for p in patches]
        nodes = [c for p, no in zip(patches, refused) for c in p.checks if c.split("::", 1)[0] not in no]
        run = _without(env, tree, list(dict.fromkeys(nodes)), nb.commit, keep) if nodes else Run(env=env.key)
    finally:
        remove_tree(tree)
    out = []
    for p, no in zip(patches, refused):
        mine = Run(env=run.env, log=run.log, junit=run.junit, error=run.error)
        for c in p.checks if run.error is None else ():
            mine.outcomes[c] = run.outcomes.get(c, NOT_APPLIED) if c.split("::", 1)[0] not in no else NOT_APPLIED
            mine.lines.update({k: v for k, v in run.lines.items() if k == c or k.startswith(c + "[")})
        out.append(mine)
    return out


def run_without_fix(ctx_like, nb: NewBase, patch: Patch, keep: Path | None = None) -> Run:
    """The patch's Checks on nb with only its test files added (run_in_one_tree of it alone)."""
    return run_in_one_tree(ctx_like, nb, [patch], keep)[0]


def checks_signal(ctx_like, nb: NewBase, patch) -> Signal:
    """Run the patch's Checks on the new base with only its test files added, in the environment of
    the new base (kvforge.env.target_env, built on first use), from a temporary tree that is removed
    afterwards."""
    if not patch.checks:
        return Signal("checks", None, False, "the patch has no Checks")
    run = run_without_fix(ctx_like, nb, patch)
    if run.error:
        return Signal("checks", None, False, run.error)
    sig = judge_checks(run.outcomes, patch.bug_checks)
    return Signal(sig.name, sig.fired, sig.strong, f"{sig.detail} [env {run.env}]")


def _add_test_files(patch, tree: Path) -> set[str]:
    """Apply the patch's test files (only those) to `tree`, each on its own; the paths that do not apply."""
    refused: set[str] = set()
    with tempfile.NamedTemporaryFile(prefix="kvforge-patch-", suffix=".patch", delete=False) as fh:
        fh.write(patch.raw)
    try:
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tree.parent), "LC_ALL": "C"}
        for path in (p for p in patch.touched_paths if is_test_path(p)):
            res = subprocess.run(["git", "apply", f"--include={path}", fh.name], cwd=tree, env=env,
                                 capture_output=True, text=True)
            if res.returncode != 0:
                refused.add(path)
    finally:
        os.unlink(fh.name)
    return refused


# ---------------------------------------------------------------- watch's verdicts, cached


@dataclass
class Budget:
    """At most `limit` Checks runs (None: no limit); a result from the cache is no run."""

    limit: int | None = None
    used: int = 0

    def take(self) -> bool:
        if self.limit is not None and self.used >= self.limit:
            return False
        self.used += 1
        return True


@dataclass
class Verdict:
    state: str  # UPSTREAM | NEEDED | UNSURE | BUDGET
    detail: str
    evidence: str | None = None  # the kept pytest log
    cached: bool = False


def env_fingerprint(ctx_like, nb: NewBase) -> str:
    """What the environment of nb's Checks is made of, read without building it: its spec's key (a hash of the
    base's requirements), or, for a component built on another one (vllm-ascend on vLLM), that component's
    release and the content of its series (the patched tree the environment installs): a changed vLLM patch
    is a new environment, so no result made with the old one is read."""
    try:
        key = env_spec(tree_reader(nb.repo, nb.commit), f"{nb.commit[:12]}").key
    except KvforgeError as exc:
        key = f"none ({exc})"
    requires = getattr(getattr(ctx_like, "component", None), "requires", None)
    if requires:
        other = ctx_like.target.component(requires)
        try:
            series = hashlib.sha256("".join(f"{p.name} {p.sha256}\n" for p in read_series(other.series_dir).patches)
                                    .encode()).hexdigest()[:16]
        except (KvforgeError, OSError) as exc:
            series = f"unreadable ({exc})"
        key = f"{requires}-{other.release.version}-{other.release.sha256 or ''}-{series}"
    return key


def result_key(kind: str, nb: NewBase, content: str, env_key: str) -> str:
    payload = {"v": RESULT_VERSION, "kind": kind, "base": nb.commit, "content": content, "env": env_key}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def results_dir(cache) -> Path:
    return cache.results / "watch"


def _load(path: Path) -> Run | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        data["outcomes"] = {k: tuple(v) for k, v in data["outcomes"].items()}
        return Run(**{**data, "cached": True})
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _save(path: Path, run: Run) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({k: v for k, v in asdict(run).items() if k != "cached"}, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def _result_path(ctx_like, nb: NewBase, patch: Patch, env_key: str) -> Path:
    return results_dir(ctx_like.cache) / f"{result_key('without-fix', nb, patch.sha256, env_key)}.json"


def cached_run(ctx_like, nb: NewBase, patch: Patch, budget: Budget) -> Run | None:
    """The Checks without the fix on nb: from the cache, else run (taking one from `budget`; None: none left)."""
    path = _result_path(ctx_like, nb, patch, env_fingerprint(ctx_like, nb))
    got = _load(path)
    if got is not None:
        return got
    if not budget.take():
        return None
    run = run_without_fix(ctx_like, nb, patch, keep=path.with_suffix(""))
    if kept(run):
        _save(path, run)
    return run


def _test_paths(patch: Patch) -> set[str]:
    """The test files a patch's run without the fix depends on: those it adds or changes, and its Checks' files."""
    return {p for p in patch.touched_paths if is_test_path(p)} | {c.split("::", 1)[0] for c in patch.checks}


def batches(patches: list[Patch]) -> list[list[Patch]]:
    """The patches in groups whose Checks can share one pytest run: no two in a group touch or check the same
    test file, and a patch that changes a conftest.py (it changes every test under it) runs alone. In order."""
    groups: list[tuple[list[Patch], set[str]]] = []
    for p in patches:
        paths = _test_paths(p)
        alone = any(x.rsplit("/", 1)[-1] == "conftest.py" for x in paths)
        home = None if alone else next((g for g in groups if not g[1] & paths and
                                        not any(x.rsplit("/", 1)[-1] == "conftest.py" for x in g[1])), None)
        if home is None:
            groups.append(([p], set(paths)))
        else:
            home[0].append(p)
            home[1].update(paths)
    return [g for g, _ in groups]


def prefetch(ctx_like, nb: NewBase, patches: list[Patch], budget: Budget) -> int:
    """Run the Checks without the fix of several patches on nb in one pytest per batch (each patch's test files
    added, the others' fixes absent), each patch's result cached under its own key as `cached_run` keeps it, so
    the later `without_fix` of each is read from the cache. Patches already cached, or without Checks, are left
    out; a batch of one is left to `cached_run`. One batch costs one run from `budget`. Returns the runs made."""
    env_key = env_fingerprint(ctx_like, nb)
    todo = [p for p in patches if p.checks and _load(_result_path(ctx_like, nb, p, env_key)) is None]
    made = 0
    for group in batches(todo):
        if len(group) < 2:
            continue
        if not budget.take():
            break
        made += 1
        paths = [_result_path(ctx_like, nb, p, env_key) for p in group]
        runs = run_in_one_tree(ctx_like, nb, group, paths[0].with_suffix(""))
        if runs[0].error and runs[0].error.startswith(NO_ENV):
            return made  # each patch's own run says why (and is not kept)
        if kept(runs[0]):  # not a timeout: then each patch's own run tries again
            for path, run in zip(paths, runs):
                _save(path, run)
    return made


def without_fix(ctx_like, nb: NewBase, patch: Patch, budget: Budget) -> Verdict:
    """Watch's verdict on one conflict or disagreement row (see the module docstring)."""
    if not patch.checks:
        return Verdict(UNSURE, "cannot tell: the patch has no Checks")
    run = cached_run(ctx_like, nb, patch, budget)
    if run is None:
        return Verdict(BUDGET, f"{BUDGET} (--checks)")
    if run.error:
        return Verdict(UNSURE, f"cannot tell: {run.error}", run.log, run.cached)
    bug = patch.bug_checks
    kinds = {n: (o, failure_kind(o, m), m) for n, (o, m) in run.outcomes.items() if n in bug}
    total = len(kinds)
    what = "Checks" if len(bug) == len(patch.checks) else "Bug-Checks"
    others = len(run.outcomes) - total
    aside = (f"; {others} other Check{'s' if others != 1 else ''} (what the variant adds) "
             f"{_tally(run.outcomes, bug)}, not counted") if others else ""
    behaviour = [n for n, (_, k, _) in kinds.items() if k == "behaviour"]
    passed = [n for n, (o, _, _) in kinds.items() if o == "passed"]
    where = f" (evidence: {run.log})" if run.log else ""
    if not kinds:
        return Verdict(UNSURE, f"cannot tell: none of the {what} ran{where}", run.log, run.cached)
    if behaviour:
        n = behaviour[0]
        line = next((v for k, v in run.lines.items() if k == n or k.startswith(n + "[")), None)
        at = f" at {line}" if line else ""
        return Verdict(NEEDED, f"{len(behaviour)} of {total} {what} fail without the fix: {n}{at}: "
                               f"{kinds[n][2][:160]}{aside}{where}", run.log, run.cached)
    if len(passed) == total:
        return Verdict(UPSTREAM, f"all {total} {what} pass on the release without the fix{aside} "
                                 f"[env {run.env}]{where}", run.log, run.cached)
    n = next(n for n in kinds if n not in passed)
    return Verdict(UNSURE, f"cannot tell: {total - len(passed)} of {total} {what} cannot run on the release "
                           f"({n.split('::')[-1]}: {kinds[n][2][:120] or kinds[n][0]}){aside}{where}", run.log,
                   run.cached)


def _tally(outcomes: dict[str, tuple[str, str]], bug: list[str]) -> str:
    """How the Checks outside `bug` did: "3 passed, 1 failed"."""
    counts: dict[str, int] = {}
    for n, (o, _m) in outcomes.items():
        if n not in bug:
            counts[o] = counts.get(o, 0) + 1
    return ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
