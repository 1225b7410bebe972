"""Plain-text tables and JSON output shared by the commands."""

from __future__ import annotations

import json
import sys
from typing import Any, Iterable, Sequence


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    rows = [[("" if c is None else str(c)) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in rows:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))
    def fmt(cells):
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    out = [fmt(headers), fmt(["-" * w for w in widths])]
    out.extend(fmt(r) for r in rows)
    return "\n".join(out)


def emit_json(data: Any) -> None:
    json.dump(data, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")
