"""Is a carried fix already upstream? The signals a rebase weighs for each patch, and the decision.

Each signal looks at the new base (a `NewBase`) and one patch and says: True (evidence the base has
the fix), False (evidence it does not) or None (cannot tell here), whether that alone is trusted
(`strong`), and one line of detail for the report:

- reverse-apply: the patch's non-test hunks apply in reverse to the new base (`git apply -R
  --check`, as `stg rebase --merged`): the fixed code is there verbatim. Strong. Applying forward
  but not in reverse is weak evidence against (the old code is still there); neither is None.
- patch-id: with history, `git cherry`: a commit between the old and the new base has the patch's
  `git patch-id --stable`. Strong when equal; a squash merge or context drift defeats it, so no
  match is no evidence (None).
- upstream-commit: the recorded `Upstream-Commit`s are ancestors of the new base. Needs history
  (a git base with its history); an sdist base only knows the one upstream commit it was built
  from (vllm/_version.py `__commit_id__`, kept by kvforge.git.bases), which answers only when equal.
  A commit that is not an ancestor is weak evidence against (release branches cherry-pick).
- drop-when: the patch's own `Drop-When` condition (evaluate_drop_when).
- checks: the patch's Checks run on the new base with only the patch's test files added (no fix):
  all pass is strong evidence for, a behavioural failure strong evidence against; a test that
  cannot run there (import error, changed signature: API drift) tells nothing. Run by
  kvforge.flow.behaviour (which owns the test environments' use); this module never runs a test.

decide() turns them into upstream | carried | disagree. A false "upstream" (dropping a fix the base
lacks) is the worst outcome, so: "upstream" needs a strong signal for it and none against, two
strong ones and only weak ones against, or two weak ones and none against; strong signals on both
sides, or one strong for and a weak one against, are "disagree" (the rebase stops and shows them);
anything else is "carried". This module reads the base repository and writes only temporary files.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from packaging.version import InvalidVersion, Version

from kvforge.git import gitutil
from kvforge.git.bases import Base
from kvforge.git.engine import joinable_paths
from kvforge.git.pathindex import PathIndex
from kvforge.project.series import Patch

NAMES = ("reverse-apply", "patch-id", "upstream-commit", "drop-when", "checks")
VERDICTS = ("upstream", "carried", "disagree")
HEX = re.compile(r"^[0-9a-f]{7,40}$")


@dataclass(frozen=True)
class Signal:
    name: str  # "reverse-apply" | "patch-id" | "upstream-commit" | "drop-when" | "checks"
    fired: bool | None  # True: evidence upstream has the fix; False: evidence it does not; None: cannot tell
    strong: bool  # whether this signal alone is trusted enough to count
    detail: str  # one line for the report


@dataclass(frozen=True)
class NewBase:
    """The base a series moves onto, as the signals see it."""

    repo: Path  # bare repository holding `commit`
    commit: str
    version: str | None  # the release version (sdist), or from a vX.Y.Z ref; None for a branch
    upstream_commit: str | None  # the upstream commit it is (git) or was built from (sdist, abbreviated)
    has_history: bool  # `repo` holds upstream's history up to `commit` (not a shallow fetch, not an import)


def _git(repo: Path, *args: str, check: bool = False, **kw) -> gitutil.Result:
    return gitutil.run(repo.parent, *args, check=check, env={"GIT_DIR": str(repo), **kw.pop("env", {})}, **kw)


def new_base_info(base: "Base", component) -> NewBase:
    """What the signals need to know about `base` (kvforge.git.bases.Base) of `component`."""
    if base.source == "sdist":
        version: str | None = component.release.version
        history = False
    else:
        m = re.match(r"^v?(\d+\.\d+(?:\.\d+)?\S*)$", base.ref)
        version = m.group(1) if m else None
        history = _git(base.repo, "rev-parse", "--is-shallow-repository").stdout.strip() == "false"
    return NewBase(Path(base.repo), base.commit, version, getattr(base, "upstream_commit", None), history)


def same_commit(a: str | None, b: str | None) -> bool:
    """Two commit ids, either abbreviated, name the same commit (the shorter is a prefix, >= 7 digits)."""
    if not a or not b or not HEX.match(a.lower()) or not HEX.match(b.lower()):
        return False
    a, b = a.lower(), b.lower()
    return a.startswith(b) if len(a) >= len(b) else b.startswith(a)


# ---------------------------------------------------------------- the signals

def gather(nb: NewBase, patch: "Patch", patch_commit: str | None, *,
           checks: "Callable[[], Signal] | None" = None, probe: "Probe | None" = None) -> list[Signal]:
    """Every signal for `patch` on `nb`, in NAMES order. `patch_commit` is the patch's commit on the
    old base (in nb.repo) for patch-id; `checks` runs the behavioural signal (it costs a pytest run);
    `probe` (a Probe of nb) shares its reads of the base with the other patches of the series."""
    out = [reverse_apply_signal(nb, patch, probe), patch_id_signal(nb, patch_commit, probe),
           upstream_commit_signal(nb, patch.values("Upstream-Commit"), probe)]
    expr = patch.value("Drop-When")
    out.append(evaluate_drop_when(expr, nb, probe) if expr else Signal("drop-when", None, False, "no Drop-When"))
    out.append(checks() if checks is not None else Signal("checks", None, False, "not run"))
    return out


class Probe:
    """One new base's reads, shared by the signals of every patch of a series (a rebase plans them all
    against one base): the base's entries for the paths the series names are read once (pathindex.PathIndex;
    the whole index, `git read-tree`, for a patch it cannot answer for) instead of once per check; the
    reverse-apply checks and the forward checks of all the series' patches run at once in a few joined runs (one
    `git apply --check` of the patch files, joined, of several patches that name no path in common: see
    _run_joined), then alone the checks no joined run answered; the series' patch-ids come from one `git cherry`
    over the whole stack, and which commits the repository holds from one `git cat-file --batch-check`.
    Invariant: every answer is the one the same read made alone gives (a check against the same index, the same
    git command; of a check that passes only the pass is kept, its detail is ""); what a batch cannot answer
    exactly is asked alone. Writes only its temporary directory, removed by close()."""

    def __init__(self, nb: NewBase, patches: "Sequence[Patch]" = (), commits: "Sequence[str | None]" = ()):
        self.nb = nb
        self._tmp: Path | None = None
        self._index: Path | None = None  # the base's whole index, for a check the small one cannot answer
        self._small: PathIndex | None = None
        self._answers: set[str] = set()  # sha256 of the patches self._small answers for
        self._files: dict[str, Path] = {}  # patch sha256 -> its bytes in the temporary directory
        self._checks: dict[tuple[str, bool], tuple[bool, str]] = {}
        self._exists: dict[str, bool] = {}
        self._cherry: dict[str, str] = {}  # commit -> its `git cherry` line, from the one run over the stack
        self._patches = list(patches)
        self._commits = [c for c in commits if c]
        self._prefetched = False
        self._cherry_tried = False

    def __enter__(self) -> "Probe":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
            self._index = self._small = None
            self._files.clear()

    def _dir(self) -> Path:
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="kvforge-probe-"))
        return self._tmp

    def _env(self, patch: "Patch") -> dict[str, str]:
        """The git environment of a check of `patch`: a PathIndex of the paths the series names when it answers
        for this patch (built once, for the series given), else the base's whole index (`git read-tree`, once)."""
        if self._small is None and self._patches:
            self._small = PathIndex(self.nb.repo, self.nb.commit, [p.raw for p in self._patches],
                                    self._dir() / "paths-index")
            self._answers = {p.sha256 for p, ok in zip(self._patches, self._small.usable) if ok}
        if self._small is not None and patch.sha256 in self._answers:
            return self._small.env
        if self._index is None:
            index = self._dir() / "index"
            _git(self.nb.repo, "read-tree", self.nb.commit, check=True,
                 env={"GIT_INDEX_FILE": str(index), "GIT_WORK_TREE": str(self._dir())})
            self._index = index
        return {"GIT_INDEX_FILE": str(self._index), "GIT_WORK_TREE": str(self._dir()), "GIT_DIR": str(self.nb.repo)}

    def _patch_file(self, patch: "Patch") -> Path:
        key = patch.sha256
        if key not in self._files:
            path = self._dir() / f"{len(self._files)}.patch"
            path.write_bytes(patch.raw)
            self._files[key] = path
        return self._files[key]

    # ------------------------------------------------------------ apply checks

    def apply_check(self, patch: "Patch", paths: list[str], reverse: bool) -> tuple[bool, str]:
        """`git apply --cached --check [-R]` of `paths` of the patch against nb.commit (see _apply_check)."""
        self._prefetch()
        key = _key(patch, paths, reverse)
        if key not in self._checks:
            self._run_checks([(patch, paths, reverse)])
        return self._checks[key]

    def _run_checks(self, todo: "list[tuple[Patch, list[str], bool]]") -> None:
        """The checks `todo`, each alone, run at once."""
        groups: dict[str, tuple[dict[str, str], list[tuple[Patch, list[str], bool]]]] = {}
        for item in todo:
            env = self._env(item[0])
            groups.setdefault(env["GIT_INDEX_FILE"], (env, []))[1].append(item)
        for env, items in groups.values():
            calls = [["apply", "--cached", "--check", *(["-R"] if reverse else []),
                      *[f"--include={p}" for p in paths], str(self._patch_file(patch))] for patch, paths, reverse in items]
            for (patch, paths, reverse), res in zip(items, gitutil.run_many(self.nb.repo.parent, calls, env=env)):
                last = (res.stderr.strip().splitlines() or [""])[-1].removeprefix("error: ")
                self._checks[_key(patch, paths, reverse)] = (res.returncode == 0, last)

    def _prefetch(self) -> None:
        """Every check of the series, reverse and forward, in a few joined runs (see _run_joined) at once; then
        alone the reverse checks no joined run answered, and the forward checks no joined run answered of the
        patches whose reverse check failed. A series whose patches name no path in common costs about two
        processes per CPU, in one wave, whatever its length."""
        if self._prefetched:
            return
        self._prefetched = True
        todo = [(p, code) for p in self._patches if (code := code_paths(p))]
        if not todo:
            return
        groups: dict[str, tuple[dict[str, str], list[list[tuple[Patch, list[str], bool]]]]] = {}
        for reverse in (True, False):
            by_index: dict[str, tuple[dict[str, str], list[tuple[Patch, list[str], bool]]]] = {}
            for p, code in todo:
                env = self._env(p)
                by_index.setdefault(env["GIT_INDEX_FILE"], (env, []))[1].append((p, code, reverse))
            for index, (env, items) in by_index.items():
                groups.setdefault(index, (env, []))[1].extend(_joined_batches(items, os.cpu_count() or 1))
        self._run_joined(groups)
        self._run_checks([(p, code, True) for p, code in todo if _key(p, code, True) not in self._checks])
        self._run_checks([(p, code, False) for p, code in todo
                          if not self._checks[_key(p, code, True)][0] and _key(p, code, False) not in self._checks])

    def _run_joined(self, groups: "dict[str, tuple[dict[str, str], list[list[tuple[Patch, list[str], bool]]]]]") \
            -> None:
        """Every batch of checks in `groups` (index file -> (its env, batches of checks against it)), all at
        once: a batch of one is the check alone (its answer kept); a batch of several is one `git apply --cached
        --check [-R]` of the patch files joined into one file, with every check's --include, whose errors say
        which checks fail (_attribute): each check gets the answer it gets alone, or none when the run's output
        cannot be read so exactly (then it is asked alone).

        Exact because the patches of a batch name no path in common (both sides of every diff, and only plain
        paths: see _joined_batches), so another patch's diffs and --include change nothing of what is checked
        of a patch; git apply checks every diff of its input against the index as it is (--check writes
        nothing), reporting each failure with the path it is about and going on to the next diff (of separate
        patch files it stops at the first that fails: hence one joined file), in the input's order (reversed
        with -R, in a check alone too): a check fails alone exactly when a line of the joined run names one
        of its paths, and its last such line is the last line the check alone prints."""
        for g, (env, batches) in enumerate(groups.values()):
            argv = []
            for n, batch in enumerate(batches):
                if len(batch) == 1:
                    patch, paths, reverse = batch[0]
                    argv.append(["apply", "--cached", "--check", *(["-R"] if reverse else []),
                                 *[f"--include={p}" for p in paths], str(self._patch_file(patch))])
                    continue
                joined = self._dir() / f"joined-{g}-{n}.patch"
                joined.write_bytes(b"".join(patch.raw for patch, _, _ in batch))
                argv.append(["apply", "--cached", "--check", *(["-R"] if batch[0][2] else []),
                             *[f"--include={p}" for _, paths, _ in batch for p in paths], str(joined)])
            for batch, res in zip(batches, gitutil.run_many(self.nb.repo.parent, argv, env=env)):
                if len(batch) == 1:
                    patch, paths, reverse = batch[0]
                    last = (res.stderr.strip().splitlines() or [""])[-1].removeprefix("error: ")
                    self._checks[_key(patch, paths, reverse)] = (res.returncode == 0, last)
                    continue
                answers = _attribute(batch, res)
                if answers is not None:
                    for (patch, paths, reverse), answer in zip(batch, answers):
                        self._checks[_key(patch, paths, reverse)] = answer

    # ------------------------------------------------------------ commits

    def exists(self, commit: str) -> bool:
        """`git cat-file -e <commit>^{commit}` succeeds; the series' commits are asked in one batch."""
        if commit not in self._exists:
            ask = [c for c in dict.fromkeys([*self._commits, commit]) if c not in self._exists]
            res = _git(self.nb.repo, "cat-file", "--batch-check=%(objecttype)",
                       stdin="".join(f"{c}^{{commit}}\n" for c in ask))
            answers = res.stdout.split("\n") if res.returncode == 0 else []
            if len(answers) == len(ask) and all(a == "commit" or a.endswith(" missing") for a in answers):
                self._exists.update({c: a == "commit" for c, a in zip(ask, answers)})
            else:  # an answer the batch cannot give exactly: ask alone
                self._exists[commit] = _git(self.nb.repo, "cat-file", "-e", f"{commit}^{{commit}}").returncode == 0
        return self._exists[commit]

    def cherry(self, commit: str) -> str | None:
        """The line `git cherry nb.commit <commit> <commit>^` prints for <commit> (None: not known from the one
        run over the stack, ask alone). One `git cherry nb.commit <tip> <first>^` answers for every commit of a
        linear stack whose first commit is not in the base: then `nb.commit ^<commit>` and `nb.commit ^<tip>`
        are the same set of upstream commits, so each commit gets the mark it gets alone."""
        if not self._cherry_tried and len(self._commits) > 1:
            self._cherry_tried = True
            self._cherry_stack()
        return self._cherry.get(commit)

    def _cherry_stack(self) -> None:
        chain = self._commits
        if not all(self.exists(c) for c in chain):
            return
        first, tip = chain[0], chain[-1]
        listed = _git(self.nb.repo, "rev-list", "--reverse", f"{first}^..{tip}")
        if listed.returncode != 0 or listed.stdout.split() != chain:
            return  # not one linear stack
        if _git(self.nb.repo, "merge-base", "--is-ancestor", first, self.nb.commit).returncode == 0:
            return  # the base holds the stack: per commit, the later ones count as upstream
        res = _git(self.nb.repo, "cherry", self.nb.commit, tip, f"{first}^")
        if res.returncode != 0:
            return
        lines = {ln[2:]: ln for ln in res.stdout.splitlines() if len(ln) > 2}
        if set(lines) == set(chain):
            self._cherry.update(lines)


def _key(patch: "Patch", paths: list[str], reverse: bool) -> tuple[str, bool]:
    """A check's key in Probe._checks: the patch's bytes, the paths checked, the direction."""
    return (patch.sha256 + "\0" + "\0".join(paths), reverse)


_WILDCARD = re.compile(r"[*?\[\\]")


def _joined_batches(items: "list[tuple[Patch, list[str], bool]]", cpus: int) \
        -> "list[list[tuple[Patch, list[str], bool]]]":
    """`items` (checks of one direction against one index) in batches whose patches name no path in common
    (engine.joinable_paths), about `cpus` of them, in series order; a patch that cannot join, whose checked paths
    hold a wildcard, or one its diffs do not name as git reads them (then alone git may find no diff to check,
    an error, where in a batch it would check the others), is a batch alone."""
    size = -(-len(items) // max(1, min(cpus, len(items))))
    batches: list[list[tuple[Patch, list[str], bool]]] = []
    named: list[set[str]] = []
    alone: list[list[tuple[Patch, list[str], bool]]] = []
    for item in items:
        paths = joinable_paths(item[0].raw)
        if paths is None or not paths.issuperset(item[1]) or any(_WILDCARD.search(p) for p in item[1]):
            alone.append([item])
            continue
        for batch, seen in zip(batches, named):
            if len(batch) < size and not seen & paths:
                batch.append(item)
                seen |= paths
                break
        else:
            batches.append([item])
            named.append(set(paths))
    return batches + alone


_PATCH_FAILED = re.compile(r"^error: patch failed: (.+):\d+$")


def _attribute(batch: "list[tuple[Patch, list[str], bool]]", res: gitutil.Result) -> "list[tuple[bool, str]] | None":
    """Each check's answer, (passed, its last error line), from the joined run `res` of `batch` (see
    Probe._run_joined); None when a line of git's errors is not one about a path of exactly one patch of the
    batch (or it failed without saying why)."""
    if res.returncode == 0:
        return [(True, "")] * len(batch)
    owner: dict[str, int] = {}
    for k, (patch, _, _) in enumerate(batch):
        for path in joinable_paths(patch.raw) or ():
            owner[path] = k
    failed: dict[int, str] = {}
    for line in res.stderr.strip().splitlines():
        m = _PATCH_FAILED.match(line)
        named = [m.group(1)] if m else [p for p in owner if line.startswith(f"error: {p}: ")]
        if len(named) != 1 or named[0] not in owner:
            return None
        failed[owner[named[0]]] = line.removeprefix("error: ")
    if not failed:
        return None
    return [(k not in failed, failed.get(k, "")) for k in range(len(batch))]


def is_test_path(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return path.startswith("tests/") or "/tests/" in path or name.startswith("test_") or name == "conftest.py"


def code_paths(patch: "Patch") -> list[str]:
    """The paths the patch changes that are not tests: the fix itself, what reverse-apply checks."""
    return [p for p in patch.touched_paths if not is_test_path(p)]


def _apply_check(nb: NewBase, patch: "Patch", paths: list[str], reverse: bool,
                 probe: "Probe | None" = None) -> tuple[bool, str]:
    """`git apply --cached --check [-R]` of `paths` of the patch against nb.commit (its index, in a temporary
    file; read once for a whole series with a `probe`)."""
    if probe is not None:
        return probe.apply_check(patch, paths, reverse)
    with Probe(nb) as alone:
        return alone.apply_check(patch, paths, reverse)


def reverse_apply_signal(nb: NewBase, patch: "Patch", probe: "Probe | None" = None) -> Signal:
    code = code_paths(patch)
    if not code:
        return Signal("reverse-apply", None, False, "the patch changes only tests")
    what = f"{len(code)} non-test file{'s' if len(code) > 1 else ''}"
    back, why_back = _apply_check(nb, patch, code, reverse=True, probe=probe)
    if back:
        return Signal("reverse-apply", True, True, f"the fix's hunks ({what}) apply in reverse: the base has them")
    forward, _ = _apply_check(nb, patch, code, reverse=False, probe=probe)
    if forward:
        return Signal("reverse-apply", False, False, f"the fix's hunks ({what}) still apply forward, not in reverse")
    return Signal("reverse-apply", None, False, f"applies neither way (the code changed: {why_back})")


def _commit_exists(nb: NewBase, commit: str, probe: "Probe | None") -> bool:
    if probe is not None:
        return probe.exists(commit)
    return _git(nb.repo, "cat-file", "-e", f"{commit}^{{commit}}").returncode == 0


def patch_id_signal(nb: NewBase, patch_commit: str | None, probe: "Probe | None" = None) -> Signal:
    if not nb.has_history:
        return Signal("patch-id", None, False, "no upstream history in this base (an sdist import or a shallow fetch)")
    if not patch_commit or not _commit_exists(nb, patch_commit, probe):
        return Signal("patch-id", None, False, "the patch's commit is not in the base repository")
    line = probe.cherry(patch_commit) if probe is not None else None
    if line is None:
        res = _git(nb.repo, "cherry", nb.commit, patch_commit, f"{patch_commit}^")
        line = next((ln for ln in res.stdout.splitlines() if ln[2:].startswith(patch_commit[:12])), None)
        if res.returncode != 0:
            line = None
    if line is None:
        return Signal("patch-id", None, False, "git cherry could not compare it")
    if line.startswith("-"):
        return Signal("patch-id", True, True, "a commit since the old base has the same git patch-id --stable")
    return Signal("patch-id", None, False, "no commit since the old base has its patch-id (not evidence: a squash "
                                           "merge or context drift changes it)")


def upstream_commit_signal(nb: NewBase, commits: list[str], probe: "Probe | None" = None) -> Signal:
    if not commits:
        return Signal("upstream-commit", None, False, "no Upstream-Commit recorded")
    if any(same_commit(c, nb.upstream_commit) for c in commits) and len(commits) == 1:
        return Signal("upstream-commit", True, True, f"the base is upstream commit {commits[0]}")
    if not nb.has_history:
        built = f" (built from {nb.upstream_commit})" if nb.upstream_commit else ""
        return Signal("upstream-commit", None, False,
                      f"no history{built}: cannot tell whether {', '.join(commits)} "
                      f"{'is an ancestor' if len(commits) == 1 else 'are ancestors'}")
    known, inside = [], []
    for c in commits:
        if _commit_exists(nb, c, probe):
            known.append(c)
            if _git(nb.repo, "merge-base", "--is-ancestor", c, nb.commit).returncode == 0:
                inside.append(c)
    if len(known) < len(commits):
        missing = [c for c in commits if c not in known]
        return Signal("upstream-commit", None, False, f"{', '.join(missing)} not in the base's history")
    if len(inside) == len(commits):
        verb = "is an ancestor" if len(commits) == 1 else "are ancestors"
        return Signal("upstream-commit", True, True, f"{', '.join(commits)} {verb} of the base")
    outside = [c for c in commits if c not in inside]
    return Signal("upstream-commit", False, False,
                  f"{', '.join(outside)} not an ancestor of the base (a cherry-pick would have another id)")


_VERSION = re.compile(r"^version >= (\S+)$")


def evaluate_drop_when(expr: str, nb: NewBase, probe: "Probe | None" = None) -> Signal:
    """A patch's `Drop-When` against the new base: `version >= X` (the base's release version),
    `base-contains C` (history, or the base's own recorded upstream commit), `upstream-pr-merged URL`
    (needs the network: None), `never` (no condition: None)."""
    expr = (expr or "").strip()
    m = _VERSION.match(expr)
    if m:
        if not nb.version:
            return Signal("drop-when", None, False, f"{expr}: the base has no release version")
        try:
            reached = Version(nb.version) >= Version(m.group(1))
        except InvalidVersion as exc:
            return Signal("drop-when", None, False, f"{expr}: {exc}")
        if reached:
            return Signal("drop-when", True, True, f"{expr}: the base is {nb.version}")
        return Signal("drop-when", False, False, f"{expr}: the base is {nb.version}")
    if expr.startswith("base-contains "):
        c = expr.split(None, 1)[1]
        if same_commit(c, nb.upstream_commit):
            return Signal("drop-when", True, True, f"{expr}: the base is that commit")
        if not nb.has_history:
            built = f" (built from {nb.upstream_commit})" if nb.upstream_commit else ""
            return Signal("drop-when", None, False, f"{expr}: no history in this base{built} to look for it")
        if not _commit_exists(nb, c, probe):
            return Signal("drop-when", None, False, f"{expr}: {c} is not in the base's history")
        if _git(nb.repo, "merge-base", "--is-ancestor", c, nb.commit).returncode == 0:
            return Signal("drop-when", True, True, f"{expr}: it is an ancestor of the base")
        return Signal("drop-when", False, False, f"{expr}: not an ancestor of the base")
    if expr.startswith("upstream-pr-merged "):
        return Signal("drop-when", None, False, f"{expr}: kvforge does not ask the forge whether a PR is merged "
                      "(it reaches only the package index); say `base-contains <merge commit>` once it is")
    if expr == "never" or expr.startswith("never "):
        return Signal("drop-when", None, False, f"{expr}: no condition to evaluate")
    return Signal("drop-when", None, False, f"{expr!r}: not a Drop-When condition")


# ---------------------------------------------------------------- the decision

def decide(signals: list[Signal]) -> tuple[str, str]:
    """("upstream" | "carried" | "disagree", one-line reason). Never "upstream" on one weak signal nor
    against a strong signal; strong signals on both sides disagree (see the module docstring)."""
    strong_for = [s for s in signals if s.fired is True and s.strong]
    strong_against = [s for s in signals if s.fired is False and s.strong]
    weak_for = [s for s in signals if s.fired is True and not s.strong]
    against = [s for s in signals if s.fired is False]

    def names(ss: list[Signal]) -> str:
        return ", ".join(s.name + ("" if s.strong else " (weak)") for s in ss)

    if strong_for and strong_against:
        return "disagree", f"strong signals disagree: for upstream {names(strong_for)}; against {names(strong_against)}"
    if strong_for and not against:
        return "upstream", f"upstream has it: {names(strong_for + weak_for)}"
    if len(strong_for) >= 2:
        return "upstream", f"upstream has it: {names(strong_for)}; against only {names(against)}"
    if strong_for:
        return "disagree", f"signals disagree: for upstream {names(strong_for)}; against {names(against)}"
    if len({s.name for s in weak_for}) >= 2 and not against:
        return "upstream", f"upstream has it: {names(weak_for)}, none against"
    if strong_against:
        return "carried", f"upstream lacks it: {names(strong_against)}"
    if weak_for:
        return "carried", f"not enough to drop it: for upstream only {names(weak_for)}" + \
                          (f"; against {names(against)}" if against else "")
    if against:
        return "carried", f"no signal says upstream has it; against {names(against)}"
    return "carried", "no signal can tell whether upstream has it: kept"
