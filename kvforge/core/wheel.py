"""Wheels as zip files, read and written member by member without recompressing what does not change.

`zipfile` can only add a member by compressing it again; recompressing the 546 MB inside vLLM's
244 MB wheel is what makes `wheel unpack` + `wheel pack` take ~29 s. Here an unchanged member is
copied as it is stored: its local file header, compressed data and data descriptor go to the new
file byte for byte (`os.copy_file_range` where the kernel has it), and its central directory record
is the original one with only the offset of its local header rewritten. New or changed members
are written STORED (not deflated), so their bytes do not depend on the zlib a machine has
(zlib and zlib-ng deflate the same input differently): the output is a function of the input
bytes, the new members and their order, on every machine.

Reading is strict, since a wheel's names become paths on install (zip-slip): no absolute names,
no `..`, no backslashes or drive letters, no symbolic links, no duplicate names, local headers
that agree with the central directory, no encryption, no multi-disk archives and no zip64 (vLLM's
wheels need none; refusing is simpler than getting it half right).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import mmap
import os
import queue
import stat
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable

from kvforge.core.errors import EXIT_USAGE, KvforgeError

LOCAL = struct.Struct("<4sHHHHHIIIHH")  # local file header, 30 bytes
CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")  # central directory header, 46 bytes
EOCD = struct.Struct("<4sHHHHIIH")  # end of central directory record, 22 bytes
SIG_LOCAL, SIG_CENTRAL, SIG_EOCD = b"PK\x03\x04", b"PK\x01\x02", b"PK\x05\x06"
SIG_DESCRIPTOR, SIG_ZIP64_LOCATOR = b"PK\x07\x08", b"PK\x06\x07"
FLAG_ENCRYPTED, FLAG_DESCRIPTOR, FLAG_UTF8 = 0x1, 0x8, 0x800
MAX16, MAX32 = 0xFFFF, 0xFFFFFFFF
MADE_BY_UNIX = 3 << 8 | 20  # version made by: unix, zip 2.0


class WheelError(KvforgeError):
    """A wheel kvforge will not read or write (unsafe names, zip64, inconsistent headers)."""

    def __init__(self, message: str):
        super().__init__(message, EXIT_USAGE)


@dataclass(slots=True)
class Member:
    """One entry of a zip file, as its central directory describes it."""

    name: str
    raw_name: bytes
    central: bytes  # the whole central directory record (header, name, extra, comment)
    offset: int  # of its local file header
    flags: int
    method: int
    crc: int
    compress_size: int
    file_size: int
    external_attr: int
    dos_time: int
    dos_date: int

    @property
    def is_dir(self) -> bool:
        return self.name.endswith("/")

    @property
    def mode(self) -> int:
        return self.external_attr >> 16


def safe_name(name: str) -> str | None:
    """Why `name` is not a safe relative member name (None when it is)."""
    s = name.rstrip("/")  # the fast path: no backslash or NUL, no drive letter, no empty, '.' or '..' component
    if s and s[0] not in "/." and "\\" not in s and "\x00" not in s and name[1:2] != ":" and "//" not in s \
            and "/." not in s:
        return None
    if not name or "\x00" in name:
        return "an empty name or a NUL byte"
    if "\\" in name:
        return "a backslash"
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return "an absolute path"
    parts = name.rstrip("/").split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "an empty, '.' or '..' path component"
    return None


def check_name(name: str, where: str) -> None:
    why = safe_name(name)
    if why:
        raise WheelError(f"{where}: member {name!r} has {why}; refusing it (zip-slip)")


def read_members(path: Path) -> list[Member]:
    """The central directory of `path`, checked (see the module docstring)."""
    where = Path(path).name
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        tail_len = min(size, EOCD.size + MAX16)
        fh.seek(size - tail_len)
        tail = fh.read(tail_len)
        at = tail.rfind(SIG_EOCD)
        if at < 0 or at + EOCD.size > len(tail):
            raise WheelError(f"{where}: not a zip file (no end of central directory record)")
        _sig, disk, cd_disk, n_disk, n_total, cd_size, cd_offset, comment_len = EOCD.unpack_from(tail, at)
        if tail[max(at - 20, 0):at - 16] == SIG_ZIP64_LOCATOR or MAX16 in (n_disk, n_total) or MAX32 in (cd_size, cd_offset):
            raise WheelError(f"{where}: a zip64 archive; kvforge reads and writes plain zip only")
        if disk or cd_disk or n_disk != n_total:
            raise WheelError(f"{where}: a multi-disk zip archive")
        eocd_at = size - tail_len + at
        if cd_offset + cd_size > eocd_at:
            raise WheelError(f"{where}: the central directory lies outside the file (truncated?)")
        fh.seek(cd_offset)
        cd = fh.read(cd_size)
        members: list[Member] = []
        seen: set[str] = set()
        pos = 0
        for _ in range(n_total):
            if cd[pos:pos + 4] != SIG_CENTRAL:
                raise WheelError(f"{where}: corrupt central directory at entry {len(members) + 1}")
            (_s, _made, _need, flags, method, dos_time, dos_date, crc, csize, usize, nlen, xlen, clen, _disk,
             _iattr, eattr, offset) = CENTRAL.unpack_from(cd, pos)
            end = pos + CENTRAL.size + nlen + xlen + clen
            raw_name = cd[pos + CENTRAL.size:pos + CENTRAL.size + nlen]
            name = raw_name.decode("utf-8" if flags & FLAG_UTF8 else "cp437")
            check_name(name, where)
            if flags & FLAG_ENCRYPTED:
                raise WheelError(f"{where}: member {name} is encrypted")
            if csize == MAX32 or usize == MAX32 or offset == MAX32:
                raise WheelError(f"{where}: member {name} needs zip64; kvforge reads plain zip only")
            if stat.S_ISLNK(eattr >> 16):
                raise WheelError(f"{where}: member {name} is a symbolic link; refusing it (zip-slip)")
            if name in seen:
                raise WheelError(f"{where}: member {name} appears twice")
            seen.add(name)
            members.append(Member(name, raw_name, cd[pos:end], offset, flags, method, crc, csize, usize, eattr,
                                  dos_time, dos_date))
            pos = end
        if pos != len(cd):
            raise WheelError(f"{where}: the central directory has bytes past its {n_total} entries")
    return members


def _local_span(buf, m: Member, where: str) -> tuple[int, int]:
    """(start, length) of the member's local header + data (+ descriptor) in `buf` (the whole zip file, an
    mmap), checked against the central record."""
    head = buf[m.offset:m.offset + LOCAL.size]
    if len(head) != LOCAL.size or head[:4] != SIG_LOCAL:
        raise WheelError(f"{where}: member {m.name}: no local file header at offset {m.offset}")
    _s, _need, flags, method, _t, _d, crc, csize, usize, nlen, xlen = LOCAL.unpack(head)
    if buf[m.offset + LOCAL.size:m.offset + LOCAL.size + nlen] != m.raw_name:
        raise WheelError(f"{where}: member {m.name}: its local header names another file")
    if method != m.method or (flags & FLAG_DESCRIPTOR) != (m.flags & FLAG_DESCRIPTOR):
        raise WheelError(f"{where}: member {m.name}: local header and central directory disagree")
    if not flags & FLAG_DESCRIPTOR and (crc, csize, usize) != (m.crc, m.compress_size, m.file_size):
        raise WheelError(f"{where}: member {m.name}: local header and central directory disagree on size or CRC")
    data_end = m.offset + LOCAL.size + nlen + xlen + m.compress_size
    end = data_end
    if flags & FLAG_DESCRIPTOR:
        desc = buf[data_end:data_end + 16]
        with_sig = len(desc) >= 8 and desc[:4] == SIG_DESCRIPTOR and struct.unpack_from("<I", desc, 4)[0] == m.crc
        end += 16 if with_sig else 12
    if end > len(buf):
        raise WheelError(f"{where}: member {m.name}: its data runs past the end of the file (truncated?)")
    return m.offset, end - m.offset


def local_spans(path: Path, members: list[Member]) -> dict[str, tuple[int, int]]:
    """{name: (start, length)} of each member's local header, data and descriptor in `path`, each local header
    checked against the central directory (what RawZipWriter.copy checks, done ahead)."""
    where = Path(path).name
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return {m.name: _local_span(buf, m, where) for m in members}


def read_member(path: Path, m: Member) -> bytes:
    """The uncompressed bytes of one member (CRC-checked)."""
    with open(path, "rb") as fh:
        fh.seek(m.offset)
        head = fh.read(LOCAL.size)
        nlen, xlen = LOCAL.unpack(head)[-2:]
        fh.seek(m.offset + LOCAL.size + nlen + xlen)
        raw = fh.read(m.compress_size)
    if m.method == 0:
        data = raw
    elif m.method == 8:
        data = zlib.decompress(raw, -15)
    else:
        raise WheelError(f"{Path(path).name}: member {m.name} uses compression method {m.method}")
    if zlib.crc32(data) != m.crc or len(data) != m.file_size:
        raise WheelError(f"{Path(path).name}: member {m.name} is corrupt (CRC or size mismatch)")
    return data


def dos_datetime(date_time: tuple[int, int, int, int, int, int]) -> tuple[int, int]:
    y, mo, d, h, mi, s = date_time
    return (h << 11) | (mi << 5) | (s // 2), ((y - 1980) << 9) | (mo << 5) | d


def date_time_of(m: Member) -> tuple[int, int, int, int, int, int]:
    return ((m.dos_date >> 9) + 1980, (m.dos_date >> 5) & 0xF, m.dos_date & 0x1F,
            m.dos_time >> 11, (m.dos_time >> 5) & 0x3F, (m.dos_time & 0x1F) * 2)


class RawZipWriter:
    """Write a zip file from raw copies of another zip's members and new STORED members.

    Every member's place in the output is fixed when it is added (self.pos), so the bytes do not depend on
    when they are written: copies of members that lie one after another in the source are merged into one
    range that the kernel copies (`os.copy_file_range`, at explicit offsets); a range of BIG bytes or more
    (vLLM's .so files: 3 ranges hold 96% of its wheel) is copied by a thread while the caller goes on, the
    rest at once (a thread for every range was no faster: it waited for the GIL between ranges); new members
    are written at their place (`os.pwrite`). close() waits for the copies and writes the central directory.
    Use it as a context manager (or call abort()) so a failure stops the thread and closes the mmaps.
    """

    BIG = 1 << 20

    def __init__(self, out):
        out.flush()
        self.out = out
        self.fd = out.fileno()
        self.central: list[bytes] = []
        self.names: set[str] = set()
        self.pending: tuple[BinaryIO, int, int, int] | None = None  # (source file, start, length, output offset)
        self.pos = out.tell()
        self.views: dict[int, tuple[BinaryIO, mmap.mmap]] = {}  # id(source file) -> (it, an mmap of it)
        self.copier: _Copier | None = None

    def __enter__(self) -> "RawZipWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.abort()

    def _start(self, name: str, checked: bool = False) -> int:
        if not checked:
            check_name(name, "output")
        if name in self.names:
            raise WheelError(f"output: member {name} written twice")
        self.names.add(name)
        if self.pos > MAX32:
            raise WheelError("output: past 4 GiB; kvforge writes plain zip only")
        return self.pos

    def _view(self, src_fh) -> mmap.mmap:
        entry = self.views.get(id(src_fh))
        if entry is None or entry[0] is not src_fh:
            entry = self.views[id(src_fh)] = (src_fh, mmap.mmap(src_fh.fileno(), 0, access=mmap.ACCESS_READ))
        return entry[1]

    def _flush(self) -> None:
        if self.pending:
            src, start, length, at = self.pending
            self.pending = None
            if length < self.BIG:
                _copy_range(src.fileno(), start, length, at, self.fd)
                return
            if self.copier is None:
                self.copier = _Copier(self.fd)
                self.copier.start()
            self.copier.submit(src.fileno(), start, length, at)

    def flush(self) -> None:
        """Copy what is pending now (copies are merged until a member that does not follow)."""
        self._flush()

    def copy(self, src_fh, m: Member, where: str, span: tuple[int, int] | None = None) -> None:
        """Copy member `m` (from read_members: its name is checked) of the open file `src_fh` as it is stored;
        `span`: its local_spans entry, when the caller has them."""
        offset = self._start(m.name, checked=True)
        start, length = span or _local_span(self._view(src_fh), m, where)
        p = self.pending
        if p and p[0] is src_fh and p[1] + p[2] == start:
            self.pending = (src_fh, p[1], p[2] + length, p[3])
        else:
            self._flush()
            self.pending = (src_fh, start, length, offset)
        self.pos += length
        self.central.append(m.central[:42] + struct.pack("<I", offset) + m.central[46:])

    def add(self, name: str, data: bytes, date_time: tuple[int, int, int, int, int, int], mode: int = 0o644) -> None:
        """A new member, STORED, with a fixed time and `mode` (a regular file)."""
        self._flush()
        offset = self._start(name)
        raw_name = name.encode("utf-8")
        flags = 0 if raw_name.isascii() else FLAG_UTF8
        dtime, ddate = dos_datetime(date_time)
        crc = zlib.crc32(data)
        head = LOCAL.pack(SIG_LOCAL, 20, flags, 0, dtime, ddate, crc, len(data), len(data), len(raw_name), 0)
        _pwrite_all(self.fd, head + raw_name, offset)
        _pwrite_all(self.fd, data, offset + len(head) + len(raw_name))
        attr = (stat.S_IFREG | (mode & 0o7777)) << 16
        self.pos = offset + len(head) + len(raw_name) + len(data)
        self.central.append(CENTRAL.pack(SIG_CENTRAL, MADE_BY_UNIX, 20, flags, 0, dtime, ddate, crc, len(data),
                                         len(data), len(raw_name), 0, 0, 0, 0, attr, offset) + raw_name)

    def close(self) -> None:
        """The last copies, then the central directory and its end record."""
        try:
            self._flush()
            if self.copier is not None:
                self.copier.finish()
            if len(self.central) >= MAX16:
                raise WheelError("output: 65535 members or more; kvforge writes plain zip only")
            cd_offset = self.pos
            cd = b"".join(self.central)
            if cd_offset > MAX32 or len(cd) > MAX32:
                raise WheelError("output: past 4 GiB; kvforge writes plain zip only")
            n = len(self.central)
            cd += EOCD.pack(SIG_EOCD, 0, 0, n, n, len(cd), cd_offset, 0)
            _pwrite_all(self.fd, cd, cd_offset)
            self.out.seek(cd_offset + len(cd))
        finally:
            self.abort()

    def abort(self) -> None:
        """Stop copying (what is queued is dropped) and release the sources' mmaps; the output is left as it
        is: incomplete unless close() ran."""
        if self.copier is not None:
            self.copier.finish(raise_error=False)
        for _fh, view in self.views.values():
            view.close()
        self.views.clear()


class _Copier(threading.Thread):
    """Copies (source fd, start, length, output offset) ranges into the output fd, in order, off the caller's
    thread (the kernel copies, the GIL released). The first error stops it; finish() raises it."""

    def __init__(self, out_fd: int):
        super().__init__(daemon=True, name="kvforge-zip-copy")
        self.out_fd = out_fd
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.cancelled = False

    def submit(self, src_fd: int, start: int, length: int, at: int) -> None:
        if self.error is not None:
            self.finish()  # raises it: the caller stops adding
        self.jobs.put((src_fd, start, length, at))

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if self.error is None and not self.cancelled:
                src_fd, start, length, at = job
                try:
                    _copy_range(src_fd, start, length, at, self.out_fd)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller by finish()
                    self.error = exc

    def finish(self, raise_error: bool = True) -> None:
        if self.is_alive():
            self.cancelled = not raise_error
            self.jobs.put(None)
            self.join()
        if raise_error and self.error is not None:
            error, self.error = self.error, None
            raise error


def _pwrite_all(fd: int, data: bytes, at: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n


def _copy_range(src_fd: int, start: int, length: int, dst_pos: int, dst_fd: int) -> None:
    """Copy `length` bytes at `start` of src_fd to `dst_pos` of dst_fd (file positions untouched)."""
    copy = getattr(os, "copy_file_range", None)
    if copy is not None:
        try:
            while length:
                n = copy(src_fd, dst_fd, length, start, dst_pos)
                if n == 0:
                    raise WheelError("input: ended before a member's data (truncated?)")
                start, length, dst_pos = start + n, length - n, dst_pos + n
            return
        except OSError:  # not supported between these files: fall back to read/write from where it stopped
            pass
    while length:
        chunk = os.pread(src_fd, min(length, 1 << 22), start)
        if not chunk:
            raise WheelError("input: ended before a member's data (truncated?)")
        _pwrite_all(dst_fd, chunk, dst_pos)
        start, length, dst_pos = start + len(chunk), length - len(chunk), dst_pos + len(chunk)


# ---------------------------------------------------------------- RECORD

def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def parse_record(text: str, where: str) -> dict[str, tuple[str, str]]:
    """RECORD -> {path: (hash, size)}; paths are checked like member names."""
    rows: Iterable[list[str]]
    if '"' in text or "\r" in text:  # quoted fields or CR line ends: the csv module's reading
        rows = csv.reader(io.StringIO(text, newline=""))
    else:  # no quoting: csv would split each line at its commas
        rows = (line.split(",") for line in text.split("\n") if line)
    try:
        return _record_rows(rows, where)
    except csv.Error as exc:
        raise WheelError(f"{where}: RECORD is not CSV ({exc})") from None


def _record_rows(rows: Iterable[list[str]], where: str) -> dict[str, tuple[str, str]]:
    out: dict[str, tuple[str, str]] = {}
    for row in rows:
        if not row:
            continue
        if len(row) != 3:
            raise WheelError(f"{where}: RECORD line {row!r} does not have 3 fields")
        path, digest, size = row
        if not path.startswith("../"):  # pip writes installed scripts as ../../bin/NAME
            check_name(path, f"{where} RECORD")
        out[path] = (digest, size)
    return out


def format_record(rows: list[tuple[str, str, str]]) -> bytes:
    """RECORD's text as csv.writer (lineterminator "\n") writes it; rows with nothing to quote are joined."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    lines = []
    for row in rows:
        line = ",".join(row)
        if len(row) > 1 and line.count(",") == len(row) - 1 and '"' not in line and "\n" not in line \
                and "\r" not in line:
            lines.append(line + "\n")
        else:
            buf.seek(0)
            buf.truncate()
            w.writerow(row)
            lines.append(buf.getvalue())
    return "".join(lines).encode("utf-8")


def wheel_sort_key(name: str, dist_info: str) -> tuple:
    """Package files by name, then the .dist-info directory, RECORD last (as wheel builders do)."""
    in_info = name.startswith(dist_info + "/")
    return (in_info, name == f"{dist_info}/RECORD", name)
