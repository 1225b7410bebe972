"""Release bases: the upstream source a series is applied to, as a commit in a cached git repository.

Sources, in order of preference with `--source auto`:
- git: a local clone or remote given with --repo (or $KVFORGE_<COMPONENT>_REPO), or the target's
  upstream when it answers; the ref is fetched shallowly and pinned as refs/tags/<ref>;
- sdist: the PyPI release archive, verified against the sha256 in the target file and imported as
  one commit with a fixed author and date, so the same sdist gives the same commit id everywhere.
  Its message records the upstream commit the release was built from (`Upstream-Commit-Id:`, read
  from the sdist's vllm/_version.py `__commit_id__`); a cached import without it (made by an older
  kvforge) is imported again, so one sdist has one commit id.
A base already in the cache is used without touching the network.

Crash safety. Invariant: refs/tags/<ref> in repos/<component>-<kind>.git exists only when every
object of that base is in the repository, and a base becomes visible in exactly one step:
- an archive gets its name in downloads/ only once complete and verified (one rename of a
  .<file>.<pid>.part file);
- a base is imported into a temporary repository repos/.<repo>.<pid>.tmp. When the cached
  repository does not exist yet, that repository is renamed into place (the commit point). When it
  does (it holds other releases, stacks and worktrees), the temporary one borrows its objects
  (objects/info/alternates), the new pack is moved in (.pack before .idx, as git itself does) and
  then the tag is set: the tag update is the commit point;
- a corrupt repository is renamed aside (.<repo>.<pid>.old) before it is removed.
So a run killed at any point leaves at most files and directories named with its pid, which the
next materialisation removes once that pid is dead (fsutil.remove_stale), or objects no ref
reaches (harmless). Materialising holds repos/.<repo>.lock: two kvforge runs never import into one
repository at once; the second waits, then uses what the first made.

Corruption. Every use of a cached base asks git for the tag's commit and reads that commit (and,
for sdist bases, its message). git checks each pack it opens against its index, so a truncated or
replaced pack fails there, as do a garbage HEAD and a broken ref; this costs a few milliseconds,
a full `git fsck` ~0.5 s. A repository git reports errors for is corrupt: it is removed and the
base imported again from the verified sdist (or fetched again), with a progress line saying why;
if it cannot be removed, the error names the command that removes it (the cache is disposable).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import tarfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvforge.git import gitutil
from kvforge.core.cache import REF_IMPORT, Cache, write_error
from kvforge.core.errors import EXIT_ENV, EXIT_NETWORK, EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import crashpoint, file_lock, remove_stale, sha256_remembered
from kvforge.core.index import download_pinned, pypi_url, refuse_offline, releases
from kvforge.core.outcome import Done
from kvforge.project.targets import Component, Release

IMPORT_IDENT = "kvforge-import <kvforge@users.noreply.github.com>"
IMPORT_DATE = "946684800 +0000"  # 2000-01-01T00:00:00Z: fixed, so the commit id depends on content only
COMMIT_ID_TRAILER = "Upstream-Commit-Id"  # in an sdist import's message: the release's upstream commit
Progress = Callable[[str], None]

STALE_DOWNLOAD = r"^\..+\.(?P<pid>\d+)\.part$"
STALE_REPO = r"^\..+\.(?P<pid>\d+)\.(tmp|old)$"
# git's words for a filesystem that refuses a write: such a failure is the cache's, not the archive's.
WRITE_FAILURES = ("No space left", "File too large", "Disk quota", "Read-only file system", "Permission denied",
                  "Input/output error")
_rename = os.rename  # one name for the moves that commit or discard a repository (tests replace it)


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
    # The upstream commit the release was built from, as the sdist records it (vllm/_version.py
    # `__commit_id__`, abbreviated, e.g. "bc150f502"); for a git base its commit; None when unknown.
    upstream_commit: str | None = None


def ensure_base(component: Component, cache: Cache, source: str = "auto", repo_url: str | None = None,
                progress: Progress | None = None) -> Base:
    """Return the component's base commit, materialising it into the cache on first use."""
    say = progress or (lambda _msg: None)
    repo_url = repo_url or os.environ.get(f"KVFORGE_{component.name.upper().replace('-', '_')}_REPO")
    if source not in ("auto", "git", "sdist"):
        raise KvforgeError(f"--source must be auto, git or sdist, not {source!r}")
    try:
        return _ensure(component, cache, source, repo_url, say)
    except OSError as exc:  # the places that write convert their own errors; this is the safety net
        raise write_error(Path(exc.filename) if exc.filename else cache.root, exc) from None


def _ensure(component: Component, cache: Cache, source: str, repo_url: str | None, say: Progress) -> Base:
    sweep(cache)  # a few directory entries: cheap enough for every use, so no leftover outlives a run
    if source == "git" or (source == "auto" and repo_url):
        return _materialise(component, cache, "git", say, repo_url or component.repo)
    if source == "auto":
        for kind in ("git", "sdist"):
            hit = _cached(component, cache, kind)
            if hit:
                return hit
        if _reachable(component.repo, cache):
            return _materialise(component, cache, "git", say, component.repo)
    return _materialise(component, cache, "sdist", say)


def _repo_path(component: Component, cache: Cache, kind: str) -> Path:
    return cache.repos / f"{component.name}-{kind}.git"


def _git(repo: Path, *args: str, check: bool = False, timeout: float | None = None) -> gitutil.Result:
    """git on one bare repository, named by GIT_DIR: a broken repository is an error, never a reason
    for git to walk up the directory tree and use whatever repository it finds there."""
    return gitutil.run(repo.parent, *args, check=check, env={"GIT_DIR": str(repo)}, timeout=timeout)


def _git_error(stderr: str) -> str | None:
    """The first error git printed, without its 'error: '/'fatal: ' prefix (None when it printed none).
    Warnings are not errors: git warns about the user's unreadable config, and a broken tag ref
    (warned about, then treated as missing) is repaired by importing the base again."""
    for line in stderr.splitlines():
        line = line.strip()
        for prefix in ("error: ", "fatal: "):
            if line.startswith(prefix):
                return line.removeprefix(prefix)
    return None


def _inspect(path: Path, ref: str) -> tuple[str | None, str, str | None]:
    """(commit, message, None) for a usable base; (None, "", None) when the repository or the tag is
    missing; (None, "", why) when git reports the repository broken (see the module docstring)."""
    if not os.path.lexists(path):
        return None, "", None
    if not path.is_dir() or path.is_symlink():
        return None, "", "not a directory"
    res = _git(path, "rev-parse", "--verify", "-q", f"refs/tags/{ref}^{{commit}}")
    why = _git_error(res.stderr)
    if why is None and res.returncode == 0:
        commit = res.stdout.strip()
        res = _git(path, "cat-file", "commit", commit)
        why = _git_error(res.stderr) or (None if res.returncode == 0 else f"cannot read commit {commit}")
        if why is None:
            return commit, res.stdout, None
    if why is None:
        return None, "", None  # a healthy repository without this tag
    if "dubious ownership" in why or "Permission denied" in why:
        raise KvforgeError(f"cannot read the cached base {path}: {why}", EXIT_ENV)
    return None, "", why


def _as_base(component: Component, path: Path, kind: str, commit: str, message: str) -> Base | None:
    if kind == "sdist":
        want = component.release.sha256
        if want and f"sha256: {want}" not in message:
            return None  # the target now pins another release: import it afresh
        if f"\n{COMMIT_ID_TRAILER}: " not in message:
            return None  # imported by an older kvforge (no upstream commit recorded): import it afresh
        origin = f"{component.release.filename} (sha256 {want or '?'})"
        return Base(component.name, kind, path, component.ref, commit, origin,
                    upstream_commit=recorded_upstream_commit(message))
    origin = _git(path, "config", "--get", "kvforge.origin").stdout.strip()
    return Base(component.name, kind, path, component.ref, commit, origin, upstream_commit=commit)


def _cached(component: Component, cache: Cache, kind: str) -> Base | None:
    """The base when the cache holds it intact; None otherwise. Changes nothing."""
    path = _repo_path(component, cache, kind)
    commit, message, _why = _inspect(path, component.ref)
    return _as_base(component, path, kind, commit, message) if commit else None


@contextlib.contextmanager
def _writing(where: Path):
    """Any OSError inside is the cache refusing a write: one line naming the place, EXIT_ENV."""
    try:
        yield
    except OSError as exc:
        raise write_error(where, exc) from None


def _materialise(component: Component, cache: Cache, kind: str, say: Progress, url: str | None = None) -> Base:
    path = _repo_path(component, cache, kind)
    if kind == "sdist":
        hit = _cached(component, cache, kind)
        if hit:
            return hit
    lock = cache.repos / f".{path.name}.lock"
    with contextlib.ExitStack() as stack:
        with _writing(lock):
            stack.enter_context(file_lock(lock, say, f"the cached base {path.name}"))
        commit, message, why = _inspect(path, component.ref)
        if commit and kind == "sdist":
            hit = _as_base(component, path, kind, commit, message)
            if hit:
                return hit  # another kvforge made it while this one waited
        if why:
            again = f"re-importing it from {component.release.filename}" if kind == "sdist" else f"fetching from {url}"
            say(f"cached base {path} is corrupt ({why}); {again}")
            _discard(path, why)
        if kind == "sdist":
            return _from_sdist(component, cache, path, say)
        assert url is not None, "a git base is fetched from a url (_ensure passes one)"
        return _from_git(component, cache, path, url, say)


def sweep(cache: Cache) -> None:
    """Remove what killed runs left: downloads and repositories named with a pid that is gone."""
    with contextlib.suppress(OSError):
        remove_stale(cache.downloads, STALE_DOWNLOAD)
    with contextlib.suppress(OSError):
        remove_stale(cache.repos, STALE_REPO)


def _temp_repo(path: Path, suffix: str = "tmp") -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{suffix}")


def _remove(path: Path) -> None:
    """Remove a directory of ours; if that fails, the next sweep does (its name carries our pid)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _discard(path: Path, why: str) -> None:
    aside = _temp_repo(path, "old")
    _remove(aside)
    try:
        _rename(path, aside)
    except OSError as exc:
        raise KvforgeError(f"cached base {path} is corrupt ({why}) and cannot be removed ({exc.strerror or exc}); "
                           f"delete it with `rm -rf {shlex.quote(str(path))}` (the cache is disposable)",
                           EXIT_ENV) from None
    crashpoint("import:corrupt-moved-aside")
    _remove(aside)


def _init_repo(path: Path, borrow: Path | None = None) -> None:
    """A new bare repository at `path` (a temporary name); with `borrow`, it sees that one's objects."""
    _remove(path)  # only a dead run with our pid can have left this name
    with _writing(path.parent):
        path.mkdir()
    _git(path, "init", "--bare", "-q", check=True)
    if borrow is not None:
        with _writing(path):
            (path / "objects" / "info" / "alternates").write_text(f"{borrow.resolve() / 'objects'}\n")


def _reachable(url: str, cache: Cache) -> bool:
    if os.environ.get("KVFORGE_OFFLINE"):
        return False
    res = gitutil.run(cache.repos, "ls-remote", "--exit-code", url, "HEAD", check=False, timeout=15)
    return res.returncode == 0


def _from_git(component: Component, cache: Cache, path: Path, url: str, say: Progress) -> Base:
    local = url.removeprefix("file://") if url.startswith("file://") else None
    if local is None and "://" not in url and ":" not in url.split("/", 1)[0]:
        local = url  # a path, as git reads it (no scheme, no host: before the first slash)
    if local is not None and not Path(local).expanduser().is_dir():
        var = f"$KVFORGE_{component.name.upper().replace('-', '_')}_REPO"
        raise KvforgeError(f"{url}: no such directory (the repository {component.name} {component.ref} is fetched "
                           f"from: --repo, {var} or the target's repo; a git clone or a URL)", EXIT_USAGE)
    if Path(url).expanduser().is_dir():
        url = str(Path(url).expanduser().resolve())
    start = time.monotonic()
    if not path.exists():
        work = _temp_repo(path)
        try:
            _init_repo(work)
            with _writing(path):
                _rename(work, path)
        finally:
            _remove(work)
        crashpoint("fetch:repo-created")
    say(f"fetching {component.ref} from {url}")
    tag = f"refs/tags/{component.ref}"
    # A tag is fetched as itself; a branch's tip becomes the pinned base tag (one atomic ref update).
    res = _git(path, "fetch", "--depth", "1", "--no-tags", "--force", url, f"{component.ref}:{tag}",
               timeout=1800)
    if res.returncode != 0:
        msg = (res.stderr.strip().splitlines() or ["git fetch failed"])[-1]
        raise KvforgeError(f"cannot fetch {component.ref} from {url}: {msg}", EXIT_NETWORK)
    crashpoint("fetch:fetched")
    _git(path, "config", "kvforge.origin", url, check=True)
    commit, _message, why = _inspect(path, component.ref)
    if not commit:
        raise KvforgeError(f"fetched {component.ref} from {url} into {path}, but git cannot read it: {why}", EXIT_ENV)
    return Base(component.name, "git", path, component.ref, commit, url, time.monotonic() - start, cached=False,
                upstream_commit=commit)


def _from_sdist(component: Component, cache: Cache, path: Path, say: Progress) -> Base:
    start = time.monotonic()
    archive = download_sdist(component, cache, say)
    digest = component.release.sha256 or sha256_remembered(archive)
    tag = f"refs/tags/{component.ref}"
    existing = path.exists()
    work = _temp_repo(path)
    say(f"importing {archive.name} as one commit")
    try:
        _init_repo(work, borrow=path if existing else None)
        crashpoint("import:started")
        commit = import_archive(work, archive, component, digest)
        upstream = recorded_upstream_commit(_git(work, "cat-file", "commit", commit, check=True).stdout)
        _git(work, "update-ref", tag, commit, check=True)
        crashpoint("import:tagged")
        if existing:
            _move_objects(work, path)
            crashpoint("import:objects-moved")
            _git(path, "update-ref", tag, commit, check=True)  # the commit point
            crashpoint("import:committed")
        else:
            with _writing(path):
                _rename(work, path)  # the commit point
            crashpoint("import:committed")
    finally:
        _remove(work)
    if existing:
        crashpoint("import:cleaned")
    origin = f"{archive.name} (sha256 {digest})"
    return Base(component.name, "sdist", path, component.ref, commit, origin, time.monotonic() - start, cached=False,
                upstream_commit=upstream)


def _move_objects(work: Path, path: Path) -> None:
    """Move the objects fast-import wrote into the cached repository; each becomes usable only whole."""
    src, dst = work / "objects", path / "objects"
    with _writing(dst):
        (dst / "pack").mkdir(parents=True, exist_ok=True)
        for idx in sorted((src / "pack").glob("pack-*.idx")):
            for side in sorted((src / "pack").glob(f"{idx.stem}.*")):
                if side.suffix not in (".idx", ".keep"):
                    os.replace(side, dst / "pack" / side.name)
            os.replace(idx, dst / "pack" / idx.name)  # git uses a pack once its index is there
        # Loose objects (fast-import keeps everything in a pack here, but whatever git wrote moves).
        for d in sorted(src.glob("[0-9a-f][0-9a-f]")):
            (dst / d.name).mkdir(exist_ok=True)
            for obj in d.iterdir():
                os.replace(obj, dst / d.name / obj.name)


def download_sdist(component: Component, cache: Cache, say: Progress) -> Path:
    """Fetch the release archive into the cache; only a fully verified file ever gets its final name."""
    rel = component.release
    downloads = cache.downloads
    with contextlib.suppress(OSError):
        remove_stale(downloads, STALE_DOWNLOAD)
    dest = downloads / rel.filename
    if dest.is_file():
        if not rel.sha256 or sha256_remembered(dest) == rel.sha256:
            return dest
        say(f"{dest} does not match the pinned sha256; downloading it again")
    refuse_offline(f"the sdist {rel.filename} of {component.name} ({rel.package}=={rel.version}) is not in the "
                   f"cache ({downloads}); the package index {pypi_url()} would be asked for it", pypi_url())
    url, expected, size = _sdist_url(rel)
    if rel.sha256 and expected and rel.sha256 != expected:
        raise KvforgeError(f"{rel.filename}: the index says sha256 {expected}, the target pins {rel.sha256}",
                           EXIT_NETWORK)
    return download_pinned(url, dest, size, rel.sha256 or expected, say)


def _sdist_url(rel: Release) -> tuple[str, str | None, int]:
    """(url, the index's sha256, size) of the release's sdist, from the index's checked file list."""
    found = releases(rel.package)
    assert found is not None, "releases() without missing_ok returns a document or raises"
    index = found.url
    for f in found.files.get(rel.version, ()):
        if f.packagetype == "sdist" and f.filename == rel.filename and f.url:
            return f.url, f.sha256, f.size or 0
    raise KvforgeError(f"{index}: no sdist {rel.filename} for {rel.package}=={rel.version}", EXIT_NETWORK)


def import_archive(repo: Path, archive: Path, component: Component, digest: str) -> str:
    """Import a release tarball as one root commit through git fast-import.

    The tree is built from the archive's members (top directory stripped, sorted, git's two file
    modes), and author, committer, date and message are fixed: the commit id is a function of the
    archive's content alone, on every machine and with any user git configuration. The message
    records the upstream commit the release was built from (`Upstream-Commit-Id:`, from the
    sdist's <package>/_version.py `__commit_id__`, or "unknown").

    Speed: the compressed archive is read once, front to back (each member's bytes become a `blob`
    with a mark as they come), and the commit then names the marks in path order: the same file
    commands in the same order as before, so the same tree and commit. Reading members in path
    order instead would seek backwards in the gzip stream, which decompresses it again from the
    start each time. fast-import tries no deltas (--depth=0: the inline imports before made none
    either) and compresses at zlib's fastest level.
    """
    rel = component.release
    try:
        tar = tarfile.open(archive, "r:*")
    except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:
        raise KvforgeError(f"{archive}: not a readable release archive: {exc}", EXIT_NETWORK) from None
    with tar:
        # unpackLimit=0: always one pack (never loose objects), so an import moves in as whole files.
        # pack.compression=1: zlib's fastest level for that pack (~5% larger; object ids do not depend on it).
        proc = gitutil.popen(repo.parent, "-c", "fastimport.unpackLimit=0", "-c", "pack.compression=1",
                             "fast-import", "--quiet", "--done", "--force", "--depth=0", env={"GIT_DIR": str(repo)})
        stdin, stderr = proc.stdin, proc.stderr
        assert stdin is not None and stderr is not None, "gitutil.popen pipes both"
        try:
            try:
                _stream(tar, stdin.write, lambda upstream: (
                    f"{rel.package} {rel.version}: release source from PyPI\n\n"
                    f"archive: {archive.name}\nsha256: {digest}\nupstream-ref: {component.ref}\n"
                    f"{COMMIT_ID_TRAILER}: {upstream or 'unknown'}\n").encode(), rel.package)
                stdin.close()
            except BrokenPipeError:
                pass  # fast-import stopped reading: its status and stderr say why
            except (tarfile.TarError, EOFError, zlib.error) as exc:
                raise KvforgeError(f"{archive}: not a readable release archive: {exc}", EXIT_NETWORK) from None
            err = stderr.read().decode(errors="replace")
            code = proc.wait()
        finally:
            gitutil.end(proc)  # interrupted: fast-import and its helpers end; done: it is no longer tracked
            for pipe in (stdin, stderr):
                with contextlib.suppress(OSError):
                    pipe.close()
    if code != 0:
        if code == -signal.SIGXFSZ:  # subprocess restores SIGXFSZ: a write past `ulimit -f` kills git
            err += "\nFile too large (killed by SIGXFSZ)"
        why = _git_error(err) or (f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}")
        if any(w in err for w in WRITE_FAILURES):
            raise KvforgeError(f"cannot write the kvforge cache at {repo.parent}: git fast-import failed: {why}; "
                               "set --cache-dir or $KVFORGE_CACHE", EXIT_ENV)
        raise KvforgeError(f"{archive.name}: git fast-import failed in {repo}: {why}", EXIT_ENV)
    crashpoint("import:fast-import-done")
    res = _git(repo, "rev-parse", "--verify", "-q", REF_IMPORT)
    if res.returncode != 0:
        raise KvforgeError(f"{archive.name}: git fast-import made no commit in {repo}", EXIT_ENV)
    _git(repo, "update-ref", "-d", REF_IMPORT, check=True)
    return res.stdout.strip()


def _member_path(m: tarfile.TarInfo) -> str | None:
    """A member's path without the archive's top directory; None for what the import leaves out
    (directories, devices, the top directory itself)."""
    if not (m.isfile() or m.issym() or m.islnk()):
        return None
    parts = m.name.split("/", 1)
    if len(parts) != 2 or not parts[1]:
        return None
    return parts[1]


_COMMIT_ID = re.compile(r"^__commit_id__\s*=\s*(?:commit_id\s*=\s*)?['\"]g?([0-9a-f]{7,40})['\"]", re.M)


def parse_commit_id(version_py: str) -> str | None:
    m = _COMMIT_ID.search(version_py)
    return m.group(1) if m else None


def recorded_upstream_commit(message: str) -> str | None:
    """The `Upstream-Commit-Id:` an sdist import recorded in its commit message (None: unknown)."""
    m = re.search(rf"^{COMMIT_ID_TRAILER}: ([0-9a-f]{{7,40}})$", message, re.M)
    return m.group(1) if m else None


def _stream(tar: tarfile.TarFile, w: Callable[[bytes], object], message: Callable[[str | None], bytes],
            package: str) -> None:
    """fast-import's input for the archive: each member's bytes as a blob with a mark, in archive order (one
    pass over the compressed stream), then one commit (message(upstream commit id)) with a file command
    per member in path order (a stable sort: of two members with one path, the later in the archive wins,
    and a directory's path sorts after the file of the same name). The upstream commit id comes from the
    first regular file <package>/_version.py in the archive (its first 64 KiB)."""
    files: list[tuple[str, bytes, int]] = []
    wanted = f"{package.replace('-', '_')}/_version.py"
    upstream: str | None = None
    seen_version = False
    for m in tar:
        path = _member_path(m)
        if path is None:
            continue
        if m.issym():
            data, mode = m.linkname.encode(), b"120000"
        else:
            fh = tar.extractfile(m)  # a hard link reads its target's bytes (seeking back: rare in a release)
            data = fh.read() if fh else b""
            mode = b"100755" if m.mode & 0o111 else b"100644"
        if path == wanted and m.isfile() and not seen_version:
            seen_version = True
            upstream = parse_commit_id(data[:1 << 16].decode("utf-8", errors="replace"))
        mark = len(files) + 1
        w(b"blob\nmark :%d\ndata %d\n" % (mark, len(data)))
        w(data)
        w(b"\n")
        files.append((path, mode, mark))
    files.sort(key=lambda e: e[0])
    msg = message(upstream)
    w(f"commit {REF_IMPORT}\n".encode())
    w(f"author {IMPORT_IDENT} {IMPORT_DATE}\ncommitter {IMPORT_IDENT} {IMPORT_DATE}\n".encode())
    w(b"data %d\n%s\n" % (len(msg), msg))
    w(b"deleteall\n")
    for path, mode, mark in files:
        w(b"M %s :%d %s\n" % (mode, mark, _quote(path)))
    w(b"done\n")


def _quote(path: str) -> bytes:
    if any(c in path for c in '"\\\n') or path.startswith(" "):
        return b'"' + path.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").encode() + b'"'
    return path.encode()


def base_command(ctx) -> Done:
    """`kvforge base`: the target's base as a commit in the cache, and where it came from."""
    base = ctx.base()
    data = {"target": ctx.target.name, "component": base.component, "ref": base.ref, "commit": base.commit,
            "source": base.source, "origin": base.origin, "repo": str(base.repo), "cached": base.cached,
            "seconds": round(base.seconds, 3)}
    how = "cached" if base.cached else f"imported in {base.seconds:.1f}s"
    return Done(data, f"{ctx.label}: {base.ref} = {base.commit} ({base.source}: {base.origin}; {how})\n"
                      f"repository: {base.repo}")
