"""Each component's series rebased onto its new release (the rebase library), then the one write.

Invariants. A component's rebase state is kvforge.flow.rebase.state's (`<cache>/rebase/<NAME>-<component>/`);
a component counts as done only once every patch is decided and target add's state says so. A dry run saves
no state of target add's and leaves no rebase state or stopped `git am` behind, stopped or not.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from kvforge.ci.scaffold import CORE_TESTS, core_cpu_suites
from kvforge.core.cache import Cache
from kvforge.core.fsutil import crashpoint
from kvforge.flow.rebase.retarget import complete_component
from kvforge.flow.rebase.state import Digests, Plan, State, StopKind, fresh_state_dir, load, save
from kvforge.flow.rebase.steps import apply_steps, old_commits, plan, release_worktree, resume, worktree_path
from kvforge.flow.targetadd.commit import discard, write_target
from kvforge.flow.targetadd.result import TargetAddResult, result_of
from kvforge.flow.targetadd.state import AddState, save_state
from kvforge.git.bases import ensure_base
from kvforge.git.context import Context, Progress
from kvforge.git.trees import open_stack
from kvforge.project.targets import Component, Target
from kvforge.project.transaction import dir_digest, file_digest


def _contexts(cache: Cache, old: Target, new: Target, cname: str, progress: Progress) -> tuple[Context, Context]:
    return (Context(cache, old, old.component(cname), source="sdist", progress=progress),
            Context(cache, new, new.component(cname), source="sdist", progress=progress))


def _start_component(ctx_old: Context, ctx_new: Context, ta: AddState, dry_run: bool) -> State:
    """The rebase of one component's series onto its new base, planned (signals per patch) and saved."""
    root = Path(ta.root)
    series = ctx_old.series()
    old_base = ctx_old.base()
    stack = open_stack(ctx_old)
    comp = ctx_new.component
    ctx_new.say(f"{comp.name}: new base {comp.release.package} {comp.release.version} ({comp.ref})")
    new_base = ensure_base(comp, ctx_new.cache, "sdist", None, ctx_new.progress)
    ta.upstream[comp.name] = new_base.upstream_commit or ""
    olds = old_commits(ctx_new, stack, old_base, new_base)
    sdir = fresh_state_dir(ctx_new, series.patches)
    target_file = root / "targets" / f"{ta.name}.toml"
    the_plan = Plan(
        target=ctx_old.target.name, component=comp.name, new_target=ta.name, dry_run=dry_run, root=root,
        target_file=target_file, old_target_file=ctx_old.target.path, series_dir=comp.series_dir,
        old_series_dir=ctx_old.component.series_dir, state_dir=sdir, worktree=worktree_path(ctx_new, new_base.repo),
        onto=comp.release.version, onto_ref=comp.ref, onto_version=comp.release.version,
        sha256=comp.release.sha256, sha256_source="pypi", wheel=(comp.wheel.filename, comp.wheel.sha256)
        if comp.wheel else None, old_base=old_base.commit, old_head=stack.commits[-1], new_base=new_base.commit,
        repo=new_base.repo, source=new_base.source, repo_url=None,
        digests=Digests(series=dir_digest(comp.series_dir), target=file_digest(target_file),
                        old_series=dir_digest(ctx_old.component.series_dir), old_target=file_digest(ctx_old.target.path)),
        started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), root_id=ta.root_id)
    t0 = time.monotonic()
    steps, _t_checks = plan(ctx_new, comp, new_base, series.patches, olds, None)
    st = State(plan=the_plan, steps=steps, head=new_base.commit, seconds={"plan": round(time.monotonic() - t0, 3)})
    save(st)
    return st


def drive(cache: Cache, ta: AddState, old: Target | None, new: Target, dry_run: bool, resuming: bool, progress: Progress,
          start: float, seconds: dict[str, float], fresh: bool = False) -> TargetAddResult:
    """Rebase every component not done yet (resuming the one stopped), then write the target. `fresh` (a new
    target add): a rebase state left for these components by a killed run is not theirs and is started again."""
    states: dict[str, State] = {}
    for comp in new.components:
        if old is None:
            break
        ctx_old, ctx_new = _contexts(cache, old, new, comp.name, progress)
        st = load(ctx_new)
        if comp.name in ta.done and st is not None:
            states[comp.name] = st
            continue
        t0 = time.monotonic()
        if st is None or dry_run or fresh:
            st = _start_component(ctx_old, ctx_new, ta, dry_run)
        elif resuming and ta.phase == "running":
            resume(st)
        if ta.phase == "running" and not apply_steps(ctx_new, st):
            if dry_run:
                _forget(states.values(), st)
            else:
                save_state(cache, ta)
            seconds[f"rebase {comp.name}"] = round(time.monotonic() - t0, 3)
            return _stopped(ta, new, states, st, seconds, start)
        save(st)
        seconds[f"rebase {comp.name}"] = round(time.monotonic() - t0, 3)
        states[comp.name] = st
        if not dry_run and comp.name not in ta.done:
            ta.done.append(comp.name)
            save_state(cache, ta)
            crashpoint("targetadd:component-done")
    if old is None:  # a first target: its bases are imported for their upstream commit and selection; no rebase
        firsts = []
        for comp in new.components:
            base = ensure_base(comp, cache, "sdist", None, progress)
            ta.upstream[comp.name] = base.upstream_commit or ""
            firsts.append(_first_selection(comp, base.repo, base.commit))
        new = replace(new, components=tuple(firsts))
    t0 = time.monotonic()
    final, selections = _final_target(new, old, states)
    seconds["selections"] = round(time.monotonic() - t0, 3)
    result = result_of(ta, final, states, selections, "planned" if dry_run else "done")
    if dry_run:
        _forget(states.values())
        result.seconds = {**seconds, "total": round(time.monotonic() - start, 3)}
        return result
    t0 = time.monotonic()
    result.written = write_target(cache, ta, final, states, selections, progress)
    seconds["write"] = round(time.monotonic() - t0, 3)
    discard(cache, ta, new)
    result.seconds = {**seconds, "total": round(time.monotonic() - start, 3)}
    return result


def _forget(states: Iterable[State], *more: State) -> None:
    """A dry run's rebase states and their worktrees' `git am`, gone: a dry run leaves nothing behind."""
    for st in (*states, *more):
        release_worktree(st.plan.worktree)
        shutil.rmtree(st.plan.state_dir, ignore_errors=True)


def _stopped(ta: AddState, new: Target, states: dict[str, State], st: State, seconds: dict[str, float],
             start: float) -> TargetAddResult:
    result = result_of(ta, new, {**states, st.plan.component: st}, {}, "stopped")
    p = st.step
    result.stopped_component, result.worktree = st.plan.component, str(st.plan.worktree)
    cont = f"`kvforge target add --continue --as {ta.name}`"
    if st.stopped is not None and st.stopped.kind is StopKind.CONFLICT:
        result.message = (f"{st.plan.component}: {p.name} does not apply to {st.plan.onto_ref}: {p.reason}. Resolve "
                          f"the conflict in {st.plan.worktree} (git am is stopped there), `git add` the files, then "
                          f"{cont}; `--skip --as {ta.name}` drops the patch, `--abort --as {ta.name}` stops (nothing "
                          "was written to targets/ or patches/)")
    else:
        result.message = (f"{st.plan.component}: {p.name}: the signals disagree whether {st.plan.onto_ref} already "
                          f"has it ({p.reason}). {cont} carries it, `--skip --as {ta.name}` drops it; "
                          f"`--abort --as {ta.name}` stops (nothing was "
                          "written to targets/ or patches/)")
    result.seconds = {**seconds, "total": round(time.monotonic() - start, 3)}
    return result


# ---------------------------------------------------------------- selections on the new base


def _first_selection(comp: Component, repo: Path, commit: str) -> Component:
    """A first target's vLLM selections, as `kvforge init --release` writes them: CPU, vLLM's own CPU-marked core
    suites of this base (kvforge.ci.scaffold.core_cpu_suites); CUDA, the core tests' directory."""
    if comp.name != "vllm":
        return comp
    return replace(comp, tests={**comp.tests, "cpu": core_cpu_suites(repo, commit), "cuda": (CORE_TESTS.rstrip("/"),)})


def _final_target(new: Target, old: Target | None, states: dict[str, State]) -> tuple[Target, dict[str, dict]]:
    """The new target with every component completed on its new base (kvforge.flow.rebase.retarget.complete_component:
    selections checked, the CPU one rescanned), and what that did per component."""
    comps = []
    report: dict[str, dict] = {}
    for c in new.components:
        st = states.get(c.name)
        if st is None or old is None:  # a first target: empty series and selections
            comps.append(c)
            continue
        done, report[c.name] = complete_component(c, old.component(c.name), st.plan.repo, st.plan.new_base, st.head,
                                                  st.plan.old_base, st.plan.old_head)
        comps.append(done)
    return replace(new, components=tuple(comps)), report

