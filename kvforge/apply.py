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
from .series import Patch, Series, load_clean_series
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


