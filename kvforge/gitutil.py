"""The one git runner: every git call kvforge makes goes through `run` (text) or `run(..., binary=True)`.

LC_ALL=C (so messages can be parsed), kvforge's committer identity (commits never depend on the
user's git config) and HERMETIC config (no hooks, no autocrlf, no quoted paths) are fixed here.
GitPython executes the calls; calls that feed standard input go through subprocess with the same
environment.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, overload

import git

from .errors import EXIT_ENV, KvforgeError

COMMITTER = {
    "GIT_COMMITTER_NAME": "kvforge",
    "GIT_COMMITTER_EMAIL": "kvforge@users.noreply.github.com",
}
# Config that must not come from the user: line endings and hooks would change commits; quoted
# paths would change file names in patches.
HERMETIC = ("-c", "core.autocrlf=false", "-c", "core.safecrlf=false", "-c", "core.hooksPath=/dev/null",
            "-c", "advice.detachedHead=false", "-c", "commit.gpgsign=false", "-c", "core.quotePath=false",
            "-c", "gc.auto=0", "-c", "maintenance.auto=false")


@dataclass
class Result:
    """A text call's result: stdout decoded, its final newline stripped."""

    returncode: int
    stdout: str
    stderr: str


@dataclass
class BinaryResult:
    """A `binary=True` call's result: stdout as git wrote it."""

    returncode: int
    stdout: bytes
    stderr: str


@overload
def run(cwd: Path, *args: str, check: bool = ..., env: dict | None = ..., timeout: float | None = ...,
        stdin: str | bytes | None = ..., binary: Literal[False] = ...) -> Result: ...


@overload
def run(cwd: Path, *args: str, check: bool = ..., env: dict | None = ..., timeout: float | None = ...,
        stdin: str | bytes | None = ..., binary: Literal[True]) -> BinaryResult: ...


def run(cwd: Path, *args: str, check: bool = True, env: dict | None = None, timeout: float | None = None,
        stdin: str | bytes | None = None, binary: bool = False) -> Result | BinaryResult:
    """Run `git <args>` in `cwd`; raise KvforgeError with git's own last words when `check` fails.

    `binary=True` returns stdout as bytes, untouched (no decoding, no stripped newline).
    """
    cmd = ["git", *HERMETIC, *args]
    out: str | bytes
    try:
        if stdin is None and not binary:
            code, out, err = git.Git(str(cwd)).execute(
                cmd, with_extended_output=True, with_exceptions=False,
                env={**COMMITTER, **(env or {})}, kill_after_timeout=timeout)
        else:
            data = stdin.encode() if isinstance(stdin, str) else stdin
            proc = subprocess.run(cmd, cwd=cwd, input=data, capture_output=True, timeout=timeout,
                                  env=_plain_env(env))
            code, err = proc.returncode, proc.stderr.decode(errors="replace")
            out = proc.stdout if binary else proc.stdout.decode(errors="replace").rstrip("\n")
    except (git.GitCommandNotFound, FileNotFoundError) as exc:
        if isinstance(exc, FileNotFoundError) and not Path(cwd).is_dir():
            raise KvforgeError(f"{cwd}: directory does not exist", EXIT_ENV) from None
        raise KvforgeError("git is not installed or not on PATH", EXIT_ENV) from None
    res: Result | BinaryResult = (BinaryResult(code, out, err) if isinstance(out, bytes)
                                  else Result(code, out, err))
    if check and code != 0:
        text = out.decode(errors="replace") if isinstance(out, bytes) else out
        last = (err.strip().splitlines() or text.strip().splitlines() or ["(no output)"])[-1]
        raise KvforgeError(f"git {args[0]} failed in {cwd}: {last}", EXIT_ENV)
    return res


def _plain_env(extra: dict | None = None) -> dict:
    """What GitPython sets up for its own calls, for the calls made through subprocess directly."""
    return {**os.environ, "LC_ALL": "C", "LANGUAGE": "C", **COMMITTER, **(extra or {})}


def popen(cwd: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """Start a git process with stdin/stderr pipes, for streams fed while they run (fast-import)."""
    return subprocess.Popen(["git", *HERMETIC, *args], cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=_plain_env(env))


def rev_parse(cwd: Path, rev: str) -> str | None:
    res = run(cwd, "rev-parse", "--verify", "-q", rev, check=False)
    return res.stdout.strip() if res.returncode == 0 else None


def is_ancestor(cwd: Path, a: str, b: str) -> bool:
    return run(cwd, "merge-base", "--is-ancestor", a, b, check=False).returncode == 0
