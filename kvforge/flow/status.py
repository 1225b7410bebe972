"""Fixes x (target, component): which fix each carries, in what upstream state, or why it needs none, and how
much of each series a person has reviewed (a patch whose header names no `Review:` field is reviewed);
the patches `kvforge rebase` dropped (each series' ledger, kvforge.project.ledger); and, with --check, which
carried patches could be dropped now (their Drop-When evaluated against their target's base).

Reads targets, series and ledgers; `drop_check` also materialises bases into the cache. Writes nothing.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from kvforge.git.bases import ensure_base
from kvforge.core.cache import Cache
from kvforge.git.context import Progress
from kvforge.core.errors import KvforgeError
from kvforge.project.ledger import Entry
from kvforge.project.ledger import load as load_ledger
from kvforge.core.outcome import Done
from kvforge.core.render import table
from kvforge.project.series import read_series, unreviewed
from kvforge.project.targets import Target, load_all
from kvforge.flow.upstream import NewBase, evaluate_drop_when, new_base_info


@dataclass
class Cell:
    state: str  # carried | in base | dropped
    detail: str


@dataclass
class StatusTable:
    """Fixes x (target, component) columns: each cell carried, in base or dropped; and the ledgers' drops."""

    columns: list[tuple[str, str]]  # (target, component), in target order
    order: list[str]  # fix ids, first seen first
    cells: dict[str, dict[tuple[str, str], Cell]] = field(default_factory=dict)
    dropped: list[tuple[str, str, Entry]] = field(default_factory=list)  # (target, component, ledger entry)
    reviewed: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)  # column -> (reviewed, patches)

    def column_name(self, col: tuple[str, str]) -> str:
        """'v0.20.1' while every target has one component; 'v0.20.2rc/vllm-ascend' where it matters."""
        multi = {t for t, _ in self.columns if sum(1 for u, _ in self.columns if u == t) > 1}
        return f"{col[0]}/{col[1]}" if col[0] in multi else col[0]

    def to_json(self) -> dict:
        return {"fixes": {fid: {f"{t}/{c}": vars(cell) for (t, c), cell in row.items()}
                          for fid, row in self.cells.items()},
                "dropped": [{"target": t, "component": c, **e.to_json()} for t, c, e in self.dropped],
                "reviewed": {f"{t}/{c}": {"reviewed": r, "patches": n} for (t, c), (r, n) in self.reviewed.items()}}


def status_matrix(targets: list[Target]) -> StatusTable:
    m = StatusTable(columns=[(t.name, c.name) for t in targets for c in t.components], order=[])
    for t in targets:
        for comp in t.components:
            col = (t.name, comp.name)
            patches = read_series(comp.series_dir).patches
            m.reviewed[col] = (sum(not unreviewed(p) for p in patches), len(patches))
            for p in patches:
                row = m.cells.setdefault(p.fix_id, {})
                if p.fix_id not in m.order:
                    m.order.append(p.fix_id)
                row[col] = Cell("carried", f"{p.name[:4]} {short_status(p.upstream_status)}")
            for entry in comp.in_base:
                if entry.fix_id not in m.order:
                    m.order.append(entry.fix_id)
                m.cells.setdefault(entry.fix_id, {}).setdefault(col, Cell("in base", entry.reason))
            for e in load_ledger(comp.series_dir):
                m.dropped.append((t.name, comp.name, e))
                if e.fix_id not in m.order:
                    m.order.append(e.fix_id)
                onto = f" onto {e.onto_version or e.onto_ref}" if (e.onto_version or e.onto_ref) else ""
                # The newest entry wins; a patch carried again (or in base) keeps its cell.
                row = m.cells.setdefault(e.fix_id, {})
                if row.get(col) is None or row[col].state == "dropped":
                    row[col] = Cell("dropped", f"{e.decision}{onto}")
    return m


def render_status(m: StatusTable) -> str:
    notes: list[str] = []

    def cell(fid: str, col) -> str:
        c = m.cells[fid].get(col)
        if c is None:
            return "-"
        if c.state in ("carried", "dropped"):
            return c.detail if c.state == "carried" else f"dropped: {c.detail}"
        text = f"{fid}: {c.detail}"
        if text not in notes:
            notes.append(text)
        return f"in base [{notes.index(text) + 1}]"

    rows = [[fid, *[cell(fid, col) for col in m.columns]] for fid in m.order]
    out = [table(["fix-id", *[m.column_name(c) for c in m.columns]], rows),
           "\n'-': not carried there; 'NNNN Status': patch number and Upstream-Status; 'dropped': a rebase "
           "dropped it (below)."]
    out += [f"[{i}] {n}" for i, n in enumerate(notes, 1)]
    todo = [f"{m.column_name(c)} {r}/{n}" for c, (r, n) in m.reviewed.items() if r < n]
    if todo:
        out.append("Reviewed (patches whose proposed header fields a person has checked; `kvforge lint` lists the "
                   "rest): " + ", ".join(todo))
    if m.dropped:
        out += ["", "Dropped by `kvforge rebase` (each series' dropped.toml):",
                table(["target", "patch", "fix-id", "decision", "onto", "when", "signals for it"],
                      [[m.column_name((t, c)), e.file, e.fix_id, e.decision,
                        e.onto_version or e.onto_ref or "-", e.dropped_at[:10] or "-", fired_signals(e.signals)]
                       for t, c, e in m.dropped])]
    return "\n".join(out)


def fired_signals(signals: list[dict]) -> str:
    """'reverse-apply, drop-when (weak)': the signals that said upstream has the fix."""
    names = [s.get("name", "?") + ("" if s.get("strong") else " (weak)") for s in signals if s.get("fired") is True]
    return ", ".join(names) or "none"


# ---------------------------------------------------------------- status --check

@dataclass
class DropCheck:
    """One carried patch's Drop-When evaluated against its own target's base."""

    target: str
    component: str
    file: str
    fix_id: str
    drop_when: str
    base: str  # "<version or ref> (<commit>)", or why the base is unavailable
    fired: bool | None  # True: the condition holds now; False: not yet; None: cannot tell here
    strong: bool
    detail: str

    @property
    def droppable(self) -> bool:
        return self.fired is True


def drop_check(targets: list[Target], cache: Cache, progress: Progress | None = None) -> list[DropCheck]:
    """Every patch's Drop-When against its target's base (materialised into `cache` if needed). A cache that
    cannot be written is one error (EXIT_ENV, naming it) before any base, not "base unavailable" per patch."""
    out: list[DropCheck] = []
    probed = False
    for t in targets:
        for comp in t.components:
            patches = read_series(comp.series_dir).patches
            if not patches:
                continue
            if not probed:  # the areas ensure_base writes (a base is imported, or locked, there)
                cache.writable("downloads")
                cache.writable("repos")
                probed = True
            nb: NewBase | None
            try:
                base = ensure_base(comp, cache, "auto", progress=progress)
                nb = new_base_info(base, comp)
                where = f"{nb.version or base.ref} ({base.commit[:12]})"
            except KvforgeError as exc:
                nb, where = None, f"base unavailable: {str(exc).splitlines()[0]}"
            for p in patches:
                expr = p.value("Drop-When") or ""
                if nb is None:
                    sig_fired, sig_strong, detail = None, False, where
                else:
                    sig = evaluate_drop_when(expr, nb)
                    sig_fired, sig_strong, detail = sig.fired, sig.strong, sig.detail
                out.append(DropCheck(t.name, comp.name, p.name, p.fix_id, expr or "(none)", where, sig_fired,
                                     sig_strong, detail))
    return out


def render_drop_check(rows: list[DropCheck]) -> str:
    word = {True: "drop now", False: "keep", None: "cannot tell"}
    body = table(["target", "patch", "Drop-When", "base", "verdict", "why"],
                 [[f"{r.target}/{r.component}", r.file, r.drop_when, r.base, word[r.fired],
                   r.detail.removeprefix(f"{r.drop_when}: ")] for r in rows])
    n = sum(r.droppable for r in rows)
    tail = (f"{n} patch{'es' if n != 1 else ''} could be dropped now: run `kvforge rebase` to drop them with "
            "all the signals" if n else "no patch can be dropped now")
    unknown = sum(r.fired is None for r in rows)
    if unknown:
        tail += f"; {unknown} cannot be told here (no history in an sdist base, or a PR state needs the network)"
    return body + "\n" + tail


def drop_check_json(rows: list[DropCheck]) -> dict:
    return {"patches": [asdict(r) | {"droppable": r.droppable} for r in rows],
            "droppable": [f"{r.target}/{r.component}/{r.file}" for r in rows if r.droppable]}


def short_status(value: str) -> str:
    """'Backport [https://github.com/vllm-project/vllm/pull/44409]' -> 'Backport #44409'."""
    m = re.match(r"^(\w[\w-]*)(?:\s+\[(.*)\])?", value)
    if not m:
        return value
    name, detail = m.group(1), m.group(2) or ""
    pr = re.search(r"/(?:pull|issues)/(\d+)", detail)
    if pr:
        return f"{name} #{pr.group(1)}"
    return f"{name} [{detail}]" if detail else name


def status_command(cache, check: bool, progress=None) -> Done:
    """`kvforge status`: the fixes x targets matrix, or with --check each patch's Drop-When verdict."""
    if check:
        rows = drop_check(load_all(), cache, progress)
        return Done(drop_check_json(rows), render_drop_check(rows))
    matrix = status_matrix(load_all())
    return Done(matrix.to_json(), render_status(matrix))
