"""`kvforge rebase`: move a target's series onto a new upstream release, dropping what upstream has.

Modules: state (the typed, versioned state), onto (the new base), steps (signals, then `git am` per
patch), commit (the one writing step), targetfile (the new target file), retarget (a component completed on its new
base, target add's: the CPU selection rescanned), result (the Outcomes), command
(start/continue/skip/abort and `run`, the CLI's one call).

Owns the rebase engine, its state in the cache and the one step that writes the result. The
per-patch "is it upstream?" signals and the decision come from kvforge.flow.upstream (not here).

For each patch, in series order: the signals are gathered against the new base and decided
(upstream | carried | disagree); then the carried patches are committed as `git am` commits them: without
a worktree while they apply as they are (the same commit ids), and a patch that does not is applied
three-way (`git am -3`, never fuzz) in a worktree of the cache's base repository:
- upstream: dropped (a ledger entry, kvforge.project.ledger);
- carried and applies: its new commit is kept;
- does not apply: the rebase stops with the worktree at that patch (conflict markers, `git am` in
  progress, rerere enabled so a recorded resolution is replayed next time);
- disagree (or git am finds it changes nothing while the signals do not say upstream): the rebase
  stops and shows the signals; `--continue` carries it, `--skip` drops it.

State. `<cache>/rebase/<target>-<component>/state.json` (written atomically after every patch;
kvforge.flow.rebase.state, versioned and type-checked on load) holds the plan, each patch's step and
verdict, the position and the commit the worktree must be at; the patch
files are copied beside it, so edits to patches/ during a rebase change nothing. A rebase killed
at any point resumes with `--continue` (the worktree is put back to the last recorded commit) or
is undone with `--abort` (the state is removed; patches/ and targets/ were never touched). The
worktree (<cache>/trees/.work/rebase-<target>-<component>) is kept for the next rebase. One flock
per target: two rebases of one target never run at once.

Commit. Nothing in patches/ or targets/ changes before every patch is decided. Then one step
(kvforge.flow.rebase.commit): the new series directory is staged complete (kvforge.project.seriesdir's transaction,
as `kvforge export`: a hidden sibling, linted), the state records phase "committing" with the new
target file's text and the digest of the staged series, then the series directory is swapped in (one
rename exchange) and the target file replaced (one rename). A kill between those renames leaves the state in "committing": any
`kvforge rebase` of that target (with or without --continue) finishes it, idempotently, before
anything else; `--abort` is then refused (the new series is already in place).
"""

from kvforge.flow.rebase.command import run
from kvforge.flow.rebase.result import RebaseResult, render  # the CLI's (it renders RebaseResult.render() once rewired)

__all__ = ["RebaseResult", "render", "run"]
