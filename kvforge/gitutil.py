"""Thin layer over GitPython's command runner: one place that fixes locale and identity.

Every git call kvforge makes goes through here, with LC_ALL=C (GitPython sets it) so messages can be
parsed, and with kvforge's committer identity so commits never depend on the user's git config.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import git

from .errors import KvforgeError

COMMITTER = {
    "GIT_COMMITTER_NAME": "kvforge",
    "GIT_COMMITTER_EMAIL": "kvforge@users.noreply.github.com",
}
# Config that must not come from the user: line endings and hooks would change commits.
HERMETIC = ("-c", "core.autocrlf=false", "-c", "core.safecrlf=false", "-c", "core.hooksPath=/dev/null",
            "-c", "advice.detachedHead=false", "-c", "commit.gpgsign=false")


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def run(cwd: Path, *args: str, check: bool = True, env: dict | None = None, timeout: float | None = None,
        stdin: str | None = None) -> Result:
    """Run `git <args>` in `cwd`; raise KvforgeError with git's own last words when `check` fails."""
    cmd = ["git", *HERMETIC, *args]
    try:
        if stdin is None:
            code, out, err = git.Git(str(cwd)).execute(
                cmd, with_extended_output=True, with_exceptions=False,
                env={**COMMITTER, **(env or {})}, kill_after_timeout=timeout)
        else:  # GitPython has no text-input helper; the same call through subprocess
            proc = subprocess.run(cmd, cwd=cwd, input=stdin, capture_output=True, text=True, timeout=timeout,
                                  env=_plain_env(env))
            code, out, err = proc.returncode, proc.stdout.rstrip("\n"), proc.stderr
    except git.GitCommandNotFound:
        raise KvforgeError("git is not installed or not on PATH") from None
    res = Result(code, out, err)
    if check and code != 0:
        last = (err.strip().splitlines() or out.strip().splitlines() or ["(no output)"])[-1]
        raise KvforgeError(f"git {args[0]} failed in {cwd}: {last}")
    return res


def _plain_env(extra: dict | None = None) -> dict:
    """What GitPython sets up for its own calls, for the few made through subprocess directly."""
    return {**os.environ, "LC_ALL": "C", "LANGUAGE": "C", **COMMITTER, **(extra or {})}


def popen(cwd: Path, *args: str) -> subprocess.Popen:
    """Start a git process with stdin/stderr pipes, for streams GitPython cannot feed (fast-import)."""
    return subprocess.Popen(["git", *HERMETIC, *args], cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=_plain_env())


def rev_parse(cwd: Path, rev: str) -> str | None:
    res = run(cwd, "rev-parse", "--verify", "-q", rev, check=False)
    return res.stdout.strip() if res.returncode == 0 else None
