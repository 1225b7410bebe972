"""Atomic file writes: a crash or a failed step never leaves a half-written file behind."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Callable, Iterator


def atomic_write_bytes(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write `path` as a temporary sibling renamed over it; `mode`: its permission bits (default: mkstemp's 0600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            if mode is not None:
                os.fchmod(fh.fileno(), mode)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str, mode: int | None = None) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), mode)


@contextlib.contextmanager
def file_lock(path: Path, say: Callable[[str], None] | None = None, what: str = "") -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing); say so when another kvforge holds it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if say:
                say(f"waiting for another kvforge that is using {what or path}")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks (release archives and wheels are hundreds of MB)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def stat_stamp(path: Path) -> str:
    """What says a file is unchanged since it was hashed: its size, inode, mtime_ns and ctime_ns (ctime cannot be
    set back by a user, so any rewrite of the file changes the stamp)."""
    st = Path(path).stat()
    return f"{st.st_size} {st.st_ino} {st.st_mtime_ns} {st.st_ctime_ns}"


def sha256_memo(path: Path) -> Path:
    """Where the sha256 of a file in kvforge's cache is remembered: `.<name>.sha256` beside it."""
    return Path(path).with_name(f".{Path(path).name}.sha256")


def remembered_sha256(path: Path) -> str | None:
    """The file's sha256 as remembered beside it, if its stat_stamp is still the one it was hashed with; else
    None (never hashes)."""
    with contextlib.suppress(OSError, UnicodeDecodeError):
        digest, _, seen = sha256_memo(path).read_text(encoding="utf-8").strip().partition(" ")
        if seen == stat_stamp(path) and re.fullmatch(r"[0-9a-f]{64}", digest):
            return digest
    return None


def remember_sha256(path: Path, digest: str, stamp: str | None = None) -> None:
    """Remember `digest` as the file's sha256, for the file as `stamp` (stat_stamp when it was hashed; default:
    now) says it was; not when the file has changed since. An unwritable directory only costs a re-hash."""
    with contextlib.suppress(OSError):
        now = stat_stamp(path)
        if stamp is None or stamp == now:
            atomic_write_text(sha256_memo(path), f"{digest} {now}\n")


def sha256_remembered(path: Path) -> str:
    """sha256_file of a file in kvforge's cache (a download it never rewrites in place), remembered beside it
    (remembered_sha256 / remember_sha256): read again only when the file changed."""
    known = remembered_sha256(path)
    if known is not None:
        return known
    stamp = stat_stamp(path)
    digest = sha256_file(path)
    remember_sha256(path, digest, stamp)
    return digest


def crashpoint(name: str) -> None:
    """Test hook: when $KVFORGE_CRASH_AT names this step, die here with SIGKILL (no cleanup runs).

    The crash-safety tests kill kvforge at every step boundary this way and check that the next
    run succeeds and that nothing is left half-made.
    """
    if os.environ.get("KVFORGE_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(directory: Path, pattern: str) -> list[Path]:
    """Remove what dead processes left in `directory`: entries whose name matches `pattern` (a regex
    with a group `pid`) and whose pid no longer runs. Files and directories; an entry that vanishes
    meanwhile (another kvforge swept it) is skipped. Returns what was removed."""
    regex = re.compile(pattern)
    removed: list[Path] = []
    try:
        entries = list(Path(directory).iterdir())
    except FileNotFoundError:
        return removed
    for entry in entries:
        m = regex.match(entry.name)
        if not m or pid_alive(int(m.group("pid"))):
            continue
        try:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except FileNotFoundError:
            continue
        removed.append(entry)
    return removed
