"""What carrying a series costs (`kvforge report`): one row per carried patch (fix x target x component).

A row says since when the fix is carried (the oldest commit of its patch file in the project's git history,
`git log --follow`) and in which releases (the targets whose series carry it), its Upstream-Status and PR (the
header), whether its Drop-When is met on the newest release the project has a target for (the evaluation
`kvforge status --check` uses: kvforge.flow.upstream.evaluate_drop_when on that release's sdist base), whether its
verify evidence is current (a record of exactly this base and series) or stale (kvforge.core.evidence, as
`kvforge pr` judges it), and its churn: the commits that changed the patch file, and the ledger's drops of the
fix from this series (dropped.toml: "upstream", or "skipped" after a conflict).

Totals count patch files by Upstream-Status as Yocto's patchreview does (one count per status value, the
malformed and missing ones apart) and by Debian UDD's forwarding categories (forwarded, not forwarded, not
needed, invalid metadata). `trend_row` is one flat JSON object per run that a scheduled job appends to a file
(`--format trend`), as patchreview's --json does per commit. docs/report.md documents the schema.

Reads targets, series, ledgers, evidence records and the project's git history; materialises bases into the
cache (as status --check does). Writes nothing else. A series file that lists what is not a readable patch, or a
verify record of the wrong shape, is refused (EXIT_USAGE, one line naming the file), never counted around.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from packaging.version import InvalidVersion, Version

from kvforge.core import evidence
from kvforge.git import gitutil
from kvforge.git.bases import ensure_base
from kvforge.core.cache import Cache
from kvforge.git.context import Progress
from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.project.ledger import load as load_ledger
from kvforge.core.outcome import Done
from kvforge.core.render import table
from kvforge.project.series import STATUSES, read_series
from kvforge.project.targets import Component, Target, load_all, project_root
from kvforge.flow.upstream import NewBase, evaluate_drop_when, new_base_info

SCHEMA = 1
FORMATS = ("table", "markdown", "trend")
# Yocto's patchreview: one count per Upstream-Status value; a value it does not know is "malformed".
YOCTO_STATUSES = ("Pending", "Submitted", "Accepted", "Backport", "Denied", "Inactive-Upstream", "Inappropriate")
# Debian UDD's patches view (from DEP-3 Forwarded/Origin): Upstream-Status -> its category.
UDD = {"Submitted": "forwarded", "Accepted": "forwarded", "Denied": "forwarded", "Pending": "not-forwarded",
       "Backport": "not-needed", "Inappropriate": "not-needed", "Inactive-Upstream": "not-needed"}
UDD_CATEGORIES = ("forwarded", "not-forwarded", "not-needed", "invalid")
_STATUS_RE = re.compile(r"^([A-Za-z][\w-]*)(?:\s+\[(.*)\])?\s*$")
_PR_RE = re.compile(r"https?://\S+/pull/\d+")


@dataclass
class Row:
    """One carried patch: a fix in one target's component."""

    target: str
    component: str
    release: str  # the target's release version of this component
    fix_id: str
    patch: str  # the patch file's name
    upstream_status: str  # the header's value, verbatim
    status: str  # its Yocto category (Pending, Backport, ...; "malformed" / "missing")
    udd: str  # its Debian UDD category
    prs: list[str]  # Upstream-PR links, else the status' bracketed PR link
    drop_when: str
    drop_when_met: bool | None  # on the newest release: True met, False not yet, None cannot tell
    drop_when_on: str  # the newest release it was evaluated on ("0.33.0 (main)"), or why none
    drop_when_detail: str
    evidence: str  # current | stale | missing | unknown (base unavailable)
    evidence_verdict: str  # this fix's verdict in that verify record (proven, ...), "" when none
    evidence_date: str
    first_carried: str | None  # UTC date of the oldest commit of the patch file (None: not in git history)
    first_commit: str | None
    releases: list[str]  # releases (targets) whose series carry this fix, this component
    commits: int  # commits that changed the patch file (git log --follow), 0 when not in history
    dropped: int  # ledger entries of this fix in this series (either decision)
    conflicts_skipped: int  # of those, "skipped": a rebase stopped at its conflict and the user dropped it

    @property
    def rewrites(self) -> int:
        return max(self.commits - 1, 0)

    def to_json(self) -> dict:
        return asdict(self) | {"rewrites": self.rewrites}


@dataclass
class CarryingReport:
    generated: str
    project: str
    project_commit: str | None
    newest: dict[str, str]  # component -> "version (target)"
    rows: list[Row] = field(default_factory=list)

    def totals(self) -> dict:
        yocto = {s: 0 for s in (*YOCTO_STATUSES, "malformed", "missing")}
        udd = {c: 0 for c in UDD_CATEGORIES}
        for r in self.rows:
            yocto[r.status] += 1
            udd[r.udd] += 1
        return {"patches": len(self.rows), "fixes": len({r.fix_id for r in self.rows}),
                "targets": len({r.target for r in self.rows}), "by_status": yocto, "udd": udd,
                "drop_when_met": sum(r.drop_when_met is True for r in self.rows),
                "evidence": {k: sum(r.evidence == k for r in self.rows)
                             for k in ("current", "stale", "missing", "unknown")},
                "commits": sum(r.commits for r in self.rows), "dropped": sum(r.dropped for r in self.rows),
                "conflicts_skipped": sum(r.conflicts_skipped for r in self.rows)}

    def trend_row(self) -> dict:
        """One flat object per run (append it to a JSON Lines file for a trend)."""
        t = self.totals()
        return {"schema": SCHEMA, "date": self.generated, "project_commit": self.project_commit,
                "patches": t["patches"], "fixes": t["fixes"], "targets": t["targets"],
                **{f"status_{k.lower().replace('-', '_')}": v for k, v in t["by_status"].items()},
                **{f"udd_{k.replace('-', '_')}": v for k, v in t["udd"].items()},
                "drop_when_met": t["drop_when_met"], "evidence_current": t["evidence"]["current"],
                "evidence_stale": t["evidence"]["stale"], "evidence_missing": t["evidence"]["missing"],
                "commits": t["commits"], "dropped": t["dropped"], "conflicts_skipped": t["conflicts_skipped"]}

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "generated": self.generated, "project": self.project,
                "project_commit": self.project_commit, "newest": self.newest,
                "rows": [r.to_json() for r in self.rows], "totals": self.totals(), "trend_row": self.trend_row()}


def classify(value: str) -> tuple[str, str]:
    """An Upstream-Status value -> (Yocto category, UDD category)."""
    value = (value or "").strip()
    if not value:
        return "missing", "invalid"
    m = _STATUS_RE.match(value)
    name = m.group(1) if m else ""
    if name not in YOCTO_STATUSES or (name in STATUSES and STATUSES[name] and not (m and m.group(2))):
        return "malformed", "invalid"
    return name, UDD[name]


# ---------------------------------------------------------------- gathering

def _history(root: Path, path: Path) -> tuple[int, str | None, str | None]:
    """(commits that changed `path`, following renames; the oldest one's UTC date and id), from the project's
    git history; (0, None, None) when the project is not a git repository or the file was never committed."""
    try:
        rel = path.resolve().relative_to(root.resolve())
    except ValueError:
        return 0, None, None
    res = gitutil.run(root, "log", "--follow", "--format=%H %cI", "--", str(rel), check=False)
    lines = res.stdout.splitlines() if res.returncode == 0 else []
    if not lines:
        return 0, None, None
    sha, when = lines[-1].split(" ", 1)
    try:
        date = datetime.fromisoformat(when).astimezone(timezone.utc).strftime("%Y-%m-%d")
    except ValueError:
        date = when
    return len(lines), date, sha


def _version(comp: Component) -> Version | None:
    try:
        return Version(comp.release.version)
    except (InvalidVersion, AttributeError):
        return None


def newest_components(targets: list[Target]) -> dict[str, tuple[Target, Component]]:
    """Per component name, the target component with the highest release version (the newest release)."""
    out: dict[str, tuple[Target, Component]] = {}
    for t in targets:
        for c in t.components:
            v = _version(c)
            if v is None:
                continue
            best = out.get(c.name)
            if best is None or v > (_version(best[1]) or v):
                out[c.name] = (t, c)
    return out


def _fix_verdicts(rec: evidence.Record) -> dict[str, str]:
    patches = rec.data.get("patches", [])
    if not isinstance(patches, list):
        raise KvforgeError(f"{rec.path}: not a kvforge verify record (data.patches must be a list, not "
                           f"{type(patches).__name__})", EXIT_USAGE)
    return {str(p.get("fix_id")): str(p.get("status", "")) for p in patches if isinstance(p, dict)}


def carrying_report(targets: list[Target], every: list[Target], cache: Cache,
                    progress: Progress | None = None) -> CarryingReport:
    """The cost rows of `targets` (the newest release and the releases carried are taken from `every`)."""
    say = progress or (lambda _m: None)
    root = project_root()
    head = gitutil.run(root, "rev-parse", "HEAD", check=False)
    project_commit = head.stdout.strip() if head.returncode == 0 else None
    report = CarryingReport(datetime.now(timezone.utc).isoformat(timespec="seconds"), str(root), project_commit,
                            {})

    cache.writable("downloads")  # the areas ensure_base writes: a cache that cannot be written is one error (5)
    cache.writable("repos")
    carried_in: dict[tuple[str, str], set[str]] = {}  # (component, fix) -> releases
    series_of = {}
    for t in every:
        for c in t.components:
            s = read_series(c.series_dir)
            if s.problems:  # a listing kvforge cannot count from (a patch missing, listed twice, not UTF-8)
                raise KvforgeError(f"{s.problems[0]} (target {t.name}; `kvforge lint` lists every problem); "
                                   "the report counts only series it can read", EXIT_USAGE)
            series_of[(t.name, c.name)] = s
            for p in s.patches:
                carried_in.setdefault((c.name, p.fix_id), set()).add(c.release.version)

    newest: dict[str, tuple[NewBase | None, str]] = {}
    for name, (t, c) in newest_components(every).items():
        where = f"{c.release.version} ({t.name})"
        try:
            say(f"{name}: the newest release a target follows is {where}")
            newest[name] = (new_base_info(ensure_base(c, cache, "sdist", progress=progress), c), where)
        except KvforgeError as exc:
            newest[name] = (None, f"{where}: base unavailable: {str(exc).splitlines()[0]}")
        report.newest[name] = where

    for t in targets:
        for c in t.components:
            s = series_of.get((t.name, c.name)) or read_series(c.series_dir)
            if not s.patches:
                continue
            ev_state, verdicts, ev_date = _evidence_of(t, c, s.digest, cache, progress)
            ledger = load_ledger(c.series_dir)
            nb, on = newest.get(c.name, (None, "no release of this component"))
            for p in s.patches:
                status, udd = classify(p.upstream_status)
                prs = p.values("Upstream-PR") or _PR_RE.findall(p.upstream_status)
                expr = p.value("Drop-When") or ""
                if nb is None:
                    met, detail = None, on
                else:
                    sig = evaluate_drop_when(expr, nb)
                    met, detail = sig.fired, sig.detail.removeprefix(f"{expr}: ")
                commits, first, first_sha = _history(root, p.path)
                drops = [e for e in ledger if e.fix_id == p.fix_id]
                report.rows.append(Row(
                    target=t.name, component=c.name, release=c.release.version, fix_id=p.fix_id, patch=p.name,
                    upstream_status=p.upstream_status, status=status, udd=udd, prs=list(prs),
                    drop_when=expr or "(none)", drop_when_met=met, drop_when_on=on, drop_when_detail=detail,
                    evidence=ev_state, evidence_verdict=verdicts.get(p.fix_id, ""), evidence_date=ev_date,
                    first_carried=first, first_commit=first_sha,
                    releases=sorted(carried_in.get((c.name, p.fix_id), set()), key=_sort_version),
                    commits=commits, dropped=len(drops),
                    conflicts_skipped=sum(e.decision == "skipped" for e in drops)))
    return report


def _sort_version(v: str):
    try:
        return (0, Version(v), v)
    except InvalidVersion:
        return (1, Version("0"), v)


def _evidence_of(t: Target, c: Component, digest: str, cache: Cache,
                 progress: Progress | None) -> tuple[str, dict[str, str], str]:
    """(current | stale | missing | unknown, fix -> verdict, date) of the newest verify record of (t, c): current
    when it is of exactly this base and series (kvforge.flow.pr.evidence's rule), stale when of another."""
    records = evidence.load(cache, t.name, c.name, kind="verify")
    if not records:
        return "missing", {}, ""
    try:
        base = ensure_base(c, cache, "auto", progress=progress)
    except KvforgeError:
        return "unknown", {}, ""
    key = evidence.Key(t.name, c.name, base.commit, digest)
    current = [r for r in records if r.key == key]
    rec = (current or records)[-1]
    return ("current" if current else "stale"), _fix_verdicts(rec), rec.created[:10]


# ---------------------------------------------------------------- rendering

HEADERS = ("target", "patch", "fix-id", "status", "PR", "since", "releases", "Drop-When on newest target", "evidence",
           "churn")


def _cells(r: Row) -> list[str]:
    met = {True: "met", False: "not yet", None: "cannot tell"}[r.drop_when_met]
    prs = ", ".join("#" + pr.rsplit("/", 1)[-1] for pr in r.prs) or "-"
    ev = r.evidence + (f" ({r.evidence_verdict})" if r.evidence_verdict else "")
    churn = f"{r.commits} commit{'s' if r.commits != 1 else ''}"
    if r.dropped:
        churn += f", dropped {r.dropped}x" + (f" ({r.conflicts_skipped} after a conflict)" if r.conflicts_skipped
                                               else "")
    return [f"{r.target}/{r.component}", r.patch[:4], r.fix_id, r.status,
            prs, r.first_carried or "uncommitted", ", ".join(r.releases), f"{met}: {r.drop_when}", ev, churn]


def _totals_rows(rep: CarryingReport) -> tuple[list[list], list[list]]:
    t = rep.totals()
    yocto = [[k, v] for k, v in t["by_status"].items()]
    udd = [[k, v] for k, v in t["udd"].items()]
    return yocto, udd


def markdown_table(headers, rows) -> str:
    def esc(c) -> str:
        return str(c).replace("|", "\\|").replace("\n", " ")
    out = ["| " + " | ".join(esc(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def render(rep: CarryingReport, fmt: str) -> str:
    render_table = markdown_table if fmt == "markdown" else table
    yocto, udd = _totals_rows(rep)
    t = rep.totals()
    newest = ", ".join(f"{k} {v}" for k, v in rep.newest.items()) or "none"
    head = "## Carrying cost\n\n" if fmt == "markdown" else ""
    sub = (lambda s: f"\n### {s}\n") if fmt == "markdown" else (lambda s: f"\n{s}:")
    out = [head + render_table(HEADERS, [_cells(r) for r in rep.rows]),
           f"\n{_count(t['patches'], 'patch', 'patches')} ({_count(t['fixes'], 'fix', 'fixes')}) in "
           f"{_count(t['targets'], 'target', 'targets')}; the newest release a target follows (per component): "
           f"{newest}; Drop-When met on it: {t['drop_when_met']}; evidence current {t['evidence']['current']}, stale "
           f"{t['evidence']['stale']}, missing {t['evidence']['missing']}.",
           sub("By Upstream-Status (Yocto patchreview)"), render_table(["Upstream-Status", "patches"], yocto),
           sub("By forwarding (Debian UDD)"), render_table(["category", "patches"], udd)]
    return "\n".join(out)


def report_command(cache: Cache, target_names: tuple[str, ...], fmt: str, progress: Progress | None = None) -> Done:
    """`kvforge report`: the carrying-cost rows and totals of the named targets (all by default)."""
    if fmt not in FORMATS:
        raise KvforgeError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}", EXIT_USAGE)
    every = load_all()
    known = {t.name: t for t in every}
    unknown = [n for n in target_names if n not in known]
    if unknown:
        raise KvforgeError(f"--target {unknown[0]}: no such target (known: {', '.join(known)})", EXIT_USAGE)
    chosen = [known[n] for n in dict.fromkeys(target_names)] if target_names else every
    rep = carrying_report(chosen, every, cache, progress)
    if fmt == "trend":
        return Done(rep.to_json(), json.dumps(rep.trend_row(), sort_keys=True))
    return Done(rep.to_json(), render(rep, fmt))
