"""Watch's rows and report: per patch its verdict and decision, per (target, component, release) a check, per
release its wheels; rendered as a table, markdown (one body per release, the scheduled workflow's issue) or
JSON, with the status and exit code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvforge.core.errors import EXIT_NETWORK, EXIT_OK, EXIT_APPLY
from kvforge.core.render import table
from kvforge.flow import behaviour
from kvforge.flow.targetadd import TargetAddResult

FORMATS = ("table", "json", "markdown")
LABEL = "kvforge-watch"  # the scheduled workflow's issues carry it (ci/github/kvforge-watch.yml)
GOOD = ("carried", "upstream")  # per-patch verdicts of the rebase that need no one
# A row's decision, what a release engineer does with it: nothing (the first three), take the proven port, or look.
DECISIONS = ("upstream", behaviour.UPSTREAM, "carried", "port proven", "needs a person")
SETTLED = DECISIONS[:3]


@dataclass
class PatchRow:
    name: str
    fix_id: str
    verdict: str  # carried | upstream | conflict | disagree
    fired: list[str]
    against: list[str]
    reason: str
    how: str  # what git am did
    drop_when: str | None  # met | not met | cannot tell (None: the patch has no drop-when signal)
    drop_when_detail: str = ""
    decision: str = ""  # one of DECISIONS
    why: str = ""  # the decision's one line
    behaviour: str | None = None  # behaviour.UPSTREAM | NEEDED | UNSURE | BUDGET (None: not asked)
    evidence: str | None = None  # the kept pytest log of the Checks without the fix
    port: dict[str, Any] | None = None  # the port tried: state, detail, source, patch_file, conflict


@dataclass
class Check:
    """One (target, component) against one release."""

    target: str
    component: str
    from_version: str
    status: str = "clean"  # clean | attention
    patches: list[PatchRow] = field(default_factory=list)
    missing_wheels: list[str] = field(default_factory=list)  # architectures the target pins and the release lacks
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    exit: int = 0  # the error's exit code
    seconds: float = 0.0

    def count(self, verdict: str) -> int:
        return sum(1 for p in self.patches if p.verdict == verdict)

    def summary(self) -> str:
        if self.error:
            return "error"
        parts = [f"{self.count(v)} {v}" for v in ("carried", "upstream", "conflict", "disagree", "skipped")
                 if self.count(v)]
        return ", ".join(parts) or "no patches"

    @property
    def cost(self) -> int:
        """How many of its rows need a person (an error counts as one)."""
        return (1 if self.error else 0) + sum(1 for p in self.patches if p.decision == "needs a person")

    def decided(self) -> str:
        parts = [f"{n} {d}" for d in DECISIONS if (n := sum(1 for p in self.patches if p.decision == d))]
        return ", ".join(parts) or ("error" if self.error else "no patches")


@dataclass
class ReleaseReport:
    package: str
    version: str
    sdist: str | None
    sdist_sha256: str | None
    uploaded: str | None
    wheels: dict[str, dict[str, str]] = field(default_factory=dict)  # arch -> {filename, sha256}
    wheels_error: str | None = None
    checks: list[Check] = field(default_factory=list)

    @property
    def status(self) -> str:
        return "clean" if all(c.status == "clean" for c in self.checks) else "attention"

    @property
    def cost(self) -> int:
        """How many rows of this release need a person."""
        return sum(c.cost for c in self.checks)

    @property
    def title(self) -> str:
        """The scheduled workflow's issue title for this release (one issue per release)."""
        return f"kvforge watch: {self.package} {self.version}"

    def markdown(self) -> str:
        head = "all clean" if self.status == "clean" else "attention needed"
        out = [f"<!-- {LABEL}: {self.package} {self.version} -->",
               f"## {self.package} {self.version}: {head}", ""]
        up = f", uploaded {self.uploaded}" if self.uploaded else ""
        out.append(f"sdist `{self.sdist}` (sha256 `{(self.sdist_sha256 or '?')[:16]}…`){up}.")
        out.append(f"Wheels: {_wheels_text(self, md=True)}.")
        out.append(f"Cost: {self.cost} row{'' if self.cost == 1 else 's'} need{'s' if self.cost == 1 else ''} a person.")
        out.append("")
        out.append("| target | component | from | status | patches | decisions |")
        out.append("|---|---|---|---|---|---|")
        for c in self.checks:
            out.append(f"| {c.target} | {c.component} | {c.from_version} | {_md(c.status)} | {_md(c.summary())} "
                       f"| {_md(c.decided())} |")
        for c in self.checks:
            out += ["", f"### {c.target} / {c.component} (from {c.from_version} onto {self.version})", ""]
            if c.error:
                out.append(f"**error** (exit {c.exit}): {_md(c.error)}")
            if c.missing_wheels:
                out.append(f"**no wheel** for {', '.join(c.missing_wheels)} (the target pins one)")
            if c.patches:
                out += ["| # | patch | verdict | decision | signals (for / against) | Drop-When | git am |",
                        "|---|---|---|---|---|---|---|"]
                for n, p in enumerate(c.patches, 1):
                    verdict = p.verdict if p.verdict in GOOD else f"**{p.verdict}**"
                    decision = p.decision if p.decision in SETTLED else f"**{p.decision}**"
                    sig = (", ".join(p.fired) or "-") + (" / " + ", ".join(p.against) if p.against else "")
                    dw = f"{p.drop_when}: {p.drop_when_detail}" if p.drop_when else "-"
                    out.append(f"| {n} | `{p.name}` | {verdict} | {decision} | {_md(sig)} | {_md(dw)} "
                               f"| {_md(p.how or '-')} |")
            out.append("")
            for p in c.patches:
                if p.verdict not in GOOD:
                    out.append(f"- `{p.name}` {p.verdict}: {_md(p.reason)}")
                    out.append(f"  - {p.decision}: {_md(p.why)}")
            for note in c.notes:
                out.append(f"- note: {_md(note)}")
            out.append(f"- reproduce: `kvforge rebase -t {c.target} --component {c.component} --onto {self.version} "
                       "--dry-run`")
        return "\n".join(out)

    def to_json(self) -> dict[str, Any]:
        return {"package": self.package, "version": self.version, "sdist": self.sdist,
                "sdist_sha256": self.sdist_sha256, "uploaded": self.uploaded, "wheels": self.wheels,
                "wheels_error": self.wheels_error, "status": self.status, "title": self.title, "cost": self.cost,
                "checks": [_check_json(c) for c in self.checks], "markdown": self.markdown()}


def _check_json(c: Check) -> dict[str, Any]:
    return {"target": c.target, "component": c.component, "from_version": c.from_version, "status": c.status,
            "summary": c.summary(), "decisions": c.decided(), "cost": c.cost, "missing_wheels": c.missing_wheels, "notes": c.notes, "error": c.error,
            "exit": c.exit, "seconds": round(c.seconds, 3),
            "patches": [{"name": p.name, "fix_id": p.fix_id, "verdict": p.verdict, "fired": p.fired,
                         "against": p.against, "reason": p.reason, "how": p.how,
                         "drop_when": {"state": p.drop_when, "detail": p.drop_when_detail},
                         "decision": p.decision, "why": p.why, "behaviour": p.behaviour, "evidence": p.evidence,
                         "port": p.port} for p in c.patches]}


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _wheels_text(r: ReleaseReport, md: bool = False) -> str:
    if r.wheels_error:
        return f"cannot tell ({r.wheels_error})"
    if not r.wheels:
        return "none on the index"
    q = "`" if md else ""
    return ", ".join(f"{arch} {q}{w['filename']}{q}" for arch, w in r.wheels.items())


# ---------------------------------------------------------------- the result


@dataclass
class WatchResult:
    index: str
    since: str | None
    watched: list[dict[str, str]]  # target, component, package, base version
    releases: list[ReleaseReport]
    fmt: str = "table"
    skipped: list[str] = field(default_factory=list)  # eol targets left out
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    applied: list[TargetAddResult] | None = None  # --apply: the target adds run, in order
    checks_run: int = 0  # Checks runs made (results from the cache are none)

    @property
    def status(self) -> str:
        if not self.releases:
            return "nothing-new"
        return "clean" if all(r.status == "clean" for r in self.releases) else "attention"

    @property
    def exit_code(self) -> int:
        if any(a.state == "stopped" for a in self.applied or ()):
            return EXIT_APPLY
        if self.status != "attention":
            return EXIT_OK
        codes = [c.exit for r in self.releases for c in r.checks if c.error]
        return EXIT_NETWORK if EXIT_NETWORK in codes else EXIT_APPLY

    @property
    def error_label(self) -> str:
        """How the CLI names `error`: "attention" for new releases that need a person (a conflict, a disagreement,
        a missing wheel: a normal result of watch), "error" when --apply stopped or the network failed."""
        network = any(c.exit == EXIT_NETWORK for r in self.releases for c in r.checks if c.error)
        stopped = any(a.state == "stopped" for a in self.applied or ())
        return "error" if network or stopped else "attention"

    @property
    def error(self) -> str | None:
        stopped = next((a for a in self.applied or () if a.state == "stopped"), None)
        if stopped is not None:
            return f"--apply: target add {stopped.name} stopped: {stopped.message}"
        if self.status != "attention":
            return None
        bad = [f"{r.package} {r.version}" for r in self.releases if r.status != "clean"]
        return f"attention needed for {len(bad)} of {len(self.releases)} new releases: {', '.join(bad)}"

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "index": self.index, "since": self.since, "watched": self.watched,
                "cost": sum(r.cost for r in self.releases), "checks_run": self.checks_run,
                "skipped": self.skipped, "releases": [r.to_json() for r in self.releases],
                "applied": None if self.applied is None else [a.to_json() for a in self.applied],
                "seconds": round(self.seconds, 3)}

    def render(self) -> str:
        text = self.markdown() if self.fmt == "markdown" else self.text()
        if self.applied is not None:
            done = [f"{a.name} ({a.state})" for a in self.applied]
            text += "\n\n--apply: " + (f"target add: {', '.join(done)}" if done else
                                        "no new vLLM release is clean for every target moving to it: nothing added")
        return text

    def _headline(self) -> str:
        watched = ", ".join(f"{w['target']}/{w['component']} ({w['package']} {w['base']})" for w in self.watched)
        since = f", newer than {self.since}" if self.since else ""
        if not self.releases:
            return f"nothing new on {self.index}{since} for {watched or 'no maintained target'}"
        n_att = sum(1 for r in self.releases if r.status != "clean")
        what = "all clean" if not n_att else f"{n_att} need attention"
        n = len(self.releases)
        cost = sum(r.cost for r in self.releases)
        return (f"{n} new release{'' if n == 1 else 's'} on {self.index}{since}: {what}, {cost} row"
                f"{'' if cost == 1 else 's'} need a person (watched: {watched})")

    def text(self) -> str:
        out = [self._headline()]
        if self.skipped:
            out.append(f"not watched (lifecycle eol): {', '.join(self.skipped)}")
        if not self.releases:
            return "\n".join(out)
        rows = [[f"{r.package} {r.version}", f"{c.target}/{c.component}", c.from_version, c.summary(),
                 "missing " + ", ".join(c.missing_wheels) if c.missing_wheels else ("?" if r.wheels_error else
                                                                                     ", ".join(r.wheels) or "none"),
                 c.status, c.cost] for r in self.releases for c in r.checks]
        out += ["", table(["release", "target/component", "from", "patches", "wheels", "status", "need a person"],
                          rows)]
        for r in self.releases:
            out += ["", f"{r.package} {r.version}: {r.cost} row{'' if r.cost == 1 else 's'} need a person"]
            for c in r.checks:
                out += ["", f"{r.package} {r.version} <- {c.target}/{c.component} ({c.status})"]
                if c.error:
                    out.append(f"  error (exit {c.exit}): {c.error}")
                if c.patches:
                    prow = [[n, p.name, p.verdict, (", ".join(p.fired) or "-")
                             + (f" (not: {', '.join(p.against)})" if p.against else ""),
                             f"{p.drop_when}: {p.drop_when_detail}" if p.drop_when else "-"]
                            for n, p in enumerate(c.patches, 1)]
                    out.append(table(["#", "patch", "verdict", "signals fired", "Drop-When"], prow))
                    out += [f"  {p.name}: {p.verdict}: {p.reason}" for p in c.patches if p.verdict not in GOOD]
                    out += [f"  {p.fix_id}: {p.decision}" + (f": {p.why}" if p.why else "") for p in c.patches]
                out += [f"  note: {n}" for n in c.notes]
            out.append(f"  wheels of {r.package} {r.version}: {_wheels_text(r)}")
        out.append(f"\ntime: {self.seconds:.1f}s")
        return "\n".join(out)

    def markdown(self) -> str:
        out = ["# kvforge watch", "", self._headline() + "."]
        for r in self.releases:
            out += ["", r.markdown()]
        return "\n".join(out)
