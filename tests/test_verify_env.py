"""kvforge's test environments: requirements read from the tree, keys, safety, the plugin, the HF cache."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvforge import env as kvenv
from kvforge.cache import Cache
from kvforge.errors import EXIT_ENV, KvforgeError

COMMON = """\
regex # Replace re
requests >= 2.26.0
transformers >= 4.56.0, != 5.0.*, != 5.5.0
fastapi[standard] >= 0.115.0 # comment
llguidance >= 1.3.0, < 1.4.0; platform_machine == "x86_64"
xgrammar == 0.2.8; platform_machine == "x86_64" or platform_machine == "aarch64"
oss-harmony >= 0.0.11  # provides openai_harmony
torch == 2.11.0
"""


def tree(tmp_path: Path, name: str, common: str | None = COMMON, pkg_info: str | None = None) -> Path:
    root = tmp_path / name
    root.mkdir()
    if common is not None:
        (root / "requirements").mkdir()
        (root / "requirements" / "common.txt").write_text(common)
    if pkg_info is not None:
        (root / "PKG-INFO").write_text(pkg_info)
    return root


def test_parse_requirements_keeps_specifiers_and_markers_drops_extras():
    reqs = kvenv.parse_requirements(COMMON, "common.txt")
    assert reqs["transformers"] == "transformers>=4.56.0,!=5.0.*,!=5.5.0"
    assert reqs["fastapi"] == "fastapi>=0.115.0"
    assert reqs["llguidance"] == 'llguidance>=1.3.0,<1.4.0; platform_machine == "x86_64"'
    assert reqs["regex"] == "regex"


def test_env_spec_takes_the_trees_specifiers_for_the_needed_set_only(tmp_path):
    spec = kvenv.env_spec(kvenv.dir_reader(tree(tmp_path, "a")), "a")
    assert spec.source == "requirements/common.txt"
    assert "transformers>=4.56.0,!=5.0.*,!=5.5.0" in spec.requirements
    assert "oss-harmony>=0.0.11" in spec.requirements  # the harmony package under its newer name
    assert "urllib3" in spec.requirements  # needed, not named by the tree: unpinned
    assert not any(r.startswith("torch") for r in spec.requirements)  # torch only ever comes from the CPU wheel
    assert spec.xgrammar.startswith("xgrammar==0.2.8;")
    same = kvenv.env_spec(kvenv.dir_reader(tree(tmp_path, "b")), "b")
    other = kvenv.env_spec(kvenv.dir_reader(tree(tmp_path, "c", COMMON.replace("4.56.0", "5.16.1"))), "c")
    assert spec.key == same.key != other.key  # targets whose requirements agree share one environment


def test_env_spec_falls_back_to_pkg_info_and_needs_one_of_them(tmp_path):
    info = "Name: vllm\nRequires-Dist: numpy>=2\nRequires-Dist: pandas; extra == \"bench\"\n"
    spec = kvenv.env_spec(kvenv.dir_reader(tree(tmp_path, "s", None, info)), "s")
    assert spec.source == "PKG-INFO" and "numpy>=2" in spec.requirements
    with pytest.raises(KvforgeError) as exc:
        kvenv.env_spec(kvenv.dir_reader(tree(tmp_path, "none", None)), "tree none")
    assert exc.value.exit_code == EXIT_ENV and "tree none" in str(exc.value)


def test_env_with_marker_but_no_python_is_broken(tmp_path):
    cache = Cache(tmp_path / "cache")
    spec = kvenv.env_spec(kvenv.dir_reader(tree(tmp_path, "a")), "a")
    (cache.envs / spec.key).mkdir()
    (cache.envs / spec.key / kvenv.MARKER).write_text(json.dumps({"packages": {}}))
    with pytest.raises(KvforgeError) as exc:
        kvenv.ensure_env(spec, cache)
    assert exc.value.exit_code == EXIT_ENV and "--rebuild" in str(exc.value)


def test_unfinished_env_is_never_used_and_a_failed_build_leaves_nothing(tmp_path, monkeypatch):
    cache = Cache(tmp_path / "cache")
    spec = kvenv.env_spec(kvenv.dir_reader(tree(tmp_path, "a")), "a")
    half = cache.envs / spec.key
    (half / "bin").mkdir(parents=True)  # no marker: a build that died
    (half / "bin" / "python").write_text("")

    def no_torch(py, version):
        raise KvforgeError("no torch here", EXIT_ENV)

    monkeypatch.setattr(kvenv, "find_torch_wheel", no_torch)
    with pytest.raises(KvforgeError, match="no torch here"):
        kvenv.ensure_env(spec, cache)
    assert not half.exists()
    assert [p.name for p in cache.envs.iterdir() if p.name.startswith(f".{spec.key}.building")] == []


def test_torch_comes_only_from_a_local_cpu_wheel(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.delenv("KVFORGE_TORCH_WHEEL", raising=False)
    links = tmp_path / "wheels"
    links.mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    with pytest.raises(KvforgeError) as exc:
        kvenv.find_torch_wheel(Path(sys.executable), "2.13.0")
    assert exc.value.exit_code == EXIT_ENV and str(links) in str(exc.value)
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    import platform

    for local in ("", "+cpu"):
        (links / f"torch-2.13.0{local}-{tag}-{tag}-manylinux_2_28_{platform.machine()}.whl").write_bytes(b"")
    (links / f"torch-2.12.0+cpu-{tag}-{tag}-manylinux_2_28_{platform.machine()}.whl").write_bytes(b"")
    assert "+cpu" in kvenv.find_torch_wheel(Path(sys.executable), "2.13.0").name


def test_cpu_platform_plugin_wheel_installs_and_registers(tmp_path):
    wheel = kvenv.build_plugin_wheel(tmp_path)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target),
                    str(wheel)], check=True, capture_output=True)
    eps = [ep for d in importlib.metadata.distributions(path=[str(target)])
           for ep in d.entry_points if ep.group == "vllm.platform_plugins"]
    assert [ep.value for ep in eps] == ["kvforge_cpu_platform:register"]
    out = subprocess.run([sys.executable, "-c", "import kvforge_cpu_platform as m; print(m.register())"],
                         env={**os.environ, "PYTHONPATH": str(target)}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "vllm.platforms.cpu.CpuPlatform"


def test_offline_hf_cache_uses_the_hub_layout(tmp_path):
    cache = Cache(tmp_path / "cache")
    home = kvenv.ensure_hf_home(cache)
    assert kvenv.ensure_hf_home(cache) == home
    model = home / "hub" / "models--Qwen--Qwen3-0.6B"
    rev = (model / "refs" / "main").read_text()
    assert json.loads((model / "snapshots" / rev / "config.json").read_text())
    env = kvenv.Env(path=tmp_path / "e", python=Path(sys.executable), key="k", hf_home=home).environ()
    assert env["HF_HOME"] == str(home) and env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["VLLM_USAGE_STATS_DISABLED"] == "1" and env["PYTHONPATH"].endswith("pytest-plugin")
