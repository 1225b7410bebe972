"""Bases: the sdist import is reproducible, cached and never poisoned by a bad download."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from pathlib import Path

import pytest

from kvforge.bases import download_sdist, ensure_base, import_archive
from kvforge.cache import Cache
from kvforge.errors import KvforgeError
from kvforge.targets import parse_target

# The commit id of vLLM 0.20.2's sdist as kvforge imports it. It depends only on the archive's
# content and kvforge's fixed import identity, so it is the same on every machine.
V0202_COMMIT = "6735d076fe28409f8d413da8b3929f80459bfd9c"


def test_sdist_import_has_the_same_commit_id_everywhere(base_v0202, tmp_path):
    cache, base = base_v0202
    assert base.commit == V0202_COMMIT
    assert base.source == "sdist"
    # A second import into another repository gives the same id.
    other = tmp_path / "other.git"
    other.mkdir()
    from kvforge import gitutil

    gitutil.run(other, "init", "--bare", "-q", ".")
    comp = parse_target(cache.root / "project-for-base" / "targets" / "t.toml", cache.root / "project-for-base").component()
    archive = cache.downloads / "vllm-0.20.2.tar.gz"
    assert import_archive(other, archive, comp, comp.release.sha256) == V0202_COMMIT
    assert gitutil.run(base.repo, "rev-parse", "refs/tags/v0.20.2").stdout.strip() == V0202_COMMIT


def test_cached_base_needs_no_network(base_v0202, monkeypatch):
    cache, base = base_v0202
    monkeypatch.setenv("KVFORGE_PYPI_URL", "http://127.0.0.1:9")  # nothing listens there
    comp = parse_target(cache.root / "project-for-base" / "targets" / "t.toml", cache.root / "project-for-base").component()
    again = ensure_base(comp, cache, "auto")
    assert again.commit == base.commit and again.cached


class _Index(http.server.BaseHTTPRequestHandler):
    payload = b""
    advertised_sha = ""

    def do_GET(self):  # noqa: N802 - http.server API
        if self.path.endswith("/json"):
            body = json.dumps({"releases": {"9.9.9": [{
                "packagetype": "sdist", "filename": "fake-9.9.9.tar.gz", "url": "../../files/fake-9.9.9.tar.gz",
                "size": len(self.payload) + 100, "digests": {"sha256": self.advertised_sha}}]}}).encode()
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
    server = http.server.HTTPServer(("127.0.0.1", 0), _Index)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("KVFORGE_PYPI_URL", f"http://127.0.0.1:{server.server_address[1]}")
    yield _Index
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
