"""`kvforge target add VERSION`: a complete new target for an upstream release, in one step (all files or none).

Modules: state (target add's own state file in the cache, its lock, the name rule every entry checks), plan
(the new target before any rebase: the from-target, each component's release and pins), result (the Outcome),
commit (the one write of the project), components (each component's series rebased, then the commit), command
(start/continue/skip/abort and `run`, the CLI's one call).

Owns the new target: which release of each component it follows and the pins of each (the sdist's sha256 and
release wheels per architecture from the package index, kvforge.flow.rebase.onto; the upstream commit the sdist
records, kvforge.git.bases), each component's series seeded by rebasing the nearest older target's series with the
rebase library (kvforge.flow.rebase.steps: signals, `git am -3`, stops and resumes), the selections checked against
the new base (and the CPU one rescanned statically, kvforge.proof.selection), `lifecycle = "maintained"`, and the one
write of targets/NAME.toml and every patches/ directory it makes.

State. `<cache>/targetadd/<NAME>/state.json` (kvforge.flow.targetadd.state: the release, the from-target, the
planned target file, the components done) plus one rebase state per component (`<cache>/rebase/<NAME>-<component>/`,
kvforge.flow.rebase.state). It is bound to the project that started it. Nothing in targets/ or patches/ is written
before every patch of every component is decided; a conflict stops (exit 3) with the worktree named;
`--continue` takes the resolution, `--abort` removes the state (the project was never touched).

Commit. The target file and the new series directories did not exist (checked at the start and again here).
One transaction of the project (kvforge.project.transaction) stages every series directory (linted) and the
target file's bytes; the state records phase "committing" with the target file's text and each directory's
digest; then the transaction commits: a target appears only with all its series. A kill is finished (past
the transaction's commit point) or undone by the next kvforge command that writes the project; `--continue`
then sees the target written (or writes it again), and `--abort` takes back, in one transaction, only the
files whose bytes are still this command's own output.
"""

from kvforge.flow.targetadd.command import add, add_abort, add_continue, run
from kvforge.flow.targetadd.plan import left_out_reason
from kvforge.flow.targetadd.result import ComponentResult, TargetAddResult

__all__ = ["ComponentResult", "TargetAddResult", "add", "add_abort", "add_continue", "left_out_reason", "run"]
