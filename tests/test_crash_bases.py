"""Crash safety of base download and import, with real kills.

kvforge is run in a subprocess with $KVFORGE_CRASH_AT naming one step boundary (fsutil.crashpoint
SIGKILLs it there: no cleanup runs). The next run, without it, must succeed with the same commit
as a clean import and leave nothing behind: no .part/.tmp files, no temporary repositories, no
refs/kvforge/import, and a cached repository that `git fsck` finds clean.

Every step boundary is exercised on a small generated release archive served by a local index
(each run takes a fraction of a second); the real vLLM 0.20.2 sdist is killed at the step that
leaves the most behind, and must still give commit 11fab712ccd1.
"""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import tarfile
import threading
from pathlib import Path

import pytest
from test_bases import (V0202_COMMIT, fresh_cache, fresh_project, fsck, kvforge_env, leftovers,
                        run_kvforge)

SIGKILLED = -9

# Step boundaries, in the order a run passes them. Crashes at or after "import:committed" happen
# once the base is in place: the next run finds it cached.
FRESH = ["download:written", "download:renamed", "import:started", "import:fast-import-done", "import:tagged",
         "import:committed"]
# Importing a second release into a repository that already holds one (the objects move in, then the tag).
SECOND = ["import:started", "import:fast-import-done", "import:tagged", "import:objects-moved", "import:committed",
          "import:cleaned"]
AFTER_COMMIT = {"import:committed", "import:cleaned"}

TARGET = """\
name = "{name}"

[[components]]
name = "fake"
repo = "https://invalid.invalid/fake.git"
ref = "v{version}"
series = "patches/{name}"
platforms = ["cpu"]

[components.release]
package = "fake"
version = "{version}"
sha256 = "{sha}"

[components.tests]
cpu = []
"""


def make_archive(version: str) -> bytes:
    """A release archive with what real sdists have: nested files, an executable, a symlink, odd names."""
    files = {
        "README.md": b"# fake\n",
        "pkg/__init__.py": f"VERSION = {version!r}\n".encode(),
        "pkg/run.sh": b"#!/bin/sh\necho run\n",
        'pkg/odd "name".txt': b"quoted\n",
        **{f"pkg/mod{i:03d}.py": f"X = {i}\n".encode() * 50 for i in range(120)},
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(f"fake-{version}/{name}")
            info.size, info.mtime = len(data), 0
            info.mode = 0o755 if name.endswith(".sh") else 0o644
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo(f"fake-{version}/pkg/link")
        link.type, link.linkname = tarfile.SYMTYPE, "run.sh"
        tar.addfile(link)
    return buf.getvalue()


ARCHIVES = {v: make_archive(v) for v in ("1.0.0", "2.0.0")}


class _FileIndex(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server API
        if self.path == "/pypi/fake/json":
            body = json.dumps({"releases": {v: [{
                "packagetype": "sdist", "filename": f"fake-{v}.tar.gz", "url": f"/files/fake-{v}.tar.gz",
                "size": len(data), "digests": {"sha256": hashlib.sha256(data).hexdigest()}}]
                for v, data in ARCHIVES.items()}}).encode()
        elif self.path.startswith("/files/fake-") and self.path[len("/files/fake-"):-len(".tar.gz")] in ARCHIVES:
            body = ARCHIVES[self.path[len("/files/fake-"):-len(".tar.gz")]]
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def fake_index():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FileIndex)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def fake_project(root: Path) -> Path:
    for name, version in (("t1", "1.0.0"), ("t2", "2.0.0")):
        (root / "targets").mkdir(parents=True, exist_ok=True)
        (root / "patches" / name).mkdir(parents=True, exist_ok=True)
        (root / "patches" / name / "series").write_text("")
        sha = hashlib.sha256(ARCHIVES[version]).hexdigest()
        (root / "targets" / f"{name}.toml").write_text(TARGET.format(name=name, version=version, sha=sha))
    return root


def base(env: dict, target: str, crash_at: str | None = None):
    if crash_at:
        env = {**env, "KVFORGE_CRASH_AT": crash_at}
    return run_kvforge("base", "--target", target, "--source", "sdist", "--json", env=env)


def ok(res) -> dict:
    assert res.returncode == 0, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def clean_commits(tmp_path_factory, fake_index):
    """The commit ids a clean, uninterrupted import gives."""
    tmp = tmp_path_factory.mktemp("clean")
    env = kvforge_env(fake_project(tmp / "p"), tmp / "cache", KVFORGE_PYPI_URL=fake_index)
    return {t: ok(base(env, t))["commit"] for t in ("t1", "t2")}


def assert_recovered(cache: Path, res, want: str, cached: bool) -> None:
    data = ok(res)
    assert data["commit"] == want
    assert data["cached"] is cached
    assert leftovers(cache) == []
    fsck(cache / "repos" / "fake-sdist.git")


@pytest.mark.parametrize("point", FRESH)
def test_killed_first_import_recovers(point, tmp_path, fake_index, clean_commits):
    cache = tmp_path / "cache"
    env = kvforge_env(fake_project(tmp_path / "p"), cache, KVFORGE_PYPI_URL=fake_index)
    crashed = base(env, "t1", point)
    assert crashed.returncode == SIGKILLED, (crashed.returncode, crashed.stderr)
    assert_recovered(cache, base(env, "t1"), clean_commits["t1"], cached=point in AFTER_COMMIT)


@pytest.mark.parametrize("point", SECOND)
def test_killed_second_import_recovers_and_keeps_the_first(point, tmp_path, fake_index, clean_commits):
    cache = tmp_path / "cache"
    env = kvforge_env(fake_project(tmp_path / "p"), cache, KVFORGE_PYPI_URL=fake_index)
    ok(base(env, "t1"))
    crashed = base(env, "t2", point)
    assert crashed.returncode == SIGKILLED, (crashed.returncode, crashed.stderr)
    assert_recovered(cache, base(env, "t2"), clean_commits["t2"], cached=point in AFTER_COMMIT)
    first = ok(base(env, "t1"))
    assert first["commit"] == clean_commits["t1"] and first["cached"] is True


def test_killed_while_replacing_a_corrupt_base_recovers(tmp_path, fake_index, clean_commits):
    cache = tmp_path / "cache"
    env = kvforge_env(fake_project(tmp_path / "p"), cache, KVFORGE_PYPI_URL=fake_index)
    ok(base(env, "t1"))
    (cache / "repos" / "fake-sdist.git" / "HEAD").write_text("garbage\n")
    crashed = base(env, "t1", "import:corrupt-moved-aside")
    assert crashed.returncode == SIGKILLED, (crashed.returncode, crashed.stderr)
    assert_recovered(cache, base(env, "t1"), clean_commits["t1"], cached=False)


def test_killed_real_sdist_import_recovers_with_the_same_commit(tmp_path, session_cache):
    cache = fresh_cache(tmp_path / "cache", session_cache)
    env = kvforge_env(fresh_project(tmp_path / "p"), cache)
    crashed = run_kvforge("base", "--target", "t", "--source", "sdist",
                          env={**env, "KVFORGE_CRASH_AT": "import:tagged"})
    assert crashed.returncode == SIGKILLED, (crashed.returncode, crashed.stderr)
    res = run_kvforge("base", "--target", "t", "--source", "sdist", "--json", env=env)
    data = ok(res)
    assert data["commit"] == V0202_COMMIT and data["cached"] is False
    assert leftovers(cache) == []
    fsck(cache / "repos" / "vllm-sdist.git")
