"""`kvforge apply`: the series on its base, as one commit per patch, on a branch in a tree the user owns.

The series is applied by the git am engine in kvforge's own stack (kvforge.git.trees, in the cache);
then the result reaches the user in one step:
- `--into DIR` (DIR absent or empty): a standalone repository is made beside DIR under a hidden
  temporary name (`.DIR.kvforge-PID`), the base and patch commits are fetched into it (objects
  copied: no alternates, no worktree link, nothing in the cache refers to it), the branch is
  checked out, the base tagged kvforge/base/<target>, and the directory renamed to DIR. Either
  DIR is complete or it does not exist; deleting the cache never affects it.
- `--into DIR` (an existing repository) or `--repo-dir DIR`: the branch and the base tag are
  fetched into it with one atomic fetch; its checkout, index and working files are untouched.
An existing branch is never moved: identical -> no-op; different -> refused with the commands
that keep the user's work. A killed apply leaves at most a hidden `.DIR.kvforge-PID` directory,
which the next apply into the same place removes (its process is dead). Nothing is registered in
the cache repository for a user's tree.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvforge.git import gitutil
from kvforge.git.context import Context, base_tag_name
from kvforge.git.engine import ApplyFailure, PatchOutcome, am_series
from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import crashpoint, file_lock, remove_stale
from kvforge.core.render import table
from kvforge.git.trees import Stack, open_stack, outcome_file, ref_prefix

BASE_TAG = "refs/tags/{tag}"  # kvforge/base/<target>[-<component>] (context.base_tag_name)


@dataclass
class ApplyResult:
    target: str
    component: str
    base: str
    base_ref: str
    base_source: str
    branch: str
    tree: str  # the repository that holds the branch
    mode: str  # created | added (branch added to an existing repository)
    head: str | None = None
    patches: list[PatchOutcome] = field(default_factory=list)
    seconds: float = 0.0
    noop: bool = False

    def to_json(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        head = self.head or ""
        if self.noop:
            return f"{self.tree}: {self.branch} already holds this series at {head[:12]}: nothing to do"
        where = "in a new repository" if self.mode == "created" else "added to the existing repository"
        return (f"{self.branch} at {head[:12]} on {self.base_ref} ({self.base[:12]}), {where} {self.tree} "
                f"({self.seconds:.1f}s)")


def outcomes_table(outcomes: list[PatchOutcome]) -> str:
    """One row per patch: what the apply did with it."""
    return table(["#", "patch", "fix-id", "result", "commit", "detail"],
                 [[i, o.name, o.fix_id, o.status, (o.commit or "")[:12], o.detail] for i, o in enumerate(outcomes, 1)])


@dataclass
class Applied:
    """How `kvforge apply` ends when every patch is in: one ApplyResult per component applied."""

    target: str
    results: list[ApplyResult]
    exit_code = 0
    error = None

    def to_json(self) -> dict:
        if len(self.results) == 1:
            return {**self.results[0].to_json(), "ok": True}
        return {"target": self.target, "ok": True, "components": [r.to_json() for r in self.results]}

    def render(self) -> str:
        lines = []
        for r in self.results:
            if len(self.results) > 1:
                lines.append(f"{r.target}/{r.component}:")
            lines += [outcomes_table(r.patches), "", r.summary()]
        return "\n".join(lines)


def apply_command(ctx: Context, component: str | None, into: Path | None, repo_dir: Path | None,
                  branch: str | None, keep_conflict: bool) -> Applied:
    """`kvforge apply`. A patch that does not apply ends as its ApplyFailure (exit 3), carrying the
    per-patch table (text) and {"target", "ok": false, "patches"} (data) for cli.finish."""
    if into is not None and repo_dir is not None:
        raise KvforgeError("--into and --repo-dir exclude each other", EXIT_USAGE)
    try:
        results = apply_components(ctx, component, into=into, repo_dir=repo_dir, branch=branch,
                                   keep_conflict=keep_conflict)
    except ApplyFailure as failure:
        failure.data = {"target": ctx.target.name, "ok": False, "patches": [o.__dict__ for o in failure.outcomes]}
        failure.text = outcomes_table(failure.outcomes)
        raise
    return Applied(ctx.target.name, results)


def default_into(ctx: Context) -> Path:
    return Path.cwd() / f"{ctx.component.name}-{ctx.target.name}"


def apply_components(ctx: Context, component: str | None, into: Path | None = None, repo_dir: Path | None = None,
                     branch: str | None = None, keep_conflict: bool = False) -> list[ApplyResult]:
    """`kvforge apply` for one component (named, or the only one) or, without --component on a target
    with several, for every component in the target file's order, each into ./<component>-<target>.

    Several components: every series is linted and applied in kvforge's own stacks first, and every
    destination checked, before any tree of the user's is made; so a patch that does not apply, or
    a destination that cannot be used, leaves nothing. --into, --repo-dir and --branch name one
    tree (--keep-conflict leaves one): with several components they need --component.
    """
    if component is not None or len(ctx.target.components) == 1:
        return [apply_target(ctx, into=into, repo_dir=repo_dir, branch=branch, keep_conflict=keep_conflict)]
    names = [c.name for c in ctx.target.components]
    given = [opt for opt, v in (("--into", into), ("--repo-dir", repo_dir), ("--branch", branch),
                                ("--keep-conflict", keep_conflict or None)) if v is not None]
    if given:
        raise KvforgeError(f"{' and '.join(given)} name{'s' if len(given) == 1 else ''} one tree, and target "
                           f"{ctx.target.name} has {len(names)} components ({', '.join(names)}): add --component "
                           f"NAME, or drop {given[0]} to apply each into ./<component>-{ctx.target.name}", EXIT_USAGE)
    ctxs = [ctx if c.name == ctx.component.name else ctx.for_component(c.name) for c in ctx.target.components]
    for c in ctxs:
        c.series()
    for c in ctxs:
        dest = default_into(c)
        if dest.exists() and not _existing_repo(dest, must=False) and (not dest.is_dir() or any(dest.iterdir())):
            raise KvforgeError(f"{dest} exists, is not empty and is not a git repository; nothing was applied "
                               f"(move it, or apply one component with --component and --into)", EXIT_USAGE)
    for c in ctxs:
        c.say(f"{c.label}: preparing the series in kvforge's stack")
        try:
            open_stack(c)
        except ApplyFailure as failure:
            failure.args = (f"{c.label}: {failure.args[0]}; no tree was made",)
            raise
    return [apply_target(c) for c in ctxs]


def apply_target(ctx: Context, into: Path | None = None, repo_dir: Path | None = None, branch: str | None = None,
                 keep_conflict: bool = False) -> ApplyResult:
    start = time.monotonic()
    series = ctx.series()  # lint first: a bad series touches nothing
    branch = branch or ctx.branch
    if gitutil.run(Path.cwd(), "check-ref-format", "--branch", branch, check=False).returncode != 0:
        raise KvforgeError(f"--branch {branch!r} is not a valid branch name", EXIT_USAGE)
    dest = Path(repo_dir or into or default_into(ctx)).expanduser().absolute()
    base = ctx.base()
    with file_lock(ctx.cache.root / "locks" / f"tree-{_key(dest)}.lock", ctx.progress, str(dest)):
        existing = _existing_repo(dest, must=repo_dir is not None)
        if keep_conflict and existing:
            raise KvforgeError(f"--keep-conflict makes a new tree; {dest} is an existing repository "
                               "(use --into with a new directory)", EXIT_USAGE)
        result = ApplyResult(ctx.target.name, ctx.component.name, base.commit, base.ref, base.source, branch,
                             str(dest), "added" if existing else "created")
        if not existing:
            _sweep_stale(dest)
            if dest.exists() and any(dest.iterdir()):
                raise KvforgeError(f"{dest} exists, is not empty and is not a git repository; choose another --into",
                                   EXIT_USAGE)
        have = gitutil.rev_parse(dest, f"refs/heads/{branch}") if existing else None
        ctx.say(f"applying {len(series.patches)} patches to {base.ref} ({base.commit[:12]})")
        try:
            stack = open_stack(ctx)
        except ApplyFailure as failure:
            if keep_conflict:
                _leave_conflict(ctx, dest, branch, failure)
            raise
        head = stack.commits[-1]
        result.patches = _outcomes(ctx, stack)
        result.head = head
        if have:
            if have == head:
                result.noop = True
                result.seconds = time.monotonic() - start
                return result
            raise KvforgeError(_refusal(ctx, dest, branch, have, base.commit), EXIT_USAGE)
        tag = BASE_TAG.format(tag=base_tag_name(ctx.target, ctx.component))
        refspecs = [f"{stack_ref(ctx, stack)}:refs/heads/{branch}", f"+refs/tags/{base.ref}:{tag}"]
        if existing:
            if _users_tag(dest, tag, base.commit, base.ref, ctx.target.name):
                refspecs.pop()  # it names the base already: kept as the user made it
            _fetch(dest, base.repo, refspecs)
        else:
            _create(ctx, dest, base.repo, refspecs, branch)
    result.seconds = time.monotonic() - start
    return result


def stack_ref(ctx: Context, stack: Stack) -> str:
    return f"{ref_prefix(ctx.target.name, ctx.component.name, stack.digest)}/{stack.size}"


def _key(path: Path) -> str:
    return hashlib.sha256(str(path).encode()).hexdigest()[:16]


def _existing_repo(dest: Path, must: bool) -> bool:
    """dest is a git repository's top level (work tree or bare)."""
    if dest.is_dir():
        res = gitutil.run(dest, "rev-parse", "--show-toplevel", check=False)
        bare = gitutil.run(dest, "rev-parse", "--is-bare-repository", check=False).stdout.strip() == "true"
        if (res.returncode == 0 and Path(res.stdout.strip()).resolve() == dest.resolve()) or bare:
            return True
    if must:
        raise KvforgeError(f"--repo-dir {dest}: not a git repository", EXIT_USAGE)
    return False


def _sweep_stale(dest: Path) -> None:
    """Remove `.DIR.kvforge-PID` directories whose process is dead (a killed apply)."""
    if not dest.parent.is_dir():
        return
    with contextlib.suppress(OSError):
        remove_stale(dest.parent, rf"^\.{re.escape(dest.name)}\.kvforge-(?P<pid>\d+)$")


def _tmp_for(dest: Path) -> Path:
    return dest.parent / f".{dest.name}.kvforge-{os.getpid()}"


def _fetch(repo: Path, source: Path, refspecs: list[str]) -> None:
    """One atomic fetch: every ref or none; never touches the checkout (fetch refuses a checked-out branch)."""
    res = gitutil.run(repo, "fetch", "--atomic", "--update-shallow", "--no-tags", "-q", str(source), *refspecs,
                      check=False)
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["git fetch failed"])[-1]
        raise KvforgeError(f"{repo}: could not add the branch: {last}; nothing was changed", EXIT_USAGE)


def _create(ctx: Context, dest: Path, source: Path, refspecs: list[str], branch: str) -> None:
    tmp = _tmp_for(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        _init(tmp)
        crashpoint("apply:initialized")
        _fetch(tmp, source, refspecs)
        crashpoint("apply:fetched")
        gitutil.run(tmp, "checkout", "-q", branch)
        crashpoint("apply:checked-out")
        _record(tmp, ctx)
        if dest.exists():
            dest.rmdir()  # empty (checked under the lock)
        os.rename(tmp, dest)
        crashpoint("apply:renamed")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _init(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    gitutil.run(path.parent, "init", "-q", str(path))


def _record(repo: Path, ctx: Context) -> None:
    """Note in the tree's own config which target made it (export and status read it)."""
    gitutil.run(repo, "config", "kvforge.target", ctx.target.name)
    gitutil.run(repo, "config", "kvforge.component", ctx.component.name)


def _leave_conflict(ctx: Context, dest: Path, branch: str, failure: ApplyFailure) -> None:
    """--keep-conflict: a new tree at the failing patch, git am stopped there with conflict markers."""
    base = ctx.base()
    tmp = _tmp_for(dest)
    try:
        _init(tmp)
        tag = BASE_TAG.format(tag=base_tag_name(ctx.target, ctx.component))
        _fetch(tmp, base.repo, [f"+refs/tags/{base.ref}:{tag}"])
        gitutil.run(tmp, "checkout", "-q", "--detach", base.commit)
        try:
            am_series(tmp, ctx.series().patches, base.commit, borrow=base.repo)
        except ApplyFailure:
            pass
        gitutil.run(tmp, "update-ref", f"refs/heads/{branch}", "HEAD", "")
        gitutil.run(tmp, "symbolic-ref", "HEAD", f"refs/heads/{branch}")
        _record(tmp, ctx)
        if dest.exists():
            dest.rmdir()
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    failure.args = (f"{failure.args[0]}\nleft at the failing patch with conflict markers in {dest} "
                    f"(branch {branch}); resolve, `git add`, then `git am --continue`",)


def _users_tag(dest: Path, tag: str, base: str, base_ref: str, target: str) -> bool:
    """Whether `dest` has the base tag already (True: it names `base`). A tag there that names another commit is
    the user's (moved or made by hand): refused, never reset; the refusal keeps it and deletes nothing."""
    have = gitutil.rev_parse(dest, f"{tag}^{{commit}}") or gitutil.rev_parse(dest, tag)
    if have is None:
        return False
    if have == base:
        return True
    name = tag.removeprefix("refs/tags/")
    raise KvforgeError(f"{dest}: tag {name} is at {have[:12]}, not at the base of {target} ({base_ref}, "
                       f"{base[:12]}); it is yours, nothing was changed. Apply into a new tree with `kvforge apply -t "
                       f"{target} --into DIR`, or keep a copy (`git -C {dest} tag {name}-mine {name}`), point {name} "
                       f"at {base[:12]} yourself and apply again", EXIT_USAGE)


def _refusal(ctx: Context, dest: Path, branch: str, have: str, base: str) -> str:
    n = gitutil.run(dest, "rev-list", "--count", f"{base}..{have}", check=False).stdout.strip() or "?"
    keep = f"{branch}-mine"
    return (f"{dest}: branch {branch} is at {have[:12]} ({n} commits on the base) and differs from the series; "
            f"nothing was changed. To keep that work: `kvforge export -t {ctx.target.name} --from {dest}:{branch}` "
            f"writes it to the series, or `git -C {dest} branch -m {branch} {keep}` sets it aside and the next apply "
            f"adds a fresh {branch}; or apply --into another directory")


def _outcomes(ctx: Context, stack: Stack) -> list[PatchOutcome]:
    """Per-patch outcomes from the stack: what git am reported when it was built (kept beside it)."""
    saved = {}
    note = outcome_file(ctx, stack.digest)
    if note.is_file():
        try:
            saved = {o["name"]: o for o in json.loads(note.read_text(encoding="utf-8"))}
        except (OSError, ValueError):
            saved = {}
    out = []
    for n, p in enumerate(stack.series.patches, 1):
        in_base = stack.commits[n] == stack.commits[n - 1]
        s = saved.get(p.name, {})
        status = "in base" if in_base else s.get("status", "applied")
        out.append(PatchOutcome(p.name, p.fix_id, status, None if in_base else stack.commits[n], s.get("detail", "")))
    return out
