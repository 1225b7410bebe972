"""The package index (kvforge.core.index), asked through the commands that read it, against a real local HTTP
server that counts every request: a JSON answer with a wrong type in a field kvforge reads is one line naming
the URL and the field, exit 6, nothing written (target add, watch, init); with $KVFORGE_OFFLINE=1 no request
reaches the index at all, and what would have been fetched is the one line, exit 6 (watch, build --arch
of an architecture the target pins no wheel for, lint --selections of a target whose sdist is not cached)."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import threading
from pathlib import Path
from typing import Iterator

import pytest
from click.testing import CliRunner

from kvforge.cli import main

OFFLINE = "offline ($KVFORGE_OFFLINE=1): "


class Index:
    """What the server answers ({path: JSON document}; anything else 404) and every path it was asked for."""

    def __init__(self, docs: dict[str, object]):
        self.docs = docs
        self.asked: list[str] = []
        self.url = ""


@contextlib.contextmanager
def serve(docs: dict[str, object]) -> Iterator[Index]:
    index = Index(docs)

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *_a):
            pass

        def do_GET(self):  # noqa: N802 - http.server API
            index.asked.append(self.path)
            doc = index.docs.get(self.path)
            if doc is None:
                self.send_error(404)
                return
            body = json.dumps(doc).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    index.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield index
    finally:
        server.shutdown()
        server.server_close()


def entry(name: str, **fields: object) -> dict:
    """One file of a release in Warehouse's JSON shape; `fields` replace what is listed."""
    filename = name
    out: dict = {"filename": filename, "packagetype": "sdist" if filename.endswith(".tar.gz") else "bdist_wheel",
                 "digests": {"sha256": hashlib.sha256(filename.encode()).hexdigest()}, "size": 10,
                 "url": f"/files/{filename}", "upload_time_iso_8601": "2026-01-01T00:00:00Z", "yanked": False}
    out.update(fields)
    return out


def vllm_doc(*files: dict, version: str = "0.21.0") -> dict:
    return {"info": {"name": "vllm"}, "releases": {"0.20.2": [entry("vllm-0.20.2.tar.gz")], version: list(files)}}


def project(root: Path, package: str | None = None, version: str = "0.20.2") -> Path:
    """A project: no target (package None), or one target `t` on `package`==`version` with an empty series,
    no wheel pins, a CPU selection, and an upstream git remote that does not exist."""
    (root / "targets").mkdir(parents=True)
    (root / "patches").mkdir()
    if package is not None:
        (root / "patches" / "t").mkdir()
        (root / "patches" / "t" / "series").write_text("")
        (root / "targets" / "t.toml").write_text(f"""name = "t"

[[components]]
name = "vllm"
repo = "https://invalid.invalid/vllm.git"
ref = "v{version}"
series = "patches/t"
platforms = ["cpu"]

[components.release]
package = "{package}"
version = "{version}"
sha256 = "{hashlib.sha256(b'an sdist').hexdigest()}"

[components.tests]
cpu = ["tests/test_a.py"]
""")
    return root


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def one_error(res, code: int = 6) -> str:
    """The one error line of a run that exited `code` (no traceback: not a crash, exit 70)."""
    assert res.exit_code == code, (res.exit_code, res.stdout, res.stderr)
    assert "Traceback" not in res.stdout + res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("kvforge: error: ")]
    assert len(errors) == 1, res.stderr
    return errors[0].removeprefix("kvforge: error: ")


@pytest.fixture()
def env(tmp_path, monkeypatch) -> Path:
    """A cache of the test's own, online, no upstream clone named; returns tmp_path."""
    monkeypatch.setenv("KVFORGE_CACHE", str(tmp_path / "cache"))
    for k in ("KVFORGE_OFFLINE", "KVFORGE_VLLM_REPO", "KVFORGE_VLLM_ASCEND_REPO", "KVFORGE_CRASH_AT"):
        monkeypatch.delenv(k, raising=False)
    return tmp_path


def kvforge(*args: str):
    return CliRunner().invoke(main, list(args))


# ---------------------------------------------------------------- a malformed answer: exit 6, one line, nothing written


@pytest.mark.parametrize("files, field, kind", [
    ((entry("vllm-0.21.0.tar.gz", digests="sha256:0123"),), 'releases["0.21.0"][0].digests', "a string"),
    ((entry("vllm-0.21.0.tar.gz"), entry("vllm-0.21.0-cp38-abi3-manylinux_2_28_x86_64.whl", filename=7)),
     'releases["0.21.0"][1].filename', "a number"),
], ids=["digests-a-string", "filename-a-number"])
def test_target_add_refuses_a_malformed_index_answer(env, monkeypatch, files, field, kind):
    """Before: AttributeError ('str' object has no attribute 'get' / 'int' object has no attribute 'endswith'),
    exit 70. Now the field is named, exit 6, and neither the project nor a target-add state is written."""
    root = project(env / "mine")
    monkeypatch.setenv("KVFORGE_ROOT", str(root))
    with serve({"/pypi/vllm/json": vllm_doc(*files)}) as index:
        monkeypatch.setenv("KVFORGE_PYPI_URL", index.url)
        res = kvforge("target", "add", "0.21.0")
    line = one_error(res)
    assert line == f"the package index {index.url}/pypi/vllm/json: {field} is {kind}, not " \
                   f"{'an object' if 'digests' in field else 'a file name'}"
    assert files_under(root) == {}
    assert [p.name for p in (env / "cache").rglob("*") if p.is_file()] == []  # no state to resume, no lock left


def test_watch_refuses_a_malformed_index_answer(env, monkeypatch):
    """Before: AttributeError ('str' object has no attribute 'get'), exit 70."""
    root = project(env / "mine", "vllm")
    before = files_under(root)
    monkeypatch.setenv("KVFORGE_ROOT", str(root))
    with serve({"/pypi/vllm/json": vllm_doc(entry("vllm-0.21.0.tar.gz", digests="0123"))}) as index:
        monkeypatch.setenv("KVFORGE_PYPI_URL", index.url)
        res = kvforge("watch")
    assert one_error(res) == f'the package index {index.url}/pypi/vllm/json: releases["0.21.0"][0].digests is a ' \
                             "string, not an object"
    assert files_under(root) == before


def test_init_refuses_a_malformed_index_answer(env, monkeypatch):
    """Before: AttributeError in scaffold.sdist_pin, exit 70. Now exit 6 and no directory made."""
    work = env / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("KVFORGE_ROOT", raising=False)
    doc = vllm_doc(entry("vllm-0.21.0.tar.gz", digests=["sha256", "0123"]))
    with serve({"/pypi/vllm/json": doc}) as index:
        monkeypatch.setenv("KVFORGE_PYPI_URL", index.url)
        res = kvforge("init", "team", "--release", "0.21.0", "--install", "kvforge==0.1.0")
    assert one_error(res) == f'the package index {index.url}/pypi/vllm/json: releases["0.21.0"][0].digests is an ' \
                             "array, not an object"
    assert list(work.iterdir()) == []


@pytest.mark.parametrize("fields, field, kind, want", [
    ({"yanked": "no"}, "yanked", "a string", "true/false"),
    ({"size": "10"}, "size", "a string", "a whole number"),
    ({"url": 3}, "url", "a number", "a string"),
    ({"upload_time_iso_8601": 1}, "upload_time_iso_8601", "a number", "a string"),
    ({"packagetype": {}}, "packagetype", "an object", "a string"),
    ({"digests": {"sha256": 5}}, "digests.sha256", "a number", "a string"),
])
def test_every_field_watch_reads_is_type_checked(env, monkeypatch, fields, field, kind, want):
    """watch reads each file's package type, file name, sha256, upload time and yanked (before: taken as they came,
    exit 0 or 3: a yanked "no" counted as yanked, a size "10" went on to the row's download)."""
    root = project(env / "mine", "vllm")
    monkeypatch.setenv("KVFORGE_ROOT", str(root))
    with serve({"/pypi/vllm/json": vllm_doc(entry("vllm-0.21.0.tar.gz", **fields))}) as index:
        monkeypatch.setenv("KVFORGE_PYPI_URL", index.url)
        res = kvforge("watch")
    assert one_error(res) == f'the package index {index.url}/pypi/vllm/json: releases["0.21.0"][0].{field} is ' \
                             f"{kind}, not {want}"


# ---------------------------------------------------------------- offline: no request at all


def test_watch_offline_asks_nothing(env, monkeypatch):
    """Before: watch read the index with $KVFORGE_OFFLINE=1 (one request)."""
    root = project(env / "mine", "vllm")
    monkeypatch.setenv("KVFORGE_ROOT", str(root))
    monkeypatch.setenv("KVFORGE_OFFLINE", "1")
    with serve({"/pypi/vllm/json": vllm_doc(entry("vllm-0.21.0.tar.gz"))}) as index:
        monkeypatch.setenv("KVFORGE_PYPI_URL", index.url)
        res = kvforge("watch")
    assert index.asked == []
    assert one_error(res) == f"{OFFLINE}vllm's releases from the package index {index.url}/pypi/vllm/json"


def test_build_arch_without_a_pin_offline_asks_nothing(env, monkeypatch):
    """An architecture the target pins no wheel for is chosen from the index: offline, that is refused before any
    request (before: the index was read, one request, and the build went on to exit 2)."""
    root = project(env / "mine", "fake", "9.9.9")
    monkeypatch.setenv("KVFORGE_ROOT", str(root))
    monkeypatch.setenv("KVFORGE_OFFLINE", "1")
    with serve({"/pypi/fake/json": {"releases": {"9.9.9": [entry("fake-9.9.9.tar.gz")]}}}) as index:
        monkeypatch.setenv("KVFORGE_PYPI_URL", index.url)
        res = kvforge("build", "-t", "t", "--arch", "aarch64", "--out", str(env / "dist"))
    assert index.asked == []
    assert one_error(res) == f"{OFFLINE}choosing the release wheels of fake 9.9.9 reads its files from the package " \
                             f"index {index.url}"
    assert "t.toml: no aarch64 wheel pinned for vllm; choosing from the index's file list" in res.stderr
    assert not (env / "dist").exists()


def test_lint_selections_offline_never_downloads_the_sdist(env, monkeypatch):
    """The target's sdist is not in the cache: lint --selections would import its base from the sdist. Before:
    the index was read and the sdist downloaded (47 MB for a real release) with $KVFORGE_OFFLINE=1."""
    root = project(env / "mine", "fake", "9.9.9")
    monkeypatch.setenv("KVFORGE_ROOT", str(root))
    monkeypatch.setenv("KVFORGE_OFFLINE", "1")
    with serve({"/pypi/fake/json": {"releases": {"9.9.9": [entry("fake-9.9.9.tar.gz")]}}}) as index:
        monkeypatch.setenv("KVFORGE_PYPI_URL", index.url)
        res = kvforge("lint", "--selections")
    assert index.asked == []
    line = one_error(res)
    assert line.startswith(f"{OFFLINE}the sdist fake-9.9.9.tar.gz of vllm (fake==9.9.9) is not in the cache ("), line
    assert line.endswith(f"); the package index {index.url} would be asked for it")
    assert not list((env / "cache" / "downloads").glob("*fake*"))
