"""How a command ends: `finish` prints an Outcome or a KvforgeError and exits with its code (the one place
that does); `run_cli` turns click's usage errors into exit 2, Ctrl-C, SIGTERM and SIGHUP into 130 / 128 + the
signal, and any other exception (a bug in kvforge) into one line and exit 70 with the traceback saved.

Owns: the exit of every command, and the signal handlers while the CLI runs (put back when it returns, so a
caller such as a test process keeps its own).
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

import click

from kvforge import __version__
from kvforge.core.errors import EXIT_INTERNAL, EXIT_USAGE, KvforgeError
from kvforge.core.outcome import Outcome
from kvforge.core.render import fit, json_text


VERBOSITY = {"level": 0}  # -q: -1 (no progress lines), -v: 1 (an internal error's traceback on stderr too)


def progress(msg: str) -> None:
    """A progress line on stderr (none with -q)."""
    if VERBOSITY["level"] >= 0:
        click.echo(f"kvforge: {msg}", err=True)


def finish(result: Outcome | KvforgeError, as_json: bool, fit_text: bool = False) -> NoReturn:
    """Print how a command ended and exit with its code: the one place that does.

    An Outcome: with --json its to_json() (plus "error" and "exit" when it failed; keys the document
    has itself win) on stdout, else its render() on stdout and its `aside` on stderr; its `notes`
    as warnings first. A KvforgeError: {"error": its first line, "exit", **data} with --json, else
    its `text` on stdout; its `notes` first. Failing: "kvforge: error: <error>" on stderr (with --json
    the first line of the document's "error"). `fit_text`: wrap the text to the terminal's width (a report
    for a terminal; never a text meant to be pasted, such as a PR body). An Outcome whose `error_label` is set
    says it instead of "error" (a result that needs attention, not a failure of kvforge)."""
    error: str | None
    doc: Any
    label = "error"
    if isinstance(result, KvforgeError):
        code, error, notes, aside = result.exit_code, str(result), result.notes, ""
        doc, text = dict(result.data), result.text
    else:
        code, error, aside = result.exit_code, result.error, getattr(result, "aside", "")
        label = getattr(result, "error_label", None) or label
        notes = getattr(result, "notes", [])
        doc, text = (result.to_json(), "") if as_json else (None, result.render())
    for note in notes:
        click.echo(f"kvforge: warning: {note}", err=True)
    if as_json:
        if error is not None:
            doc = {"error": first_line(error), "exit": code, **doc}
            error = str(doc["error"])
        click.echo(json_text(doc))
    else:
        if text and fit_text:
            text = fit(text)
        if text:
            click.echo(text, nl=not text.endswith("\n"))
        if aside:
            click.echo(aside, err=True)
    if error is not None:
        click.echo(f"kvforge: {label}: {first_line(error) if as_json else error}", err=True)
    sys.exit(code)


def first_line(text: str) -> str:
    return (text.splitlines() or [""])[0]


def wants_json(kwargs: dict) -> bool:
    """--json, or matrix's --format json."""
    return bool(kwargs.get("as_json")) or kwargs.get("fmt") == "json"


def handle_errors(fn):
    """KvforgeError -> finish (one line and its exit code, a JSON error object with --json)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KvforgeError as exc:
            finish(exc, wants_json(kwargs))
        except KeyboardInterrupt as exc:
            interrupted(exc)

    return wrapper


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a CI timeout, a closed terminal), raised where the process is, so every cleanup
    that ends a child on KeyboardInterrupt (testrun's pytest process group, every git call with the helpers
    git started: kvforge.git.gitutil, subprocess.run's child, the transactions' rollbacks) runs before kvforge exits
    128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _terminate(signum, _frame) -> None:
    signal.signal(signum, signal.SIG_DFL)  # a second one ends kvforge at once
    raise Terminated(signum)


def handle_signals() -> dict:
    """SIGTERM and SIGHUP end kvforge like Ctrl-C does: its children are ended first (see Terminated).
    Returns the handlers it replaced (run_cli puts them back: a caller such as a test process keeps its own)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}


def interrupted(exc: BaseException) -> NoReturn:
    gitutil = sys.modules.get("kvforge.git.gitutil")  # not loaded: no command ran git, nothing to end
    if gitutil is not None:
        gitutil.end_all()  # git that other threads started (the main thread's call ended its own on the way out)
    if isinstance(exc, Terminated):
        click.echo(f"kvforge: terminated ({signal.Signals(exc.signum).name}); its child processes were ended",
                   err=True)
        sys.exit(128 + exc.signum)
    click.echo("kvforge: interrupted", err=True)
    sys.exit(130)


def crash_report(exc: BaseException) -> Path | None:
    """Save the traceback of an unexpected exception; return the file (None if nothing is writable)."""
    text = "".join(traceback.format_exception(exc))
    for d in (os.environ.get("KVFORGE_CACHE"), tempfile.gettempdir()):
        if not d:
            continue
        try:
            Path(d).mkdir(parents=True, exist_ok=True)
            path = Path(d) / f"kvforge-crash-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.txt"
            path.write_text(f"kvforge {__version__}\nargv: {sys.argv}\n\n{text}", encoding="utf-8")
            return path
        except OSError:
            continue
    return None


def run_cli(group: click.Group, args: list[str] | None, prog_name: str | None, **extra) -> None:
    """Run the CLI; turn usage errors and bugs into one line and a documented exit code."""
    args = list(sys.argv[1:] if args is None else args)
    as_json = "--json" in args
    previous = handle_signals()
    try:
        _run(group, args, prog_name, as_json, **extra)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(group: click.Group, args: list[str], prog_name: str | None, as_json: bool, **extra) -> NoReturn:
    try:
        code = click.Group.main(group, args=args, prog_name=prog_name or "kvforge", standalone_mode=False, **extra)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort as exc:
        interrupted(exc.__context__ if isinstance(exc.__context__, Terminated) else exc)
    except click.ClickException as exc:
        if as_json:
            click.echo(json_text({"error": exc.format_message(), "exit": EXIT_USAGE}))
        exc.show()
        sys.exit(EXIT_USAGE)
    except KvforgeError as exc:  # raised outside a command (e.g. while parsing the group)
        finish(exc, as_json)
    except SystemExit:
        raise
    except KeyboardInterrupt as exc:
        interrupted(exc)
    except Exception as exc:
        where = crash_report(exc)
        if VERBOSITY["level"] > 0:
            click.echo("".join(traceback.format_exception(exc)).rstrip(), err=True)
        msg = f"internal error: {type(exc).__name__}: {exc}".splitlines()[0]
        msg += f" (a bug in kvforge; traceback: {where})" if where else " (a bug in kvforge)"
        finish(KvforgeError(msg, EXIT_INTERNAL), as_json)
    sys.exit(code if isinstance(code, int) else 0)

