"""The new base a rebase moves onto: `--onto VERSION` (a PyPI release, its sha256 from PyPI) or a git ref."""

from __future__ import annotations

import os
import re
import tarfile
import urllib.parse
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

from packaging.version import InvalidVersion, Version

from kvforge.git import gitutil
from kvforge.core.index import download_pinned, pypi_url, release_files, release_versions
from kvforge.wheels.choose import choose_wheels
from kvforge.git.context import Context, Progress, quiet
from kvforge.core.errors import EXIT_NETWORK, EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import sha256_remembered
from kvforge.project.targets import Component, Release, WheelPin

# ASCII digits only (\d would take Arabic-Indic ones), matched whole (fullmatch: `$` would allow a trailing newline).
VERSION_ONTO_RE = re.compile(r"v?([0-9]+\.[0-9]+(?:\.[0-9]+)?(?:[A-Za-z0-9.+-]*)?)", re.ASCII)


def _sha_of(files: list[dict], filename: str) -> str | None:
    for f in files:
        if f.get("filename") == filename:
            sha = (f.get("digests") or {}).get("sha256")
            return sha if isinstance(sha, str) else None
    return None


def resolve_onto(ctx: Context, onto: str, repo_url: str | None) -> tuple[Component, str, list[str]]:
    """The component moved onto `onto`: (component, where its sha256 came from, notes).

    VERSION (no --repo): the PyPI sdist of that release, its sha256 taken from PyPI's JSON (offline:
    from an archive already in the cache, and said so), and its release wheels per architecture
    (kvforge.wheels.choose.choose_wheels: the first upload, whatever the manylinux tag). REF with --repo/--source git: that ref; a
    version-like ref (v0.21.0) also moves the offline source to that release.
    """
    comp = ctx.component
    notes: list[str] = []
    if not onto.isascii() or not onto.isprintable() or not onto.strip() or onto != onto.strip():
        raise KvforgeError(f"--onto {onto!r} is not a release version or a git ref (ASCII, no spaces or control "
                           "characters)", EXIT_USAGE)
    m = VERSION_ONTO_RE.fullmatch(onto)
    repo_url = repo_url or os.environ.get(f"KVFORGE_{comp.name.upper().replace('-', '_')}_REPO")
    use_git = bool(repo_url) or ctx.source == "git"
    if not m and not use_git:
        raise KvforgeError(f"--onto {onto!r} is not a release version (e.g. 0.20.2); a git ref needs --repo URL|DIR",
                           EXIT_USAGE)
    if m and not use_git:
        ref = onto if onto.startswith("v") else f"v{onto}"
    else:
        ref = onto
        if gitutil.run(Path.cwd(), "check-ref-format", "--allow-onelevel", ref, check=False).returncode != 0:
            raise KvforgeError(f"--onto {onto!r} is not a valid git ref name", EXIT_USAGE)
    if not m:
        notes.append(f"the offline source stays {comp.release.package}=={comp.release.version}: {onto} is not a "
                     "release version; edit [components.release] by hand if it should change")
        return replace(comp, ref=ref), "git", notes
    version = m.group(1)
    release = Release(comp.release.package, version, None)
    pins: tuple[WheelPin, ...] = ()
    if os.environ.get("KVFORGE_OFFLINE"):
        files = None
    else:
        try:
            _, files = release_files(release.package, version)
        except KvforgeError as exc:
            notes.append(f"{exc}; falling back to the cached archive")
            files = None
    if files is not None:
        if not files:
            raise KvforgeError(f"--onto {onto}: {release.package} {version} is not a release on the package index "
                               f"({pypi_url()})", EXIT_USAGE)
        sha = _sha_of(files, release.filename)
        if sha is None:
            raise KvforgeError(f"--onto {onto}: {release.package} {version} has no sdist {release.filename} on the "
                               "package index (a rebase needs the release source)", EXIT_USAGE)
        source = "pypi"
        pins = tuple(pin for _arch, pin in sorted(choose_wheels(release.package, version).items()))
    else:
        local = ctx.cache.downloads / release.filename
        if not local.is_file():
            raise KvforgeError(f"cannot take the sha256 of {release.filename} from PyPI (offline or unreachable) and "
                               "the cache has no copy of it", EXIT_NETWORK)
        sha = sha256_remembered(local)
        source = "local archive (offline: not checked against PyPI)"
        notes.append(f"sha256 of {release.filename} taken from the cached archive, not from PyPI (offline)")
    new = replace(comp, ref=ref, release=replace(release, sha256=sha), wheels=pins)
    if comp.wheels and not pins:
        notes.append(f"no release wheel of {release.package} {version} on the package index"
                     f"{'' if files is not None else ' (offline)'}: its wheel pins are removed (kvforge build needs one)")
    return new, source, notes


# ---------------------------------------------------------------- a release's pins (kvforge target add, rebase --as)


RELEASE_RE = re.compile(r"[0-9]+\.[0-9]+\.[0-9]+(?:(?:rc|\.post)[0-9]+)?", re.ASCII)  # 0.21.0, 0.21.0rc1


@dataclass(frozen=True)
class ReleasePins:
    """What the package index says about one release: its sdist's sha256 and the release wheels kvforge
    build overlays (per architecture, the first upload: kvforge.wheels.choose.choose_wheels)."""

    package: str
    version: str
    sha256: str
    wheels: tuple[WheelPin, ...]
    index: str


def release_pins(package: str, version: str) -> ReleasePins | None:
    """The pins of `package`==`version` from the package index (None: the index has no such release or no sdist
    of it). Network problems are KvforgeError exit 6 (kvforge.core.index.release_files)."""
    index, files = release_files(package, version)
    rel = Release(package, version)
    sha = _sha_of(files, rel.filename) if files else None
    if not sha:
        return None
    wheels = tuple(pin for _arch, pin in sorted(choose_wheels(package, version).items()))
    return ReleasePins(package, version, sha.lower(), wheels, index)


DOCKERFILE_ARG_RE = re.compile(r"^\s*ARG\s+(VLLM_TAG|VLLM_COMMIT)\s*=\s*[\"']?([^\"'\s]*)", re.M)


@dataclass(frozen=True)
class Candidate:
    """One release of a component looked at for a vLLM version, and the vLLM its sdist's Dockerfile builds on
    (`ARG VLLM_TAG=v0.22.1`; a non-empty `ARG VLLM_COMMIT` pins a commit instead: not a release)."""

    version: str
    vllm_tag: str | None  # "v0.22.1"; None: the Dockerfile names no tag (or pins a commit)
    built_on: str  # for the reason a component is left out: "vLLM v0.22.1 (its Dockerfile's VLLM_TAG)"


def dockerfile_vllm(text: str) -> tuple[str | None, str]:
    """(VLLM_TAG, what it says) of a vllm-ascend Dockerfile: its images and CI build on that vLLM tag. A
    non-empty VLLM_COMMIT wins over the tag in the Dockerfile's own RUN, so it is a commit, not a release."""
    args = dict(DOCKERFILE_ARG_RE.findall(text))
    if args.get("VLLM_COMMIT"):
        return None, f"vLLM commit {args['VLLM_COMMIT'][:12]} (its Dockerfile's VLLM_COMMIT), not a release"
    if args.get("VLLM_TAG"):
        return args["VLLM_TAG"], f"vLLM {args['VLLM_TAG']} (its Dockerfile's VLLM_TAG)"
    return None, "no vLLM its Dockerfile names (no ARG VLLM_TAG)"


def sdist_dockerfile(path: Path) -> str | None:
    """The top-level Dockerfile of an sdist, read from the tarball as a stream (nothing extracted); None if
    it has none. A damaged archive is KvforgeError exit 6 (it came from the index)."""
    try:
        with tarfile.open(path, "r|gz") as tar:
            for m in tar:
                parts = m.name.split("/")
                if len(parts) == 2 and parts[1] == "Dockerfile" and m.isfile():
                    f = tar.extractfile(m)
                    return f.read().decode("utf-8", "replace") if f else None
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise KvforgeError(f"{path}: not a readable sdist ({exc})", EXIT_NETWORK) from None
    return None


def fetch_sdist(package: str, version: str, downloads: Path, say: Progress) -> Path | None:
    """The sdist of `package`==`version` in the cache's downloads/, downloaded once and checked against the
    index's sha256 (a cached copy is checked too); None when the index lists no sdist of it."""
    index, files = release_files(package, version)
    rel = Release(package, version)
    for f in files:
        if f.get("packagetype") != "sdist" or f.get("filename") != rel.filename or not isinstance(f.get("url"), str):
            continue
        sha = _sha_of(files, rel.filename)
        dest = downloads / rel.filename
        if dest.is_file() and (sha is None or sha256_remembered(dest) == sha):
            return dest
        size = f.get("size")
        return download_pinned(urllib.parse.urljoin(index, f["url"]), dest, size if isinstance(size, int) else 0,
                               sha, say)
    return None


def matching_release(package: str, vllm_version: str, downloads: Path,
                     say: Progress = quiet) -> tuple[str | None, list[Candidate]]:
    """The release of `package` (vllm_ascend) built on vLLM `vllm_version`: the newest one whose sdist's
    Dockerfile says `ARG VLLM_TAG=v<vllm_version>` (what its images and CI build on; its version name does not
    tell: vllm_ascend 0.21.0rc1 is built on vLLM v0.22.1). Candidates: its releases of the vLLM minor version,
    the one before and the one after (0.21.x for 0.21.0: 0.20.x-0.22.x), no dev releases; each sdist is
    downloaded once into `downloads` (sha256-checked). (None, the candidates and what each is built on) when
    none matches."""
    want = Version(vllm_version)
    major, minor = want.release[:2]
    versions = []
    for v in release_versions(package):
        try:
            parsed = Version(v)
        except InvalidVersion:
            continue
        if parsed.release[:1] == (major,) and len(parsed.release) > 1 and abs(parsed.release[1] - minor) <= 1 \
                and not parsed.is_devrelease:
            versions.append(parsed)
    looked: list[Candidate] = []
    for cand in sorted(versions, reverse=True):
        say(f"{package} {cand}: which vLLM its Dockerfile builds on")
        sdist = fetch_sdist(package, str(cand), downloads, say)
        text = sdist_dockerfile(sdist) if sdist is not None else None
        if sdist is None:
            tag, built_on = None, "no sdist on the package index"
        elif text is None:
            tag, built_on = None, "no Dockerfile in its sdist"
        else:
            tag, built_on = dockerfile_vllm(text)
        looked.append(Candidate(str(cand), tag, built_on))
        if tag == f"v{vllm_version}":
            return str(cand), looked
    return None, looked


def release_ref(package: str, version: str) -> str:
    """The upstream git ref of a release: vLLM's tag vX.Y.Z; vllm-ascend's release branch for a candidate
    (0.21.0rc1 -> releases/v0.21.0rc, as releases/v0.20.2rc), else its tag vX.Y.Z."""
    v = Version(version)
    if package.replace("-", "_") != "vllm" and v.pre is not None and v.pre[0] == "rc":
        return f"releases/v{v.base_version}rc"
    return f"v{version}"
