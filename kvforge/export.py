"""`kvforge export`: write a tree's commits back as a series, all or nothing.

Bytes. Each commit becomes engine.format_patch's output: FORMAT_PATCH plus PINNED_CONFIG / PINNED_OPTS
(engine.py, the one definition), which hold every setting a user's or a tree's git
config could use to change those bytes (subject prefix, numbering, sign-off, extra headers, notes,
a/ b/ prefixes, context, order file, funcname attributes, ...) at git's defaults. So re-exporting an
unchanged commit reproduces its file byte for byte on any machine; renames are exported as renames
(--find-renames) and non-ASCII paths unquoted (core.quotePath=false, gitutil.HERMETIC).

Names. A commit keeps the file name its Fix-Id has in the existing series (the destination's, or,
for a new --out directory, the target's); a new Fix-Id gets NNNN-<fix-id>.patch with the next free
number; --renumber names every file NNNN-<Fix-Id>.patch by position. The series file keeps its
comment lines (the header at the top, comments before and on an entry's line go with that entry).
Files of the series directory that are not patches of the old series (a README, notes) are kept.

Transaction. For series directory D in parent P (the names below are siblings of D in P):
  1. lock P (flock on the directory: one export of a directory at a time) and recover (4.);
  2. compute every file into P/.D.kvforge-tmp-<pid>-<rand> (unchanged patches and the files kept
     are hard links to D's, so they keep bytes, mode and mtime), fsync, and lint it there with
     series.read_series: on any problem (or a commit without a valid Fix-Id, found before this
     step) it is deleted and D is untouched;
  3. rename it to P/.D.kvforge-new (from now on a complete series), then swap:
     - Linux: renameat2(RENAME_EXCHANGE) exchanges D and .D.kvforge-new in one step;
     - elsewhere, or where the file system refuses the exchange: rename D to P/.D.kvforge-old,
       then .D.kvforge-new to D;
     - D did not exist (a new --out): rename .D.kvforge-new to D;
     then rename the old contents to P/.D.kvforge-trash-<pid>-<rand> and delete them.
  4. recovery (every export, under the lock; readers can call recover_series_dir): if D is missing,
     rename .D.kvforge-new to D (roll forward), else .D.kvforge-old to D (roll back); then every
     other P/.D.kvforge-* is garbage: renamed to a trash name and deleted.

Invariants: .D.kvforge-new and .D.kvforge-old only ever name complete series directories, and
tmp-*/trash-* entries are garbage. D always names the complete old series (or nothing, for a new
--out) or the complete new one, except in the fallback's window between its two renames (no
RENAME_EXCHANGE), where D is absent and both complete versions exist under those fixed names,
which step 4 turns back into D. A SIGKILL at any step boundary (fsutil.crashpoint("export:<step>"),
see CRASH_STEPS) leaves nothing else.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import shutil
import sys
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from . import gitutil
from .errors import EXIT_ENV, EXIT_USAGE, KvforgeError
from .fsutil import crashpoint, file_lock
from .outcome import Done
from .report import table
from .series import FIX_ID_RE, parse_patch, read_series
from .engine import format_patch
from .trees import commits_since, resolve_from

# Step boundaries where $KVFORGE_CRASH_AT=<step> kills the export (tests); "swap-aside" is the fallback's.
CRASH_STEPS = ("locked", "staging", "staged", "ready", "swap-aside", "swapped", "cleanup", "done")

FILE_STATUSES = ("unchanged", "rewritten", "new", "removed")  # ExportedFile.status
_NUMBER_RE = re.compile(r"^(\d{4})-")


# ---------------------------------------------------------------- result


@dataclass
class ExportedFile:
    name: str
    fix_id: str
    status: str  # unchanged | rewritten | new | removed
    commit: str | None = None  # None for removed
    subject: str = ""
    old_name: str | None = None  # the name it had in the old series, when that differs (--renumber)


@dataclass
class ExportResult:
    target: str
    component: str
    directory: Path
    source: str  # which tree and branch/rev the commits came from
    repo: Path
    head: str
    base: str
    commits: list[str]
    files: list[ExportedFile] = field(default_factory=list)
    series_file: str = "unchanged"  # unchanged | rewritten | new
    compared_with: Path | None = None  # the old series the statuses refer to
    written: bool = False

    @property
    def shown(self) -> str:
        return _display(self.directory)

    def count(self, status: str) -> int:
        return sum(1 for f in self.files if f.status == status)

    def summary(self) -> str:
        n = len(self.commits)
        parts = [f"{n} patch" + ("" if n == 1 else "es")]
        parts += [f"{self.count(s)} {s}" for s in ("rewritten", "new", "removed", "unchanged") if self.count(s)]
        line = f"{self.shown}: {', '.join(parts)}"
        if not self.written:
            line += " (nothing written: the series already says this)"
        elif self.series_file != "unchanged" and not any(f.status != "unchanged" for f in self.files):
            line += f" (series file {self.series_file})"
        return line

    def to_json(self) -> dict:
        return {
            "target": self.target, "component": self.component, "directory": str(self.directory),
            "source": self.source, "repo": str(self.repo), "head": self.head, "base": self.base,
            "commits": list(self.commits),
            "files": [vars(f).copy() for f in self.files],
            "series_file": self.series_file,
            "compared_with": str(self.compared_with) if self.compared_with else None,
            "written": self.written, "summary": self.summary(),
        }


def _display(path: Path) -> str:
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return str(path)


# ---------------------------------------------------------------- export


@dataclass
class _Commit:
    sha: str
    raw: bytes
    fix_id: str
    subject: str


def export_target(ctx, out: Path | None = None, renumber: bool = False) -> ExportResult:
    """Export base..head of ctx's tree (ctx.from_rev, or the default tree) into the series directory."""
    base = ctx.base()
    repo, head, what = _source(ctx, base.commit)
    shas = commits_since(repo, base.commit, head, what)
    if not shas:
        raise KvforgeError(f"{what}: no commits on top of the base {base.commit[:12]}: nothing to export "
                           "(to empty the series, edit its `series` file)", EXIT_USAGE)
    commits = [_commit(repo, sha, what) for sha in shas]
    seen: dict[str, _Commit] = {}
    for c in commits:
        if c.fix_id in seen:
            raise KvforgeError(f"{what}: commits {seen[c.fix_id].sha[:12]} and {c.sha[:12]} both have Fix-Id "
                               f"{c.fix_id!r}; each fix is one commit (squash them, or give one a new Fix-Id)",
                               EXIT_USAGE)
        seen[c.fix_id] = c

    dest = Path(out).expanduser().resolve() if out else Path(ctx.component.series_dir).resolve()
    if dest.exists() and not dest.is_dir():
        raise KvforgeError(f"{_display(dest)} is not a directory", EXIT_USAGE)
    with _locked(dest, ctx.say):
        _recover(dest, ctx.say)
        crashpoint("export:locked")
        return _export_locked(ctx, dest, commits, renumber, repo, head, base.commit, what)


def _export_locked(ctx, dest: Path, commits: list[_Commit], renumber: bool, repo: Path, head: str, base: str,
                   what: str) -> ExportResult:
    own = _read_listing(dest)  # dest's own series, or None
    if own is None and dest.is_dir() and any(dest.iterdir()):
        raise KvforgeError(f"{_display(dest)} is not empty and has no `series` file; export into a series "
                           "directory or a new or empty one", EXIT_USAGE)
    ref_dir = dest if own is not None else Path(ctx.component.series_dir).resolve()
    ref = own if own is not None else _read_listing(ref_dir)
    result = ExportResult(ctx.target.name, ctx.component.name, dest, what, repo, head, base,
                          [c.sha for c in commits], compared_with=ref_dir if ref is not None else None)

    # Old series: Fix-Id -> (name, bytes), in series order.
    old_by_fix: dict[str, str] = {}
    old_raw: dict[str, bytes] = {}
    if ref is not None:
        for name in ref.names:
            path = ref_dir / name
            if "/" in name or not path.is_file():
                continue
            old_raw[name] = path.read_bytes()
            fid = parse_patch(path, old_raw[name]).value("Fix-Id")
            if fid and fid not in old_by_fix:
                old_by_fix[fid] = name
    managed = set(own.names) | {"series"} if own is not None else {"series"}
    kept = sorted(p.name for p in dest.iterdir() if p.name not in managed) if dest.is_dir() else []

    # Names.
    names: list[str] = []
    taken = set(kept) | set(ref.names if ref else [])
    if renumber:
        names = [f"{n:04d}-{c.fix_id}.patch" for n, c in enumerate(commits, 1)]
    else:
        numbers = [int(m.group(1)) for m in map(_NUMBER_RE.match, taken) if m]
        nxt = max(numbers, default=0) + 1
        for c in commits:
            if c.fix_id in old_by_fix:
                names.append(old_by_fix[c.fix_id])
            else:
                names.append(f"{nxt:04d}-{c.fix_id}.patch")
                nxt += 1
    for name in names:
        if name in kept:
            raise KvforgeError(f"{_display(dest / name)} is not in the series; export would overwrite it "
                               "(move it away first)", EXIT_USAGE)

    # Statuses, against the old series.
    used_old: set[str] = set()
    for c, name in zip(commits, names):
        old = old_by_fix.get(c.fix_id)
        if old is None:
            status = "new"
        else:
            used_old.add(old)
            status = "unchanged" if old == name and old_raw[old] == c.raw else "rewritten"
        result.files.append(ExportedFile(name, c.fix_id, status, c.sha, c.subject,
                                         old_name=old if old not in (None, name) else None))
    for name in (ref.names if ref else []):
        if name not in used_old:
            fid = parse_patch(ref_dir / name, old_raw[name]).value("Fix-Id") if name in old_raw else None
            result.files.append(ExportedFile(name, fid or "", "removed"))

    series_text = _series_text(ref, names, {f.name: f.old_name or f.name for f in result.files
                                            if f.status in ("unchanged", "rewritten")})
    series_bytes = series_text.encode("utf-8")
    if own is None:
        result.series_file = "new"
    elif (dest / "series").read_bytes() != series_bytes:
        result.series_file = "rewritten"

    # Nothing to do when dest already holds exactly these bytes under these names.
    if own is not None and result.series_file == "unchanged" and set(own.names) == set(names) and all(
            (dest / n).is_file() and (dest / n).read_bytes() == c.raw for n, c in zip(names, commits)):
        return result

    _write(dest, commits, names, series_bytes, kept, result)
    result.written = True
    return result


def _commit(repo: Path, sha: str, what: str) -> _Commit:
    raw = format_patch(repo, sha)
    p = parse_patch(Path("commit.patch"), raw)
    subject = p.subject
    if not raw.strip() or not p.diff_line:
        subject = subject or gitutil.run(repo, "log", "-1", "--format=%s", sha).stdout.strip()
        raise KvforgeError(f"{what}: commit {sha[:12]} ({subject}) changes nothing; a patch must change a file "
                           "(drop the commit)", EXIT_USAGE)
    fix_ids = [v.strip() for v in p.values("Fix-Id")]
    if not fix_ids or not FIX_ID_RE.match(fix_ids[0]):
        got = f"its Fix-Id {fix_ids[0]!r} is not a lowercase slug" if fix_ids else "it has no 'Fix-Id:' trailer"
        raise KvforgeError(f"{what}: commit {sha[:12]} ({subject}): {got} in the header block at the end of its "
                           "message (docs/patch-format.md); nothing was written", EXIT_USAGE)
    return _Commit(sha, raw, fix_ids[0], subject)


def _source(ctx, base_commit: str) -> tuple[Path, str, str]:
    """(repository, head commit, how to name it in messages) of the tree to export."""
    if ctx.from_rev:
        repo, head = resolve_from(ctx.from_rev)
        return repo, head, f"--from {ctx.from_rev}"
    branch = ctx.branch
    cwd = Path.cwd()
    top = gitutil.run(cwd, "rev-parse", "--show-toplevel", check=False)
    if top.returncode == 0:
        repo = Path(top.stdout.strip())
        if gitutil.run(repo, "cat-file", "-e", f"{base_commit}^{{commit}}", check=False).returncode == 0:
            return repo, _branch_head(repo, branch), f"branch {branch} of {_display(repo) or '.'}"
    default = cwd / f"{ctx.component.name}-{ctx.target.name}"
    if default.is_dir():
        top = gitutil.run(default, "rev-parse", "--show-toplevel", check=False)
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != default.resolve():
            raise KvforgeError(f"{_display(default)} is not a git repository; point at your tree with --from DIR "
                               "(or DIR:REV)", EXIT_USAGE)
        return default.resolve(), _branch_head(default, branch), f"branch {branch} of {_display(default)}"
    raise KvforgeError(f"no tree to export: the repository here does not contain the base {base_commit[:12]} of "
                       f"{ctx.label} and ./{default.name} does not exist; point at your tree with --from DIR "
                       f"(or DIR:REV), or make one with `kvforge apply -t {ctx.target.name}`", EXIT_USAGE)


def _branch_head(repo: Path, branch: str) -> str:
    head = gitutil.rev_parse(repo, f"refs/heads/{branch}^{{commit}}")
    if not head:
        raise KvforgeError(f"{_display(repo) or '.'} has no branch {branch}; name the commits with --from REV "
                           "(or DIR:REV)", EXIT_USAGE)
    return head


# ---------------------------------------------------------------- the series file


@dataclass
class _Entry:
    name: str
    line: str
    before: list[str]  # comment and blank lines right above it


@dataclass
class _Listing:
    header: list[str]
    entries: list[_Entry]
    trailer: list[str]

    @property
    def names(self) -> list[str]:
        seen: list[str] = []
        for e in self.entries:
            if e.name not in seen:
                seen.append(e.name)
        return seen


def _read_listing(directory: Path) -> _Listing | None:
    """The series file's structure (read_series' syntax: '#' starts a comment), or None without one."""
    path = directory / "series"
    if not path.is_file():
        return None
    header: list[str] | None = None
    pending: list[str] = []
    entries: list[_Entry] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        name = line.split("#", 1)[0].strip()
        if not name:
            pending.append(line)
            continue
        if header is None:
            header, pending = pending, []
        entries.append(_Entry(name, line, pending))
        pending = []
    if header is None:
        header, pending = pending, []
    return _Listing(header, entries, pending)


def _series_text(ref: _Listing | None, names: list[str], old_name_of: dict[str, str]) -> str:
    """The new series file: the old header, each kept entry with its comments (renamed if need be), new
    entries bare, the old trailing lines. Comments above a removed entry move to the next kept one."""
    if ref is None:
        return "".join(f"{n}\n" for n in names)
    kept_old = set(old_name_of.values())
    entry_of: dict[str, _Entry] = {}
    carry: list[str] = []
    for e in ref.entries:
        if e.name in kept_old and e.name not in entry_of:
            entry_of[e.name] = _Entry(e.name, e.line, carry + e.before)
            carry = []
        else:
            carry = carry + e.before
    lines = list(ref.header)
    for name in names:
        e = entry_of.get(old_name_of.get(name, ""))
        if e is None:
            lines.append(name)
            continue
        lines += e.before
        lines.append(e.line if e.name == name else e.line.replace(e.name, name, 1))
    lines += carry + ref.trailer
    return "".join(f"{ln}\n" for ln in lines)


# ---------------------------------------------------------------- the transaction


def _sibling(dest: Path, what: str) -> Path:
    return dest.parent / f".{dest.name}.kvforge-{what}"


def _write(dest: Path, commits: list[_Commit], names: list[str], series_bytes: bytes, kept: list[str],
           result: ExportResult) -> None:
    parent = dest.parent
    made = _make_parents(parent)
    tmp = _sibling(dest, f"tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(tmp)
        if dest.is_dir():
            os.chmod(tmp, dest.stat().st_mode & 0o7777)
        first = True
        for c, name in zip(commits, names):
            old = dest / name
            if old.is_file() and not old.is_symlink() and old.read_bytes() == c.raw:
                _link_or_copy(old, tmp / name)
            else:
                _write_file(tmp / name, c.raw)
            if first:
                crashpoint("export:staging")
                first = False
        if (dest / "series").is_file() and (dest / "series").read_bytes() == series_bytes:
            _link_or_copy(dest / "series", tmp / "series")
        else:
            _write_file(tmp / "series", series_bytes)
        for name in kept:
            _copy_entry(dest / name, tmp / name)
        _fsync_dir(tmp)
        _lint(tmp, dest, dict(zip(names, commits)))
    except BaseException as exc:
        _discard(tmp)
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:
                pass
        if isinstance(exc, OSError):
            raise _cannot_write(dest, exc) from None
        raise
    crashpoint("export:staged")
    new = _sibling(dest, "new")
    try:
        os.rename(tmp, new)
        _fsync_dir(parent)
        crashpoint("export:ready")
        old = _swap(new, dest)
    except OSError as exc:
        _discard(tmp)
        if new.exists():
            _retire(dest, new)
        raise _cannot_write(dest, exc) from None
    _fsync_dir(parent)
    crashpoint("export:swapped")
    if old is None:
        crashpoint("export:cleanup")
    else:
        _retire(dest, old, crash_step="export:cleanup")
    crashpoint("export:done")


def _swap(new: Path, dest: Path) -> Path | None:
    """Put `new` in place of `dest`; return where the old contents are now (None: there were none)."""
    if not dest.exists():
        os.rename(new, dest)
        return None
    if _exchange(new, dest):
        return new  # it holds the old contents now
    old = _sibling(dest, "old")
    os.rename(dest, old)
    crashpoint("export:swap-aside")
    try:
        os.rename(new, dest)
    except OSError:
        os.rename(old, dest)  # put the old series back before reporting
        raise
    return old


def _cannot_write(dest: Path, exc: OSError) -> KvforgeError:
    where = exc.filename or dest
    return KvforgeError(f"cannot write the series {_display(dest)} ({where}): {exc.strerror or exc}; "
                        "nothing was changed", EXIT_ENV)


def _lint(tmp: Path, dest: Path, by_name: dict[str, _Commit]) -> None:
    problems = read_series(tmp).all_problems()
    if not problems:
        return
    first = problems[0]
    where = f"{_display(dest / first.path.name)}" + (f":{first.line}" if first.line else "")
    c = by_name.get(first.path.name)
    whose = f" (commit {c.sha[:12]} {c.subject})" if c else ""
    more = f"; and {len(problems) - 1} more" if len(problems) > 1 else ""
    raise KvforgeError(f"export refused, nothing written: {where}: {first.message}{whose}{more}", EXIT_USAGE)


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


def _fsync_dir(path: Path) -> None:
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


def _discard(path: Path, crash_step: str | None = None) -> None:
    """Delete a leftover directory (or file); `crash_step` fires after its first entry is gone."""
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
        if n == 0 and crash_step:
            crashpoint(crash_step)
    shutil.rmtree(path, ignore_errors=True)


# RENAME_EXCHANGE: Linux >= 3.15, glibc >= 2.28 has renameat2(). Elsewhere the two-rename fallback.
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
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
def _locked(dest: Path, say) -> Iterator[None]:
    """One export (or recovery) of `dest` at a time: flock on its parent directory."""
    probe = dest.parent
    while not probe.exists():  # a new --out: lock the nearest existing ancestor
        probe = probe.parent
    try:
        fd = os.open(probe, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        raise _cannot_write(dest, exc) from None
    try:
        flocked = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another kvforge that is exporting into {_display(probe)}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # no flock on a directory here (NFS): a lock file beside the series instead
            flocked = False
        if flocked:
            yield
        else:
            with file_lock(probe / f".{dest.name}.kvforge.lock", say, _display(dest)):
                yield
    finally:
        os.close(fd)  # releases the lock


def _recover(dest: Path, say=lambda _m: None) -> None:
    parent = dest.parent
    if not parent.is_dir():
        return
    new, old = _sibling(dest, "new"), _sibling(dest, "old")
    if not dest.exists():  # the swap died between its renames (or a new --out's rename): finish it
        for staged, how in ((new, "finished"), (old, "rolled back")):
            if staged.is_dir():
                os.rename(staged, dest)
                _fsync_dir(parent)
                say(f"{_display(dest)}: {how} an export that was interrupted while swapping the series in")
                break
    for name in sorted(os.listdir(parent)):
        if name.startswith(f".{dest.name}.kvforge-"):
            _retire(dest, parent / name)


def _retire(dest: Path, path: Path, crash_step: str | None = None) -> None:
    """Delete a leftover. .new and .old are first renamed to a trash name, so that those two names
    only ever hold complete series directories (recovery may move them into place)."""
    if not path.name.startswith((f".{dest.name}.kvforge-tmp-", f".{dest.name}.kvforge-trash-")):
        trash = _sibling(dest, f"trash-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.rename(path, trash)
        path = trash
    _discard(path, crash_step)


def recover_series_dir(directory: Path) -> None:
    """Finish or undo an export that was killed (see the module docstring); cheap when there is nothing to do.

    For readers of a series: only needed when `directory` is missing (the fallback's window).
    """
    directory = Path(directory).resolve()
    parent = directory.parent
    if not parent.is_dir() or not any(n.startswith(f".{directory.name}.kvforge-") for n in os.listdir(parent)):
        return
    with _locked(directory, lambda _m: None):
        _recover(directory)


def export_command(ctx, out: Path | None = None, renumber: bool = False) -> Done:
    """`kvforge export`: one row per patch file (its Fix-Id and what happened to it), then the summary."""
    result = export_target(ctx, out=out, renumber=renumber)
    return Done(result.to_json(), table(["patch", "fix-id", "file"], [[e.name, e.fix_id, e.status] for e in result.files])
                + "\n" + result.summary())
