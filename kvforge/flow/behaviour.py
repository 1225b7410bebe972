"""Behaviour decides: a patch's Checks run on a new base, without the fix (is it upstream?) and with a
variant of the fix ported onto it (is the port proven?), in that base's CPU environment.

- checks_signal: the rebase's "checks" signal (kvforge.flow.upstream.gather): the Checks on the new base with
  only the patch's test files added; all pass is strong evidence for "upstream", a behavioural failure strong
  evidence against, a test that cannot run there (absent API, changed signature, a test file that does not
  apply) tells nothing.
- without_fix: the same run for `kvforge watch`, as a verdict a release engineer acts on: "upstream (by
  behaviour)" (every Check passes without the fix), "needed" (a behavioural failure: the test and its line),
  "needed?" (cannot tell: the Checks cannot run there, and why). Never "upstream" on a partial pass.

Both decide on the patch's Bug-Checks (Patch.bug_checks: every Check unless the patch names the ones that
show the bug): a Check of what the variant adds (its knob, its API) failing on a release that fixed the bug
in another shape says nothing about the bug. Every Check still runs and is reported.
- port: the nearest variant of the fix (`git am -3` onto the new base, its preimages copied in), then its
  Checks with the fix: "port proven" (they failed without it and all pass with it), else where it stops (the
  file, the hunk, and the release's change of that region since the old base).

Results are cached by content (<cache>/results/watch/<key>.json: the new base's commit, the patch's or the
variant's sha256, the environment's key): a daily run re-runs nothing it has run. The evidence (pytest's log
and JUnit XML) is kept beside each result. Writes only the cache and temporary trees under
<cache>/trees/.work (.upstream-checks.<pid>.*, removed afterwards or by the next run once that pid is gone).
"""

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
from typing import Any

from kvforge.core.errors import KvforgeError
from kvforge.core.fsutil import remove_stale
from kvforge.env.venv import Env, env_spec, target_env, tree_reader
from kvforge.flow.upstream import NewBase, Signal, is_test_path
from kvforge.git import gitutil
from kvforge.git.engine import am_one, diagnose
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


def _env(ctx_like, nb: NewBase) -> Env:
    env = target_env(ctx_like, base=nb)
    env.check()
    return env


def _pytest(env: Env, tree: Path, nodes: list[str], state: str, commit: str, keep: Path | None) -> Run:
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


def _tree(cache) -> Path:
    return Path(tempfile.mkdtemp(prefix=f".upstream-checks.{os.getpid()}.", dir=_scratch(cache)))


def _cleanup(tree: Path) -> None:
    shutil.rmtree(tree, ignore_errors=True)
    for leftover in tree.parent.glob(f"{tree.name}.*"):
        with contextlib.suppress(OSError):
            leftover.unlink()


def run_without_fix(ctx_like, nb: NewBase, patch: Patch, keep: Path | None = None) -> Run:
    """The patch's Checks on nb with only its test files added (a test file that does not apply: that node
    cannot run), in nb's environment (built on first use)."""
    tree = _tree(ctx_like.cache)
    try:
        try:
            env = _env(ctx_like, nb)
        except KvforgeError as exc:
            return Run(error=f"no test environment for the new base: {exc}")
        gitutil.export(nb.repo.parent, nb.commit, tree, env={"GIT_DIR": str(nb.repo)})
        refused = _add_test_files(patch, tree)
        nodes = [c for c in patch.checks if c.split("::", 1)[0] not in refused]
        run = _pytest(env, tree, nodes, "new base without the fix", nb.commit, keep) if nodes else Run(env=env.key)
        for c in patch.checks:
            if c not in nodes:
                run.outcomes[c] = ("error", "collection error: its test file does not apply to the new base")
        return run
    finally:
        _cleanup(tree)


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


def _results(cache) -> Path:
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


def cached_run(ctx_like, nb: NewBase, patch: Patch, budget: Budget) -> Run | None:
    """The Checks without the fix on nb: from the cache, else run (taking one from `budget`; None: none left)."""
    key = result_key("without-fix", nb, patch.sha256, env_fingerprint(ctx_like, nb))
    path = _results(ctx_like.cache) / f"{key}.json"
    got = _load(path)
    if got is not None:
        return got
    if not budget.take():
        return None
    run = run_without_fix(ctx_like, nb, patch, keep=path.with_suffix(""))
    if run.error is None:  # a missing environment is not kept: the next run tries again
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
    todo = [p for p in patches if p.checks and
            _load(_results(ctx_like.cache) / f"{result_key('without-fix', nb, p.sha256, env_key)}.json") is None]
    made = 0
    for group in batches(todo):
        if len(group) < 2:
            continue
        if not budget.take():
            break
        made += 1
        keys = [_results(ctx_like.cache) / f"{result_key('without-fix', nb, p.sha256, env_key)}.json" for p in group]
        tree = _tree(ctx_like.cache)
        try:
            try:
                env = _env(ctx_like, nb)
            except KvforgeError:
                return made  # no environment: each patch's own run says why (and is not kept)
            gitutil.export(nb.repo.parent, nb.commit, tree, env={"GIT_DIR": str(nb.repo)})
            refused = {p.sha256: _add_test_files(p, tree) for p in group}
            nodes = [c for p in group for c in p.checks if c.split("::", 1)[0] not in refused[p.sha256]]
            run = _pytest(env, tree, list(dict.fromkeys(nodes)), "new base without the fix", nb.commit,
                          keys[0].with_suffix("")) if nodes else Run(env=env.key)
        finally:
            _cleanup(tree)
        for p, path in zip(group, keys):
            mine = Run(env=run.env, log=run.log, junit=run.junit)
            for c in p.checks:
                mine.outcomes[c] = run.outcomes[c] if c.split("::", 1)[0] not in refused[p.sha256] and \
                    c in run.outcomes else ("error", "collection error: its test file does not apply to the new base")
                if c in run.lines:
                    mine.lines[c] = run.lines[c]
                mine.lines.update({k: v for k, v in run.lines.items() if k.startswith(c + "[")})
            _save(path, mine)
    return made


def without_fix(ctx_like, nb: NewBase, patch: Patch, budget: Budget) -> Verdict:
    """Watch's verdict on one conflict or disagreement row (see the module docstring)."""
    if not patch.checks:
        return Verdict(UNSURE, "cannot tell: the patch has no Checks")
    run = cached_run(ctx_like, nb, patch, budget)
    if run is None:
        return Verdict(BUDGET, f"{BUDGET} (--checks)")
    if run.error:
        return Verdict(UNSURE, f"cannot tell: {run.error}")
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


# ---------------------------------------------------------------- a port, proven


INDEX_RE = re.compile(rb"^index ([0-9a-f]{40,64})\.\.[0-9a-f]{40,64}", re.M)


def copy_preimages(patch: Patch, source: Path, dest: Path) -> int:
    """Copy the blobs the patch was made against (its full-index preimages) from the bare repository `source`
    into the repository of the worktree `dest`, so `git am -3` can merge. Returns how many."""
    wanted = [m.group(1).decode() for m in INDEX_RE.finditer(patch.raw) if set(m.group(1)) != {ord("0")}]
    copied = 0
    for blob in dict.fromkeys(wanted):
        if gitutil.run(dest, "cat-file", "-e", blob, check=False).returncode == 0:
            continue
        data = gitutil.run(source.parent, "cat-file", "blob", blob, check=False, binary=True,
                           env={"GIT_DIR": str(source)})
        if data.returncode != 0:
            continue  # not there either: git am says which preimage it lacks
        gitutil.run(dest, "hash-object", "-w", "--stdin", stdin=data.stdout)
        copied += 1
    return copied


@dataclass(frozen=True)
class Variant:
    """A variant of a fix to port from: the target whose series carries it, its release, and the patch."""

    target: str
    release: str
    patch: Patch
    base_repo: Path | None  # the bare repository its preimages are in (None: not imported yet)


@dataclass
class Port:
    state: str  # "port proven" | "needs a person"
    detail: str
    source: str | None = None  # the variant's target
    patch_file: str | None = None  # the ported patch, ready (port proven)
    conflict: dict[str, Any] = field(default_factory=dict)  # file, hunk, the release's change of that region
    final: bool = True  # kept in the cache (False: no budget or no environment left it undecided)


def port(ctx_like, nb: NewBase, old_commit: str | None, variants: list[Variant], budget: Budget,
         release: str | None = None) -> Port:
    """Try each variant, nearest first: `git am -3` onto nb, then its Checks without it (at least one must fail
    for a behavioural reason) and with it (all must pass): "port proven". The first variant that applies
    decides; when none applies, the nearest one's conflict is reported, with the change of that region between
    `old_commit` and `release` (the release itself when nb.commit is the release with earlier patches on it;
    default nb.commit)."""
    if not variants:
        return Port("needs a person", "no variant of the fix to port from")
    first_conflict: Port | None = None
    for v in variants:
        path = _results(ctx_like.cache) / f"{result_key('port', nb, v.patch.sha256, env_fingerprint(ctx_like, nb))}.json"
        got = _load_port(path)
        if got is None:
            got = _try(ctx_like, nb, old_commit, v, path.with_suffix(""), budget, release or nb.commit)
            if got.final:
                _save_port(path, got)
        if not got.conflict:
            return got
        first_conflict = first_conflict or got
    assert first_conflict is not None
    return first_conflict


def _load_port(path: Path) -> Port | None:
    try:
        return Port(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None


def _save_port(path: Path, got: Port) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(got), indent=1), encoding="utf-8")
    os.replace(tmp, path)


def _try(ctx_like, nb: NewBase, old_commit: str | None, v: Variant, keep: Path, budget: Budget,
         release: str) -> Port:
    tree = _tree(ctx_like.cache)
    try:
        gitutil.run(tree.parent, "clone", "-q", "--shared", "--no-checkout", str(nb.repo), str(tree))
        gitutil.run(tree, "checkout", "-q", "--detach", nb.commit)
        if v.base_repo is not None:
            copy_preimages(v.patch, v.base_repo, tree)
        copy = tree.parent / f"{tree.name}.patch"
        copy.write_bytes(v.patch.raw)
        how, commit, out = am_one(tree, copy, nb.commit)
        if how == "no change":
            return Port("needs a person", f"{v.target}'s variant changes nothing on the release", v.target)
        if how == "conflict":
            detail = diagnose(tree, v.patch, out)
            conflict = _region(nb, release, old_commit, v.patch, detail)
            moved = f"; the release's change there since the old base: {conflict['upstream']}" \
                if conflict.get("upstream") else ""
            return Port("needs a person", f"{v.target}'s variant does not apply: {detail}{moved}", v.target,
                        conflict=conflict)
        before = cached_run(ctx_like, nb, v.patch, budget)
        if before is None:
            return Port("needs a person", f"{v.target}'s variant applies ({how}); {BUDGET} (--checks)", v.target,
                        final=False)
        if before.error:
            return Port("needs a person", f"{v.target}'s variant applies ({how}); its Checks cannot run on the "
                                          f"release: {before.error}", v.target, final=False)
        failing = [n for n, (o, m) in before.outcomes.items()
                   if n in v.patch.bug_checks and failure_kind(o, m) == "behaviour"]
        if not failing:
            return Port("needs a person", f"{v.target}'s variant applies ({how}) but none of its Checks that "
                                          "show the bug fails without it on the release: nothing proven",
                        v.target)
        if not budget.take():
            return Port("needs a person", f"{v.target}'s variant applies ({how}); {BUDGET} (--checks) for its "
                                          "Checks with it", v.target, final=False)
        try:
            env = _env(ctx_like, nb)
        except KvforgeError as exc:
            return Port("needs a person", f"{v.target}'s variant applies ({how}) but there is no test "
                                          f"environment for the release: {exc}", v.target, final=False)
        run = _pytest(env, tree, list(v.patch.checks), "release with the ported fix", commit or nb.commit, keep)
        bad = [n for n, (o, _m) in run.outcomes.items() if o != "passed"]
        if not run.outcomes:
            return Port("needs a person", f"{v.target}'s variant applies ({how}) but has no Checks", v.target)
        if bad:
            n = bad[0]
            return Port("needs a person", f"{v.target}'s variant applies ({how}) but {len(bad)} of "
                                          f"{len(run.outcomes)} Checks fail with it: {n}: "
                                          f"{run.outcomes[n][1][:160]} (evidence: {run.log})", v.target)
        ready = keep.with_suffix(".patch")
        made = gitutil.run(tree, "format-patch", "-1", "--stdout", "--full-index", "--no-signature", "HEAD",
                           binary=True)
        ready.write_bytes(made.stdout)
        bug = v.patch.bug_checks
        shown = (f"{len(failing)} of its {len(run.outcomes)} Checks fail without it, all pass with it"
                 if len(bug) == len(v.patch.checks) else
                 f"{len(failing)} of its {len(bug)} Bug-Checks fail without it, all {len(run.outcomes)} Checks "
                 "pass with it")
        return Port("port proven", f"{v.target}'s variant applies ({how}); {shown} "
                                   f"(evidence: {run.log})", v.target, str(ready))
    finally:
        _cleanup(tree)
        with contextlib.suppress(OSError):
            (tree.parent / f"{tree.name}.patch").unlink()


def _region(nb: NewBase, release: str, old_commit: str | None, patch: Patch, detail: str) -> dict[str, Any]:
    """The conflicting file and hunk (from `detail`, git am's diagnosis), and the release's diff of that file
    since the old base: its hunks near the patch's hunk, and the command that shows them."""
    m = re.search(r"hunk (\d+) of (\S+) does not apply at line (\d+)", detail)
    files = re.findall(r"3-way merge conflict in (.+)$", detail)
    path = m.group(2) if m else (files[0].split(", ")[0] if files else None)
    out: dict[str, Any] = {"file": path, "hunk": int(m.group(1)) if m else None,
                           "line": int(m.group(3)) if m else None, "upstream": ""}
    if not path or not old_commit:
        return out
    res = gitutil.run(nb.repo.parent, "diff", "-U0", old_commit, release, "--", path, check=False,
                      env={"GIT_DIR": str(nb.repo)})
    heads = re.findall(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", res.stdout, re.M)
    near = heads
    if out["line"]:
        line = out["line"]
        near = [h for h in heads if int(h[0]) - 40 <= line <= int(h[0]) + int(h[1] or 1) + 40] or heads
    if not heads:
        out["upstream"] = f"{path} unchanged between the bases" if res.returncode == 0 else ""
        return out
    shown = ", ".join(f"-{h[0]},{h[1] or 1} +{h[2]},{h[3] or 1}" for h in near[:3])
    out["upstream"] = (f"{len(heads)} hunk{'s' if len(heads) != 1 else ''} in {path} "
                       f"({'near it: ' if near is not heads else ''}{shown}); "
                       f"git diff {old_commit[:12]} {release[:12]} -- {path}")
    return out


# ---------------------------------------------------------------- history first (--source git)


def by_history(clone: Path, tag: str, old_ref: str | None, patch: Patch) -> str | None:
    """Why the release `tag` has the fix by a git clone of upstream's history, or None (no answer: not evidence
    that it lacks it): every recorded Upstream-Commit is an ancestor of the tag, or a commit since `old_ref` (the
    old base) has the patch's `git patch-id --stable`. Reads the clone only."""
    if gitutil.run(clone, "rev-parse", "--verify", "--quiet", f"{tag}^{{commit}}", check=False).returncode != 0:
        return None
    commits = patch.values("Upstream-Commit")
    if commits and all(gitutil.run(clone, "merge-base", "--is-ancestor", c, tag, check=False).returncode == 0
                       for c in commits):
        verb = "is an ancestor" if len(commits) == 1 else "are ancestors"
        return f"Upstream-Commit {', '.join(commits)} {verb} of {tag}"
    old_ref = next((r for r in (old_ref, f"origin/{old_ref}") if old_ref and gitutil.run(
        clone, "rev-parse", "--verify", "--quiet", f"{r}^{{commit}}", check=False).returncode == 0), None)
    if old_ref is None:
        return None
    mine = gitutil.run(clone, "patch-id", "--stable", stdin=patch.raw.decode("utf-8", "replace"), check=False)
    want = mine.stdout.split()[0] if mine.stdout.split() else None
    if not want:
        return None
    log = gitutil.run(clone, "log", "-p", "--no-merges", "--format=commit %H", f"{old_ref}..{tag}", check=False)
    ids = gitutil.run(clone, "patch-id", "--stable", stdin=log.stdout, check=False)
    for line in ids.stdout.splitlines():
        pid, _, commit = line.partition(" ")
        if pid == want:
            return f"commit {commit[:12]} since {old_ref} has the patch's git patch-id --stable"
    return None
