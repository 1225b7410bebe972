"""One transaction for every write to patches/ and targets/: N series directories and files, all or none.

StGit's transaction.py is the model: an operation computes everything first (each series directory's new
files, each target or ledger file's new bytes, and the digest of each path as it read it), then this module
writes all of it or none. `kvforge export`, `rebase`, `target add` and `pick` write the project only through
it, and its steps are the only crash points of those writes ($KVFORGE_CRASH_AT=<op>:<step>, CRASH_STEPS):

  locked      `open_transaction` holds the locks (the root and every series directory's parent, in one
              order) and has recovered an earlier transaction a kill interrupted (below);
  staging     a directory's first file is staged (kvforge.project.seriesdir.stage: P/.D.kvforge-tmp-*);
  staged      that directory's copy is complete and linted (kvforge.project.series): a problem refuses, nothing moved;
  committing  `commit` begins: everything is staged and the caller has saved its own state;
  committed   THE COMMIT POINT: the journal <root>/.kvforge-transaction.json is written (atomically);
  ready       every staged copy is renamed to P/.D.kvforge-new;
  swap-aside  the two-rename fallback's window (kvforge.project.seriesdir.swap_in);
  swapped     a directory is swapped in;
  written     every file is replaced (one rename each);
  cleanup     the old contents are being deleted;
  done        the journal is removed.

Read check: before anything is staged, every path the operation read (`stage_dir`'s and `stage_file`'s
`read`, `expect`) must still have the digest it had at planning; else one line names the file (exit 2) and
nothing is written.

A removal (`remove_dir`, `remove_file`: `target add --abort` taking back its own output) is a write whose new
digest is ABSENT; it happens only where the path still has the digest read.

The journal (JOURNAL_VERSION, type-checked on load): the operation, and per directory and file its path
relative to the root, its digest as read and once written, its new bytes (a directory's kept entries are
named, copied from where they were), and the staged copy. Every path is checked to stay inside the root
before anything is written or removed; a journal of another version or shape is one line (exit 2) naming it
and the `mv` that moves it out of the way, and nothing is touched.

Recovery (`open_transaction`, under the locks: the one recovery path, which every command that writes the
project runs first): a journal means the kill came after the commit point: each path it names whose digest
is still the one read gets its new contents (the staged copy, or staged again from the journal's bytes),
those already new are kept, any other (changed since by someone else) is left as it is and named; then the
journal is removed. No journal: the kill came before it, and every leftover beside the series directories
(P/.D.kvforge-*) is deleted (kvforge.project.seriesdir.recover_dir): the project is wholly old or wholly new.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator, Mapping, Sequence

from kvforge.core.errors import EXIT_ENV, EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import atomic_write_bytes, crashpoint, sha256_file
from kvforge.project import seriesdir
from kvforge.project.series import lint_directory
from kvforge.project.targets import display_path

JOURNAL = ".kvforge-transaction.json"
JOURNAL_FORMAT = "kvforge-transaction"
JOURNAL_VERSION = 1
CRASH_STEPS = ("locked", "staging", "staged", "committing", "committed", "ready", "swap-aside", "swapped",
               "written", "cleanup", "done")
COMMIT_POINT = "committed"  # a kill at a step before it is undone, at it or after it finished
ABSENT = "absent"  # the digest of a path that does not exist

Say = Callable[[str], None]


# ---------------------------------------------------------------- digests


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes; ABSENT when it is not a file."""
    return sha256_file(path) if Path(path).is_file() else ABSENT


def bytes_digest(data: bytes) -> str:
    """file_digest of a file holding `data`."""
    return hashlib.sha256(data).hexdigest()


def text_digest(text: str) -> str:
    """file_digest of a file holding `text` (UTF-8)."""
    return bytes_digest(text.encode("utf-8"))


def dir_digest(path: Path) -> str:
    """Names (relative paths) and bytes of every file under `path`; ABSENT when it is not a directory."""
    path = Path(path)
    if not path.is_dir():
        return ABSENT
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file() and not p.is_symlink():
            h.update(str(p.relative_to(path)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def digest(path: Path) -> str:
    """dir_digest of a directory, else file_digest."""
    return dir_digest(path) if Path(path).is_dir() else file_digest(path)


# ---------------------------------------------------------------- the journal


@dataclass(frozen=True)
class DirWrite:
    """A series directory's new contents."""

    path: str  # relative to the root, POSIX
    read: str  # its digest as the operation read it
    after: str  # the digest of its new contents
    staged: str  # the staged copy (relative), until it is renamed to .D.kvforge-new
    files: dict[str, str]  # name -> base64 bytes
    keep: list[str]  # entries copied as they are from keep_from
    keep_from: str  # relative; "" for the directory itself


@dataclass(frozen=True)
class FileWrite:
    """A target or ledger file's new bytes."""

    path: str
    read: str
    after: str
    data: str  # base64


@dataclass(frozen=True)
class Journal:
    op: str
    dirs: list[DirWrite] = field(default_factory=list)
    files: list[FileWrite] = field(default_factory=list)

    def paths(self) -> list[str]:
        return [d.path for d in self.dirs] + [f.path for f in self.files]


class _Malformed(Exception):
    pass


def _strings(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _Malformed(f"{where} is not a list of strings")
    return list(value)


def _record(value: Any, keys: dict[str, type], where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Malformed(f"{where} is not an object")
    if set(value) != set(keys):
        odd = sorted(set(value) ^ set(keys))[0]
        raise _Malformed(f"{where} {'has an unknown key' if odd in value else 'lacks'} {odd!r}")
    for k, tp in keys.items():
        if not isinstance(value[k], tp):
            raise _Malformed(f"{where}.{k} is not a {tp.__name__}")
    return value


def _decode_journal(data: Any) -> Journal:
    top = _record(data, {"format": str, "version": int, "op": str, "dirs": list, "files": list}, "journal")
    if top["format"] != JOURNAL_FORMAT or top["version"] != JOURNAL_VERSION:
        raise _Malformed(f"format {top['format']!r} version {top['version']!r}, not {JOURNAL_FORMAT} "
                         f"{JOURNAL_VERSION}")
    dirs = []
    for i, d in enumerate(top["dirs"]):
        where = f"dirs[{i}]"
        d = _record(d, {"path": str, "read": str, "after": str, "staged": str, "files": dict, "keep": list,
                        "keep_from": str}, where)
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in d["files"].items()):
            raise _Malformed(f"{where}.files is not an object of strings")
        dirs.append(DirWrite(d["path"], d["read"], d["after"], d["staged"], dict(d["files"]),
                             _strings(d["keep"], f"{where}.keep"), d["keep_from"]))
    files = []
    for i, f in enumerate(top["files"]):
        f = _record(f, {"path": str, "read": str, "after": str, "data": str}, f"files[{i}]")
        files.append(FileWrite(f["path"], f["read"], f["after"], f["data"]))
    return Journal(top["op"], dirs, files)


def _encode_journal(j: Journal) -> bytes:
    doc = {"format": JOURNAL_FORMAT, "version": JOURNAL_VERSION, **asdict(j)}
    return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode("utf-8")


def _inside(root: Path, rel: str, where: str) -> Path:
    """root/rel, refused unless rel is a relative path that stays inside root (no '..', no symlink out)."""
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or ".." in p.parts or "\0" in rel:
        raise _Malformed(f"{where} {rel!r} is not a path inside {root}")
    full = root / p
    try:
        full.resolve().relative_to(root.resolve())
    except ValueError:
        raise _Malformed(f"{where} {rel!r} leads outside {root}") from None
    return full


def _b64(data: str, where: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise _Malformed(f"{where} is not base64") from None


def load_journal(root: Path) -> Journal | None:
    """The journal of the transaction a kill interrupted past its commit point, None without one; every path
    in it checked (a one-line KvforgeError, exit 2, naming the file and how to move it away; nothing is touched)."""
    path = root / JOURNAL
    if not path.exists():
        return None
    try:
        j = _decode_journal(json.loads(path.read_text(encoding="utf-8")))
        for i, d in enumerate(j.dirs):
            _inside(root, d.path, f"dirs[{i}].path")
            if d.staged:
                _inside(root, d.staged, f"dirs[{i}].staged")
            if d.keep_from:
                _inside(root, d.keep_from, f"dirs[{i}].keep_from")
            for name, data in d.files.items():
                if "/" in name or name in ("", ".", ".."):
                    raise _Malformed(f"dirs[{i}].files has the name {name!r}")
                _b64(data, f"dirs[{i}].files[{name!r}]")
            for name in d.keep:
                if "/" in name or name in ("", ".", ".."):
                    raise _Malformed(f"dirs[{i}].keep has the name {name!r}")
        for i, f in enumerate(j.files):
            _inside(root, f.path, f"files[{i}].path")
            _b64(f.data, f"files[{i}].data")
    except (OSError, UnicodeDecodeError, ValueError, _Malformed) as exc:
        raise KvforgeError(f"{path}: unusable transaction journal ({exc}); nothing was written or removed; look at "
                           f"it, then `mv {path} {path}.unusable` and run the command again", EXIT_USAGE) from None
    return j


# ---------------------------------------------------------------- the transaction


def _no_crash(_step: str) -> None:
    pass


def _quiet(_message: str) -> None:
    pass


class Transaction:
    """One write of the project; made by `open_transaction`, which holds the locks. Stage every directory and
    file, then `commit` (see the module docstring). Leaving the block without a commit deletes what was staged."""

    def __init__(self, root: Path, op: str, say: Say, dirs: Sequence[Path], hint: str):
        self.root = Path(root).resolve()
        self.op = op
        self.say = say
        self.hint = hint
        self.dirs = [Path(d).resolve() for d in dirs]
        self.journal = Journal(op)
        self._staged: list[Path] = []
        self.committed = False

    def crash(self, step: str) -> None:
        crashpoint(f"{self.op}:{step}")

    def rel(self, path: Path) -> str:
        """`path` relative to the root; a KvforgeError when it is outside (the operation's own mistake)."""
        try:
            return Path(path).resolve().relative_to(self.root).as_posix()
        except ValueError:
            raise KvforgeError(f"{self.op}: {path} is outside {self.root}; nothing was written", EXIT_USAGE) from None

    def _claim(self, rel: str) -> str:
        """One write per path, and no file inside a directory the transaction replaces (the operation's mistake)."""
        for other in self.journal.paths():
            if rel == other or PurePosixPath(rel).is_relative_to(other) or PurePosixPath(other).is_relative_to(rel):
                raise KvforgeError(f"{self.op}: {rel} and {other} are both written by one transaction; nothing was "
                                   "written", EXIT_USAGE)
        return rel

    def expect(self, path: Path, read: str) -> None:
        """Refuse (exit 2, nothing written) unless `path` still has the digest `read` it had at planning."""
        if digest(Path(path)) != read:
            self.discard()
            raise KvforgeError(f"{display_path(Path(path))} changed since the {self.op} read it; nothing was "
                               f"written{self.hint}", EXIT_USAGE)

    def stage_dir(self, dest: Path, files: Mapping[str, bytes], *, read: str | None = None,
                  keep: Sequence[str] = (), keep_from: Path | None = None,
                  blame: Mapping[str, str] | None = None) -> str:
        """Stage the complete new contents of series directory `dest` (one of `open_transaction`'s `dirs`):
        `files` (name -> bytes, in order) and the entries `keep` of `keep_from` (default `dest`), linted.
        Returns the digest of the new contents (dir_digest). `read`: its digest at planning (expect)."""
        dest = Path(dest).resolve()
        if dest not in self.dirs:
            raise KvforgeError(f"{self.op}: {dest} was not named when the transaction began", EXIT_USAGE)
        rel = self._claim(self.rel(dest))
        if read is not None:
            self.expect(dest, read)
        tmp = seriesdir.stage(dest, files, lint=lint_directory, show=display_path, crash=self.crash, keep=keep,
                              keep_from=keep_from, blame=blame)
        self._staged.append(tmp)
        after = dir_digest(tmp)
        self.journal.dirs.append(DirWrite(
            rel, dir_digest(dest), after, self.rel(tmp),
            {n: base64.b64encode(b).decode() for n, b in files.items()}, list(keep),
            self._keep_from(dest, keep_from)))
        return after

    def _keep_from(self, dest: Path, keep_from: Path | None) -> str:
        """How the journal names where kept entries come from: "" for the directory itself, or one outside the
        root (a recovery then stages the directory without them)."""
        if keep_from is None or Path(keep_from).resolve() == dest:
            return ""
        source = Path(keep_from).resolve()
        return source.relative_to(self.root).as_posix() if source.is_relative_to(self.root) else ""

    def stage_file(self, path: Path, data: bytes, *, read: str | None = None) -> str:
        """Record a target or ledger file's new bytes (written after the commit point); return their digest."""
        rel = self._claim(self.rel(path))
        if read is not None:
            self.expect(path, read)
        after = bytes_digest(data)
        self.journal.files.append(FileWrite(rel, file_digest(Path(path)), after, base64.b64encode(data).decode()))
        return after

    def remove_dir(self, dest: Path, *, read: str) -> None:
        """Remove series directory `dest` (one of `dirs`) if it still has the digest `read` (the operation's own
        output it takes back)."""
        dest = Path(dest).resolve()
        if dest not in self.dirs:
            raise KvforgeError(f"{self.op}: {dest} was not named when the transaction began", EXIT_USAGE)
        rel = self._claim(self.rel(dest))
        self.expect(dest, read)
        self.journal.dirs.append(DirWrite(rel, read, ABSENT, "", {}, [], ""))

    def remove_file(self, path: Path, *, read: str) -> None:
        """Remove a file if it still has the digest `read`."""
        rel = self._claim(self.rel(path))
        self.expect(path, read)
        self.journal.files.append(FileWrite(rel, read, ABSENT, ""))

    def staged_copy(self, dest: Path) -> Path:
        """The staged copy of `dest` (to read before the commit: it is renamed at the commit)."""
        rel = self.rel(dest)
        return self.root / next(d.staged for d in self.journal.dirs if d.path == rel)

    def commit(self) -> None:
        """Write the journal (the commit point), then swap every directory in and replace every file."""
        self.crash("committing")
        if not self.journal.dirs and not self.journal.files:
            self.committed = True
            return
        try:
            atomic_write_bytes(self.root / JOURNAL, _encode_journal(self.journal))
            seriesdir.fsync_dir(self.root)
        except OSError as exc:
            self.discard()
            raise KvforgeError(f"cannot write {self.root / JOURNAL}: {exc.strerror or exc}; nothing was changed",
                               EXIT_ENV) from None
        self.committed = True
        self.crash("committed")
        try:
            _apply(self.root, self.journal, self.say, self.crash, trusted=True)
        except OSError as exc:
            raise KvforgeError(f"cannot finish writing {', '.join(self.journal.paths())} in {self.root}: "
                               f"{exc.strerror or exc}; the next kvforge command that writes the project finishes "
                               "it", EXIT_ENV) from None

    def discard(self) -> None:
        """Delete what was staged (before the commit point)."""
        for tmp in self._staged:
            seriesdir.retire(tmp.parent / tmp.name.split(".kvforge-", 1)[0].lstrip("."), tmp)
        self._staged = []
        self.journal = Journal(self.op)


@contextlib.contextmanager
def open_transaction(root: Path, op: str, say: Say, *, dirs: Sequence[Path] = (),
                     hint: str = "") -> Iterator[Transaction]:
    """Lock `root` and the parent of each of `dirs` (the series directories the transaction may write), recover
    an interrupted transaction, and yield a new one; "<op>:locked" fires once it is ready. `hint`: what the
    refusal of a changed file adds (after "nothing was written")."""
    root = Path(root).resolve()
    tx = Transaction(root, op, say, dirs, hint)
    with _locked(root, tx.dirs, say):
        recover(root, say, tx.dirs)
        tx.crash("locked")
        try:
            yield tx
        finally:
            if not tx.committed:
                tx.discard()


def settle(root: Path, say: Say = _quiet) -> list[str]:
    """Take the locks and recover (see `recover`): what a command that reads the project's write state first calls."""
    root = Path(root).resolve()
    with _locked(root, (), say):
        return recover(root, say)


@contextlib.contextmanager
def _locked(root: Path, dirs: Sequence[Path], say: Say) -> Iterator[None]:
    """The lock of the root and of each directory's parent (kvforge.project.seriesdir.locked), in a fixed order."""
    holders: dict[Path, Path] = {root: root / JOURNAL}
    patches = root / "patches"
    if patches.is_dir():
        holders.setdefault(patches, patches / "x")
    for d in dirs:
        probe = d.parent
        while not probe.exists():
            probe = probe.parent
        holders.setdefault(probe.resolve(), d)
    with contextlib.ExitStack() as stack:
        for p in sorted(holders):
            stack.enter_context(seriesdir.locked(holders[p], say, display_path))
        yield


def recover(root: Path, say: Say = _quiet, dirs: Sequence[Path] = ()) -> list[str]:
    """Finish (journal) or undo (no journal) a transaction a kill interrupted, under the locks (see the module
    docstring); `dirs`: series directories to clean besides those under root/patches. Returns the paths a
    finished transaction wrote ([] when there was none)."""
    root = Path(root).resolve()
    j = load_journal(root)
    if j is None:
        parents = {root / "patches"} | {Path(d).parent for d in dirs}
        for parent in sorted(parents):
            if not parent.is_dir():
                continue
            names = sorted({n.split(".kvforge-", 1)[0][1:] for n in os.listdir(parent)
                            if n.startswith(".") and ".kvforge-" in n and not n.startswith(".kvforge-")})
            for name in names:
                if name:
                    seriesdir.recover_dir(parent / name, say, display_path)
        return []
    _apply(root, j, say, _no_crash, trusted=False)
    article = "an" if j.op[:1] in "aeiou" else "a"
    say(f"finished {article} {j.op} that was interrupted while writing ({', '.join(j.paths())})")
    return j.paths()


# ---------------------------------------------------------------- applying a journal (commit and recovery)


def _apply(root: Path, j: Journal, say: Say, crash: Callable[[str], None], trusted: bool) -> None:
    """Make every path of `j` its new contents, then remove the journal. `trusted`: the staged copies are the
    ones this process just made (no digest to check)."""
    swaps = [d for d in j.dirs if d.after != ABSENT and _ready(root, j.op, d, say, trusted)]
    crash("ready")
    olds: list[tuple[Path, Path]] = []
    for d in swaps:
        dest = root / d.path
        old = seriesdir.swap_in(dest, crash)
        if old is not None:
            olds.append((dest, old))
        crash("swapped")
    for d in j.dirs:
        dest = root / d.path
        if d.after == ABSENT and dest.is_dir() and dir_digest(dest) == d.read:  # a removal: out of the way at once
            trash = seriesdir.sibling(dest, f"trash-{os.getpid()}-removed")
            os.rename(dest, trash)
            seriesdir.fsync_dir(dest.parent)
            olds.append((dest, trash))
    for f in j.files:
        path = root / f.path
        now = file_digest(path)
        if now == f.after:
            continue
        if now != f.read:
            say(f"{display_path(path)} changed since the {j.op} read it: left as it is")
        elif f.after == ABSENT:
            path.unlink()
        else:
            mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
            atomic_write_bytes(path, base64.b64decode(f.data), mode)
    crash("written")
    fired = False

    def first() -> None:
        nonlocal fired
        if not fired:
            fired = True
            crash("cleanup")

    for dest, old in olds:
        seriesdir.retire(dest, old, on_first=first)
    for d in j.dirs:
        seriesdir.recover_dir(root / d.path, say, display_path)  # staged copies a kill left, .old beside a new D
    first()
    (root / JOURNAL).unlink(missing_ok=True)
    seriesdir.fsync_dir(root)
    crash("done")


def _ready(root: Path, op: str, d: DirWrite, say: Say, trusted: bool) -> bool:
    """Put the new contents of `d` at .D.kvforge-new; False when there is nothing to swap (D is new already, or
    changed since by someone else: named, left as it is)."""
    dest = root / d.path
    new, old = seriesdir.sibling(dest, "new"), seriesdir.sibling(dest, "old")
    staged = root / d.staged if d.staged else None
    if not dest.exists():  # the fallback's window, or a new directory whose rename was cut off
        if new.is_dir() and dir_digest(new) == d.after:
            os.rename(new, dest)
            seriesdir.fsync_dir(dest.parent)
            return False
        if old.is_dir():
            os.rename(old, dest)
            seriesdir.fsync_dir(dest.parent)
    now = dir_digest(dest)
    if now == d.after:
        return False
    if now != d.read:
        say(f"{display_path(dest)} changed since the {op} read it: left as it is")
        return False
    if staged is not None and staged.is_dir() and (trusted or dir_digest(staged) == d.after):
        seriesdir.make_ready(dest, staged)
    elif not (new.is_dir() and dir_digest(new) == d.after):
        files = {n: base64.b64decode(b) for n, b in d.files.items()}
        source = root / d.keep_from if d.keep_from else dest
        tmp = seriesdir.stage(dest, files, lint=lint_directory, show=display_path,
                              keep=[n for n in d.keep if (source / n).exists()], keep_from=source)
        seriesdir.make_ready(dest, tmp)
    return True
