"""target add's one write of the project: every series directory and the target file, in one transaction.

Invariants. Writes only through kvforge.project.transaction (all or nothing, each replaced file checked against
what was read); the target file and every series directory did not exist, checked here again before staging.
The state's phase "committing" (with the target text and each directory's digest) is saved before the
transaction commits, so a later --continue or --abort knows exactly which bytes are its own. `discard` removes
only kvforge's own state: the rebase states of the new target's components and <cache>/targetadd/<NAME>.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

from kvforge.ci.scaffold import first_selection_comment
from kvforge.core.cache import Cache
from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.flow.rebase.commit import stage_series
from kvforge.flow.rebase.retarget import render_target, selection_comments
from kvforge.flow.rebase.state import State, load, state_dir
from kvforge.flow.rebase.steps import release_worktree
from kvforge.flow.targetadd.state import AddState, own_dir, save_state
from kvforge.git.context import Context, Progress
from kvforge.proof.selection import scan_target
from kvforge.project import seriesdir
from kvforge.project.targets import Target, display_path
from kvforge.project.transaction import ABSENT, dir_digest, file_digest, open_transaction, text_digest


def _header(ta: AddState) -> list[str]:
    lines = [f"Made by `kvforge target add {ta.version}{' --from ' + ta.from_target if ta.from_target else ''}` "
             f"({ta.started}): every component's"]
    lines += ["release pinned from the package index, its series rebased from the from-target's, its selections",
              "checked against the new base."] if ta.from_target else \
        ["release pinned from the package index; the project had no target: an empty series, and as CPU selection",
         "vLLM's own CPU-marked core suites of the release (as `kvforge init --release` selects)."]
    for cname, why in ta.left_out.items():
        lines.append(f"{cname} is left out: {why}")
    return lines


def write_target(cache: Cache, ta: AddState, final: Target, states: dict[str, State], selections: dict[str, dict],
            progress: Progress) -> list[str]:
    """Write every series directory and the target file in one transaction (see the module docstring); after a
    kill, what a finished transaction wrote is kept and an undone one is written again."""
    root = Path(ta.root)
    tfile = root / "targets" / f"{ta.name}.toml"
    written = [display_path(c.series_dir) for c in final.components] + [display_path(tfile)]
    with open_transaction(root, "targetadd", progress, dirs=[c.series_dir for c in final.components]) as tx:
        if ta.phase == "committing" and file_digest(tfile) == text_digest(ta.final_text) and all(
                dir_digest(c.series_dir) == ta.series_digests.get(c.name) for c in final.components):
            return written
        if ta.phase != "committing":
            comments = {c.name: selection_comments(c, selections.get(c.name, {}), ta.from_target, ta.name,
                                                   ta.upstream.get(c.name)) for c in final.components}
            if not ta.from_target:
                for c in final.components:
                    if c.tests.get("cpu"):
                        comments[c.name]["cpu"] = first_selection_comment(tuple(c.tests["cpu"]))
            ta.final_text = render_target(final, root, _header(ta), comments)
        if tfile.exists():
            raise KvforgeError(f"{display_path(tfile)} appeared since the target add of {ta.name} started; nothing "
                               f"more was written (`kvforge target add --abort --as {ta.name}` removes what it "
                               "wrote)", EXIT_USAGE)
        for c in final.components:
            dest = c.series_dir
            if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
                raise KvforgeError(f"{display_path(dest)} appeared since the target add of {ta.name} started; it is "
                                   f"left as it is and nothing more was written (`kvforge target add --abort --as "
                                   f"{ta.name}` removes what it wrote)", EXIT_USAGE)
        for c in final.components:
            st = states.get(c.name)
            dest = c.series_dir
            read = dir_digest(dest)  # absent, or an empty directory (check_name)
            ta.series_digests[c.name] = (stage_series(tx, st, dest, read=read) if st is not None
                                         else tx.stage_dir(dest, {seriesdir.SERIES_FILE: b""}, read=read))
        if ta.try_cpu and ta.phase != "committing":
            final = _try_new_modules(cache, ta, final, selections, progress,
                                     {c.name: tx.staged_copy(c.series_dir) for c in final.components})
        tx.stage_file(tfile, ta.final_text.encode("utf-8"), read=ABSENT)
        ta.phase = "committing"
        save_state(cache, ta)  # what the next run compares the project with
        tx.commit()
    return written


def _try_new_modules(cache: Cache, ta: AddState, final: Target, selections: dict[str, dict], progress: Progress,
                     staged: dict[str, Path]) -> Target:
    """--try: run the modules the rescan found new in the release on the new base in the component's CPU test
    environment (kvforge.proof.selection.scan_target with try_cpu, which `kvforge test --scan --try` runs), on the
    staged series (`staged`: component -> its staged copy; nothing is written to the project yet); those that
    run join the CPU selection. The target file's text is rendered again; returns the target with them."""
    root = Path(ta.root)
    comps = []
    for c in final.components:
        rep = selections.get(c.name, {}).get("cpu", {})
        if not rep.get("unlisted"):
            comps.append(c)
            continue
        # What the old release's scan found and its target left out counts as covered: only the new modules are tried.
        probe = replace(c, tests={**c.tests, "cpu": (*c.tests["cpu"], *rep.get("judged_before", []))},
                        series_dir=staged.get(c.name, c.series_dir))
        progress(f"{c.name}: trying {len(rep['unlisted'])} modules new in {c.release.version} on CPU (--try)")
        trials = scan_target(Context(cache, replace(final, components=(probe,)), probe, source="sdist",
                                     progress=progress), try_cpu=True).trials
        runs = [t.module for t in trials if t.runs]
        rep["tried"] = [t.to_json() for t in trials]
        rep["unlisted"] = [m for m in rep["unlisted"] if m not in runs]
        rep["added"] = runs
        comps.append(replace(c, tests={**c.tests, "cpu": (*c.tests["cpu"], *runs)}))
    final = replace(final, components=tuple(comps))
    comments = {c.name: selection_comments(c, selections.get(c.name, {}), ta.from_target, ta.name,
                                           ta.upstream.get(c.name)) for c in final.components}
    ta.final_text = render_target(final, root, _header(ta), comments)
    return final


def discard(cache: Cache, ta: AddState, new: Target) -> None:
    """Remove the target add's state and its components' rebase states; a stopped `git am` is ended only in a
    worktree inside the cache's trees (a path a state names elsewhere is never touched)."""
    trees = cache.trees.resolve()
    for c in new.components:
        ctx = Context(cache, new, c, source="sdist")
        try:
            st = load(ctx)
        except KvforgeError:
            st = None
        if st is not None and st.plan.worktree.resolve().is_relative_to(trees):
            release_worktree(st.plan.worktree)
        shutil.rmtree(state_dir(ctx), ignore_errors=True)
    own = own_dir(cache, ta.name)
    if own is not None:
        shutil.rmtree(own, ignore_errors=True)

