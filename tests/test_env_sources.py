"""Where a built environment's torch comes from: the source chain of kvforge/env/torchsource.py.

Most tests here install a FAKE torch: a tiny wheel named torch-2.13.0+cpu-py3-none-any.whl whose
only module says which source it came from. It is not PyTorch; it exercises the chain (order,
isolation from pip's configuration, hash checking, refusal of GPU builds, the one-line error), which
does not depend on what is inside the wheel. One test installs the real torch CPU wheel from a local
PEP 503 index; it needs that wheel in pip's configured find-links and is skipped where there is none.

Every install goes into a throw-away venv made for this module, never into the interpreter running
the tests.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import subprocess
import sys
import urllib.parse
import zipfile
from pathlib import Path

import pytest

from kvforge.env import venv as kvenv
from kvforge.env import torchsource
from kvforge.core.errors import EXIT_ENV, KvforgeError
from kvforge.core.fsutil import sha256_file

VERSION = "2.13.0"


def fake_torch_wheel(where: Path, label: str, version: str = f"{VERSION}+cpu", requires: tuple[str, ...] = ()) -> Path:
    """A FAKE torch wheel (not PyTorch): torch/__init__.py holds SOURCE = label."""
    dist = f"torch-{version}"
    meta = f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {"torch/__init__.py": f"SOURCE = {label!r}\n__version__ = {version!r}\n".encode(),
             f"{dist}.dist-info/METADATA": meta.encode(),
             f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: kvforge-test\nRoot-Is-Purelib: true\n"
                                         b"Tag: py3-none-any\n"}
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        writer.writerow([path, f"sha256={digest}", len(data)])
    writer.writerow([f"{dist}.dist-info/RECORD", "", ""])
    files[f"{dist}.dist-info/RECORD"] = record.getvalue().encode()
    where.mkdir(parents=True, exist_ok=True)
    wheel = where / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return wheel


def pep503_index(root: Path, wheel: Path, sha256: str | None = "real", link: bool = False) -> Path:
    """root/torch/index.html linking `wheel` (placed in root) with #sha256=<its hash>, a given one, or none."""
    (root / "torch").mkdir(parents=True, exist_ok=True)
    target = root / wheel.name
    if target != wheel:
        if link:
            try:
                os.link(wheel, target)
            except OSError:
                target.symlink_to(wheel)
        else:
            target.write_bytes(wheel.read_bytes())
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest() if sha256 == "real" else sha256
    href = "../" + urllib.parse.quote(wheel.name) + (f"#sha256={digest}" if digest else "")
    (root / "torch" / "index.html").write_text(
        f'<!DOCTYPE html><html><body><a href="{href}">{wheel.name}</a><br/></body></html>\n')
    return root


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A throw-away venv (python) that torch is installed into; emptied of torch after each test."""
    root = tmp_path_factory.mktemp("torch-venv") / "v"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, capture_output=True)
    return root / "bin" / "python"


@pytest.fixture()
def py(venv, monkeypatch, tmp_path):
    """The venv's python, with no pip configuration at all: no config files, no PIP_* variables."""
    for k in list(os.environ):
        if k.startswith("PIP_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.delenv("KVFORGE_TORCH_WHEEL", raising=False)
    monkeypatch.setenv("KVFORGE_OFFLINE", "1")  # the default PyTorch index is never asked here
    yield venv
    if list(venv.parent.parent.glob("lib/python*/site-packages/torch-*.dist-info")):
        subprocess.run([str(venv), "-m", "pip", "uninstall", "-y", "-q", "torch"], capture_output=True,
                       env={**os.environ, "PIP_CONFIG_FILE": os.devnull})


def installed_source(py: Path) -> str | None:
    res = subprocess.run([str(py), "-c", "import torch; print(torch.SOURCE)"], capture_output=True, text=True)
    return res.stdout.strip() if res.returncode == 0 else None


def log_in(tmp_path: Path) -> Path:
    log = tmp_path / "build.log"
    log.write_text("")
    return log


def test_sources_are_tried_in_the_documented_order(monkeypatch):
    monkeypatch.delenv("KVFORGE_TORCH_WHEEL", raising=False)
    assert [(s.kind, s.default) for s in torchsource.torch_sources()] == [("index", True), ("find-links", False)]
    monkeypatch.setenv("KVFORGE_TORCH_WHEEL", "/w/torch.whl")
    sources = torchsource.torch_sources("https://example.invalid/simple")
    assert [s.short for s in sources] == ["$KVFORGE_TORCH_WHEEL", "--torch-index", "PyTorch's CPU index",
                                          "pip's find-links"]
    assert sources[2].location == "https://download.pytorch.org/whl/cpu"


def test_an_explicit_local_index_installs_torch_with_no_find_links_configured(py, tmp_path):
    wheel = fake_torch_wheel(tmp_path / "built", "local index")
    index = pep503_index(tmp_path / "index", wheel)
    got = torchsource.install_torch(py, VERSION, str(index), log_in(tmp_path))
    assert installed_source(py) == "local index"
    assert (got.kind, got.version, got.source) == ("index", f"{VERSION}+cpu", f"--torch-index {index}")
    assert got.sha256 == hashlib.sha256(wheel.read_bytes()).hexdigest()
    # The same index as a file:// URL.
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torch"], check=True, capture_output=True)
    torchsource.install_torch(py, VERSION, index.as_uri(), log_in(tmp_path))
    assert installed_source(py) == "local index"


def test_pip_configuration_cannot_supply_torch_when_an_index_is_given(py, tmp_path, monkeypatch):
    """pip's configuration (a config file and PIP_* variables) says no-index and offers a decoy
    through find-links, an extra index and the index URL (a higher local version matching
    ==2.13.0): with any of it in effect pip would ignore the given index; torch still comes from it."""
    good = fake_torch_wheel(tmp_path / "good", "given index")
    index = pep503_index(tmp_path / "index", good)
    decoy = fake_torch_wheel(tmp_path / "decoys", "decoy", version=f"{VERSION}+cpu.zz")
    decoy_index = pep503_index(tmp_path / "decoy-index", decoy)
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nno-index = true\nfind-links = {decoy.parent}\n"
                    f"extra-index-url = {decoy_index.as_uri()}\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    monkeypatch.setenv("PIP_FIND_LINKS", str(decoy.parent))
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", decoy_index.as_uri())
    monkeypatch.setenv("PIP_INDEX_URL", decoy_index.as_uri())
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    torchsource.install_torch(py, VERSION, str(index), log_in(tmp_path))
    assert installed_source(py) == "given index"


def test_a_wrong_sha256_in_the_index_is_refused_by_pip(py, tmp_path):
    wheel = fake_torch_wheel(tmp_path / "built", "tampered")
    index = pep503_index(tmp_path / "index", wheel, sha256="0" * 64)
    with pytest.raises(KvforgeError) as exc:
        torchsource.install_torch(py, VERSION, str(index), log_in(tmp_path))
    assert exc.value.exit_code == EXIT_ENV
    assert f"--torch-index {index}: pip: sha256 mismatch: the index says 0000000000000000" in str(exc.value)
    assert installed_source(py) is None


def test_an_index_link_without_sha256_is_refused(py, tmp_path):
    index = pep503_index(tmp_path / "index", fake_torch_wheel(tmp_path / "built", "unhashed"), sha256=None)
    with pytest.raises(KvforgeError, match="give no sha256 for torch-2.13.0"):
        torchsource.install_torch(py, VERSION, str(index), log_in(tmp_path))
    assert installed_source(py) is None


def test_a_gpu_torch_is_refused_and_removed_and_the_next_source_used(py, tmp_path, monkeypatch):
    cuda = fake_torch_wheel(tmp_path / "gpu", "cuda build", requires=("nvidia-cublas-cu12==12.8.4.1",))
    index = pep503_index(tmp_path / "index", cuda)
    links = tmp_path / "links"
    fake_torch_wheel(links, "find-links")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    msgs = []
    got = torchsource.install_torch(py, VERSION, str(index), log_in(tmp_path), msgs.append)
    assert installed_source(py) == "find-links" and got.kind == "find-links"
    assert any("GPU build (needs nvidia-cublas-cu12)" in m for m in msgs), msgs


def test_no_source_has_torch_one_line_names_every_source_and_why(py, tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORGE_TORCH_WHEEL", str(tmp_path / "missing.whl"))
    other = pep503_index(tmp_path / "index", fake_torch_wheel(tmp_path / "built", "old", version="2.12.0+cpu"))
    empty = tmp_path / "empty-links"
    empty.mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(KvforgeError) as exc:
        torchsource.install_torch(py, VERSION, str(other), log_in(tmp_path))
    msg = str(exc.value)
    assert exc.value.exit_code == EXIT_ENV and "\n" not in msg
    assert f"$KVFORGE_TORCH_WHEEL {tmp_path / 'missing.whl'}: no such file" in msg
    assert f"--torch-index {other}: no torch 2.13.0 wheel" in msg and "versions there: 2.12.0" in msg
    assert "PyTorch's CPU index https://download.pytorch.org/whl/cpu: not tried: $KVFORGE_OFFLINE=1" in msg
    assert f"pip's find-links: no torch 2.13.0 wheel for cp{sys.version_info[0]}{sys.version_info[1]}" in msg
    assert str(empty) in msg
    assert installed_source(py) is None


def test_an_unreachable_index_fails_at_the_probe_before_pip_runs(py, tmp_path, monkeypatch):
    """A closed local port stands in for an index that cannot be reached (PyTorch's, on a machine that
    only reaches PyPI): the probe says so and pip is never started."""
    monkeypatch.delenv("KVFORGE_OFFLINE")
    monkeypatch.setattr(torchsource, "PYTORCH_CPU_INDEX", "http://127.0.0.1:9/whl/cpu")
    log = log_in(tmp_path)
    with pytest.raises(KvforgeError) as exc:
        torchsource.install_torch(py, VERSION, "http://127.0.0.1:9/simple", log)
    msg = str(exc.value)
    assert "--torch-index http://127.0.0.1:9/simple: unreachable (" in msg
    assert "PyTorch's CPU index http://127.0.0.1:9/whl/cpu: unreachable (" in msg
    assert "pip install" not in log.read_text()


def test_an_explicit_wheel_file_must_be_torch_of_the_version(py, tmp_path, monkeypatch):
    old = fake_torch_wheel(tmp_path / "w", "old", version="2.12.0+cpu")
    monkeypatch.setenv("KVFORGE_TORCH_WHEEL", str(old))
    with pytest.raises(KvforgeError, match=r"torch-2.12.0\+cpu-py3-none-any.whl is torch 2.12.0\+cpu, not 2.13.0"):
        torchsource.install_torch(py, VERSION, None, log_in(tmp_path))
    good = fake_torch_wheel(tmp_path / "w", "wheel file")
    monkeypatch.setenv("KVFORGE_TORCH_WHEEL", str(good))
    got = torchsource.install_torch(py, VERSION, None, log_in(tmp_path))
    assert installed_source(py) == "wheel file" and got.sha256 == hashlib.sha256(good.read_bytes()).hexdigest()


def test_the_env_key_does_not_depend_on_where_torch_comes_from(tmp_path, monkeypatch):
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "common.txt").write_text("transformers >= 4.56.0\n")
    monkeypatch.delenv("KVFORGE_TORCH_WHEEL", raising=False)
    monkeypatch.delenv("KVFORGE_TORCH_INDEX", raising=False)
    key = kvenv.env_spec(kvenv.dir_reader(tmp_path), "t").key
    monkeypatch.setenv("KVFORGE_TORCH_WHEEL", "/elsewhere/torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl")
    monkeypatch.setenv("KVFORGE_TORCH_INDEX", "https://mirror.example/whl/cpu")
    assert kvenv.env_spec(kvenv.dir_reader(tmp_path), "t").key == key


def real_torch_wheel() -> Path | None:
    """The real torch CPU wheel, if pip's configuration on this machine names a find-links directory with it."""
    try:
        return torchsource.find_torch_wheel(Path(sys.executable), VERSION)
    except KvforgeError:
        return None


REAL_WHEEL = real_torch_wheel()  # looked up before any test clears pip's configuration


@pytest.mark.slow
@pytest.mark.skipif(REAL_WHEEL is None, reason=f"no real torch {VERSION} wheel in pip's configured find-links")
def test_the_real_torch_wheel_installs_from_a_local_pep503_index(py, tmp_path):
    index = pep503_index(tmp_path / "index", REAL_WHEEL, link=True)  # hard link (or symlink): it is ~190 MB
    got = torchsource.install_torch(py, VERSION, str(index), log_in(tmp_path))
    assert got.kind == "index" and got.version.startswith(VERSION) and "+cpu" in got.version
    assert got.sha256 == sha256_file(REAL_WHEEL)
    out = subprocess.run([str(py), "-c", "import importlib.metadata as m; d = m.distribution('torch');"
                          "print(d.version); print(d.read_text('INSTALLER').strip())"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [got.version, "pip"]


@pytest.mark.slow
@pytest.mark.skipif(REAL_WHEEL is None, reason=f"no real torch {VERSION} wheel in pip's configured find-links")
def test_a_whole_env_builds_with_torch_from_a_local_index_and_no_find_links(base_v0202, tmp_path, monkeypatch):
    """`kvforge env` end to end, as on a machine whose pip has no find-links: torch (the real CPU wheel)
    from --torch-index DIR, everything else from the package index; same key as from any other source."""
    from kvforge.core.cache import Cache

    cache, base = base_v0202
    for k in list(os.environ):
        if k.startswith("PIP_") and k not in ("PIP_CERT", "PIP_DEFAULT_TIMEOUT"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.delenv("KVFORGE_TORCH_WHEEL", raising=False)
    monkeypatch.setenv("KVFORGE_OFFLINE", "1")
    index = pep503_index(tmp_path / "index", REAL_WHEEL, link=True)
    spec = kvenv.env_spec(kvenv.tree_reader(base.repo, base.commit), "vLLM 0.20.2")
    env = kvenv.ensure_env(spec, Cache(tmp_path / "cache"), torch_index=str(index))
    assert env.key == spec.key and not env.reused
    assert env.torch_source["kind"] == "index" and env.torch_source["source"] == f"--torch-index {index}"
    assert env.torch_source["sha256"] == sha256_file(REAL_WHEEL)
    assert env.packages["torch"] == env.torch_source["version"] and "+cpu" in env.packages["torch"]
    assert "kvforge-cpu-platform" in env.packages and "transformers" in env.packages
    assert not any(p.lower().startswith("nvidia-") for p in env.packages)
