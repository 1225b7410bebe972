"""Plain-text tables and JSON output shared by the commands, fitted to the terminal.

Width: `width()` is $COLUMNS when set, else the terminal's when stdout is one, else None (no limit: a pipe or a
file gets every cell whole on one line). `table` wraps its widest cells onto continuation lines to fit that width;
`fit` wraps any other line longer than it (with a hanging indent). Both only wrap: every character of the data is
still printed. JSON (`json_text`) is never fitted.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
from typing import Any, Iterable, Sequence

MIN_COLUMN = 6  # a column narrowed to fit is at least this wide (or its natural width, when smaller)
WORD_MAX = 24  # a word up to this long is kept whole while narrowing can still fit by breaking lines elsewhere
SEP = "  "


def width() -> int | None:
    """The width output is fitted to: $COLUMNS, else the terminal's, else None (no limit)."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        if sys.stdout.isatty():
            return shutil.get_terminal_size().columns
    except (AttributeError, ValueError, OSError):
        pass
    return None


def _wrap(text: str, w: int) -> list[str]:
    """`text` as lines of at most `w` characters, every character kept (long words broken)."""
    if len(text) <= w:
        return [text]
    lines = textwrap.wrap(text, w, break_long_words=True, break_on_hyphens=False, drop_whitespace=True)
    return lines or [""]


def _narrow(widths: list[int], limit: int, floor: list[int]) -> list[int]:
    """Shrink the widest columns, one character at a time, until the row fits `limit` or every column is at
    its `floor`."""
    widths = list(widths)
    total = sum(widths) + len(SEP) * (len(widths) - 1)
    while total > limit:
        i = max(range(len(widths)), key=lambda j: (widths[j] - floor[j], widths[j]))
        if widths[i] <= floor[i]:
            break
        widths[i] -= 1
        total -= 1
    return widths


def _fit_widths(widths: list[int], words: list[int], limit: int) -> list[int]:
    """Column widths that fit `limit`: first keeping each column's longest word whole (up to WORD_MAX), so
    wrapping breaks lines between words; when that cannot fit, down to MIN_COLUMN."""
    keep_words = [min(w, max(MIN_COLUMN, min(word, WORD_MAX))) for w, word in zip(widths, words)]
    fitted = _narrow(widths, limit, keep_words)
    if sum(fitted) + len(SEP) * (len(fitted) - 1) <= limit:
        return fitted
    return _narrow(fitted, limit, [min(w, MIN_COLUMN) for w in widths])


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], max_width: int | None = -1) -> str:
    """A table of left-aligned columns. `max_width`: fit to it (wrapping cells); -1: to `width()`; None: no limit."""
    cells = [[("" if c is None else str(c)) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    words = [max((len(w) for w in h.split()), default=0) for h in headers]
    for r in cells:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))
            words[i] = max(words[i], max((len(w) for w in c.split()), default=0))
    limit = width() if max_width == -1 else max_width
    if limit is not None:
        widths = _fit_widths(widths, words, limit)

    def fmt(row: Sequence[str]) -> list[str]:
        parts = [_wrap(c, w) for c, w in zip(row, widths)]
        height = max((len(p) for p in parts), default=1)
        return [SEP.join((p[k] if k < len(p) else "").ljust(w) for p, w in zip(parts, widths)).rstrip()
                for k in range(height)]

    out = fmt(list(headers)) + fmt(["-" * w for w in widths])
    for r in cells:
        out.extend(fmt(r))
    return "\n".join(out)


def fit(text: str, max_width: int | None = -1) -> str:
    """Wrap every line of `text` longer than the width (continuations indented like the line, plus two)."""
    limit = width() if max_width == -1 else max_width
    if limit is None:
        return text
    out: list[str] = []
    for line in text.split("\n"):
        if len(line) <= limit:
            out.append(line)
            continue
        indent = " " * min(len(line) - len(line.lstrip(" ")) + 2, limit // 2)
        out.extend(textwrap.wrap(line, limit, subsequent_indent=indent, break_long_words=True,
                                 break_on_hyphens=False) or [line[:limit]])
    return "\n".join(out)


def json_text(data: Any) -> str:
    """A command's JSON document as printed: indented, keys sorted, anything else as str()."""
    return json.dumps(data, indent=2, sort_keys=True, default=str)
