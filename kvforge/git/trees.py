"""Stacks: a series applied once, one commit per patch, for tests, verify and bench.

A stack is keyed by (target, component, series digest). Its series is either the series files
(applied with the git am engine in a kvforge-internal worktree) or, with --from, the commits
base..REV of a user's tree (copied into the cache repository as they are: nothing is re-applied).
The tree after patch n is recorded as refs/kvforge/stacks/<target>/<component>/<digest>/<n>
(n = 0 is the base) in the base's cached repository. `checkout(n)` moves the one reused worktree
<cache>/trees/.work/<target>-<component> to any state: no tree is copied per patch, and a built
stack costs nothing next time. kvforge owns these worktrees; users never get them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvforge.git import gitutil
from kvforge.git.bases import Base
from kvforge.core.cache import REF_FROM, REF_STACKS, Cache
from kvforge.git.context import Context, Progress
from kvforge.git.engine import am_in_progress, am_series, ensure_worktree, format_patch
from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.core.evidence import Key
from kvforge.core.fsutil import atomic_write_text, crashpoint, file_lock, pid_alive
from kvforge.project.series import Series, parse_patch



@dataclass
class Stack:
    target: str
    component: str
    base: Base
    series: Series
    worktree: Path
    commits: list[str]  # commits[n]: the tree after patch n; commits[0] is the base
    built: bool = False  # True when this call applied the series (False: reused refs)
    origin: str = "series"  # "series" (the files) or "--from <rev> (<sha>)"

    @property
    def size(self) -> int:
        return len(self.series.patches)

    @property
    def digest(self) -> str:
        return self.series.digest

    @property
    def key(self) -> Key:
        """The evidence key of this stack: (target, component, base commit, series digest)."""
        return Key(self.target, self.component, self.base.commit, self.digest)

    def in_base(self, n: int) -> bool:
        """Patch n changed nothing: git am found it already in the tree."""
        return n > 0 and gitutil.rev_parse(self.worktree, f"{self.commits[n]}^{{tree}}") == \
            gitutil.rev_parse(self.worktree, f"{self.commits[n - 1]}^{{tree}}")

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
            data = gitutil.run(self.worktree, "cat-file", "blob", f"{self.commits[n]}:{path}", binary=True).stdout
            dest = self.worktree / path
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)

    def label(self, n: int) -> str:
        return "base" if n == 0 else f"after {self.series.patches[n - 1].name}"

    def lock(self, progress: Progress | None = None):
        """Hold the worktree while tests run in it: two kvforge runs never move it under each other."""
        return file_lock(self.worktree.parent / f"{self.worktree.name}.lock", progress, str(self.worktree))


def ref_prefix(target: str, component: str, digest: str | None = None) -> str:
    prefix = f"{REF_STACKS}/{target}/{component}"
    return f"{prefix}/{digest}" if digest else prefix


def open_stack(ctx: Context) -> Stack:
    """ctx's stack: from the series files, or from ctx.from_rev; reused when its refs exist."""
    if ctx.from_rev:
        return _stack_from_rev(ctx, ctx.from_rev)
    series = ctx.series()
    base = ctx.base()
    stack = Stack(ctx.target.name, ctx.component.name, base, series, _worktree_path(ctx), [])
    with stack.lock(ctx.progress):
        _ensure_worktree(base, stack.worktree)
        prefix = ref_prefix(ctx.target.name, ctx.component.name, series.digest)
        commits = read_stack_refs(base.repo, prefix, len(series.patches))
        if commits and commits[0] == base.commit:
            stack.commits = commits
            return stack
        ctx.say(f"applying {len(series.patches)} patches of {ctx.component.series_dir.name} to {base.ref} "
                f"({base.commit[:12]}) for tests")
        stack.commits, outcomes = _build(base, series, stack.worktree)
        stack.built = True
        crashpoint("stack:applied")
        atomic_write_text(outcome_file(ctx, series.digest),
                          json.dumps([vars(o) for o in outcomes], indent=1) + "\n")
        crashpoint("stack:recorded")
        _write_refs(base.repo, ref_prefix(ctx.target.name, ctx.component.name), prefix, stack.commits)
    return stack


def outcome_file(ctx: Context, digest: str) -> Path:
    """What git am reported for each patch when the stack was built (applied, applied (3-way), in base)."""
    return _worktree_path(ctx).parent / f"{ctx.target.name}-{ctx.component.name}.{digest}.outcomes.json"


def _worktree_path(ctx: Context) -> Path:
    path = ctx.cache.trees / ".work" / f"{ctx.target.name}-{ctx.component.name}"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------- --from: a user's commits as the series

def resolve_from(spec: str, cwd: Path | None = None) -> tuple[Path, str]:
    """`--from` value -> (repository, commit): DIR (its HEAD), DIR:REV, or REV in the current directory's repo."""
    cwd = Path(cwd or Path.cwd())
    repo, rev = None, spec
    if ":" in spec and Path(spec.split(":", 1)[0]).expanduser().is_dir():
        d, rev = spec.split(":", 1)
        repo = Path(d).expanduser()
    elif Path(spec).expanduser().is_dir():
        repo, rev = Path(spec).expanduser(), "HEAD"
    if repo is None:
        top = gitutil.run(cwd, "rev-parse", "--show-toplevel", check=False)
        if top.returncode != 0:
            raise KvforgeError(f"--from {spec}: not a directory, and {cwd} is not inside a git repository to "
                               "resolve it in (use --from DIR or --from DIR:REV)", EXIT_USAGE)
        repo = Path(top.stdout.strip())
    elif gitutil.run(repo, "rev-parse", "--git-dir", check=False).returncode != 0:
        raise KvforgeError(f"--from {spec}: {repo} is not a git repository", EXIT_USAGE)
    commit = gitutil.rev_parse(repo, f"{rev}^{{commit}}")
    if not commit:
        raise KvforgeError(f"--from {spec}: no commit {rev!r} in {repo.resolve()}", EXIT_USAGE)
    return repo.resolve(), commit


def commits_since(repo: Path, base: str, head: str, what: str) -> list[str]:
    """base..head, oldest first: linear history on top of the base, or a clear refusal."""
    if gitutil.run(repo, "cat-file", "-e", f"{base}^{{commit}}", check=False).returncode != 0:
        raise KvforgeError(f"{what}: {repo} does not contain the base commit {base[:12]} (was the tree made by "
                           "`kvforge apply` for this target?)", EXIT_USAGE)
    if not gitutil.is_ancestor(repo, base, head):
        raise KvforgeError(f"{what}: {head[:12]} is not built on the base {base[:12]}", EXIT_USAGE)
    merges = gitutil.run(repo, "rev-list", "--merges", f"{base}..{head}").stdout.split()
    if merges:
        raise KvforgeError(f"{what}: {merges[0][:12]} is a merge commit; a series is linear history", EXIT_USAGE)
    return gitutil.run(repo, "rev-list", "--reverse", f"{base}..{head}").stdout.split()


def patch_name(n: int, fix_id: str | None, subject: str) -> str:
    slug = fix_id or re.sub(r"[^a-z0-9]+", "-", subject.lower()).strip("-")[:52] or "patch"
    return f"{n:04d}-{slug}.patch"


def series_from_commits(repo: Path, commits: list[str], directory: Path) -> Series:
    """The commits as a Series: each one's format-patch bytes, parsed as a patch file would be."""

    patches = []
    for n, c in enumerate(commits, 1):
        raw = format_patch(repo, c)
        probe = parse_patch(directory / "commit.patch", raw)
        patches.append(parse_patch(directory / patch_name(n, probe.value("Fix-Id"), probe.subject), raw))
    return Series(directory=directory, patches=patches, problems=[])


def _stack_from_rev(ctx: Context, from_rev: str) -> Stack:
    base = ctx.base()
    user_repo, head = resolve_from(from_rev)
    what = f"--from {from_rev}"
    commits = commits_since(user_repo, base.commit, head, what)
    if not commits:
        ctx.say(f"{what}: no commits on top of the base: the stack is the base alone")
    # Copy the commits into the cache repository (the user's repository is only read).
    gitutil.run(user_repo, "push", "-q", "--no-verify", str(base.repo),
                f"+{head}:{REF_FROM}/{ctx.target.name}/{ctx.component.name}/head")
    series = series_from_commits(base.repo, commits, ctx.component.series_dir)
    for p in series.patches:
        for prob in p.problems:
            ctx.say(f"{what}: {p.name} ({p.subject}): {prob.message}")
    stack = Stack(ctx.target.name, ctx.component.name, base, series, _worktree_path(ctx), [base.commit, *commits],
                  origin=f"--from {from_rev} ({head[:12]})")
    with stack.lock(ctx.progress):
        _ensure_worktree(base, stack.worktree)
    return stack


# ---------------------------------------------------------------- building from the series files

def scratch_dir(cache: Cache, kind: str) -> Path:
    """A new directory <cache>/trees/.work/.<kind>.<pid>.* for one run's worktrees and files (the cache checked
    writable: exit 5). Those of dead kvforge processes (killed: no cleanup ran) are removed first; their worktree
    registrations are pruned by `repair_worktrees`."""
    work = cache.writable("trees", ".work")
    for old in work.glob(f".{kind}.*.*"):
        if _dead_run(old):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f".{kind}.{os.getpid()}.", dir=work))


def _dead_run(path: Path) -> bool:
    """`path` is a scratch directory (`scratch_dir`) of a kvforge process that is gone."""
    parts = path.name.split(".")
    return len(parts) > 3 and parts[0] == "" and parts[2].isdigit() and not pid_alive(int(parts[2]))


STALE_LOCK = 60.0  # seconds after which a `git worktree add` still "initializing" a missing directory is dead


def _ensure_worktree(base: Base, worktree: Path) -> None:
    """The stack's worktree, made or reused (a git am an earlier run died inside is aborted), after repairing
    what a killed kvforge left in the cache (`repair_worktrees`). Called under the stack's lock."""
    repair_worktrees(base.repo, worktree)
    ensure_worktree(base.repo, worktree, base.commit)


def repair_worktrees(repo: Path, mine: Path) -> None:
    """kvforge owns its cache: a kill never leaves it for the user to repair. `mine` is a worktree of `repo` this
    process holds the lock of: git's lock files in its git directory (index.lock, HEAD.lock: a git killed inside
    it) and the "initializing" lock of a `git worktree add` killed before it finished are removed. Every
    registration of a worktree under the same `.work` directory (or a run's scratch directory in it) whose
    directory is gone is pruned, locked or not (locked: by a dead run, or for longer than STALE_LOCK: no live
    `git worktree add` is that slow before its directory exists)."""
    admin = Path(repo) / "worktrees"
    if not admin.is_dir():
        return
    work = mine.parent.resolve()
    now = time.time()
    pruned = False
    for entry in admin.iterdir():
        try:
            target = Path((entry / "gitdir").read_text(encoding="utf-8").strip()).parent
        except (OSError, UnicodeDecodeError):
            continue
        locked = entry / "locked"
        if target == mine or target.resolve() == mine.resolve():
            for name in ("index.lock", "HEAD.lock"):
                (entry / name).unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                if locked.read_text(encoding="utf-8").strip() == "initializing":
                    locked.unlink()
        elif not target.exists() and work in (target.parent.resolve(), target.parent.parent.resolve()):
            with contextlib.suppress(OSError):
                if _dead_run(target.parent) or now - locked.stat().st_mtime > STALE_LOCK:
                    locked.unlink()
            pruned = True
    if pruned:
        gitutil.run(repo, "worktree", "prune", check=False)


def read_stack_refs(repo: Path, prefix: str, size: int) -> list[str] | None:
    """The commits of a stack's refs <prefix>/0 .. <prefix>/<size> (base first), or None when one is
    missing. Reads refs only: no worktree, no lock."""
    out = gitutil.run(repo, "for-each-ref", "--format=%(refname) %(objectname)", prefix + "/", check=False).stdout
    refs = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    commits = []
    for n in range(size + 1):
        c = refs.get(f"{prefix}/{n}")
        if not c:
            return None
        commits.append(c)
    return commits


def _build(base: Base, series: Series, worktree: Path) -> tuple[list[str], list]:
    gitutil.run(worktree, "checkout", "--detach", "-f", "-q", base.commit)
    gitutil.run(worktree, "clean", "-ffdqx")
    try:
        outcomes = am_series(worktree, series.patches, base.commit)
    except BaseException:
        if am_in_progress(worktree):
            gitutil.run(worktree, "am", "--abort", check=False)
        gitutil.run(worktree, "checkout", "--detach", "-f", "-q", base.commit, check=False)
        raise
    commits = [base.commit]
    for o in outcomes:
        commits.append(o.commit or commits[-1])  # a patch already in the tree leaves it as it was
    return commits, outcomes


def _write_refs(repo: Path, target_prefix: str, prefix: str, commits: list[str]) -> None:
    """Record the stack atomically, and drop the stacks of older versions of this series."""
    old = gitutil.run(repo, "for-each-ref", "--format=%(refname)", target_prefix + "/", check=False).stdout.split()
    lines = [f"delete {r}" for r in old if not r.startswith(prefix + "/")]
    lines += [f"update {prefix}/{n} {c}" for n, c in enumerate(commits)]
    gitutil.run(repo, "update-ref", "--stdin", stdin="\n".join(lines) + "\n")
