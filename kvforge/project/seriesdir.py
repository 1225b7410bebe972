"""The series directory: its `series` file syntax, and the steps that replace one all or nothing.

Owns (the only module that does): the syntax of the `series` file (one patch file name per line,
'#' starts a comment; read by `read_listing`/`parse_listing`, written by `listing_text`; kvforge.project.series
reads it through `parse_listing`), the directory's lock, the names beside it, staging one directory,
swapping it in, and putting a directory back that a killed swap left missing. kvforge.project.transaction
drives these steps for every write to patches/ and targets/ (one journal, one commit point); this module
never decides when a step runs, and fires no crash point itself (the transaction passes its `crash` hook).

For series directory D in parent P (the names below are siblings of D in P):
  - `stage` computes every file into P/.D.kvforge-tmp-<pid>-<rand> (a file whose bytes D already has and
    the files kept are hard links to D's, so they keep bytes, mode and mtime), fsyncs, and lints it there
    with the series reader (kvforge.project.series, passed in as `lint`): on any problem it is deleted and D is
    untouched;
  - `make_ready` renames it to P/.D.kvforge-new (from now on a complete series);
  - `swap_in` swaps: Linux: renameat2(RENAME_EXCHANGE) exchanges D and .D.kvforge-new in one step;
    elsewhere, or where the file system refuses the exchange: rename D to P/.D.kvforge-old, then
    .D.kvforge-new to D; D did not exist (a new --out): rename .D.kvforge-new to D;
  - `retire` renames a leftover to P/.D.kvforge-trash-<pid>-<rand> and deletes it;
  - `recover_dir` (under the lock): if D is missing, rename .D.kvforge-new to D (roll forward), else
    .D.kvforge-old to D (roll back); then every other P/.D.kvforge-* is garbage and is retired.

Invariants: .D.kvforge-new and .D.kvforge-old only ever name complete series directories, and
tmp-*/trash-* entries are garbage. D always names the complete old series (or nothing, for a new
--out) or the complete new one, except in the fallback's window between its two renames (no
RENAME_EXCHANGE), where D is absent and both complete versions exist under those fixed names,
which `recover_dir` turns back into D (what every reader of a series calls through `recover`).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shlex
import shutil
import sys
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping, Protocol, Sequence

from kvforge.core.errors import EXIT_ENV, EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import file_lock

SERIES_FILE = "series"


# ---------------------------------------------------------------- the series file


def entry_name(line: str) -> str:
    """The patch file a line of the series file names ('' for a comment or blank line)."""
    return line.split("#", 1)[0].strip()


@dataclass
class Entry:
    name: str
    line: str
    before: list[str]  # comment and blank lines right above it
    number: int = 0  # its line number (1-based)


@dataclass
class Listing:
    """The series file's structure: the header, the entries (with their comments), the trailing lines."""

    header: list[str]
    entries: list[Entry]
    trailer: list[str] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        seen: list[str] = []
        for e in self.entries:
            if e.name not in seen:
                seen.append(e.name)
        return seen


def parse_listing(text: str) -> Listing:
    header: list[str] | None = None
    pending: list[str] = []
    entries: list[Entry] = []
    for n, line in enumerate(text.splitlines(), 1):
        name = entry_name(line)
        if not name:
            pending.append(line)
            continue
        if header is None:
            header, pending = pending, []
        entries.append(Entry(name, line, pending, n))
        pending = []
    if header is None:
        header, pending = pending, []
    return Listing(header, entries, pending)


def read_listing(directory: Path) -> Listing | None:
    """The series file of `directory`, or None without one."""
    path = Path(directory) / SERIES_FILE
    if not path.is_file():
        return None
    return parse_listing(path.read_text(encoding="utf-8"))


def listing_text(ref: Listing | None, names: list[str], old_name_of: dict[str, str]) -> str:
    """The new series file: the old header, each kept entry with its comments (renamed if need be), new
    entries bare, the old trailing lines. Comments above a removed entry move to the next kept one."""
    if ref is None:
        return "".join(f"{n}\n" for n in names)
    kept_old = set(old_name_of.values())
    entry_of: dict[str, Entry] = {}
    carry: list[str] = []
    for e in ref.entries:
        if e.name in kept_old and e.name not in entry_of:
            entry_of[e.name] = Entry(e.name, e.line, carry + e.before)
            carry = []
        else:
            carry = carry + e.before
    lines = list(ref.header)
    for name in names:
        kept = entry_of.get(old_name_of.get(name, ""))
        if kept is None:
            lines.append(name)
            continue
        lines += kept.before
        lines.append(kept.line if kept.name == name else kept.line.replace(kept.name, name, 1))
    lines += carry + ref.trailer
    return "".join(f"{ln}\n" for ln in lines)


# ---------------------------------------------------------------- the transaction


class Problem(Protocol):
    """A lint finding (kvforge.project.series.Problem)."""

    @property
    def path(self) -> Path: ...

    @property
    def line(self) -> int | None: ...

    @property
    def message(self) -> str: ...


Lint = Callable[[Path], Sequence[Problem]]
Say = Callable[[str], None]
Show = Callable[[Path], str]  # how messages show a path (targets.display_path; not imported: no cycle)
Crash = Callable[[str], None]  # the transaction's crash hook: called with a step name at each boundary


def sibling(dest: Path, what: str) -> Path:
    """P/.D.kvforge-<what>: the names the transaction uses beside D."""
    return dest.parent / f".{dest.name}.kvforge-{what}"


def _no_crash(_step: str) -> None:
    pass


def stage(dest: Path, files: Mapping[str, bytes], *, lint: Lint, show: Show = str, crash: Crash = _no_crash,
          keep: Sequence[str] = (), keep_from: Path | None = None, blame: Mapping[str, str] | None = None) -> Path:
    """Write `files` (name -> bytes, in order) and the entries `keep` of `keep_from` (default D) into a
    temporary sibling P/.D.kvforge-tmp-*, fsync and lint it; return that path. On any problem nothing is left
    and D is untouched: a lint problem is a KvforgeError naming the file (and `blame[name]`). `crash` gets
    "staging" after the first file and "staged" once the copy is linted."""
    source = dest if keep_from is None else keep_from
    made = _make_parents(dest.parent)
    tmp = sibling(dest, f"tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(tmp)
        if dest.is_dir():
            os.chmod(tmp, dest.stat().st_mode & 0o7777)
        first = True
        for name, data in files.items():
            old = dest / name
            if old.is_file() and not old.is_symlink() and old.read_bytes() == data:
                _link_or_copy(old, tmp / name)
            else:
                _write_file(tmp / name, data)
            if first:
                crash("staging")
                first = False
        for name in keep:
            _copy_entry(source / name, tmp / name)
        fsync_dir(tmp)
        _check(dest, tmp, lint, show, blame or {})
    except BaseException as exc:
        _discard(tmp)
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:
                pass
        if isinstance(exc, OSError):
            raise cannot_write(dest, exc, show) from None
        raise
    crash("staged")
    return tmp


def make_ready(dest: Path, tmp: Path) -> Path:
    """Rename a staged copy to P/.D.kvforge-new (an older one there is retired first); return that path."""
    new = sibling(dest, "new")
    if new.exists():
        retire(dest, new)
    os.rename(tmp, new)
    fsync_dir(dest.parent)
    return new


def swap_in(dest: Path, crash: Crash = _no_crash) -> Path | None:
    """Put P/.D.kvforge-new in place of D; return where the old contents are now (None: there were none).
    On an OSError the old series is back at D (or the error says the swap could not be undone)."""
    new = sibling(dest, "new")
    if not dest.exists():
        os.rename(new, dest)
        fsync_dir(dest.parent)
        return None
    if exchange(new, dest):
        fsync_dir(dest.parent)
        return new  # it holds the old contents now
    old = sibling(dest, "old")
    os.rename(dest, old)
    crash("swap-aside")
    try:
        os.rename(new, dest)
    except OSError:
        os.rename(old, dest)  # put the old series back before reporting
        raise
    fsync_dir(dest.parent)
    return old


def _check(dest: Path, tmp: Path, lint: Lint, show: Show, blame: Mapping[str, str]) -> None:
    problems = lint(tmp)
    if not problems:
        return
    first = problems[0]
    where = show(dest / first.path.name) + (f":{first.line}" if first.line else "")
    whose = blame.get(first.path.name, "")
    more = f"; and {len(problems) - 1} more" if len(problems) > 1 else ""
    raise KvforgeError(f"export refused, nothing written: {where}: {first.message}{whose}{more}", EXIT_USAGE)


def cannot_write(dest: Path, exc: OSError, show: Show = str) -> KvforgeError:
    where = exc.filename or dest
    return KvforgeError(f"cannot write the series {show(dest)} ({where}): {exc.strerror or exc}; "
                        "nothing was changed", EXIT_ENV)


def _make_parents(parent: Path) -> list[Path]:
    made = []
    p = parent
    while not p.exists():
        made.append(p)
        p = p.parent
    for d in reversed(made):
        d.mkdir()
    return list(reversed(made))


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "xb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def _copy_entry(src: Path, dst: Path) -> None:
    if src.is_dir() and not src.is_symlink():
        shutil.copytree(src, dst, symlinks=True, copy_function=lambda s, d: _link_or_copy(Path(s), Path(d)))
    elif src.is_symlink():
        os.symlink(os.readlink(src), dst)
    else:
        _link_or_copy(src, dst)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _discard(path: Path, on_first: Callable[[], None] | None = None) -> None:
    """Delete a leftover directory (or file); `on_first` is called once its first entry is gone."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
        return
    if not path.is_dir():
        return
    for n, entry in enumerate(sorted(os.listdir(path))):
        p = path / entry
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        if n == 0 and on_first is not None:
            on_first()
    shutil.rmtree(path, ignore_errors=True)


# RENAME_EXCHANGE: Linux >= 3.15, glibc >= 2.28 has renameat2(). Elsewhere the two-rename fallback.
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths; False when this system or file system cannot (use the fallback)."""
    if not sys.platform.startswith("linux") or os.environ.get("KVFORGE_EXPORT_SWAP") == "rename":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")


@contextmanager
def locked(dest: Path, say: Say, show: Show = str) -> Iterator[None]:
    """One transaction (or recovery) of `dest` at a time: flock on its parent directory."""
    probe = dest.parent
    while not probe.exists():  # a new --out: lock the nearest existing ancestor
        probe = probe.parent
    try:
        fd = os.open(probe, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        raise cannot_write(dest, exc, show) from None
    try:
        flocked = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another kvforge that is exporting into {show(probe)}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # no flock on a directory here (NFS): a lock file beside the series instead
            flocked = False
        if flocked:
            yield
        else:
            with file_lock(probe / f".{dest.name}.kvforge.lock", say, show(dest)):
                yield
    finally:
        os.close(fd)  # releases the lock


def recover_dir(dest: Path, say: Say, show: Show = str) -> None:
    """Put D back from .D.kvforge-new (or -old) if it is missing, and retire every other leftover beside it
    (the lock is held)."""
    parent = dest.parent
    if not parent.is_dir():
        return
    new, old = sibling(dest, "new"), sibling(dest, "old")
    if not dest.exists():  # the swap died between its renames (or a new --out's rename): finish it
        for staged, how in ((new, "finished"), (old, "rolled back")):
            if staged.is_dir():
                os.rename(staged, dest)
                fsync_dir(parent)
                say(f"{show(dest)}: {how} an export that was interrupted while swapping the series in")
                break
    for name in sorted(os.listdir(parent)):
        if name.startswith(f".{dest.name}.kvforge-"):
            retire(dest, parent / name)


def retire(dest: Path, path: Path, on_first: Callable[[], None] | None = None) -> None:
    """Delete a leftover. .new and .old are first renamed to a trash name, so that those two names
    only ever hold complete series directories (recovery may move them into place)."""
    if not path.name.startswith((f".{dest.name}.kvforge-tmp-", f".{dest.name}.kvforge-trash-")):
        trash = sibling(dest, f"trash-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.rename(path, trash)
        path = trash
    _discard(path, on_first)


def recover(directory: Path, show: Show = str) -> None:
    """Finish or undo a transaction that was killed (see the module docstring); cheap when there is nothing
    to do. What every reader of a series calls when `directory` is missing (the fallback's window: a swap
    killed between its two renames, whichever command ran it). When the recovery cannot be done here (the
    lock cannot be taken, the rename is refused), a KvforgeError (EXIT_ENV) names the `mv` that finishes it:
    nothing is written or deleted then."""
    directory = Path(directory).resolve()
    parent = directory.parent
    if not parent.is_dir() or not any(n.startswith(f".{directory.name}.kvforge-") for n in os.listdir(parent)):
        return
    try:
        with locked(directory, _quiet, show):
            recover_dir(directory, _quiet, show)
    except (OSError, KvforgeError) as exc:
        if directory.exists():
            return  # in place; a leftover beside it is garbage the next transaction deletes
        staged = next((p for p in (sibling(directory, "new"), sibling(directory, "old")) if p.is_dir()), None)
        if staged is None:
            return  # nothing complete to put back: the reader says the directory does not exist
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise KvforgeError(f"{show(directory)} is missing: a series swap (export, rebase, pick or target add) was "
                           f"interrupted and cannot be finished here ({why}); finish it with: "
                           f"mv {shlex.quote(str(staged))} {shlex.quote(str(directory))}", EXIT_ENV) from None


def _quiet(_message: str) -> None:
    pass
