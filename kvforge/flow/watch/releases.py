"""Which releases the package index has for a component, and which of them are new for a target's component."""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from kvforge.core import index
from kvforge.project.targets import Component


@dataclass(frozen=True)
class IndexRelease:
    """One release of a package on the index: its version, its sdist (None: none listed), upload time."""

    package: str
    version: str
    sdist: str | None
    sdist_sha256: str | None
    uploaded: str | None
    yanked: bool


def index_releases(package: str) -> list[IndexRelease]:
    """Every release of `package` on the package index, oldest first (versions that do not parse and releases
    without files are left out): kvforge.core.index.releases, one read of PyPI's JSON API, every field
    checked. A package the index does not know is []; offline, an unreachable index or a malformed answer
    is EXIT_NETWORK."""
    found = index.releases(package, missing_ok=True)
    if found is None:
        return []
    out: list[tuple[Version, IndexRelease]] = []
    for ver, files in found.files.items():
        try:
            parsed = Version(ver)
        except InvalidVersion:
            continue
        if not files:
            continue
        sdist = next((f for f in files if f.packagetype == "sdist"), None)
        first = sdist or files[0]
        out.append((parsed, IndexRelease(package, ver, sdist.filename if sdist else None,
                                         sdist.sha256 if sdist else None, first.uploaded,
                                         all(f.yanked for f in files))))
    return [r for _v, r in sorted(out, key=lambda x: x[0])]


def new_releases(component: Component, releases: list[IndexRelease], since: Version | None) -> list[IndexRelease]:
    """The releases a component could move to: newer than its release (and than `since`), not yanked.
    Pre-releases count only for a component whose own release is one (vllm-ascend's rc's). A release with
    no sdist is kept: its row then says the rebase cannot get the release source (attention)."""
    base = Version(component.release.version)
    out = []
    for r in releases:
        v = Version(r.version)
        if v <= base or (since is not None and v <= since) or r.yanked:
            continue
        if v.is_prerelease and not base.is_prerelease:
            continue
        out.append(r)
    return out
