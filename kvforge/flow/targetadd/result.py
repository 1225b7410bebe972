"""What `kvforge target add` returns: the Outcome of each entry (done, planned, stopped, aborted) and its rendering.

Invariants. Built from the state and the per-component rebase states; reads the from-target's file, writes
nothing. A stop is exit 3 (kvforge.core.errors.EXIT_APPLY) with its one message; every other state exits 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvforge.core.render import table
from kvforge.flow.rebase.result import StopExit
from kvforge.flow.rebase.state import State, Step
from kvforge.flow.targetadd.state import AddState
from kvforge.project.targets import Target, display_path, load_target


@dataclass
class ComponentResult:
    """One component of the new target: its release and pins, its series' verdicts, or why it is left out."""

    name: str
    package: str
    version: str | None = None
    ref: str | None = None
    sha256: str | None = None
    upstream_commit: str | None = None
    wheels: list[dict[str, str]] = field(default_factory=list)  # {"filename", "sha256", "arch"}
    series: str | None = None  # relative to the project
    from_series: str | None = None
    patches: list[Step] = field(default_factory=list)
    left_out: str | None = None  # why the component is not in the new target
    selection: dict[str, Any] = field(default_factory=dict)  # per platform: kept, dropped; cpu: scan

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for p, d in zip(self.patches, data["patches"]):
            d["fired"] = p.fired
        return data


@dataclass
class TargetAddResult(StopExit):
    """What `kvforge target add` returns (an Outcome): done, planned (--dry-run), stopped (exit 3) or aborted."""

    name: str
    version: str
    from_target: str
    state: str  # done | planned | stopped | aborted
    components: list[ComponentResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    written: list[str] = field(default_factory=list)
    message: str = ""
    worktree: str | None = None
    stopped_component: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["components"] = [c.to_json() for c in self.components]
        if self.state == "stopped":
            data.update({"error": self.message, "exit": self.exit_code})
        return data

    def render(self) -> str:
        if self.state == "aborted":
            return self.message
        out = []
        for c in self.components:
            if c.left_out:
                out.append(f"{c.name}: left out: {c.left_out}")
                continue
            up = (f", built from upstream commit {c.upstream_commit}" if c.upstream_commit
                  else ", its sdist names no upstream commit")
            out.append(f"{c.name}: {c.package} {c.version} ({c.ref}{up}), sdist sha256 {(c.sha256 or '')[:12]}…, "
                       f"series {c.series} " + (f"from {c.from_series}" if c.from_series else "(empty: a first target)"))
            for w in c.wheels:
                out.append(f"  wheel {w['arch']}: {w['filename']} (sha256 {w['sha256'][:12]}…)")
            if c.patches:
                rows = []
                for n, p in enumerate(c.patches, 1):
                    sig = ", ".join(p.fired) or "-"
                    if p.against:
                        sig += " (not: " + ", ".join(p.against) + ")"
                    rows.append([n, p.name, p.verdict, sig, p.how, p.reason])
                out.append(table(["#", "patch", "verdict", "signals fired", "git am", "why"], rows))
            for plat, s in c.selection.items():
                line = f"  tests {plat}: {len(s.get('kept', []))} selectors kept"
                if "scan" in s:
                    line += (f"; rescanned: the series reaches {len(s['scan'])} test modules "
                             f"({len(s.get('judged_before', []))} left out in {self.from_target} as not CPU)")
                if s.get("dropped"):
                    line += f"; dropped (not in {c.version}): {', '.join(s['dropped'])}"
                if s.get("added"):
                    line += f"; added (new in {c.version}, run on CPU: --try): {', '.join(s['added'])}"
                if s.get("unlisted"):
                    line += (f"; new in {c.version}, not tried on CPU (`kvforge test -t {self.name} --scan --try`): "
                             f"{', '.join(s['unlisted'])}")
                out.append(line)
        head = {"done": "added", "planned": "plan (dry run, nothing written)", "stopped": "stopped"}[self.state]
        out.append(f"{head}: target {self.name} for vLLM {self.version} "
                   + (f"from {self.from_target}" if self.from_target else "(the project's first target)"))
        if self.written:
            out.append("written: " + ", ".join(self.written))
        if self.seconds:
            out.append("time: " + ", ".join(f"{k} {v:.1f}s" for k, v in self.seconds.items()))
        return "\n".join(out)  # the notes go to stderr as warnings, a stop's message as the error line (cli.finish)


def result_of(ta: AddState, target: Target, states: dict[str, State], selections: dict[str, dict],
            state: str) -> TargetAddResult:
    root = Path(ta.root)
    old_series = {c.name: c for c in load_target(ta.from_target, root).components} if ta.from_target else {}
    comps: list[ComponentResult] = []
    for cname in [*ta.components, *ta.left_out]:
        if cname in ta.left_out:
            comps.append(ComponentResult(cname, old_series[cname].release.package if cname in old_series else "",
                                         left_out=ta.left_out[cname]))
            continue
        c = target.component(cname)
        st = states.get(cname)
        comps.append(ComponentResult(
            cname, c.release.package, c.release.version, c.ref, c.release.sha256, ta.upstream.get(cname),
            [{"filename": w.filename, "sha256": w.sha256, "arch": w.arch or ""} for w in c.wheels],
            display_path(c.series_dir), display_path(old_series[cname].series_dir) if cname in old_series else None,
            list(st.steps) if st else [], None, selections.get(cname, {})))
    notes = list(ta.notes)
    for st in states.values():
        notes += [f"{st.plan.component}: {n}" for n in st.notes]
    return TargetAddResult(ta.name, ta.version, ta.from_target, state, comps, notes)

