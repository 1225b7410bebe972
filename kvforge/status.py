"""Fixes x targets: which fix each target carries, in what upstream state, or why it needs none."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .series import read_series
from .targets import Target


@dataclass
class Cell:
    state: str  # carried | in base | absent
    detail: str


def status_matrix(targets: list[Target]) -> tuple[list[str], dict[str, dict[str, Cell]]]:
    """Return fix ids (series order, first seen first) and cells[fix_id][target_name]."""
    order: list[str] = []
    cells: dict[str, dict[str, Cell]] = {}
    for t in targets:
        for comp in t.components:
            series = read_series(comp.series_dir)
            for p in series.patches:
                fid = p.fix_id
                if fid not in cells:
                    order.append(fid)
                    cells[fid] = {}
                cells[fid][t.name] = Cell("carried", f"{p.name[:4]} {short_status(p.upstream_status)}")
            for entry in comp.in_base:
                if entry.fix_id not in cells:
                    order.append(entry.fix_id)
                    cells[entry.fix_id] = {}
                cells[entry.fix_id].setdefault(t.name, Cell("in base", entry.reason))
    return order, cells


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
