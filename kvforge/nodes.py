"""pytest node ids and selectors (`tests/dir`, `tests/x.py`, `tests/x.py::test`): pure string helpers.

A leaf: it imports nothing of kvforge, so every module that hands selectors to pytest (matrix, runner)
can use it.
"""

from __future__ import annotations


def minimal(selection: list[str]) -> list[str]:
    """The selectors without those another one already covers (a node in a listed file or directory)."""
    paths = [s.rstrip("/") for s in selection if "::" not in s]
    def covered(s: str) -> bool:
        p = s.split("::", 1)[0].rstrip("/")
        return any(q != s.rstrip("/") and (p == q or p.startswith(q + "/")) for q in paths)
    return [s for s in selection if not covered(s)]
