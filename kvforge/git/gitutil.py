"""The one git runner: every git call kvforge makes goes through `run` (text) or `run(..., binary=True)`.

LC_ALL=C (so messages can be parsed), kvforge's committer identity (commits never depend on the
user's git config) and HERMETIC config (no hooks, no autocrlf, no quoted paths) are fixed here.
GitPython executes the calls; calls that feed standard input go through subprocess with the same
environment. A commit's files leave the repository through `archive`/`export` (one `git archive`).
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Sequence, overload

import git

from kvforge.core.errors import EXIT_ENV, KvforgeError

COMMITTER = {
    "GIT_COMMITTER_NAME": "kvforge",
    "GIT_COMMITTER_EMAIL": "kvforge@users.noreply.github.com",
}
# Config that must not come from the user: line endings and hooks would change commits; quoted
# paths would change file names in patches.
HERMETIC = ("-c", "core.autocrlf=false", "-c", "core.safecrlf=false", "-c", "core.hooksPath=/dev/null",
            "-c", "advice.detachedHead=false", "-c", "commit.gpgsign=false", "-c", "core.quotePath=false",
            "-c", "gc.auto=0", "-c", "maintenance.auto=false")


class GitError(KvforgeError):
    """A checked git call failed (EXIT_ENV); `stderr` is all git printed, for callers that word their own error."""

    def __init__(self, message: str, stderr: str):
        super().__init__(message, EXIT_ENV)
        self.stderr = stderr


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
        raise GitError(f"git {args[0]} failed in {cwd}: {last}", err)
    return res


def _plain_env(extra: dict | None = None) -> dict:
    """What GitPython sets up for its own calls, for the calls made through subprocess directly."""
    return {**os.environ, "LC_ALL": "C", "LANGUAGE": "C", **COMMITTER, **(extra or {})}


def popen(cwd: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """Start a git process with stdin/stderr pipes, for streams fed while they run (fast-import)."""
    return subprocess.Popen(["git", *HERMETIC, *args], cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=_plain_env(env))


def run_many(cwd: Path, calls: Sequence[Sequence[str]], env: dict | None = None, jobs: int = 0) -> list[Result]:
    """`run(cwd, *args, check=False, env=env)` for each args in `calls`, up to `jobs` at once (default: twice the
    CPUs): the same environment, config and decoding as `run`, results in the order of `calls`. For independent,
    read-only git calls (checks against one index), whose cost is mostly process start-up and waiting."""
    width = jobs or 2 * (os.cpu_count() or 1)
    results: list[Result | None] = [None] * len(calls)
    running: list[tuple[int, subprocess.Popen]] = []

    def collect(k: int, proc: subprocess.Popen) -> None:
        out, err = proc.communicate()
        results[k] = Result(proc.returncode, out.decode(errors="replace").rstrip("\n"), err.decode(errors="replace"))

    try:
        for k, args in enumerate(calls):
            if len(running) >= width:
                collect(*running.pop(0))
            try:
                proc = subprocess.Popen(["git", *HERMETIC, *args], cwd=cwd, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_plain_env(env))
            except FileNotFoundError:
                if not Path(cwd).is_dir():
                    raise KvforgeError(f"{cwd}: directory does not exist", EXIT_ENV) from None
                raise KvforgeError("git is not installed or not on PATH", EXIT_ENV) from None
            running.append((k, proc))
        while running:
            collect(*running.pop(0))
    finally:
        for _k, proc in running:  # interrupted: end what is still running
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    return [r for r in results if r is not None]


def rev_parse(cwd: Path, rev: str) -> str | None:
    res = run(cwd, "rev-parse", "--verify", "-q", rev, check=False)
    return res.stdout.strip() if res.returncode == 0 else None


def is_ancestor(cwd: Path, a: str, b: str) -> bool:
    return run(cwd, "merge-base", "--is-ancestor", a, b, check=False).returncode == 0


def archive(cwd: Path, commit: str, paths: Sequence[str] = (), env: dict | None = None) -> tarfile.TarFile:
    """`commit`'s files under `paths` (all of them without) as a tar read into memory, by one `git archive`
    run in `cwd` (a repository, or any directory with env GIT_DIR): no worktree or index is touched, so
    bare repositories work. A path the commit lacks, or a broken repository, raises GitError."""
    data = run(cwd, "archive", "--format=tar", commit, "--", *paths, binary=True, env=env).stdout
    return tarfile.open(fileobj=io.BytesIO(data))


def export(cwd: Path, commit: str, dest: Path, paths: Sequence[str] = (), env: dict | None = None) -> None:
    """Write `commit`'s files under `paths` (all without) into `dest` (created), through `archive`
    and tarfile's "data" filter (nothing lands outside `dest`). The one export of a commit's files."""
    with archive(cwd, commit, paths, env) as tar:
        dest.mkdir(parents=True, exist_ok=True)
        tar.extractall(dest, filter="data")
