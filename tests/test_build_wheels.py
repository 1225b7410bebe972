"""`kvforge build` for every platform a deployment installs, on the real v0.20.2rc releases (slow, in CI):
vLLM's aarch64 release wheel and vllm-ascend's release wheels overlaid, and vLLM built for
VLLM_TARGET_DEVICE=empty, each in two empty caches (only the downloaded release files and the test
environments shared) giving the same sha256, and verified as far as this machine can (a foreign wheel's
import is labelled not run, never passed). Plus the --arch/--device options' refusals (fast)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from kvforge.core.cache import default_cache_dir

USER_DOWNLOADS = default_cache_dir() / "downloads"
TEST_ENVS_DIR = Path(os.environ.get("KVFORGE_TEST_ENVS") or default_cache_dir() / "envs")
RELEASE_FILES = ("vllm-0.20.2.tar.gz", "vllm_ascend-0.20.2rc1.tar.gz")


def kvforge(cache: Path, *args: str, timeout: int = 1800) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "KVFORGE_ROOT": str(REPO_ROOT), "KVFORGE_CACHE": str(cache)}
    for k in ("KVFORGE_OFFLINE", "KVFORGE_CRASH_AT", "KVFORGE_TEST_PYTHON"):
        env.pop(k, None)
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-c", "from kvforge.cli import main; main()", *args], env=env,
                       capture_output=True, text=True, timeout=timeout)
    return r, time.monotonic() - t


def empty_cache(root: Path, wheels: list[str]) -> Path:
    """A cache with nothing but the release files (linked from the user cache: downloading them again proves
    nothing) and the shared test environments."""
    (root / "downloads").mkdir(parents=True)
    for name in [*RELEASE_FILES, *wheels]:
        src = USER_DOWNLOADS / name
        if not src.is_file():
            pytest.skip(f"{src} is not downloaded (run `kvforge build -t v0.20.2rc --arch all` once)")
        try:
            os.link(src, root / "downloads" / name)
        except OSError:
            shutil.copy(src, root / "downloads" / name)
    TEST_ENVS_DIR.mkdir(parents=True, exist_ok=True)
    (root / "envs").symlink_to(TEST_ENVS_DIR, target_is_directory=True)
    return root


def builds(doc: dict) -> list[dict]:
    return doc["builds"] if "builds" in doc else [doc]


@pytest.mark.slow
def test_aarch64_and_vllm_ascend_overlays_are_reproducible_and_checked(tmp_path):
    """vLLM aarch64 and vllm-ascend's four wheels, in two empty caches: equal sha256 per wheel; RECORD,
    patched files and .so files checked; the aarch64 / cp310 wheels' import not run (said so); the cp311
    x86_64 vllm-ascend wheel imported next to the patched vLLM tree."""
    from kvforge.project.targets import load_target

    target = load_target("v0.20.2rc", REPO_ROOT)
    ascend = [w.filename for w in target.component("vllm-ascend").wheels]
    vllm_arm = "vllm-0.20.2-cp38-abi3-manylinux_2_35_aarch64.whl"
    runs = []
    for i in (1, 2):
        cache = empty_cache(tmp_path / f"cache{i}", [vllm_arm, *ascend])
        r1, s1 = kvforge(cache, "build", "-t", "v0.20.2rc", "--component", "vllm", "--arch", "aarch64", "--source",
                         "sdist", "--out", str(tmp_path / f"out{i}"), "--json")
        assert r1.returncode == 0, r1.stdout[-2000:] + r1.stderr[-2000:]
        r2, s2 = kvforge(cache, "build", "-t", "v0.20.2rc", "--component", "vllm-ascend", "--arch", "all",
                         "--source", "sdist", "--out", str(tmp_path / f"out{i}"), "--json")
        assert r2.returncode == 0, r2.stdout[-2000:] + r2.stderr[-2000:]
        runs.append(builds(json.loads(r1.stdout)) + builds(json.loads(r2.stdout)))
        print(f"cache {i}: vLLM aarch64 {s1:.0f}s, vllm-ascend x4 {s2:.0f}s")
    first, second = runs
    assert [b["filename"] for b in first] == [b["filename"] for b in second]
    assert [b["sha256"] for b in first] == [b["sha256"] for b in second]  # same bytes from two caches
    by = {b["upstream"]["filename"]: b for b in first}
    assert set(by) == {vllm_arm, *ascend}
    for name, b in by.items():
        v = b["verification"]
        assert b["ok"] and v["problems"] == [], (name, v["problems"])
        assert v["record"]["checked"] > 1000 and v["record"]["compiled"]["equal"] == v["record"]["compiled"]["files"] > 0
        assert v["record"]["metadata"]["version"] == b["local_version"] and "+kvforge.v0.20.2rc." in b["local_version"]
        assert v["modules"]["equal"], name  # every patched module installed equals the patched tree's
        assert b["pinned"] is True and b["upstream"]["pinned"] is True, name  # every wheel pinned in the target
    arm = by[vllm_arm]["verification"]
    assert "not run" in arm["probe"]["not_run"] and "aarch64 wheel on this x86_64 machine" in arm["probe"]["not_run"]
    cp310 = next(by[n]["verification"] for n in ascend if "cp310" in n and "x86_64" in n)
    assert "cp310" in cp310["probe"]["not_run"]
    cp311 = next(by[n]["verification"] for n in ascend if "cp311" in n and "x86_64" in n)
    assert "vllm_ascend" in cp311["probe"]["imported"]
    assert all("torch_npu" in why for why in cp311["probe"]["not_run"].values())
    assert "vllm patched tree" in cp311["probe"]["required"]
    # the .so files are the release's: the kernels a CANN machine loads were not touched
    assert {b["verification"]["record"]["compiled"]["files"] for n, b in by.items() if n in ascend} == {7}


@pytest.mark.slow
def test_empty_device_build_is_reproducible_and_imports(tmp_path):
    """vLLM's own VLLM_TARGET_DEVICE=empty build of the patched tree in two empty caches: equal sha256, pure
    Python, version 0.20.2+empty.kvforge..., vllm.v1.core imported from the installed wheel with the CPU
    env's torch, the series' Checks passed."""
    shas = []
    for i in (1, 2):
        cache = empty_cache(tmp_path / f"cache{i}", [])
        r, secs = kvforge(cache, "build", "-t", "v0.20.2rc", "--component", "vllm", "--device", "empty", "--source",
                          "sdist", "--out", str(tmp_path / f"out{i}"), "--json")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        doc = json.loads(r.stdout)
        print(f"cache {i}: --device empty {secs:.0f}s ({doc['seconds']})")
        shas.append(doc["sha256"])
        assert doc["filename"].endswith("-py3-none-any.whl") and doc["device"] == "empty"
        assert doc["local_version"].startswith("0.20.2+empty.kvforge.v0.20.2rc.")
        v = doc["verification"]
        assert v["ok"] and v["probe"]["version"] == "0.20.2" and v["probe"]["version_is_release"]
        assert v["probe"]["imported"]["vllm.v1.core"].endswith("/site/vllm/v1/core/__init__.py")
        assert v["probe"]["metadata_version"] == doc["local_version"]
        assert v["tests"]["passed"] > 0 and v["tests"]["failed"] == 0 and not v["tests"]["vllm_modules_elsewhere"]
    assert shas[0] == shas[1]


def test_device_and_arch_refusals_are_one_line(tmp_path):
    """--device with --wheel / --mode source / --arch, or for a package it does not build: exit 2, one line."""
    cache = tmp_path / "cache"
    for args, want in ((["--device", "empty", "--arch", "all"], "--device builds from the patched tree"),
                       (["--device", "empty", "--mode", "source"], "--device builds from the patched tree"),
                       (["--component", "vllm-ascend", "--device", "empty"], "--device empty builds vllm")):
        r, _ = kvforge(cache, "build", "-t", "v0.20.2rc", *args, "--json", timeout=300)
        assert r.returncode == 2, r.stderr
        assert want in json.loads(r.stdout)["error"] and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r, _ = kvforge(cache, "build", "-t", "v0.20.2rc", "--arch", "ppc64le", timeout=300)
    assert r.returncode == 2 and "--arch" in r.stderr
