"""The package index: the one place kvforge asks it anything, and what it reads there.

The index is PyPI, or `$KVFORGE_PYPI_URL` (an http(s):// or file:// URL serving the same shape). kvforge
reads Warehouse's JSON API, `{index}/pypi/<package>/json`: one document per package with every release and
its files (filename, url, sha256, size, package type, upload time, yanked, requires-python). Not the
standard simple API (PEP 691 JSON, e.g. the `pypi-simple` client): it lists files, not releases (a
version would be parsed back out of each file name, and a release listed without files, which kvforge
reports, is not there), it needs content negotiation that a file:// index cannot do (the tests' indexes
and a mirror on disk are file:// or http.server), and `pypi-simple` pulls in `requests`, whose import
every command importing this module would pay (kvforge imports at the top of its modules).

Questions asked (one function each): a package's releases with their files (`releases`), one release's
files in the index's own shape (`release_files`, what the sdist, wheel and rebase pins read), the versions
that have files (`release_versions`), and a file downloaded and checked against its pinned sha256
(`download_pinned`).

Invariants:
- every field kvforge reads is type-checked when the document is loaded: a wrong type is one line naming
  the URL and the field (`releases["0.21.0"][0].digests is a string, not an object`), exit 6, before any
  caller sees the document; a field that is missing or null is unknown (None), except `filename`;
- `$KVFORGE_OFFLINE` set: no request is made at all; each question is refused with one line
  "offline ($KVFORGE_OFFLINE=1): <what it would fetch>", exit 6 (callers that keep a cached answer, such as a
  downloaded sdist, check it first); a file:// index (a mirror in a directory) is still read: that is no request;
- every request has a timeout; a network failure is one line naming the URL and the reason, exit 6;
- a downloaded file gets its final name only complete and matching its sha256 (written as
  .<name>.<pid>.part beside it, which fsutil.remove_stale sweeps once that pid is dead).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from kvforge.core.cache import write_error
from kvforge.core.errors import EXIT_NETWORK, KvforgeError
from kvforge.core.fsutil import crashpoint

Progress = Callable[[str], None]

INDEX_TIMEOUT = 60.0  # seconds for the JSON document (connect, and each read)
DOWNLOAD_TIMEOUT = 120.0  # seconds per read of a file


def pypi_url() -> str:
    """The package index's base URL: $KVFORGE_PYPI_URL, else https://pypi.org (no trailing slash)."""
    return os.environ.get("KVFORGE_PYPI_URL", "https://pypi.org").rstrip("/")


def offline() -> bool:
    """$KVFORGE_OFFLINE set: the index is never asked."""
    return bool(os.environ.get("KVFORGE_OFFLINE"))


def refuse_offline(what: str, url: str) -> None:
    """Raise the offline refusal (exit 6) naming `what` would be fetched from `url`, when $KVFORGE_OFFLINE is set
    (a file:// URL is a directory on this machine, a mirror of the index: reading it is no request)."""
    if offline() and urllib.parse.urlsplit(url).scheme != "file":
        raise KvforgeError(f"offline ($KVFORGE_OFFLINE=1): {what}", EXIT_NETWORK)


@dataclass(frozen=True)
class IndexFile:
    """One file of a release, as the index lists it (every field type-checked; None: not listed)."""

    filename: str
    url: str | None  # absolute (a relative url is resolved against the document's URL)
    sha256: str | None
    size: int | None
    packagetype: str | None  # "sdist", "bdist_wheel"
    uploaded: str | None  # upload_time_iso_8601, else upload_time
    yanked: bool
    requires_python: str | None

    def as_json(self) -> dict:
        """The entry in Warehouse's shape (what release_files' callers read), its fields those checked."""
        out: dict = {"filename": self.filename, "yanked": self.yanked}
        for key, value in (("url", self.url), ("size", self.size), ("packagetype", self.packagetype),
                           ("upload_time_iso_8601", self.uploaded), ("requires_python", self.requires_python)):
            if value is not None:
                out[key] = value
        if self.sha256 is not None:
            out["digests"] = {"sha256": self.sha256}
        return out


@dataclass(frozen=True)
class Releases:
    """A package's releases on the index: version -> its files, in the index's order."""

    package: str
    url: str  # the JSON document read
    files: dict[str, tuple[IndexFile, ...]]


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object" if isinstance(value, dict) else type(value).__name__


def _bad(url: str, where: str, value: object, want: str) -> KvforgeError:
    return KvforgeError(f"the package index {url}: {where} is {_kind(value)}, not {want}", EXIT_NETWORK)


def _optional(url: str, where: str, entry: dict, key: str, kind: type, want: str) -> object:
    """entry[key] when it is a `kind` (None: missing or null); any other type is exit 6 naming the field."""
    value = entry.get(key)
    if value is None:
        return None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _bad(url, f"{where}.{key}", value, want)
    return value


def _text(url: str, where: str, entry: dict, key: str) -> str | None:
    value = _optional(url, where, entry, key, str, "a string")
    return value if isinstance(value, str) and value else None


def _file(url: str, where: str, entry: object) -> IndexFile:
    """One file entry, every field kvforge reads checked (wrong type: exit 6 naming `where`)."""
    if not isinstance(entry, dict):
        raise _bad(url, where, entry, "an object")
    filename = entry.get("filename")
    if not isinstance(filename, str) or not filename:
        raise _bad(url, f"{where}.filename", filename, "a file name")
    digests = _optional(url, where, entry, "digests", dict, "an object")
    sha = _text(url, f"{where}.digests", digests, "sha256") if isinstance(digests, dict) else None
    link = _text(url, where, entry, "url")
    size = _optional(url, where, entry, "size", int, "a whole number")
    if isinstance(size, int) and size < 0:
        raise KvforgeError(f"the package index {url}: {where}.size is negative ({size})", EXIT_NETWORK)
    iso, plain = _text(url, where, entry, "upload_time_iso_8601"), _text(url, where, entry, "upload_time")
    return IndexFile(filename=filename, url=urllib.parse.urljoin(url, link) if link else None,
                     sha256=sha.lower() if sha else None, size=size if isinstance(size, int) else None,
                     packagetype=_text(url, where, entry, "packagetype"), uploaded=iso or plain,
                     yanked=_optional(url, where, entry, "yanked", bool, "true/false") is True,
                     requires_python=_text(url, where, entry, "requires_python"))


def parse_releases(package: str, url: str, meta: object) -> Releases:
    """The releases of Warehouse's JSON document `meta` (read from `url`), every field checked."""
    if not isinstance(meta, dict):
        raise _bad(url, "the document", meta, "an object")
    table = meta.get("releases")
    if not isinstance(table, dict):
        raise KvforgeError(f"the package index {url}: \"releases\" is {_kind(table)}, not an object (not PyPI's "
                           "JSON API?)", EXIT_NETWORK)
    out: dict[str, tuple[IndexFile, ...]] = {}
    for version, entries in table.items():
        where = f"releases[{json.dumps(version)}]"
        if not isinstance(entries, list):
            raise _bad(url, where, entries, "an array")
        out[version] = tuple(_file(url, f"{where}[{i}]", e) for i, e in enumerate(entries))
    return Releases(package, url, out)


def _read_json(url: str, missing_ok: bool) -> object | None:
    """The JSON document at `url` (None: 404 and `missing_ok`); every failure one line, exit 6."""
    import http.client  # the network modules load only when the index is read (see _receive)
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=INDEX_TIMEOUT) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as exc:
        if exc.code == 404 and missing_ok:
            return None
        raise KvforgeError(f"cannot read the package index {url}: HTTP {exc.code} {exc.reason}",
                           EXIT_NETWORK) from None
    except (ValueError, RecursionError) as exc:  # json's errors and bad UTF-8 are ValueErrors
        raise KvforgeError(f"the package index {url} did not answer JSON: {network_reason(exc)}",
                           EXIT_NETWORK) from None
    except (OSError, http.client.HTTPException) as exc:
        raise KvforgeError(f"cannot read the package index {url}: {network_reason(exc)}", EXIT_NETWORK) from None


def releases(package: str, *, missing_ok: bool = False) -> Releases | None:
    """Every release of `package` with its files (one read of {index}/pypi/<package>/json). None: the index
    does not know the package (HTTP 404) and `missing_ok`; otherwise that is exit 6 like any failure."""
    url = f"{pypi_url()}/pypi/{package}/json"
    refuse_offline(f"{package}'s releases from the package index {url}", url)
    meta = _read_json(url, missing_ok)
    return None if meta is None else parse_releases(package, url, meta)


def release_files(package: str, version: str) -> tuple[str, list[dict]]:
    """(the index URL read, the files of `package`==`version` in Warehouse's shape; [] if none): the entries
    the sdist (bases), wheel (build) and pin (rebase, target add, init) readers take, each field checked and
    its url absolute."""
    found = releases(package)
    assert found is not None, "releases() without missing_ok returns a document or raises"
    return found.url, [f.as_json() for f in found.files.get(version, ())]


def release_versions(package: str) -> list[str]:
    """Every version the package index lists for `package` that has at least one file (index order)."""
    found = releases(package)
    assert found is not None, "releases() without missing_ok returns a document or raises"
    return [v for v, files in found.files.items() if files]


def network_reason(exc: BaseException) -> str:
    """The first line of what failed (a URLError's reason, else the exception), for one-line errors."""
    reason = getattr(exc, "reason", None) or exc
    return str(reason).splitlines()[0] if str(reason) else type(exc).__name__


@contextlib.contextmanager
def _writing(where: Path) -> Iterator[None]:
    """Any OSError inside is the cache refusing a write: one line naming the place, EXIT_ENV."""
    try:
        yield
    except OSError as exc:
        raise write_error(where, exc) from None


def download_pinned(url: str, dest: Path, size: int, want: str | None, say: Progress, *, mb_digits: int = 1,
                    pinned: str = "") -> Path:
    """Download `url` to `dest` (in the cache's downloads/) for the release archives (sdists) and wheels
    (build): written as .<name>.<pid>.part beside it, checked against `size` (when known) and the sha256
    `want` (when given), then renamed, so only a complete, verified file ever has its final name. Offline,
    network failures and a mismatch are EXIT_NETWORK, a write the cache refuses EXIT_ENV. `mb_digits` and
    `pinned` only word the progress line and the mismatch error."""
    refuse_offline(f"{dest.name} from {url}", url)
    downloads = dest.parent
    tmp = downloads / f".{dest.name}.{os.getpid()}.part"
    say(f"downloading {dest.name} ({size / 1e6:.{mb_digits}f} MB) from {urllib.parse.urlsplit(url).netloc}")
    try:
        with _writing(downloads):
            out = open(tmp, "wb")
        with out:
            got, digest = _receive(url, out, size, say, downloads)
            with _writing(downloads):
                out.flush()
                os.fsync(out.fileno())
        if size and got != size:
            raise KvforgeError(f"{dest.name}: download truncated ({got} of {size} bytes)", EXIT_NETWORK)
        if want and digest != want:
            raise KvforgeError(f"{dest.name}: sha256 {digest} does not match {pinned}{want}", EXIT_NETWORK)
        crashpoint("download:written")
        with _writing(downloads):
            os.replace(tmp, dest)
        crashpoint("download:renamed")
    except OSError as exc:  # closing a file the disk refused
        raise write_error(downloads, exc) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
    return dest


def _receive(url: str, out: BinaryIO, size: int, say: Progress, downloads: Path) -> tuple[int, str]:
    """Copy `url` into `out`: network failures are EXIT_NETWORK, a refused write is the cache's (EXIT_ENV)."""
    # http.client and urllib.request (~30 ms to import) load here and in _read_json, where a request is made:
    # a command that finds everything in the cache (a rebase onto a cached release) never pays for them.
    import http.client
    import urllib.request

    h = hashlib.sha256()
    got = 0
    last = time.monotonic()
    try:
        resp = urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT)
    except (OSError, ValueError, http.client.HTTPException) as exc:
        raise KvforgeError(f"cannot download {url}: {network_reason(exc)}", EXIT_NETWORK) from None
    with resp:
        while True:
            try:
                chunk = resp.read(1 << 20)
            except (OSError, http.client.HTTPException) as exc:
                raise KvforgeError(f"cannot download {url}: {network_reason(exc)}", EXIT_NETWORK) from None
            if not chunk:
                break
            with _writing(downloads):
                out.write(chunk)
            h.update(chunk)
            got += len(chunk)
            if time.monotonic() - last > 2:
                say(f"  {got / 1e6:.1f} / {size / 1e6:.1f} MB")
                last = time.monotonic()
    return got, h.hexdigest()
