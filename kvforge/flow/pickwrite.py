"""A pick's verdict per target, and its one write: every changed series directory and target file, or none.

Nothing in patches/ or targets/ changes until every row is decided (and, with --verify, proven). Then
`build_plan` computes every new file (the picked patch and the `series` file of each directory that takes
it; an in_base entry in the target file for `present`), and `commit_all` hands all of it to one transaction
of the project (kvforge.project.transaction): every path the pick read is checked unchanged (else one line,
exit 2, nothing written), the directories are staged (linted), the journal is the commit point, and a kill
is finished or undone by the next kvforge command that writes the project. A stopped pick's state records
what its write makes of each path (`_mark_writing`), so the next pick sees the write finished
(`written_by`) whichever command finished it.
"""

from __future__ import annotations

import base64
import json
import re
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvforge.core.errors import EXIT_ENV, EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import atomic_write_text
from kvforge.git.context import Progress
from kvforge.project import seriesdir, transaction
from kvforge.project.transaction import dir_digest, file_digest
from kvforge.project.targets import display_path, load_target

OK_VERDICTS = ("present", "carried", "applies", "applies (3-way)", "resolved")
WRITTEN = ("applies", "applies (3-way)", "resolved")
STOPS = ("conflict", "needs prerequisite", "disagree")
CHANGED_HINT = " (`kvforge pick --abort` and pick again)"  # after "<file> changed since the pick read it; ..."


# ---------------------------------------------------------------- per target


@dataclass
class Row:
    target: str
    component: str
    verdict: str
    detail: str = ""
    signals: list[dict[str, Any]] = field(default_factory=list)
    patch: str | None = None  # the file name in the series
    commit: str | None = None  # the picked commit (kvforge's repository, or the user's tree once resolved)
    repo: str | None = None  # the repository holding `commit`
    tree: str | None = None  # the user's tree left at the conflict
    tree_head: str | None = None  # its HEAD before the pick (base + series)
    conflicts: list[str] = field(default_factory=list)
    prerequisites: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    proof: str = "-"
    evidence: dict[str, Any] | None = None  # --verify: the picked patch's Checks before/after and the regression
    position: int | None = None  # --after: the picked patch's place in the new series (1-based); None: appended
    rewrites: dict[str, str] = field(default_factory=dict)  # --after: later patches re-exported (name -> base64)
    seconds: float = 0.0  # what the upstream signals cost on this target
    data: str | None = None  # base64 of the patch file to write

    @property
    def label(self) -> str:
        return f"{self.target}/{self.component}"

    def public(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("data")
        return d


def digests_of(rows: list[Row]) -> dict[str, str]:
    out: dict[str, str] = {}
    for r in rows:
        t = load_target(r.target)
        d = t.component(r.component).series_dir
        out[str(d)] = dir_digest(d)
        out[str(t.path)] = file_digest(t.path)
    return out


# ---------------------------------------------------------------- writing: every directory, or none


def _in_base_text(text: str, component: str, fix_id: str, reason: str) -> str:
    """The target file with an in_base entry for `component`, inserted at the end of that component's tables."""
    lines = text.splitlines(keepends=True)
    starts = [k for k, ln in enumerate(lines) if ln.strip() == "[[components]]"]
    cut = None
    for n, k in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(lines)
        if any(re.match(rf'^name\s*=\s*"{re.escape(component)}"\s*$', ln.strip()) for ln in lines[k:end]):
            cut = end
            break
    if cut is None:
        raise KvforgeError(f"target file has no component {component!r}", EXIT_USAGE)
    if cut < len(lines):  # before the blank and comment lines that lead into the next component
        while cut > 0 and (lines[cut - 1].strip() == "" or lines[cut - 1].lstrip().startswith("#")):
            cut -= 1
    block = f'\n[[components.in_base]]\nfix_id = "{fix_id}"\nreason = {json.dumps(reason)}\n'
    if cut < len(lines) and lines[cut].strip() != "":
        block += "\n"
    head = "".join(lines[:cut])
    if head and not head.endswith("\n"):
        head += "\n"
    new = head + block + "".join(lines[cut:])
    doc = tomllib.loads(new)  # a reason with a quote or a newline must still parse
    entry = next(c for c in doc["components"] if c.get("name") == component)
    if fix_id not in [e.get("fix_id") for e in entry.get("in_base", [])]:
        raise KvforgeError(f"could not add in_base {fix_id} for {component}", EXIT_USAGE)
    return new


@dataclass
class Plan:
    """What the write step changes: series directory -> its complete new files; target file -> text."""

    dirs: dict[str, dict[str, bytes]] = field(default_factory=dict)
    keep: dict[str, list[str]] = field(default_factory=dict)  # sub-directories kept as they are
    targets: dict[str, str] = field(default_factory=dict)


def build_plan(rows: list[Row], fix_id: str, upstream_info: dict[str, Any]) -> Plan:
    plan = Plan()
    for r in rows:
        t = load_target(r.target)
        comp = t.component(r.component)
        if r.verdict in WRITTEN and r.data:
            d = comp.series_dir
            files = plan.dirs.setdefault(str(d), {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()})
            plan.keep.setdefault(str(d), [p.name for p in sorted(d.iterdir()) if p.is_dir()])
            assert r.patch is not None
            files[r.patch] = base64.b64decode(r.data)
            files.update({name: base64.b64decode(b) for name, b in r.rewrites.items()})
            listing = seriesdir.read_listing(d)
            names = list(listing.names if listing else [])
            names.insert(len(names) if r.position is None else r.position - 1, r.patch)
            files[seriesdir.SERIES_FILE] = seriesdir.listing_text(listing, names, {n: n for n in names}).encode()
        elif r.verdict == "present" and fix_id not in {e.fix_id for e in comp.in_base}:
            where = ", ".join(x for x in (upstream_info.get("pr"), upstream_info.get("commit")) if x) or "upstream"
            fired = [s["name"] for s in r.signals if s["fired"]]
            reason = f"{where} (kvforge pick: {', '.join(fired) or r.detail})"
            path = str(t.path)
            plan.targets[path] = _in_base_text(plan.targets.get(path) or t.path.read_text(encoding="utf-8"),
                                               comp.name, fix_id, reason)
    return plan


def recover(root: Path, say: Progress) -> list[str]:
    """Finish or undo a write a kill interrupted (kvforge.project.transaction's one recovery); the paths a
    finished one wrote."""
    return transaction.settle(root, say)


def _mark_writing(state: Path, after: dict[str, str], summary: dict[str, Any] | None) -> None:
    """Record in a stopped pick's state what its write makes of each path: the next pick sees it written."""
    data = json.loads(state.read_text(encoding="utf-8"))
    data["writing"] = {"after": after, "summary": summary or {}}
    atomic_write_text(state, json.dumps(data, indent=1) + "\n")


def written_by(state: dict[str, Any]) -> dict[str, Any] | None:
    """The summary of the write a stopped pick's state records, when the project holds all of it."""
    writing = state.get("writing")
    if not isinstance(writing, dict) or not isinstance(writing.get("after"), dict):
        return None
    if not all(transaction.digest(Path(p)) == d for p, d in writing["after"].items()):
        return None
    return dict(writing.get("summary") or {})


def commit_all(root: Path, plan: Plan, digests: dict[str, str], say: Progress, state: Path | None = None,
               summary: dict[str, Any] | None = None) -> list[str]:
    """Write every series directory and target file of `plan` in one transaction of the project, after checking
    that every path the pick read (`digests`) is unchanged (the module docstring)."""
    if not plan.dirs and not plan.targets:
        return []
    dirs = [Path(d) for d in plan.dirs]
    with transaction.open_transaction(root, "pick", say, dirs=dirs, hint=CHANGED_HINT) as tx:
        for path, want in digests.items():
            tx.expect(Path(path), want)
        try:
            after = {d: tx.stage_dir(Path(d), files, keep=plan.keep.get(d, [])) for d, files in plan.dirs.items()}
            after |= {path: tx.stage_file(Path(path), text.encode("utf-8")) for path, text in plan.targets.items()}
            if state is not None and state.is_file():
                _mark_writing(state, after, summary)
        except OSError as exc:  # a full disk or a read-only directory before the commit point: all undone
            raise KvforgeError(f"cannot write {exc.filename or root}: {exc.strerror or exc}; nothing was written",
                               EXIT_ENV) from None
        tx.commit()
    if state is not None:
        state.unlink(missing_ok=True)
    return [display_path(Path(d)) for d in plan.dirs] + [display_path(Path(p)) for p in plan.targets]
