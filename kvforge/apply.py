"""Apply a target's series to its base as one commit per patch, transactionally.

The work happens in a hidden, detached worktree next to the destination; no branch exists until
every patch is in. Then the branch is created (only if it did not exist) and the worktree moved to
its final place. On failure the hidden worktree is removed and nothing the user can see has changed,
unless --keep-conflict asks to be left at the failing patch with conflict markers.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import gitutil
from .bases import Base, Progress, ensure_base
from .cache import Cache
from .errors import EXIT_APPLY, EXIT_USAGE, KvforgeError
from .series import Patch, Series, read_series
from .targets import Component, Target

AM_OPTS = ("am", "-3", "--keep-non-patch", "--committer-date-is-author-date", "--no-gpg-sign")


@dataclass
class PatchOutcome:
    name: str
    fix_id: str
    status: str  # applied | applied (3-way) | in base | failed | not reached
    commit: str | None = None
    detail: str = ""


@dataclass
class ApplyResult:
    target: str
    component: str
    base: str
    base_source: str
    branch: str | None
    worktree: str | None
    head: str | None
    patches: list[PatchOutcome] = field(default_factory=list)
    seconds: float = 0.0
    noop: bool = False

    def to_json(self) -> dict:
        return asdict(self)


class ApplyFailure(KvforgeError):
    """A patch did not apply; carries the per-patch outcomes for the report."""

    exit_code = EXIT_APPLY

    def __init__(self, message: str, outcomes: list[PatchOutcome]):
        super().__init__(message)
        self.outcomes = outcomes


def load_clean_series(component: Component) -> Series:
    series = read_series(component.series_dir)
    problems = series.all_problems()
    if problems:
        more = f" (and {len(problems) - 1} more; run `kvforge lint`)" if len(problems) > 1 else ""
        raise KvforgeError(f"{problems[0]}{more}")
    return series


def default_into(cache: Cache, target: Target, component: Component) -> Path:
    name = target.name if len(target.components) == 1 else f"{target.name}-{component.name}"
    return cache.trees / name


def apply_target(target: Target, cache: Cache, into: Path | None = None, branch: str | None = None,
                 keep_conflict: bool = False, source: str = "auto", repo_url: str | None = None,
                 component: str | None = None, progress: Progress | None = None) -> ApplyResult:
    say = progress or (lambda _m: None)
    start = time.monotonic()
    comp = target.component(component)
    series = load_clean_series(comp)
    base = ensure_base(comp, cache, source, repo_url, say)
    into = Path(into).expanduser().resolve() if into else default_into(cache, target, comp)
    branch = branch or f"kvforge/{target.name}" + ("" if len(target.components) == 1 else f"-{comp.name}")
    if gitutil.run(base.repo, "check-ref-format", "--branch", branch, check=False).returncode != 0:
        raise KvforgeError(f"--branch {branch!r} is not a valid branch name", EXIT_USAGE)
    result = ApplyResult(target.name, comp.name, base.commit, base.source, branch, str(into), None)

    existing = gitutil.rev_parse(base.repo, f"refs/heads/{branch}")
    if not existing and into.exists() and any(into.iterdir()):
        raise KvforgeError(f"{into} exists and is not empty; choose another --into or remove it", EXIT_USAGE)

    tmp = into.parent / f".{into.name}.kvforge-{os.getpid()}"
    into.parent.mkdir(parents=True, exist_ok=True)
    say(f"applying {len(series.patches)} patches to {base.ref} ({base.commit[:12]})")
    add_worktree(base.repo, tmp, base.commit)
    try:
        result.patches = am_series(tmp, series.patches, base)
    except ApplyFailure as failure:
        if keep_conflict and not existing:
            gitutil.run(base.repo, "worktree", "move", str(tmp), str(into))
            gitutil.run(into, "update-ref", f"refs/heads/{branch}", "HEAD", "")
            gitutil.run(into, "symbolic-ref", "HEAD", f"refs/heads/{branch}")
            failure.args = (f"{failure.args[0]}\nleft at the failing patch with conflict markers in {into} "
                            f"(branch {branch}); resolve, `git add`, then `git am --continue`",)
        else:
            remove_worktree(base.repo, tmp)
        raise
    except BaseException:
        remove_worktree(base.repo, tmp)
        raise

    head = gitutil.rev_parse(tmp, "HEAD")
    if existing:
        # Re-running apply: a no-op when the branch already holds exactly this result, else refuse.
        same = gitutil.rev_parse(base.repo, f"{existing}^{{tree}}") == gitutil.rev_parse(tmp, "HEAD^{tree}")
        count = gitutil.run(base.repo, "rev-list", "--count", f"{base.commit}..{existing}", check=False).stdout.strip()
        remove_worktree(base.repo, tmp)
        applied = sum(1 for o in result.patches if o.commit)
        if same and count == str(applied):
            result.noop, result.head = True, existing
            result.worktree = worktree_of(base.repo, branch)
            result.seconds = time.monotonic() - start
            return result
        raise KvforgeError(f"branch {branch} already exists at {existing[:12]} and differs from this series; "
                           f"nothing was changed (use --branch NAME, or delete it: "
                           f"git -C {base.repo} worktree remove <dir> && git -C {base.repo} branch -D {branch})",
                           EXIT_USAGE)
    try:
        if into.exists():
            into.rmdir()  # empty (checked above)
        gitutil.run(base.repo, "worktree", "move", str(tmp), str(into))
        gitutil.run(into, "update-ref", f"refs/heads/{branch}", head, "")  # "" = only if it does not exist
        gitutil.run(into, "symbolic-ref", "HEAD", f"refs/heads/{branch}")
    except BaseException:
        remove_worktree(base.repo, tmp if tmp.exists() else into)
        raise
    result.head = head
    result.seconds = time.monotonic() - start
    return result


def add_worktree(repo: Path, path: Path, commit: str) -> None:
    if path.exists():
        remove_worktree(repo, path)
    gitutil.run(repo, "worktree", "add", "--detach", "-q", str(path), commit)


def remove_worktree(repo: Path, path: Path) -> None:
    gitutil.run(repo, "worktree", "remove", "--force", "--force", str(path), check=False)
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)
    gitutil.run(repo, "worktree", "prune", check=False)


def worktree_of(repo: Path, branch: str) -> str | None:
    out = gitutil.run(repo, "worktree", "list", "--porcelain", check=False).stdout
    current = None
    for line in out.splitlines():
        if line.startswith("worktree "):
            current = line[len("worktree "):]
        elif line == f"branch refs/heads/{branch}":
            return current
    return None


def am_series(worktree: Path, patches: list[Patch], base: Base) -> list[PatchOutcome]:
    """`git am -3` the patches in one run; skip ones already in the tree; explain a failure.

    One `git am` call for the whole series keeps the cost that of plain `git am`; the per-patch
    table is recovered from its output ("Applying: <subject>", 3-way fallback, "already applied").
    """
    check_link_paths(worktree, patches)
    outcomes = [PatchOutcome(p.name, p.fix_id, "not reached") for p in patches]
    position = 0
    while position < len(patches):
        res = gitutil.run(worktree, *AM_OPTS, *[str(p.path) for p in patches[position:]], check=False)
        position = _record(res.stdout + "\n" + res.stderr, patches, outcomes, position, worktree)
        if res.returncode == 0:
            break
        # git am stopped at patches[position].
        failing = patches[position]
        if reverse_applies(worktree, failing):
            outcomes[position].status = "in base"
            outcomes[position].detail = "already contained in the tree (applies in reverse)"
            # --quit, not --abort: --abort would also drop the commits this am run already made.
            gitutil.run(worktree, "am", "--quit", check=False)
            gitutil.run(worktree, "reset", "--hard", "-q", "HEAD", check=False)
            position += 1
            continue
        reason = diagnose(worktree, failing, res.stdout + "\n" + res.stderr)
        outcomes[position].status = "failed"
        outcomes[position].detail = reason
        raise ApplyFailure(f"{failing.name}: {reason}", outcomes)
    commits = gitutil.run(worktree, "rev-list", "--reverse", f"{base.commit}..HEAD").stdout.split()
    applied = [o for o in outcomes if o.status.startswith("applied")]
    for o, c in zip(applied, commits):
        o.commit = c
    return outcomes


def _record(output: str, patches: list[Patch], outcomes: list[PatchOutcome], position: int, worktree: Path) -> int:
    """Mark outcomes from git am's output; return the index of the patch am stopped at (or the end)."""
    current = position - 1
    for line in output.splitlines():
        if line.startswith("Applying: "):
            current += 1
            outcomes[current].status = "applied"
        elif line.startswith("Falling back to patching base and 3-way merge") and current >= position:
            outcomes[current].status = "applied (3-way)"
        elif "Patch already applied" in line and current >= position:
            outcomes[current].status = "in base"
            outcomes[current].detail = "3-way merge found no change: already in the tree"
    stopped = am_in_progress(worktree)
    if stopped:
        return max(current, position)
    return len(patches)


def am_in_progress(worktree: Path) -> bool:
    path = gitutil.run(worktree, "rev-parse", "--git-path", "rebase-apply").stdout.strip()
    return (worktree / path).exists() if not os.path.isabs(path) else Path(path).exists()


def reverse_applies(worktree: Path, patch: Patch) -> bool:
    return gitutil.run(worktree, "apply", "--check", "-R", str(patch.path), check=False).returncode == 0


HUNK_FAIL = re.compile(r"error: patch failed: (.+):(\d+)")
NO_FILE = re.compile(r"error: (.+): (does not exist in index|No such file or directory|already exists in (?:index|working directory))")


def diagnose(worktree: Path, patch: Patch, am_output: str) -> str:
    """Name the file, hunk and line that failed, as a release engineer needs it."""
    text = _apply_check(worktree, patch) + "\n" + am_output
    conflicts = re.findall(r"CONFLICT \([^)]*\): Merge conflict in (\S+)", am_output)
    m = HUNK_FAIL.search(text)
    if m:
        path, line = m.group(1), int(m.group(2))
        hunk = patch.hunk_at(path, line)
        where = f"hunk {hunk} of {path}" if hunk else f"a hunk of {path}"
        how = " (and the 3-way merge conflicts)" if path in conflicts else ""
        return f"{where} does not apply at line {line}{how}"
    m = NO_FILE.search(text)
    if m:
        return f"{m.group(1)}: {m.group(2)}"
    if conflicts:
        return f"3-way merge conflict in {', '.join(conflicts)}"
    lines = [ln for ln in am_output.splitlines() if ln.startswith(("error:", "fatal:"))]
    return lines[0] if lines else "git am failed"


def _apply_check(worktree: Path, patch: Patch) -> str:
    """`git apply --check` against HEAD itself: the index may hold am's half-made merge."""
    fd, name = tempfile.mkstemp(prefix="kvforge-index-")
    os.close(fd)
    index = Path(name)
    index.unlink()
    env = {"GIT_INDEX_FILE": str(index)}
    try:
        gitutil.run(worktree, "read-tree", "HEAD", env=env)
        return gitutil.run(worktree, "apply", "--check", "--cached", str(patch.path), check=False, env=env).stderr
    finally:
        index.unlink(missing_ok=True)


def check_link_paths(worktree: Path, patches: list[Patch]) -> None:
    """Refuse a patch that would write through a symbolic link of the tree."""
    prefixes: dict[str, Patch] = {}
    for p in patches:
        for path in p.touched_paths:
            parts = path.split("/")
            for k in range(1, len(parts) + 1):
                prefixes.setdefault("/".join(parts[:k]), p)
    if not prefixes:
        return
    out = gitutil.run(worktree, "ls-tree", "HEAD", "--", *sorted(prefixes), check=False).stdout
    for line in out.splitlines():
        meta, _, name = line.partition("\t")
        if meta.startswith("120000"):
            p = prefixes[name]
            raise ApplyFailure(f"{p.name}: {name} is a symbolic link in the base; writing through it is refused",
                               [PatchOutcome(p.name, p.fix_id, "failed", detail="writes through a symlink")])
