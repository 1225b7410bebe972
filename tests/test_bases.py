"""Bases: the sdist import is reproducible, cached and never poisoned by a bad download."""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import TARGET_TOML, V0202_SHA256

from kvforge.git.bases import download_sdist, ensure_base, import_archive
from kvforge.core.cache import Cache, default_cache_dir
from kvforge.core.errors import EXIT_ENV, KvforgeError
from kvforge.project.targets import parse_target

# The commit id of vLLM 0.20.2's sdist as kvforge imports it. It depends only on the archive's
# content and kvforge's fixed import identity, so it is the same on every machine.
V0202_COMMIT = "11fab712ccd186ee6dc9bf7ec7c276f09555d168"


def test_sdist_import_has_the_same_commit_id_everywhere(base_v0202, tmp_path):
    cache, base = base_v0202
    assert base.commit == V0202_COMMIT
    assert base.source == "sdist"
    # A second import into another repository gives the same id.
    other = tmp_path / "other.git"
    other.mkdir()
    from kvforge.git import gitutil

    gitutil.run(other, "init", "--bare", "-q", ".")
    comp = parse_target(cache.root / "project-for-base" / "targets" / "t.toml", cache.root / "project-for-base").component()
    archive = cache.downloads / "vllm-0.20.2.tar.gz"
    assert import_archive(other, archive, comp, comp.release.sha256) == V0202_COMMIT
    assert gitutil.run(base.repo, "rev-parse", "refs/tags/v0.20.2").stdout.strip() == V0202_COMMIT


def test_sdist_import_records_the_upstream_commit(base_v0202):
    """vllm/_version.py of the 0.20.2 sdist says __commit_id__ = 'gbc150f502' (tag v0.20.2): the import
    commit keeps it as a trailer and the Base exposes it."""
    from kvforge.git import gitutil

    _cache, base = base_v0202
    assert base.upstream_commit == "bc150f502"
    message = gitutil.run(base.repo, "cat-file", "commit", base.commit).stdout
    assert message.endswith("\nupstream-ref: v0.20.2\nUpstream-Commit-Id: bc150f502")


def test_older_import_without_upstream_commit_is_imported_again(tmp_path):
    """A cached sdist base whose message lacks Upstream-Commit-Id (an older kvforge made it) is not
    used: the next ensure_base imports the archive afresh and records the commit."""
    import io
    import tarfile

    from kvforge.git.bases import _git
    from kvforge.core.cache import REF_IMPORT

    cache = Cache(tmp_path / "cache")
    archive = cache.downloads / "fake-9.9.9.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in (("fake-9.9.9/fake/_version.py", b"__commit_id__ = commit_id = 'g0123abcd9'\n"),
                           ("fake-9.9.9/README", b"hello\n")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    root = tmp_path / "project"
    (root / "targets").mkdir(parents=True)
    (root / "patches" / "t").mkdir(parents=True)
    (root / "targets" / "t.toml").write_text(TARGET_TOML.replace('version = "0.20.2"', 'version = "9.9.9"')
                                             .replace('package = "vllm"', 'package = "fake"')
                                             .format(name="t", sha=sha))
    comp = parse_target(root / "targets" / "t.toml", root).component()
    # What an older kvforge left: the same tree, a message without the trailer.
    repo = cache.repos / "vllm-sdist.git"
    repo.mkdir(parents=True)
    _git(repo, "init", "--bare", "-q", check=True)
    empty_tree = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"  # git knows it without storing it
    old = _git(repo, "commit-tree", empty_tree, "-m", f"fake 9.9.9\n\nsha256: {sha}\n", check=True).stdout.strip()
    _git(repo, "update-ref", "refs/tags/v0.20.2", old, check=True)
    base = ensure_base(comp, cache, "sdist")
    assert base.commit != old and base.upstream_commit == "0123abcd9" and not base.cached
    assert _git(repo, "rev-parse", "refs/tags/v0.20.2").stdout.strip() == base.commit
    assert _git(repo, "rev-parse", "--verify", "-q", REF_IMPORT).returncode != 0
    again = ensure_base(comp, cache, "sdist")
    assert again.commit == base.commit and again.cached and again.upstream_commit == "0123abcd9"


def test_cached_base_needs_no_network(base_v0202, monkeypatch):
    cache, base = base_v0202
    monkeypatch.setenv("KVFORGE_PYPI_URL", "http://127.0.0.1:9")  # nothing listens there
    comp = parse_target(cache.root / "project-for-base" / "targets" / "t.toml", cache.root / "project-for-base").component()
    again = ensure_base(comp, cache, "auto")
    assert again.commit == base.commit and again.cached


class _Index(http.server.BaseHTTPRequestHandler):
    payload = b""
    advertised_sha = ""
    size = None  # advertised size; default: more than is sent (a truncated download)

    def do_GET(self):  # noqa: N802 - http.server API
        if self.path.endswith("/json"):
            body = json.dumps({"releases": {"9.9.9": [{
                "packagetype": "sdist", "filename": "fake-9.9.9.tar.gz", "url": "../../files/fake-9.9.9.tar.gz",
                "size": self.size if self.size is not None else len(self.payload) + 100,
                "digests": {"sha256": self.advertised_sha}}]}}).encode()
        else:
            body = self.payload  # shorter than advertised: a truncated download
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture()
def local_index(monkeypatch):
    _Index.size = None
    server = http.server.HTTPServer(("127.0.0.1", 0), _Index)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("KVFORGE_PYPI_URL", f"http://127.0.0.1:{server.server_address[1]}")
    yield _Index
    server.shutdown()


class _SdistIndex(http.server.BaseHTTPRequestHandler):
    """A package index on 127.0.0.1 with one file: the real vllm 0.20.2 sdist (no network is used)."""

    archive: Path

    def do_GET(self):  # noqa: N802 - http.server API
        if self.path == "/pypi/vllm/json":
            size = self.archive.stat().st_size
            body = json.dumps({"releases": {"0.20.2": [{
                "packagetype": "sdist", "filename": "vllm-0.20.2.tar.gz", "url": "/files/vllm-0.20.2.tar.gz",
                "size": size, "digests": {"sha256": V0202_SHA256}}]}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/files/vllm-0.20.2.tar.gz":
            self.send_response(200)
            self.send_header("Content-Length", str(self.archive.stat().st_size))
            self.end_headers()
            with open(self.archive, "rb") as fh:
                shutil.copyfileobj(fh, self.wfile)
        else:
            self.send_error(404)

    def log_message(self, *args):
        pass


@pytest.fixture()
def sdist_index(session_cache):
    """URL of a local index serving the real sdist, for runs that must download it."""
    handler = type("Handler", (_SdistIndex,), {"archive": session_cache.downloads / "vllm-0.20.2.tar.gz"})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def fake_component(tmp_path: Path, sha: str):
    root = tmp_path / "proj"
    (root / "targets").mkdir(parents=True)
    (root / "patches" / "f").mkdir(parents=True)
    (root / "targets" / "f.toml").write_text(f"""
name = "f"
[[components]]
name = "fake"
repo = "https://invalid.invalid/fake.git"
ref = "v9.9.9"
series = "patches/f"
platforms = ["cpu"]
[components.release]
package = "fake"
version = "9.9.9"
sha256 = "{sha}"
[components.tests]
cpu = []
""")
    return parse_target(root / "targets" / "f.toml", root).component()


def test_bad_download_never_poisons_the_cache(tmp_path, local_index):
    local_index.payload = b"not really a tarball"
    local_index.advertised_sha = hashlib.sha256(b"something else").hexdigest()
    comp = fake_component(tmp_path, local_index.advertised_sha)
    cache = Cache(tmp_path / "cache")
    with pytest.raises(KvforgeError, match="truncated"):
        download_sdist(comp, cache, lambda m: None)
    assert list(cache.downloads.iterdir()) == []  # no partial file, under any name


def test_pinned_sha_mismatch_is_refused(tmp_path, local_index):
    local_index.payload = b"x"
    local_index.advertised_sha = "0" * 64
    comp = fake_component(tmp_path, "1" * 64)
    with pytest.raises(KvforgeError, match="the target pins"):
        download_sdist(comp, Cache(tmp_path / "cache"), lambda m: None)


# ----------------------------------------------------------------- helpers: per-test caches and a real CLI

def fresh_project(root: Path, name: str = "t") -> Path:
    (root / "targets").mkdir(parents=True, exist_ok=True)
    (root / "patches" / name).mkdir(parents=True, exist_ok=True)
    (root / "patches" / name / "series").write_text("")
    (root / "targets" / f"{name}.toml").write_text(TARGET_TOML.format(name=name, sha=V0202_SHA256))
    return root


def fresh_cache(path: Path, session_cache: Cache, sdist: bool = True) -> Path:
    """A cache of its own for one test; with the real 0.20.2 sdist (a hard link: nothing writes in place)."""
    (path / "downloads").mkdir(parents=True)
    if sdist:
        src = session_cache.downloads / "vllm-0.20.2.tar.gz"
        try:
            os.link(src, path / "downloads" / src.name)
        except OSError:
            shutil.copy2(src, path / "downloads" / src.name)
    return path


def copy_base_repo(base, cache_root: Path) -> Path:
    dest = cache_root / "repos" / base.repo.name
    shutil.copytree(base.repo, dest, symlinks=True, ignore=shutil.ignore_patterns("worktrees"))
    return dest


def kvforge_env(project: Path, cache: Path | None, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFORGE_")}
    env.update(KVFORGE_ROOT=str(project), KVFORGE_OFFLINE="1", KVFORGE_PYPI_URL="http://127.0.0.1:9")
    if cache is not None:
        env["KVFORGE_CACHE"] = str(cache)
    env.update(extra)
    if "KVFORGE_PYPI_URL" in extra:  # a test serving its own package index asks it: online (offline asks nothing)
        env.pop("KVFORGE_OFFLINE")
    return env


def run_kvforge(*args: str, env: dict, preexec_fn=None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvforge.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=preexec_fn, cwd=env["KVFORGE_ROOT"])


def one_error_line(res, code: int) -> str:
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr + res.stdout
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("kvforge: error:")]
    assert len(errors) == 1, res.stderr
    return errors[0]


def leftovers(cache: Path) -> list[str]:
    """Anything a crashed or failed run could leave behind: partial files, temporary repos, import refs."""
    out = [str(p.relative_to(cache)) for p in cache.rglob("*")
           if p.name.endswith((".part", ".tmp", ".old")) or p.name.startswith(("tmp_", "fast_import_crash"))]
    for repo in (cache / "repos").glob("*.git"):
        refs = subprocess.run(["git", "--git-dir", str(repo), "for-each-ref", "refs/kvforge/import"],
                              capture_output=True, text=True).stdout
        out += [f"{repo.name}: {r}" for r in refs.splitlines()]
    return out


def fsck(repo: Path) -> str:
    res = subprocess.run(["git", "--git-dir", str(repo), "fsck", "--no-dangling", "--no-progress"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return res.stderr


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ------------------------------------------------------------------------------ the cache cannot be written

def test_cache_beneath_a_file_is_one_line_exit_env(tmp_path):
    """Root ignores permission bits; a cache whose parent is a regular file fails for everyone (ENOTDIR)."""
    (tmp_path / "afile").write_text("")
    cache = tmp_path / "afile" / "cache"
    env = kvforge_env(fresh_project(tmp_path / "p"), cache)
    res = run_kvforge("base", "--target", "t", "--source", "sdist", env=env)
    line = one_error_line(res, EXIT_ENV)
    assert f"cannot write the kvforge cache at {cache}" in line, line
    assert "set --cache-dir or $KVFORGE_CACHE" in line
    with pytest.raises(KvforgeError, match="cannot write the kvforge cache") as info:
        Cache(cache).repos
    assert info.value.exit_code == EXIT_ENV


def test_repos_that_is_a_file_is_one_line(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "repos").write_text("not a directory")
    env = kvforge_env(fresh_project(tmp_path / "p"), cache)
    res = run_kvforge("base", "--target", "t", "--source", "sdist", env=env)
    line = one_error_line(res, EXIT_ENV)
    assert str(cache / "repos") in line and "not a directory" in line, line


def _limit_file_size():
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG (also in git)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def test_disk_full_during_import_is_one_line_and_leaves_nothing(tmp_path, session_cache):
    cache = fresh_cache(tmp_path / "cache", session_cache)
    env = kvforge_env(fresh_project(tmp_path / "p"), cache)
    res = run_kvforge("base", "--target", "t", "--source", "sdist", env=env, preexec_fn=_limit_file_size)
    line = one_error_line(res, EXIT_ENV)
    assert f"cannot write the kvforge cache at {cache}" in line, line
    assert not (cache / "repos" / "vllm-sdist.git").exists()
    assert leftovers(cache) == []


def test_disk_full_during_download_is_an_environment_error(tmp_path, sdist_index):
    cache = tmp_path / "cache"
    env = kvforge_env(fresh_project(tmp_path / "p"), cache, KVFORGE_PYPI_URL=sdist_index)
    res = run_kvforge("base", "--target", "t", "--source", "sdist", env=env, preexec_fn=_limit_file_size)
    line = one_error_line(res, EXIT_ENV)
    assert f"cannot write the kvforge cache at {cache / 'downloads'}" in line, line
    assert list((cache / "downloads").iterdir()) == []


def test_empty_home_refuses_to_put_the_cache_at_the_root(monkeypatch, tmp_path):
    for var in ("KVFORGE_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", "")
    with pytest.raises(KvforgeError, match=r"set --cache-dir or \$KVFORGE_CACHE") as info:
        default_cache_dir()
    assert info.value.exit_code == EXIT_ENV
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec says: ignore relative paths
    with pytest.raises(KvforgeError):
        default_cache_dir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "kvforge"


def test_empty_home_through_the_cli(tmp_path):
    project = fresh_project(tmp_path / "p")
    env = kvforge_env(project, None, HOME="")
    env.pop("XDG_CACHE_HOME", None)
    existed = Path("/.cache").exists()
    line = one_error_line(run_kvforge("base", "--target", "t", "--json", env=env), EXIT_ENV)
    assert "$HOME" in line and "--cache-dir" in line, line
    assert existed or not Path("/.cache").exists()
    assert run_kvforge("lint", "--no-audit", env=env).returncode == 0  # commands that need no cache still work
    # lint's audit reads the bases: without a cache it is the same one line, exit 5
    assert "$HOME" in one_error_line(run_kvforge("lint", env=env), EXIT_ENV)


# ------------------------------------------------------------------------------- corrupt cached bases

def test_garbage_head_is_detected_and_reimported(tmp_path, base_v0202, session_cache):
    _cache, base = base_v0202
    cache = fresh_cache(tmp_path / "cache", session_cache)
    repo = copy_base_repo(base, cache)
    (repo / "HEAD").write_text("garbage\n")
    res = run_kvforge("base", "--target", "t", "--source", "sdist", "--json",
                      env=kvforge_env(fresh_project(tmp_path / "p"), cache))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["commit"] == V0202_COMMIT
    assert f"cached base {repo} is corrupt" in res.stderr and "re-importing" in res.stderr, res.stderr
    fsck(repo)
    assert leftovers(cache) == []


def test_truncated_pack_is_detected_and_reimported(tmp_path, base_v0202, session_cache):
    _cache, base = base_v0202
    cache = fresh_cache(tmp_path / "cache", session_cache)
    repo = copy_base_repo(base, cache)
    pack = max((repo / "objects" / "pack").glob("*.pack"), key=lambda p: p.stat().st_size)
    os.chmod(pack, 0o644)
    with open(pack, "r+b") as fh:
        fh.truncate(pack.stat().st_size // 2)
    env = kvforge_env(fresh_project(tmp_path / "p"), cache)
    res = run_kvforge("base", "--target", "t", "--source", "sdist", env=env)
    assert res.returncode == 0, res.stderr
    assert V0202_COMMIT in res.stdout
    progress = [ln for ln in res.stderr.splitlines() if "is corrupt" in ln]
    assert len(progress) == 1 and "does not match index" in progress[0], res.stderr
    fsck(repo)
    assert leftovers(cache) == []
    again = run_kvforge("base", "--target", "t", "--json", env=env)  # and now it is a plain cache hit
    assert json.loads(again.stdout)["cached"] is True and "corrupt" not in again.stderr


def test_corrupt_base_that_cannot_be_removed_names_the_command(tmp_path, base_v0202, session_cache, monkeypatch):
    from kvforge.git import bases

    _cache, base = base_v0202
    cache = Cache(fresh_cache(tmp_path / "cache", session_cache))
    repo = copy_base_repo(base, cache.root)
    (repo / "HEAD").write_text("garbage\n")

    def refuse(path, dest):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(bases, "_rename", refuse)
    comp = fresh_component(tmp_path)
    with pytest.raises(KvforgeError) as info:
        ensure_base(comp, cache, "sdist")
    assert info.value.exit_code == EXIT_ENV
    assert f"`rm -rf {repo}`" in str(info.value) and "corrupt" in str(info.value), str(info.value)


def fresh_component(tmp_path: Path):
    root = fresh_project(tmp_path / "proj-c")
    return parse_target(root / "targets" / "t.toml", root).component()


# ------------------------------------------------------------------------------- leftovers of killed runs

def test_dead_downloads_part_files_are_removed(tmp_path, local_index):
    payload = b"a tarball, honestly"
    local_index.payload = payload
    local_index.advertised_sha = hashlib.sha256(payload).hexdigest()
    local_index.size = len(payload)
    comp = fake_component(tmp_path, local_index.advertised_sha)
    cache = Cache(tmp_path / "cache")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        dead, live = dead_pid(), sleeper.pid  # `live` stands for another kvforge still downloading
        for name in (f".fake-9.9.9.tar.gz.{dead}.part", f".fake-9.9.9.tar.gz.{live}.part",
                     f".other-1.tar.gz.{dead}.part"):
            (cache.downloads / name).write_bytes(b"half")
        dest = download_sdist(comp, cache, lambda m: None)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert dest.read_bytes() == payload
    left = sorted(p.name for p in cache.downloads.iterdir())
    assert left == sorted(["fake-9.9.9.tar.gz", f".fake-9.9.9.tar.gz.{live}.part"]), left


# ---------------------------------------------------------------------------------------- two at once

def test_two_imports_at_once_import_once(tmp_path, session_cache):
    cache = fresh_cache(tmp_path / "cache", session_cache)
    env = kvforge_env(fresh_project(tmp_path / "p"), cache)
    cmd = [sys.executable, "-m", "kvforge.cli", "base", "--target", "t", "--source", "sdist", "--json"]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=env["KVFORGE_ROOT"]) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    results = [json.loads(out) for out, _err in outs]
    assert {r["commit"] for r in results} == {V0202_COMMIT}
    assert sorted(r["cached"] for r in results) == [False, True], outs  # one imported, the other used it
    fsck(cache / "repos" / "vllm-sdist.git")
    assert leftovers(cache) == []


def test_git_source_fetches_pins_and_replaces_a_corrupt_repository(tmp_path):
    upstream = tmp_path / "upstream"
    upstream.mkdir()
    for args in (("init", "-q"), ("commit", "-q", "--allow-empty", "-m", "v0.20.2"), ("tag", "v0.20.2")):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=upstream, check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=upstream, capture_output=True, text=True).stdout.strip()
    cache = tmp_path / "cache"
    env = kvforge_env(fresh_project(tmp_path / "p"), cache, KVFORGE_VLLM_REPO=str(upstream))
    first = json.loads(run_kvforge("base", "--target", "t", "--json", env=env).stdout)
    assert (first["commit"], first["source"], first["origin"]) == (head, "git", str(upstream.resolve()))
    repo = cache / "repos" / "vllm-git.git"
    (repo / "HEAD").write_text("garbage\n")
    res = run_kvforge("base", "--target", "t", "--json", env=env)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["commit"] == head
    assert f"cached base {repo} is corrupt" in res.stderr
    fsck(repo)
    assert leftovers(cache) == []
