"""The one git runner: every git call kvforge makes goes through `run` (text) or `run(..., binary=True)`.

LC_ALL=C (so messages can be parsed), kvforge's committer identity (commits never depend on the
user's git config) and HERMETIC config (no hooks, no autocrlf, no quoted paths) are fixed here.
Every git process is registered while it runs and, when its call is interrupted (Ctrl-C, SIGTERM,
SIGHUP: kvforge.cli.finish raises in the main thread) or times out, ended together with the helpers
git started (`worktree add` runs `reset --hard`): SIGTERM, then SIGKILL, so nothing git started
outlives kvforge. `end_all` ends what is still running from any thread. GitPython starts every call (the
thin runner the project chose); this module keeps the process to end it. A commit's files leave the
repository through `archive`/`export`.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import tarfile
import threading
import time
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
    data = stdin.encode() if isinstance(stdin, str) else stdin
    try:
        proc = _start(cmd, cwd, env, stdin=subprocess.PIPE if data is not None else subprocess.DEVNULL,
                      stdout=subprocess.PIPE)
    except FileNotFoundError:
        if not Path(cwd).is_dir():
            raise KvforgeError(f"{cwd}: directory does not exist", EXIT_ENV) from None
        raise KvforgeError("git is not installed or not on PATH", EXIT_ENV) from None
    try:
        raw, raw_err = proc.communicate(data, timeout=timeout)
    except subprocess.TimeoutExpired:
        raw, raw_err = b"", f"git {args[0]}: timed out after {timeout}s".encode()
    finally:
        end(proc)
    code, err = proc.returncode, raw_err.decode(errors="replace")
    out = raw if binary else raw.decode(errors="replace").rstrip("\n")
    res: Result | BinaryResult = (BinaryResult(code, out, err) if isinstance(out, bytes)
                                  else Result(code, out, err))
    if check and code != 0:
        text = out.decode(errors="replace") if isinstance(out, bytes) else out
        last = (err.strip().splitlines() or text.strip().splitlines() or ["(no output)"])[-1]
        raise GitError(f"git {args[0]} failed in {cwd}: {last}", err)
    return res


_LIVE: set[subprocess.Popen] = set()  # git processes started and not yet ended (every thread's)
_LIVE_LOCK = threading.Lock()
GRACE = 2.0  # seconds git and its helpers have to exit on SIGTERM (their own cleanup: lock files) before SIGKILL


def _start(cmd: list[str], cwd: Path, env: dict | None, *, stdin: int, stdout: int) -> subprocess.Popen:
    """Start git through GitPython (the runner: its environment, C messages), registered until `end` (see the
    module docstring). GitPython's handle is detached (`proc = None`): the Popen is ours to end, never killed by
    the handle's finaliser. A missing directory or git is FileNotFoundError; GitPython would run git in the
    current directory instead of one it cannot enter, so that is refused here."""
    if not Path(cwd).is_dir():
        raise FileNotFoundError(str(cwd))
    if not os.access(cwd, os.X_OK):
        raise KvforgeError(f"{cwd}: cannot enter the directory (permission denied)", EXIT_ENV)
    with _LIVE_LOCK:
        try:
            handle = git.Git(str(cwd)).execute(cmd, as_process=True, istream=stdin if stdin == subprocess.PIPE else None,
                                               with_stdout=stdout == subprocess.PIPE, env={**COMMITTER, **(env or {})})
        except git.GitCommandNotFound as exc:
            raise FileNotFoundError("git") from exc
        proc, handle.proc = handle.proc, None
        _LIVE.add(proc)
    return proc


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...); None when gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields


def _descendants(pid: int) -> dict[int, str]:
    """Every live process below `pid` (Linux /proc; none elsewhere): pid -> its start time (a reused pid differs)."""
    children: dict[int, list[tuple[int, str]]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    for name in names:
        if name.isdigit() and (fields := _stat(int(name))) is not None:
            children.setdefault(int(fields[1]), []).append((int(name), fields[19]))
    out: dict[int, str] = {}
    todo = [pid]
    while todo:
        for child, start in children.get(todo.pop(), []):
            if child not in out:
                out[child] = start
                todo.append(child)
    return out


def _alive(pid: int, start: str) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[19] == start


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def end(proc: subprocess.Popen) -> None:
    """Unregister `proc` and, unless git exited by itself, end it and every helper it started (`worktree add`
    runs `reset --hard`, `am` runs `apply`): SIGTERM to all of them (git removes its lock files), up to GRACE
    seconds, then SIGKILL to what is left. Helpers are found before their parent ends (they are reparented)."""
    with _LIVE_LOCK:
        if proc not in _LIVE:
            return
        _LIVE.discard(proc)
    if proc.poll() is None:
        helpers: dict[int, str] = {}
        deadline = time.monotonic() + GRACE
        while proc.poll() is None and time.monotonic() < deadline:
            found = _descendants(proc.pid)
            for pid, start in found.items():
                if pid not in helpers:
                    _kill(pid, signal.SIGTERM)
            helpers |= found
            if proc.returncode is None:
                _kill(proc.pid, signal.SIGTERM)
            time.sleep(0.01)
        if proc.poll() is None:
            helpers |= _descendants(proc.pid)
            proc.kill()
        proc.wait()
        while time.monotonic() < deadline and any(_alive(p, s) for p, s in helpers.items()):
            time.sleep(0.01)
        for pid, start in helpers.items():
            if _alive(pid, start):
                _kill(pid, signal.SIGKILL)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def end_all() -> None:
    """End every git process still running (any thread's) and its helpers: what an interrupted kvforge does last."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for proc in live:
        end(proc)


def popen(cwd: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """Start a git process with stdin/stderr pipes, for streams fed while they run (fast-import); the caller
    waits for it and then calls `end` (which ends it and its helpers if it was interrupted)."""
    return _start(["git", *HERMETIC, *args], cwd, env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)


def run_many(cwd: Path, calls: Sequence[Sequence[str]], env: dict | None = None, jobs: int = 0) -> list[Result]:
    """`run(cwd, *args, check=False, env=env)` for each args in `calls`, up to `jobs` at once (default: twice the
    CPUs): the same environment, config and decoding as `run`, results in the order of `calls`. For independent,
    read-only git calls (checks against one index), whose cost is mostly process start-up and waiting."""
    width = jobs or 2 * (os.cpu_count() or 1)
    results: list[Result | None] = [None] * len(calls)
    running: list[tuple[int, subprocess.Popen]] = []

    def collect(k: int, proc: subprocess.Popen) -> None:
        out, err = proc.communicate()
        end(proc)
        results[k] = Result(proc.returncode, out.decode(errors="replace").rstrip("\n"), err.decode(errors="replace"))

    try:
        for k, args in enumerate(calls):
            if len(running) >= width:
                collect(*running.pop(0))
            try:
                proc = _start(["git", *HERMETIC, *args], cwd, env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
            except FileNotFoundError:
                if not Path(cwd).is_dir():
                    raise KvforgeError(f"{cwd}: directory does not exist", EXIT_ENV) from None
                raise KvforgeError("git is not installed or not on PATH", EXIT_ENV) from None
            running.append((k, proc))
        while running:
            collect(*running.pop(0))
    finally:
        for _k, proc in running:  # interrupted: end what is still running
            end(proc)
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
