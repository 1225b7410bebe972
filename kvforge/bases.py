"""Release bases: the upstream source a series is applied to, as a commit in a cached git repository.

Sources, in order of preference with `--source auto`:
- git: a local clone or remote given with --repo (or $KVFORGE_<COMPONENT>_REPO), or the target's
  upstream when it answers; the ref is fetched shallowly and pinned as refs/tags/<ref>;
- sdist: the PyPI release archive, verified against the sha256 in the target file and imported as
  one commit with a fixed author and date, so the same sdist gives the same commit id everywhere.
A base already in the cache is used without touching the network.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import gitutil
from .cache import Cache
from .errors import EXIT_NETWORK, KvforgeError
from .targets import Component

IMPORT_IDENT = "kvforge-import <kvforge@users.noreply.github.com>"
IMPORT_DATE = "946684800 +0000"  # 2000-01-01T00:00:00Z: fixed, so the commit id depends on content only
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Base:
    component: str
    source: str  # "sdist" or "git"
    repo: Path  # bare repository in the cache
    ref: str  # upstream ref name, kept as refs/tags/<ref>
    commit: str
    origin: str  # where it came from: the sdist file name + sha256, or the git url
    seconds: float = 0.0  # time spent materialising (0 on a cache hit)
    cached: bool = True


def pypi_url() -> str:
    return os.environ.get("KVFORGE_PYPI_URL", "https://pypi.org").rstrip("/")


def ensure_base(component: Component, cache: Cache, source: str = "auto", repo_url: str | None = None,
                progress: Progress | None = None) -> Base:
    """Return the component's base commit, materialising it into the cache on first use."""
    say = progress or (lambda _msg: None)
    repo_url = repo_url or os.environ.get(f"KVFORGE_{component.name.upper().replace('-', '_')}_REPO")
    if source not in ("auto", "git", "sdist"):
        raise KvforgeError(f"--source must be auto, git or sdist, not {source!r}")
    if source == "git" or (source == "auto" and repo_url):
        return _from_git(component, cache, repo_url or component.repo, say)
    if source == "sdist":
        return _cached(component, cache, "sdist") or _from_sdist(component, cache, say)
    if source == "auto":
        for kind in ("git", "sdist"):
            hit = _cached(component, cache, kind)
            if hit:
                return hit
        if _reachable(component.repo):
            return _from_git(component, cache, component.repo, say)
    return _from_sdist(component, cache, say)


def _repo_path(component: Component, cache: Cache, kind: str) -> Path:
    return cache.repos / f"{component.name}-{kind}.git"


def _cached(component: Component, cache: Cache, kind: str) -> Base | None:
    path = _repo_path(component, cache, kind)
    if not (path / "HEAD").exists():
        return None
    commit = gitutil.rev_parse(path, f"refs/tags/{component.ref}^{{commit}}")
    if not commit:
        return None
    if kind == "sdist":
        want = component.release.sha256
        note = gitutil.run(path, "log", "-1", "--format=%B", commit).stdout
        if want and f"sha256: {want}" not in note:
            return None  # the target now pins another release: import it afresh
        origin = f"{component.release.filename} (sha256 {want or '?'})"
    else:
        origin = gitutil.run(path, "config", "--get", "kvforge.origin", check=False).stdout.strip()
    return Base(component.name, kind, path, component.ref, commit, origin)


def _init_bare(path: Path) -> None:
    if not (path / "HEAD").exists():
        path.mkdir(parents=True, exist_ok=True)
        gitutil.run(path, "init", "--bare", "-q", ".")


def _reachable(url: str) -> bool:
    if os.environ.get("KVFORGE_OFFLINE"):
        return False
    res = gitutil.run(Path.cwd(), "ls-remote", "--exit-code", url, "HEAD", check=False, timeout=15)
    return res.returncode == 0


def _from_git(component: Component, cache: Cache, url: str, say: Progress) -> Base:
    path = _repo_path(component, cache, "git")
    _init_bare(path)
    if Path(url).expanduser().is_dir():
        url = str(Path(url).expanduser().resolve())
    start = time.monotonic()
    say(f"fetching {component.ref} from {url}")
    tag = f"refs/tags/{component.ref}"
    # A tag is fetched as itself; a branch's tip becomes the pinned base tag.
    res = gitutil.run(path, "fetch", "--depth", "1", "--no-tags", "--force", url,
                      f"{component.ref}:{tag}", check=False, timeout=1800)
    if res.returncode != 0:
        msg = (res.stderr.strip().splitlines() or ["git fetch failed"])[-1]
        raise KvforgeError(f"cannot fetch {component.ref} from {url}: {msg}", EXIT_NETWORK)
    gitutil.run(path, "config", "kvforge.origin", url)
    commit = gitutil.rev_parse(path, f"{tag}^{{commit}}")
    return Base(component.name, "git", path, component.ref, commit, url, time.monotonic() - start, cached=False)


def _from_sdist(component: Component, cache: Cache, say: Progress) -> Base:
    start = time.monotonic()
    archive = download_sdist(component, cache, say)
    path = _repo_path(component, cache, "sdist")
    _init_bare(path)
    say(f"importing {archive.name} as one commit")
    commit = import_archive(path, archive, component, sha256_file(archive))
    gitutil.run(path, "update-ref", f"refs/tags/{component.ref}", commit)
    origin = f"{archive.name} (sha256 {component.release.sha256 or sha256_file(archive)})"
    return Base(component.name, "sdist", path, component.ref, commit, origin, time.monotonic() - start, cached=False)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_sdist(component: Component, cache: Cache, say: Progress) -> Path:
    """Fetch the release archive into the cache; only a fully verified file ever gets its final name."""
    rel = component.release
    dest = cache.downloads / rel.filename
    if dest.is_file() and (not rel.sha256 or sha256_file(dest) == rel.sha256):
        return dest
    import urllib.parse
    import urllib.request

    url, expected, size = _sdist_url(rel)
    if rel.sha256 and expected and rel.sha256 != expected:
        raise KvforgeError(f"{rel.filename}: the index says sha256 {expected}, the target pins {rel.sha256}",
                           EXIT_NETWORK)
    want = rel.sha256 or expected
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    say(f"downloading {rel.filename} ({size / 1e6:.1f} MB) from {urllib.parse.urlsplit(url).netloc}")
    h = hashlib.sha256()
    got = 0
    last = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=120) as resp, open(tmp, "wb") as out:
            while chunk := resp.read(1 << 20):
                out.write(chunk)
                h.update(chunk)
                got += len(chunk)
                if time.monotonic() - last > 2:
                    say(f"  {got / 1e6:.1f} / {size / 1e6:.1f} MB")
                    last = time.monotonic()
        if size and got != size:
            raise KvforgeError(f"{rel.filename}: download truncated ({got} of {size} bytes)", EXIT_NETWORK)
        if want and h.hexdigest() != want:
            raise KvforgeError(f"{rel.filename}: sha256 {h.hexdigest()} does not match {want}", EXIT_NETWORK)
        os.replace(tmp, dest)
    except OSError as exc:
        raise KvforgeError(f"cannot download {url}: {exc}", EXIT_NETWORK) from None
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _sdist_url(rel) -> tuple[str, str | None, int]:
    import urllib.parse
    import urllib.request

    index = f"{pypi_url()}/pypi/{rel.package}/json"
    try:
        with urllib.request.urlopen(index, timeout=60) as resp:
            meta = json.load(resp)
    except (OSError, ValueError) as exc:
        raise KvforgeError(f"cannot read the package index {index}: {exc}", EXIT_NETWORK) from None
    for f in meta.get("releases", {}).get(rel.version, []):
        if f.get("packagetype") == "sdist" and f.get("filename") == rel.filename:
            return urllib.parse.urljoin(index, f["url"]), f.get("digests", {}).get("sha256"), int(f.get("size") or 0)
    raise KvforgeError(f"{index}: no sdist {rel.filename} for {rel.package}=={rel.version}", EXIT_NETWORK)


def import_archive(repo: Path, archive: Path, component: Component, digest: str) -> str:
    """Import a release tarball as one root commit through git fast-import.

    The tree is built from the archive's members (top directory stripped, sorted, git's two file
    modes), and author, committer, date and message are fixed: the commit id is a function of the
    archive's content alone, on every machine and with any user git configuration.
    """
    rel = component.release
    message = (f"{rel.package} {rel.version}: release source from PyPI\n\n"
               f"archive: {archive.name}\nsha256: {digest}\nupstream-ref: {component.ref}\n").encode()
    with tarfile.open(archive, "r:*") as tar:
        members = [m for m in tar.getmembers() if m.isfile() or m.issym() or m.islnk()]
        entries = []
        for m in members:
            parts = m.name.split("/", 1)
            if len(parts) != 2 or not parts[1]:
                continue
            entries.append((parts[1], m))
        entries.sort(key=lambda e: e[0])
        proc = gitutil.popen(repo, "fast-import", "--quiet", "--done", "--force")
        try:
            w = proc.stdin.write
            w(b"commit refs/kvforge/import\n")
            w(f"author {IMPORT_IDENT} {IMPORT_DATE}\ncommitter {IMPORT_IDENT} {IMPORT_DATE}\n".encode())
            w(b"data %d\n%s\n" % (len(message), message))
            w(b"deleteall\n")
            for path, m in entries:
                if m.issym():
                    data, mode = m.linkname.encode(), b"120000"
                else:
                    fh = tar.extractfile(m)
                    data = fh.read() if fh else b""
                    mode = b"100755" if m.mode & 0o111 else b"100644"
                w(b"M %s inline %s\ndata %d\n" % (mode, _quote(path), len(data)))
                w(data)
                w(b"\n")
            w(b"done\n")
            proc.stdin.close()
            err = proc.stderr.read().decode(errors="replace")
            if proc.wait() != 0:
                raise KvforgeError(f"{archive}: git fast-import failed: {err.strip()}")
        finally:
            if proc.poll() is None:
                proc.kill()
    commit = gitutil.rev_parse(repo, "refs/kvforge/import")
    gitutil.run(repo, "update-ref", "-d", "refs/kvforge/import")
    return commit


def _quote(path: str) -> bytes:
    if any(c in path for c in '"\\\n') or path.startswith(" "):
        return b'"' + path.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").encode() + b'"'
    return path.encode()
