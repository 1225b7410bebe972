"""Stacks: a target's series applied once, one commit per patch, for tests and verify.

A stack is keyed by (target, component, series digest). Building it applies the series with the
same machinery as `kvforge apply` in a kvforge-internal detached worktree and records the tree
after each patch as refs/kvforge/stacks/<target>/<component>/<digest>/<n> in the base's cached
repository (n = 0 is the base). `checkout(n)` then moves that one reused worktree to any state with
`git checkout --detach -f`: no tree is copied per patch, and a built stack costs nothing next time.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from . import gitutil
from .apply import add_worktree, am_in_progress, am_series, load_clean_series
from .fsutil import file_lock
from .bases import Base, Progress, ensure_base
from .cache import Cache
from .series import Series
from .targets import Component, Target


@dataclass
class Stack:
    target: str
    component: Component
    base: Base
    series: Series
    worktree: Path
    commits: list[str]  # commits[n]: the tree after patch n; commits[0] is the base
    built: bool = False  # True when this call applied the series (False: reused refs)

    @property
    def size(self) -> int:
        return len(self.series.patches)

    @property
    def digest(self) -> str:
        return self.series.digest

    def in_base(self, n: int) -> bool:
        """Patch n changed nothing: git am found it already in the tree."""
        return n > 0 and self.commits[n] == self.commits[n - 1]

    def checkout(self, n: int) -> str:
        """Move the stack's worktree to the base (n=0) or to the tree after patch n; return the commit."""
        if not 0 <= n <= self.size:
            raise ValueError(f"state {n} outside 0..{self.size}")
        commit = self.commits[n]
        gitutil.run(self.worktree, "checkout", "--detach", "-f", "-q", commit)
        gitutil.run(self.worktree, "clean", "-ffdqx")
        return commit

    def has(self, n: int, path: str) -> bool:
        return gitutil.run(self.worktree, "cat-file", "-e", f"{self.commits[n]}:{path}", check=False).returncode == 0

    def overlay(self, n: int, paths: list[str]) -> None:
        """Write files as they are after patch n into the worktree (untracked; the next checkout removes them)."""
        for path in paths:
            data = subprocess.run(["git", "cat-file", "blob", f"{self.commits[n]}:{path}"], cwd=self.worktree,
                                  capture_output=True, check=True).stdout
            dest = self.worktree / path
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)

    def label(self, n: int) -> str:
        return "base" if n == 0 else f"after {self.series.patches[n - 1].name}"

    def lock(self, progress: Progress | None = None):
        """Hold the worktree while tests run in it: two kvforge runs never move it under each other."""
        return file_lock(self.worktree.parent / f"{self.worktree.name}.lock", progress, str(self.worktree))


def ref_prefix(target: str, component: str, digest: str | None = None) -> str:
    prefix = f"refs/kvforge/stacks/{target}/{component}"
    return f"{prefix}/{digest}" if digest else prefix


def open_stack(target: Target, cache: Cache, component: str | None = None, source: str = "auto",
               repo_url: str | None = None, progress: Progress | None = None) -> Stack:
    """The target's stack: reused when its refs exist for this series and base, else built now."""
    say = progress or (lambda _m: None)
    comp = target.component(component)
    series = load_clean_series(comp)
    base = ensure_base(comp, cache, source, repo_url, say)
    worktree = cache.trees / ".work" / (f"{target.name}-{comp.name}")
    worktree.parent.mkdir(parents=True, exist_ok=True)
    stack = Stack(target.name, comp, base, series, worktree, [])
    with stack.lock(say):
        _ensure_worktree(base, worktree)
        prefix = ref_prefix(target.name, comp.name, series.digest)
        commits = _read_refs(base.repo, prefix, len(series.patches))
        if commits and commits[0] == base.commit:
            stack.commits = commits
            return stack
        say(f"applying {len(series.patches)} patches of {comp.series_dir.name} to {base.ref} "
            f"({base.commit[:12]}) for tests")
        stack.commits = _build(base, series, worktree)
        stack.built = True
        _write_refs(base.repo, ref_prefix(target.name, comp.name), prefix, stack.commits)
    return stack


def _ensure_worktree(base: Base, worktree: Path) -> None:
    registered = gitutil.run(base.repo, "worktree", "list", "--porcelain", check=False).stdout
    if worktree.is_dir() and f"worktree {worktree}\n" in registered + "\n" and (worktree / ".git").exists():
        if am_in_progress(worktree):  # an earlier run died inside git am
            gitutil.run(worktree, "am", "--abort", check=False)
        return
    add_worktree(base.repo, worktree, base.commit)


def _read_refs(repo: Path, prefix: str, size: int) -> list[str] | None:
    out = gitutil.run(repo, "for-each-ref", "--format=%(refname) %(objectname)", prefix + "/", check=False).stdout
    refs = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    commits = []
    for n in range(size + 1):
        c = refs.get(f"{prefix}/{n}")
        if not c:
            return None
        commits.append(c)
    return commits


def _build(base: Base, series: Series, worktree: Path) -> list[str]:
    gitutil.run(worktree, "checkout", "--detach", "-f", "-q", base.commit)
    gitutil.run(worktree, "clean", "-ffdqx")
    try:
        outcomes = am_series(worktree, series.patches, base)
    except BaseException:
        if am_in_progress(worktree):
            gitutil.run(worktree, "am", "--abort", check=False)
        gitutil.run(worktree, "checkout", "--detach", "-f", "-q", base.commit, check=False)
        raise
    commits = [base.commit]
    for o in outcomes:
        commits.append(o.commit or commits[-1])  # a patch already in the tree leaves it as it was
    return commits


def _write_refs(repo: Path, target_prefix: str, prefix: str, commits: list[str]) -> None:
    """Record the stack atomically, and drop the stacks of older versions of this series."""
    old = gitutil.run(repo, "for-each-ref", "--format=%(refname)", target_prefix + "/", check=False).stdout.split()
    lines = [f"delete {r}" for r in old if not r.startswith(prefix + "/")]
    lines += [f"update {prefix}/{n} {c}" for n, c in enumerate(commits)]
    gitutil.run(repo, "update-ref", "--stdin", stdin="\n".join(lines) + "\n")
