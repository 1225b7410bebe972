"""`kvforge rebase`'s actions: start, continue, skip, abort; `run` is the CLI's one call."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from kvforge.git.bases import ensure_base
from kvforge.git.context import Context
from kvforge.git.engine import am_ahead
from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import crashpoint
from kvforge.project.targets import project_root, target_name_problem
from kvforge.git.trees import open_stack
from kvforge.flow.rebase.commit import changed_files, commit, range_diff
from kvforge.flow.rebase.onto import resolve_onto
from kvforge.flow.rebase.result import Aborted, RebaseResult, result_of
from kvforge.flow.rebase.state import (Digests, Phase, Plan, State, bound_elsewhere, check_project, load, lock, project_id,
                                       fresh_state_dir, save, state_dir)
from kvforge.project.transaction import dir_digest, file_digest
from kvforge.flow.rebase.steps import CheckRunner, apply_steps, old_commits, plan, release_worktree, resume, skip, worktree_path

ACTIONS = ("start", "continue", "skip", "abort")


def run(ctx: Context, action: str, onto: str | None = None, as_target: str | None = None, dry_run: bool = False,
        checks: CheckRunner | None = None) -> RebaseResult | Aborted:
    """The CLI's one call: action start | continue | skip | abort. Returns an Outcome in every case; a stop
    raises nothing (the result's exit_code is 3 and its error the message)."""
    if action == "start":
        if not onto:
            raise KvforgeError("--onto VERSION|REF is required to start a rebase (or --continue, --skip, --abort)",
                               EXIT_USAGE)
        return rebase(ctx, onto, as_target, dry_run, checks)
    if onto or as_target or dry_run:
        raise KvforgeError(f"--{action} takes no --onto, --as or --dry-run: they were fixed when the rebase started",
                           EXIT_USAGE)
    if action in ("continue", "skip"):
        return rebase_resume(ctx, action)
    if action == "abort":
        return rebase_abort(ctx)
    raise KvforgeError(f"unknown rebase action {action!r} (one of {', '.join(ACTIONS)})", EXIT_USAGE)


def rebase(ctx: Context, onto: str, as_target: str | None = None, dry_run: bool = False,
           checks: CheckRunner | None = None) -> RebaseResult:
    """Start a rebase of ctx's series onto `onto` (see the package docstring)."""
    start = time.monotonic()
    root = project_root()
    _check_repo(ctx.repo_url)
    if as_target is not None:
        _check_new_target(root, ctx, as_target)
    with lock(ctx):
        st = load(ctx)
        if st is not None and st.plan.dry_run and st.phase is Phase.RUNNING:
            _discard_state(ctx, st)  # an interrupted dry run: nothing to keep
            st = None
        if st is not None:
            check_project(st, root, ctx.label)
        if st is not None and st.phase is Phase.COMMITTING:
            if dry_run:  # a dry run never writes: the interrupted commit is reported, not finished
                raise KvforgeError(f"a rebase of {ctx.label} onto {st.plan.onto_ref} was interrupted while writing "
                                   f"its result; `kvforge rebase -t {ctx.target.name} --continue` finishes it "
                                   "(--dry-run writes nothing, so it stops here)", EXIT_USAGE)
            ctx.say("finishing an interrupted rebase commit first")
            commit(ctx, st)
            st = None
        if st is not None:
            raise KvforgeError(f"a rebase of {ctx.label} onto {st.plan.onto_ref} is in progress "
                               f"({st.where()}); `kvforge rebase -t {ctx.target.name} --continue`, --skip or --abort",
                               EXIT_USAGE)
        series = ctx.series()
        t0 = time.monotonic()
        new_comp, sha_source, notes = resolve_onto(ctx, onto, ctx.repo_url)  # a bad --onto: before any work
        old_base = ctx.base()
        stack = open_stack(ctx)
        ctx.say(f"new base: {new_comp.release.package} {new_comp.ref}")
        new_base = ensure_base(new_comp, ctx.cache, ctx.source, ctx.repo_url, ctx.progress)
        # Commit the whole series on the new base while the rest is read and the signals run (most rebases carry
        # most patches): the apply step takes these commits when its run of carried patches (the copies of these
        # bytes in the state directory) is this series or begins it.
        am_ahead(new_base.repo, new_base.commit, [p.raw for p in series.patches])
        olds = old_commits(ctx, stack, old_base, new_base)
        t_base = time.monotonic() - t0

        sdir = fresh_state_dir(ctx, series.patches)
        target_name = as_target or ctx.target.name
        series_dir = (root / "patches" / as_target) if as_target else ctx.component.series_dir
        target_file = root / "targets" / f"{target_name}.toml"
        the_plan = Plan(
            target=ctx.target.name, component=ctx.component.name, new_target=target_name, dry_run=dry_run,
            root=root, target_file=target_file, old_target_file=ctx.target.path, series_dir=series_dir,
            old_series_dir=ctx.component.series_dir, state_dir=sdir, worktree=worktree_path(ctx, new_base.repo),
            onto=onto, onto_ref=new_comp.ref,
            onto_version=new_comp.release.version if sha_source != "git" else None,
            sha256=new_comp.release.sha256, sha256_source=sha_source,
            wheel=(new_comp.wheel.filename, new_comp.wheel.sha256) if new_comp.wheel else None,
            old_base=old_base.commit, old_head=stack.commits[-1], new_base=new_base.commit,
            repo=new_base.repo, source=new_base.source, repo_url=ctx.repo_url,
            digests=Digests(series=dir_digest(series_dir), target=file_digest(target_file),
                            old_series=dir_digest(ctx.component.series_dir),
                            old_target=file_digest(ctx.target.path)),
            started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), root_id=project_id(root))
        t0 = time.monotonic()
        steps, t_checks = plan(ctx, new_comp, new_base, series.patches, olds, checks)
        st = State(plan=the_plan, steps=steps, head=new_base.commit, notes=notes,
                   seconds={"base": round(t_base, 3), "plan": round(time.monotonic() - t0 - t_checks, 3),
                            "checks": round(t_checks, 3)})
        save(st)
        crashpoint("rebase:planned")
        return _advance(ctx, st, start)


def rebase_resume(ctx: Context, action: str) -> RebaseResult:
    """--continue (carry the patch the rebase stopped at, go on after a kill, or finish a commit a kill
    interrupted) or --skip (drop the patch it stopped at)."""
    start = time.monotonic()
    with lock(ctx):
        st = _require_state(ctx)
        if st.phase is Phase.COMMITTING and action == "continue":
            return commit(ctx, st, start)
        if st.phase is Phase.COMMITTING:
            raise KvforgeError("the rebase is being committed; nothing to skip: --continue finishes it", EXIT_USAGE)
        if action == "continue":
            resume(st)
        elif st.stopped is None:
            raise KvforgeError(f"the rebase of {ctx.label} is not stopped at a patch (it was interrupted); "
                               "--continue resumes it", EXIT_USAGE)
        else:
            skip(st)
        return _advance(ctx, st, start)


def rebase_abort(ctx: Context) -> Aborted:
    """Remove the rebase's state and worktree; patches/ and targets/ were never touched."""
    with lock(ctx):
        sdir = state_dir(ctx)
        st = None
        try:
            st = load(ctx)
        except KvforgeError:
            pass  # an unreadable state is removed all the same
        if st is not None and st.plan.root.exists() and bound_elsewhere(st, project_root()):
            check_project(st, project_root(), ctx.label)  # that project's rebase is its own to abort
        if st is not None and st.phase is Phase.COMMITTING:
            raise KvforgeError(f"the rebase of {ctx.label} is past its commit point (the new series is being "
                               f"written); `kvforge rebase -t {ctx.target.name} --continue` finishes it", EXIT_USAGE)
        if not sdir.exists():
            raise KvforgeError(f"no rebase of {ctx.label} in progress", EXIT_USAGE)
        _discard_state(ctx, st)
        return Aborted(ctx.target.name, f"rebase of {ctx.label} aborted: patches/ and targets/ are as they were")


def _advance(ctx: Context, st: State, start: float) -> RebaseResult:
    """Apply from st.position on; stop at a conflict or a disagreement; commit when all are decided."""
    if not apply_steps(ctx, st):
        return result_of(st, "stopped", start)
    if st.plan.dry_run:
        result = result_of(st, "planned", start)
        result.range_diff = range_diff(st)
        if st.worktree_ready:
            release_worktree(st.plan.worktree)
        shutil.rmtree(st.plan.state_dir, ignore_errors=True)
        return result
    return commit(ctx, st, start)


def _discard_state(ctx: Context, st: State | None) -> None:
    if st is not None:
        release_worktree(st.plan.worktree)  # also when a kill came before the state said it was used
    shutil.rmtree(state_dir(ctx), ignore_errors=True)


def _require_state(ctx: Context) -> State:
    """The state of ctx's rebase, bound to this project; a change to the files its commit replaces is said
    now (the commit then keeps both: kvforge.flow.rebase.commit)."""
    st = load(ctx)
    if st is None:
        raise KvforgeError(f"no rebase of {ctx.label} in progress", EXIT_USAGE)
    check_project(st, project_root(), ctx.label)
    changed = changed_files(st)
    if changed:
        ctx.say(f"note: {', '.join(str(p) for p in changed)} changed since the rebase started; its commit will "
                "not replace them (the result is kept in the cache instead)")
    return st


def _check_repo(url: str | None) -> None:
    """--repo naming a local path (/, ./, ../, ~, file://) that is not a directory: one line, exit 2 (git's own
    message would be about access rights)."""
    if not url:
        return
    local = url.removeprefix("file://") if url.startswith("file://") else url
    if url.startswith(("/", "./", "../", "~", "file://")) and not Path(local).expanduser().is_dir():
        raise KvforgeError(f"--repo {url}: no such directory (a git clone, or a URL)", EXIT_USAGE)


def _check_new_target(root: Path, ctx: Context, name: str) -> None:
    problem = target_name_problem(name)
    if problem is not None:
        shown = name if len(name) <= 40 else name[:37] + "..."
        raise KvforgeError(f"--as {shown!r} {problem}", EXIT_USAGE)
    if len(ctx.target.components) > 1:
        others = ", ".join(c.name for c in ctx.target.components if c.name != ctx.component.name)
        raise KvforgeError(f"--as {name}: {ctx.target.name} has more than one component ({others} besides "
                           f"{ctx.component.name}); rebase moves one component's series, and a new target needs "
                           f"each component's own release and series: `kvforge target add VERSION --from "
                           f"{ctx.target.name} --as {name}` makes it (every component rebased, pinned, checked)",
                           EXIT_USAGE)
    if (root / "targets" / f"{name}.toml").exists():
        raise KvforgeError(f"--as {name}: targets/{name}.toml exists; choose a new name", EXIT_USAGE)
    d = root / "patches" / name
    if d.exists() and not d.is_dir():
        raise KvforgeError(f"--as {name}: patches/{name} exists and is not a directory; choose a new name",
                           EXIT_USAGE)
    if d.is_dir() and any(d.iterdir()):
        raise KvforgeError(f"--as {name}: patches/{name} exists and is not empty; choose a new name", EXIT_USAGE)
