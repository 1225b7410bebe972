"""What `kvforge rebase` returns: a RebaseResult (done, planned, or stopped at a patch) or Aborted.

Both are kvforge.core.outcome.Outcome: a stopped rebase has exit code 3 and its message as the error line.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from kvforge.core.errors import EXIT_APPLY
from kvforge.core.render import table
from kvforge.flow.rebase.state import State, Step, StopKind, Verdict

VERDICTS = tuple(v.value for v in Verdict)


class StopExit:
    """The exit of a result that can stop at a patch: exit 3 (EXIT_APPLY) and its message when `state` is
    "stopped", else 0 and no error (rebase's and target add's results)."""

    state: str
    message: str

    @property
    def exit_code(self) -> int:
        return EXIT_APPLY if self.state == "stopped" else 0

    @property
    def error(self) -> str | None:
        return self.message if self.state == "stopped" else None


@dataclass
class RebaseResult(StopExit):
    target: str
    component: str
    new_target: str  # == target unless --as
    onto_version: str | None
    onto_ref: str
    old_base: str
    new_base: str
    sha256: str | None
    sha256_source: str  # pypi | local archive (offline) | git
    state: str  # done | stopped | planned
    patches: list[Step]
    worktree: str | None = None
    stopped_at: int | None = None  # index into patches
    stop_kind: str | None = None  # conflict | disagree
    message: str = ""
    range_diff: str = ""
    written: list[str] = field(default_factory=list)  # project files the commit wrote
    seconds: dict = field(default_factory=dict)  # base, plan (signals), checks, apply, write, total
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for p, d in zip(self.patches, data["patches"]):
            d["fired"] = p.fired
        if self.state == "stopped":
            data.update({"error": self.message, "exit": self.exit_code})
        return data

    def count(self, verdict: str) -> int:
        return sum(1 for p in self.patches if p.verdict == verdict)

    def render(self) -> str:
        rows = []
        for n, p in enumerate(self.patches, 1):
            sig = ", ".join(p.fired) or "-"
            if p.against:
                sig += " (not: " + ", ".join(p.against) + ")"
            rows.append([n, p.name, p.verdict, sig, p.how, p.reason])
        out = [table(["#", "patch", "verdict", "signals fired", "git am", "why"], rows), ""]
        onto = f"{self.onto_ref} ({self.new_base[:12]}"
        onto += f", sha256 {self.sha256[:12]}… from {self.sha256_source})" if self.sha256 else ")"
        counts = ", ".join(f"{self.count(v)} {v}" for v in VERDICTS if self.count(v))
        head = {"done": "rebased", "planned": "plan (dry run, nothing written)", "stopped": "stopped"}[self.state]
        out.append(f"{head}: {self.target} -> {self.new_target} onto {onto}: {counts}")
        out += [f"note: {note}" for note in self.notes]
        if self.range_diff.strip():
            out += ["\nrange-diff (old series vs new):", self.range_diff.rstrip()]
        if self.written:
            out.append("\nwritten: " + ", ".join(self.written))
        secs = ", ".join(f"{k} {v:.2f}s" for k, v in self.seconds.items())
        out.append(f"time: {secs}")
        if self.message:
            out.append(self.message)
        return "\n".join(out)


@dataclass
class Aborted:
    """`kvforge rebase --abort`: the state and the worktree's `git am` are gone."""

    target: str
    message: str
    exit_code: int = 0
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "state": "aborted", "message": self.message}

    def render(self) -> str:
        return self.message

    def __str__(self) -> str:  # what the CLI printed for --abort before it took Outcomes
        return self.message


def render(result: RebaseResult, echo: Callable[[str], Any]) -> None:
    """The text of `result`, through `echo` (the CLI's; RebaseResult.render is the same text)."""
    echo(result.render())


def result_of(st: State, state: str, start: float) -> RebaseResult:
    plan = st.plan
    r = RebaseResult(
        target=plan.target, component=plan.component, new_target=plan.new_target,
        onto_version=plan.onto_version, onto_ref=plan.onto_ref, old_base=plan.old_base,
        new_base=plan.new_base, sha256=plan.sha256, sha256_source=plan.sha256_source, state=state,
        patches=st.steps, seconds=dict(st.seconds), notes=list(st.notes))
    r.seconds["total"] = round(time.monotonic() - start, 3)  # this process's wall time
    if state == "stopped" and st.stopped is not None:
        p = st.step
        r.stopped_at, r.stop_kind, r.worktree = st.position, str(st.stopped.kind), str(plan.worktree)
        t = plan.target
        if st.stopped.kind is StopKind.CONFLICT:
            r.message = (f"{p.name} does not apply to {plan.onto_ref}: {p.reason}. Resolve the conflict in "
                         f"{plan.worktree} (git am is stopped there; rerere is on), `git add` the files, then "
                         f"`kvforge rebase -t {t} --continue`; or `--skip` to drop the patch, `--abort` to stop")
        else:
            r.message = (f"{p.name}: the signals disagree whether {plan.onto_ref} already has it ({p.reason}). "
                         f"`kvforge rebase -t {t} --continue` carries it, `--skip` drops it (recorded in the ledger), "
                         f"`--abort` stops the rebase")
    return r
