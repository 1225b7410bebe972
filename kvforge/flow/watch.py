"""`kvforge watch`: the upstream releases newer than each maintained target's base, and what moving the
target onto each would do: a dry-run rebase per (target, component, release), each patch's Drop-When
evaluated there, and whether the release's wheels exist.

Owns: the package index's release lists (`index_releases`: PyPI's JSON API at $KVFORGE_PYPI_URL, read
once per package and run), which releases count as new for a component (`new_releases`), the report
(table, markdown, JSON; one markdown body per release for the scheduled workflow's issue) and its status.
Not owned here: the rebase (kvforge.flow.rebase, called with dry_run=True: it writes only the cache, never
patches/ or targets/), the signals and Drop-When (kvforge.flow.upstream, read from the rebase's steps), the
wheel choice (kvforge.wheels.choose.choose_wheels), the downloads (kvforge.core.index: cached, sha256-checked).

`--apply` (`apply=True`): for each new vLLM release that is clean for every target moving to it and that no
target has yet, `kvforge target add VERSION --from T` (kvforge.flow.targetadd; T: the newest watched target it is clean for): the
one write watch makes, all or nothing per target; a target add that stops (a conflict in another component's
series) ends the applying (exit 3), its state resumable with `kvforge target add --continue`.

Behaviour decides (kvforge.flow.behaviour): a conflict or disagreement row gets the patch's Checks run on the
release with the patches the dry run carried before it, without the fix, in the release's CPU environment (built
once, cached by content; a release's rows on one commit share a pytest run where their test files allow): all
pass (its Bug-Checks) ->
"upstream (by behaviour)"; a behavioural failure -> "needed", and then a port of the nearest variant of the fix
(the same Fix-Id in any target's series of that component, the one whose release is nearest first) onto that
same commit, proven when its Checks fail without it and pass with it ("port proven", the ready patch kept in the
cache); else "needs a person" with why (the Checks cannot run there, or where the port stops and the release's
change of that region). `checks` (--checks N; $KVFORGE_WATCH_CHECKS) bounds the Checks runs of one watch (a
result from the cache is no run); rows beyond it say "not checked: budget". Each row's `decision` is one of
DECISIONS; a release's cost is how many of its rows need a person.

Invariants: without --apply, writes nothing in the project; targets with `lifecycle = "eol"` are never watched; every
(target, component, release) gets a row, and a failure of one (a download, a rebase of that target in
progress) is that row's error, never the end of the run. Status and exit code: "nothing-new" (0), "clean"
(0: every new release carries or drops every patch and has the wheels the target pins), "attention" (3: a
conflict, a disagreement, missing wheels, or a row that failed; a row's network failure makes it 6).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from packaging.version import InvalidVersion, Version

from kvforge.core import index
from kvforge.core.index import pypi_url
from kvforge.flow import behaviour
from kvforge.flow.upstream import NewBase, new_base_info
from kvforge.git import gitutil
from kvforge.git.bases import ensure_base
from kvforge.wheels.choose import choose_wheels
from kvforge.core.cache import Cache
from kvforge.git.context import Context
from kvforge.core.errors import EXIT_APPLY, EXIT_NETWORK, EXIT_OK, EXIT_USAGE, KvforgeError
from kvforge.flow.rebase import RebaseResult
from kvforge.flow.rebase.state import Verdict
from kvforge.flow.rebase.command import rebase
from kvforge.core.render import table
from kvforge.flow.targetadd import TargetAddResult, add
from kvforge.project.series import Patch, read_series
from kvforge.project.targets import Component, Release, Target, load_all, load_target

FORMATS = ("table", "json", "markdown")
LABEL = "kvforge-watch"  # the scheduled workflow's issues carry it (ci/github/kvforge-watch.yml)
GOOD = ("carried", "upstream")  # per-patch verdicts of the rebase that need no one
# A row's decision, what a release engineer does with it: nothing (the first three), take the proven port, or look.
DECISIONS = ("upstream", behaviour.UPSTREAM, "carried", "port proven", "needs a person")
SETTLED = DECISIONS[:3]


# ---------------------------------------------------------------- the package index


@dataclass(frozen=True)
class IndexRelease:
    """One release of a package on the index: its version, its sdist (None: none listed), upload time."""

    package: str
    version: str
    sdist: str | None
    sdist_sha256: str | None
    uploaded: str | None
    yanked: bool


def index_releases(package: str) -> list[IndexRelease]:
    """Every release of `package` on the package index, oldest first (versions that do not parse and releases
    without files are left out): kvforge.core.index.releases, one read of PyPI's JSON API, every field
    checked. A package the index does not know is []; offline, an unreachable index or a malformed answer
    is EXIT_NETWORK."""
    found = index.releases(package, missing_ok=True)
    if found is None:
        return []
    out: list[tuple[Version, IndexRelease]] = []
    for ver, files in found.files.items():
        try:
            parsed = Version(ver)
        except InvalidVersion:
            continue
        if not files:
            continue
        sdist = next((f for f in files if f.packagetype == "sdist"), None)
        first = sdist or files[0]
        out.append((parsed, IndexRelease(package, ver, sdist.filename if sdist else None,
                                         sdist.sha256 if sdist else None, first.uploaded,
                                         all(f.yanked for f in files))))
    return [r for _v, r in sorted(out, key=lambda x: x[0])]


def new_releases(component: Component, releases: list[IndexRelease], since: Version | None) -> list[IndexRelease]:
    """The releases a component could move to: newer than its release (and than `since`), not yanked.
    Pre-releases count only for a component whose own release is one (vllm-ascend's rc's). A release with
    no sdist is kept: its row then says the rebase cannot get the release source (attention)."""
    base = Version(component.release.version)
    out = []
    for r in releases:
        v = Version(r.version)
        if v <= base or (since is not None and v <= since) or r.yanked:
            continue
        if v.is_prerelease and not base.is_prerelease:
            continue
        out.append(r)
    return out


# ---------------------------------------------------------------- the rows


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


# ---------------------------------------------------------------- the run


def _patch_rows(result: RebaseResult) -> list[PatchRow]:
    rows = []
    for s in result.patches:
        dw = next((g for g in s.signals if g.get("name") == "drop-when"), None)
        state = None
        if dw is not None:
            fired = dw.get("fired")
            state = "met" if fired is True else "not met" if fired is False else "cannot tell"
        rows.append(PatchRow(s.name, s.fix_id, str(s.verdict), list(s.fired), list(s.against), s.reason, s.how,
                             state, str(dw.get("detail", "")) if dw else ""))
    return rows


def _watched(targets: list[Target]) -> list[tuple[Target, Component]]:
    return [(t, c) for t in targets for c in t.components]


def watch(cache: Cache, target_names: tuple[str, ...] = (), since: str | None = None, fmt: str = "table",
          source: str = "sdist", progress: Callable[[str], None] = lambda _m: None,
          apply: bool = False, checks: int | None = None) -> WatchResult:
    """The CLI's one call (see the module docstring)."""
    start = time.monotonic()
    if fmt not in FORMATS:
        raise KvforgeError(f"--format {fmt!r}: one of {', '.join(FORMATS)}", EXIT_USAGE)
    budget = behaviour.Budget(checks_budget(checks))
    since_v = None
    if since is not None:
        try:
            since_v = Version(since.removeprefix("v"))
        except InvalidVersion:
            raise KvforgeError(f"--since {since!r} is not a release version (e.g. 0.20.2)", EXIT_USAGE) from None
    targets = [load_target(n) for n in dict.fromkeys(target_names)] if target_names else load_all()
    skipped = [t.name for t in targets if t.lifecycle == "eol"]
    targets = [t for t in targets if t.lifecycle != "eol"]
    pairs, notes = [], []
    for t, c in _watched(targets):
        try:
            Version(c.release.version)
            pairs.append((t, c))
        except InvalidVersion:
            notes.append(f"{t.name}/{c.name}: its release version {c.release.version!r} is not a PEP 440 version; "
                         "not watched")
    packages = list(dict.fromkeys(c.release.package for _t, c in pairs))
    listed: dict[str, list[IndexRelease]] = {}
    for pkg in packages:
        progress(f"watch: reading {pkg}'s releases from {pypi_url()}")
        listed[pkg] = index_releases(pkg)
    reports: dict[tuple[str, str], ReleaseReport] = {}
    todo: list[tuple[Target, Component, IndexRelease]] = []
    for t, c in pairs:
        for r in new_releases(c, listed[c.release.package], since_v):
            todo.append((t, c, r))
            reports.setdefault((r.package, r.version),
                               ReleaseReport(r.package, r.version, r.sdist, r.sdist_sha256, r.uploaded))
    wheels_read: set[tuple[str, str]] = set()
    for n, (t, c, r) in enumerate(todo, 1):
        rep = reports[(r.package, r.version)]
        if (r.package, r.version) not in wheels_read:  # once per release, whichever targets move to it
            wheels_read.add((r.package, r.version))
            try:
                rep.wheels = {a: {"filename": p.filename, "sha256": p.sha256}
                              for a, p in choose_wheels(r.package, r.version).items()}
            except KvforgeError as exc:
                rep.wheels_error = str(exc)
        progress(f"watch: [{n}/{len(todo)}] {t.name}/{c.name} {c.release.version} -> {r.version} (dry-run rebase)")
        rep.checks.append(_check(cache, t, c, r, rep, source, progress, budget))
    ordered = sorted(reports.values(), key=lambda x: (x.package, Version(x.version)))
    watched = [{"target": t.name, "component": c.name, "package": c.release.package, "base": c.release.version}
               for t, c in pairs]
    result = WatchResult(pypi_url(), since, watched, ordered, fmt, skipped, time.monotonic() - start, notes)
    result.checks_run = budget.used
    if apply:
        result.applied = apply_clean(cache, result, progress)
        result.seconds = time.monotonic() - start
    return result


def apply_clean(cache: Cache, result: WatchResult, progress: Callable[[str], None]) -> list[TargetAddResult]:
    """--apply: `target add` for each clean new vLLM release no target has yet, oldest first; the first one
    that stops ends it (its state is resumable). vllm-ascend releases are not added on their own: a target
    follows vLLM, and target add pairs the vllm-ascend release built on it."""
    have = {c.release.version for t in load_all() for c in t.components if c.release.package == "vllm"}
    done: list[TargetAddResult] = []
    for r in result.releases:
        if r.package != "vllm" or r.status != "clean" or r.version in have or not r.checks:
            continue
        # from the newest of the targets this release is clean for (the one the fewest releases away)
        src = max(r.checks, key=lambda c: Version(c.from_version)).target
        progress(f"watch --apply: kvforge target add {r.version} --from {src}")
        added = add(cache, r.version, from_target=src, progress=progress)
        done.append(added)
        if added.state == "stopped":
            break
    return done


def checks_budget(checks: int | None) -> int | None:
    """--checks N, else $KVFORGE_WATCH_CHECKS, else no limit (None); a negative or non-integer one is bad input."""
    where = "--checks"
    if checks is None:
        text = os.environ.get("KVFORGE_WATCH_CHECKS", "").strip()
        if not text:
            return None
        where = "$KVFORGE_WATCH_CHECKS"
        try:
            checks = int(text)
        except ValueError:
            raise KvforgeError(f"{where} {text!r}: not a number of Checks runs (e.g. 20; 0: none)", EXIT_USAGE) \
                from None
    if checks < 0:
        raise KvforgeError(f"{where} {checks}: not a number of Checks runs (0 or more)", EXIT_USAGE)
    return checks


def _check(cache: Cache, t: Target, c: Component, r: IndexRelease, rep: ReleaseReport, source: str,
           progress: Callable[[str], None], budget: behaviour.Budget | None = None) -> Check:
    t0 = time.monotonic()
    chk = Check(t.name, c.name, c.release.version)
    try:
        ctx = Context(cache, t, c, source=source, progress=progress)
        # A git base is the release's tag (vX.Y.Z, vX.Y.ZrcN: both upstreams tag so); an sdist base the version.
        result = rebase(ctx, f"v{r.version}" if source == "git" else r.version, dry_run=True)
        chk.patches = _patch_rows(result)
        chk.notes = [n for n in result.notes if not n.startswith("no wheel like")]  # the wheels are said apart
        _decide(ctx, r, chk, budget or behaviour.Budget(None), _under(result))
    except KvforgeError as exc:
        chk.error, chk.exit = str(exc).splitlines()[0] if str(exc) else type(exc).__name__, exc.exit_code
        for p in chk.patches:  # every row has a decision, whatever stopped the others
            if not p.decision:
                p.decision, p.why = "needs a person", f"not decided: {chk.error}"
    pinned = sorted({w.arch for w in c.wheels if w.arch})
    if rep.wheels_error is None:
        chk.missing_wheels = [a for a in pinned if a not in rep.wheels]
    if chk.error or chk.missing_wheels or any(p.verdict not in GOOD for p in chk.patches):
        chk.status = "attention"
    chk.seconds = time.monotonic() - t0
    return chk


# ---------------------------------------------------------------- behaviour decides


def _under(result: RebaseResult) -> list[tuple[str | None, int]]:
    """For each patch of the dry run: the commit it goes on (the last carried patch's before it; None: the release
    itself) and how many carried patches that commit holds."""
    out: list[tuple[str | None, int]] = []
    head, carried = None, 0
    for s in result.patches:
        out.append((head, carried))
        if s.verdict == Verdict.CARRIED and s.commit:
            head, carried = s.commit, carried + 1
    return out


def _decide(ctx: Context, r: IndexRelease, chk: Check, budget: behaviour.Budget,
            under: list[tuple[str | None, int]] | None = None) -> None:
    """Each row's decision: the rebase's verdict where it settles it (upstream, carried), else the Checks without
    the fix and, for a fix still needed, a port of its nearest variant (kvforge.flow.behaviour), both on what the
    patch goes on in the series: the release with the patches carried before it (`under`: _under's list; a
    conflict earlier in the series is left out, as the dry run left it out)."""
    open_rows = [p for p in chk.patches if p.verdict not in GOOD]
    for p in chk.patches:
        if p.verdict in GOOD:
            p.decision, p.why = p.verdict, ""
    if not open_rows:
        return
    c = ctx.component
    new_comp = replace(c, ref=f"v{r.version}", release=Release(c.release.package, r.version, r.sdist_sha256))
    new_ctx = Context(ctx.cache, ctx.target, new_comp, ctx.source, ctx.repo_url, ctx.progress)
    nb = new_base_info(ensure_base(new_comp, ctx.cache, ctx.source, ctx.repo_url, ctx.progress), new_comp)
    by_name = {q.name: q for q in ctx.series().patches}
    old_commit = ctx.base().commit
    clone = upstream_clone(ctx)
    if clone is not None:  # history first: ancestry and patch-id
        for p in open_rows:
            found = behaviour.by_history(clone, f"v{r.version}", c.ref, by_name[p.name])
            if found:
                p.decision, p.why = "upstream", f"by history ({clone.name}): {found}"
        open_rows = [p for p in open_rows if not p.decision]
    row_nb: dict[int, tuple[NewBase, str]] = {}  # id(row) -> (what it goes on, said in its why)
    for k, p in enumerate(chk.patches):
        head, carried = under[k] if under else (None, 0)
        if head is not None and gitutil.run(nb.repo.parent, "cat-file", "-e", f"{head}^{{commit}}", check=False,
                                            env={"GIT_DIR": str(nb.repo)}).returncode == 0:
            row_nb[id(p)] = (replace(nb, commit=head), f"on the release with the {carried} patch"
                                                       f"{'es' if carried != 1 else ''} carried before it: ")
        else:
            row_nb[id(p)] = (nb, "")
    groups: dict[str, list[PatchRow]] = {}
    for p in open_rows:
        groups.setdefault(row_nb[id(p)][0].commit, []).append(p)
    for rows in groups.values():  # the rows on one commit in as few pytest runs as their test files allow
        if len(rows) > 1:
            ctx.say(f"watch: {len(rows)} rows on {r.package} {r.version}: their Checks without the fixes")
            behaviour.prefetch(new_ctx, row_nb[id(rows[0])][0], [by_name[p.name] for p in rows], budget)
    for p in open_rows:
        patch = by_name[p.name]
        pnb, on = row_nb[id(p)]
        ctx.say(f"watch: {p.fix_id} on {r.package} {r.version}: its Checks without the fix"
                f"{' (' + on.rstrip(': ') + ')' if on else ''}")
        v = behaviour.without_fix(new_ctx, pnb, patch, budget)
        p.behaviour, p.evidence = v.state, v.evidence
        if v.state == behaviour.UPSTREAM:
            p.decision, p.why = behaviour.UPSTREAM, on + v.detail
            continue
        said = f"{on}{v.state} ({v.detail.split(' (evidence')[0]})"
        if v.state == behaviour.BUDGET:
            p.decision, p.why = "needs a person", v.detail
            continue
        # Needed, or the series' own Checks cannot run there: a variant's Checks, failing without it and passing
        # with it on the release, prove both that the fix is needed and the port.
        ctx.say(f"watch: {p.fix_id} on {r.version}: {v.state}; porting its nearest variant")
        got = behaviour.port(new_ctx, pnb, old_commit, variants(ctx, patch, r.version), budget, release=nb.commit)
        p.port = {"state": got.state, "detail": got.detail, "source": got.source, "patch_file": got.patch_file,
                  "conflict": got.conflict}
        if got.state == "port proven":
            p.decision = "port proven"
            p.why = (f"{said}; {got.detail}; ready: {got.patch_file} (kvforge target add {r.version} --from "
                     f"{ctx.target.name}, then `git am -3` it in place of {p.name})")
        else:
            p.decision, p.why = "needs a person", f"{said}; {got.detail}"


def upstream_clone(ctx: Context) -> Path | None:
    """With --source git: the local git clone of the component's upstream ($KVFORGE_<COMPONENT>_REPO, e.g.
    KVFORGE_VLLM_ASCEND_REPO, naming a directory) whose history answers before the Checks; else None."""
    if ctx.source != "git":
        return None
    where = ctx.repo_url or os.environ.get(f"KVFORGE_{ctx.component.name.upper().replace('-', '_')}_REPO")
    path = Path(where).expanduser() if where else None
    return path if path is not None and path.is_dir() else None


def variants(ctx: Context, patch: Patch, version: str) -> list[behaviour.Variant]:
    """Every variant of the patch's fix in a series of the same component (the patch's own included), the one
    whose target's release is nearest `version` first (ties: the newer release)."""
    want = Version(version)
    found: list[tuple[tuple[float, int, int], behaviour.Variant]] = []
    for t in load_all():
        comp = next((x for x in t.components if x.name == ctx.component.name), None)
        if comp is None:
            continue
        try:
            series = read_series(comp.series_dir)
        except (KvforgeError, OSError):
            continue
        for q in series.patches:
            if q.fix_id != patch.fix_id:
                continue
            try:
                rel = Version(comp.release.version)
            except InvalidVersion:
                continue
            # Its preimages, where the cache already holds its base (nothing is imported for them: a blob it lacks
            # is one git am -3 says it lacks).
            repo = ctx.cache.repos / f"{comp.name}-{'git' if ctx.source == 'git' else 'sdist'}.git"
            distance = abs(_position(rel) - _position(want))
            newer_first = 0 if rel >= want else 1
            found.append(((distance, newer_first, 0 if t.name != ctx.target.name else 1),
                          behaviour.Variant(t.name, comp.release.version, q, repo if repo.is_dir() else None)))
    seen: set[str] = set()
    out = []
    for _k, v in sorted(found, key=lambda x: x[0]):
        if v.patch.sha256 not in seen:
            seen.add(v.patch.sha256)
            out.append(v)
    return out


def _position(v: Version) -> float:
    """A release's place on one line: major * 1e6 + minor * 1e3 + micro (0.20.2 is nearer 0.22.0 than 0.20.1 is)."""
    r = v.release + (0, 0, 0)
    return r[0] * 1e6 + r[1] * 1e3 + r[2]
