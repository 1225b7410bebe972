"""The release wheel a build starts from: downloaded once into <cache>/downloads (only a complete file with
the pinned sha256 gets its name), its sha256 checked in a thread while the overlay copies it (Hasher, the
digest remembered beside the file), and the upstream commit it was built from checked against the base's
(check_same_commit): an overlay never mixes a wheel with a base it was not built from.
"""

from __future__ import annotations

import contextlib
import threading
import urllib.parse
from pathlib import Path

from packaging.utils import canonicalize_name

from kvforge.core.cache import Cache
from kvforge.core.errors import EXIT_NETWORK, EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import remember_sha256, remembered_sha256, remove_stale, sha256_file, sha256_memo, stat_stamp
from kvforge.core.wheel import Member, read_member
from kvforge.core.index import download_pinned, release_files
from kvforge.git.bases import STALE_DOWNLOAD, Base, Progress, parse_commit_id
from kvforge.project.targets import Component, WheelPin


def download_wheel(component: Component, cache: Cache, say: Progress, pin: WheelPin | None = None) -> Path:
    """The pinned release wheel (`pin`, default the x86_64 one) in <cache>/downloads; only a complete file
    with the pinned sha256 gets its name."""
    pin = pin or component.wheel
    assert pin is not None, "build_target refuses a component without a wheel pin"
    downloads = cache.downloads
    with contextlib.suppress(OSError):
        remove_stale(downloads, STALE_DOWNLOAD)
    dest = downloads / pin.filename
    if dest.is_file():
        return dest  # its sha256 is checked while the overlay reads it (check_download)
    index, files = release_files(component.release.package, component.release.version)
    entry = next((f for f in files if f.get("filename") == pin.filename and isinstance(f.get("url"), str)), None)
    if entry is None:
        raise KvforgeError(f"{index}: no file {pin.filename} in {component.release.package}=="
                           f"{component.release.version}", EXIT_NETWORK)
    listed = (entry.get("digests") or {}).get("sha256")
    if listed and listed != pin.sha256:
        raise KvforgeError(f"{pin.filename}: the index says sha256 {listed}, the target pins {pin.sha256}",
                           EXIT_NETWORK)
    url, size = urllib.parse.urljoin(index, entry["url"]), int(entry.get("size") or 0)
    path = download_pinned(url, dest, size, pin.sha256, say, mb_digits=0, pinned="the pinned ")
    Hasher.stamp_checked(path, pin.sha256)  # hashed while downloading: the first build need not hash it again
    return path


def wheel_commit(path: Path, members: list[Member], package: str) -> str | None:
    """The upstream commit a release wheel was built from: its `<package>/_version.py` `__commit_id__`
    (vLLM's; None for a wheel that records none)."""
    name = f"{canonicalize_name(package).replace('-', '_')}/_version.py"
    member = next((m for m in members if m.name == name), None)
    return parse_commit_id(read_member(path, member).decode("utf-8", "replace")) if member else None


def check_same_commit(path: Path, members: list[Member], package: str, base: Base, pin: WheelPin) -> None:
    """Refuse (exit 2) a release wheel built from another upstream commit than the base the series is
    applied to: its unpatched files would be another commit's, so the overlay would mix two trees."""
    built, want = wheel_commit(path, members, package), base.upstream_commit
    if built and want and not (want.startswith(built) or built.startswith(want)):
        raise KvforgeError(f"{pin.filename} was built from upstream commit {built}, the base {base.ref} from "
                           f"{want[:12]}: an overlay would mix two commits; pin the release wheel built from "
                           f"{want[:9]} (PyPI's first upload of the release; a later build number is a rebuild)",
                           EXIT_USAGE)


class Hasher(threading.Thread):
    """sha256 of the cached release wheel, in a thread (hashlib releases the GIL) while the overlay copies it.

    A file's sha256 is remembered beside it (fsutil.remember_sha256: `.<file>.sha256` with its size, inode,
    mtime and ctime); while its stat still says the same, the sha256 is taken from there, as git trusts its
    index for unchanged files. ctime cannot be set back by a user, so any rewrite of the file is hashed
    again. (Every build's verification then checks each installed file against RECORD as well.)
    """

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.digest, self.stamped = path, "", False
        self.error: OSError | None = None
        self.key = ""

    @property
    def stamp(self) -> Path:
        return sha256_memo(self.path)

    def run(self) -> None:
        try:
            known = remembered_sha256(self.path)
            if known is not None:
                self.digest, self.stamped = known, True
                return
            self.key = stat_stamp(self.path)
            self.digest = sha256_file(self.path)
        except OSError as exc:
            self.error = exc

    @classmethod
    def stamp_checked(cls, path: Path, sha256: str) -> None:
        """Remember the sha256 of a file that was just checked (download_pinned's)."""
        remember_sha256(path, sha256)

    def record(self) -> None:
        """Remember the file's sha256 (call once it matched the pin)."""
        if not self.stamped and not self.error:
            remember_sha256(self.path, self.digest, self.key)
