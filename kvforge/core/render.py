"""Plain-text tables and JSON output shared by the commands."""

from __future__ import annotations

import json
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


def json_text(data: Any) -> str:
    """A command's JSON document as printed: indented, keys sorted, anything else as str()."""
    return json.dumps(data, indent=2, sort_keys=True, default=str)
