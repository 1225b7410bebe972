"""How a command ends: the library returns an Outcome, the CLI renders it (cli.finish) and exits.

Library code never prints results and never exits. A command's function returns an object with
this shape; a failure that has something to show besides its one line is a KvforgeError carrying
`data` (extra keys of its JSON error object) and `text` (the human report printed before the line).
cli.finish is the one place that turns either into stdout, stderr and an exit code:

- with --json: `to_json()` (plus "error" and "exit" when exit_code != 0; keys the document has
  itself win) on stdout;
- otherwise: `render()` on stdout (a newline added unless it ends with one; "" prints nothing),
  then the optional `aside` on stderr, and "kvforge: error: <error>" on stderr when failing;
- in both: the optional `notes` first, each "kvforge: warning: <note>" on stderr; then the exit code.
One exception to "error is set exactly when exit_code != 0": an outcome whose render already says
why (bench prefix-cache's errors, lint's problems) may fail with error None: no error line then.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Outcome(Protocol):
    """What every command returns. `error` is one line, set exactly when `exit_code` != 0."""

    @property
    def exit_code(self) -> int: ...

    @property
    def error(self) -> str | None: ...

    def to_json(self) -> Any: ...

    def render(self) -> str: ...


@dataclass
class Done:
    """An Outcome made of parts: for commands whose result is a document and a text already."""

    data: Any
    text: str = ""
    exit_code: int = 0
    error: str | None = None
    notes: list[str] = field(default_factory=list)  # warnings, printed on stderr before the result
    aside: str = ""  # text mode only: printed on stderr after the result (e.g. "kvforge: wrote FILE")

    def to_json(self) -> Any:
        return self.data

    def render(self) -> str:
        return self.text
