"""Fixes x (target, component): which fix each carries, in what upstream state, or why it needs none."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .report import table
from .series import read_series
from .targets import Target


@dataclass
class Cell:
    state: str  # carried | in base
    detail: str


@dataclass
class Matrix:
    columns: list[tuple[str, str]]  # (target, component), in target order
    order: list[str]  # fix ids, first seen first
    cells: dict[str, dict[tuple[str, str], Cell]] = field(default_factory=dict)

    def column_name(self, col: tuple[str, str]) -> str:
        """'v0.20.1' while every target has one component; 'v0.20.2rc/vllm-ascend' where it matters."""
        multi = {t for t, _ in self.columns if sum(1 for u, _ in self.columns if u == t) > 1}
        return f"{col[0]}/{col[1]}" if col[0] in multi else col[0]

    def to_json(self) -> dict:
        return {fid: {f"{t}/{c}": vars(cell) for (t, c), cell in row.items()} for fid, row in self.cells.items()}


def status_matrix(targets: list[Target]) -> Matrix:
    m = Matrix(columns=[(t.name, c.name) for t in targets for c in t.components], order=[])
    for t in targets:
        for comp in t.components:
            col = (t.name, comp.name)
            for p in read_series(comp.series_dir).patches:
                row = m.cells.setdefault(p.fix_id, {})
                if p.fix_id not in m.order:
                    m.order.append(p.fix_id)
                row[col] = Cell("carried", f"{p.name[:4]} {short_status(p.upstream_status)}")
            for entry in comp.in_base:
                if entry.fix_id not in m.order:
                    m.order.append(entry.fix_id)
                m.cells.setdefault(entry.fix_id, {}).setdefault(col, Cell("in base", entry.reason))
    return m


def render_status(m: Matrix) -> str:
    notes: list[str] = []

    def cell(fid: str, col) -> str:
        c = m.cells[fid].get(col)
        if c is None:
            return "-"
        if c.state == "carried":
            return c.detail
        text = f"{fid}: {c.detail}"
        if text not in notes:
            notes.append(text)
        return f"in base [{notes.index(text) + 1}]"

    rows = [[fid, *[cell(fid, col) for col in m.columns]] for fid in m.order]
    out = [table(["fix-id", *[m.column_name(c) for c in m.columns]], rows),
           "\n'-': not carried there; 'NNNN Status': patch number and Upstream-Status."]
    out += [f"[{i}] {n}" for i, n in enumerate(notes, 1)]
    return "\n".join(out)


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
