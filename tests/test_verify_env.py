"""kvforge's test environments: requirements read from the tree, keys, safety, the plugin, the HF cache,
the user's own interpreter with an overlay, and platforms as data."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvforge.env import venv as kvenv
from kvforge.env import torchsource
from kvforge.env import userenv
from kvforge.core.cache import Cache
from kvforge.core.errors import EXIT_ENV, EXIT_USAGE, KvforgeError

REPO_ROOT = Path(__file__).resolve().parent.parent

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
    assert not any(r.startswith("torch") for r in spec.requirements)  # torch comes only from the torch sources
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

    def no_torch(py, version, torch_index, log, progress=None):
        raise KvforgeError("no torch here", EXIT_ENV)

    monkeypatch.setattr(kvenv, "install_torch", no_torch)  # where env's build looks it up
    with pytest.raises(KvforgeError, match="no torch here"):
        kvenv.ensure_env(spec, cache)
    assert not half.exists()
    assert [p.name for p in cache.envs.iterdir() if p.name.startswith(f".{spec.key}.building")] == []


def _probe_wheel(where: Path, name: str = "kvf_layer_probe", version: str = "1.0") -> Path:
    """A pure-Python wheel holding one module `name` (pip installs it with no index)."""
    import base64
    import hashlib
    import zipfile

    where.mkdir(parents=True, exist_ok=True)
    wheel = where / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": f"VERSION = {version!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for path, text in files.items()] + [f"{info}/RECORD,,"]
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
        zf.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return wheel


def test_a_components_test_requirements_go_into_a_layer_keyed_by_env_and_list(tmp_path, monkeypatch):
    from kvforge.env.common import Env
    from kvforge.env.components import Layer

    links = tmp_path / "links"
    _probe_wheel(links)
    _probe_wheel(links, "kvf_layer_other")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    cache = Cache(tmp_path / "cache")
    env = Env(path=tmp_path, python=Path(sys.executable), key="env-a", hf_home=tmp_path / "hf")
    site = kvenv.layer_requirements(env, ["kvf_layer_probe"], cache)
    assert (site / "kvf_layer_probe" / "__init__.py").is_file() and (site / kvenv.LAYER_MARKER).is_file()
    assert site.parent == cache.envs and not [p for p in cache.envs.iterdir() if ".building-" in p.name]
    out = subprocess.run([sys.executable, "-c", "import kvf_layer_probe as m; print(m.__file__)"],
                         env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True, check=True)
    assert out.stdout.strip().startswith(str(site))

    def no_pip(*a, **k):
        raise AssertionError("a built layer is reused, pip is not run again")

    monkeypatch.setattr(kvenv, "run_logged", no_pip)
    assert kvenv.layer_requirements(env, ["kvf_layer_probe"], cache) == site
    monkeypatch.undo()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    # Another list, or the same list on another environment, is another layer.
    other = kvenv.layer_requirements(env, ["kvf_layer_probe", "kvf_layer_other"], cache)
    assert other != site and (other / "kvf_layer_other").is_dir()
    env_b = Env(path=tmp_path, python=Path(sys.executable), key="env-b", hf_home=tmp_path / "hf")
    assert kvenv.layer_key(env_b, ["kvf_layer_probe"]) != kvenv.layer_key(env, ["kvf_layer_probe"])
    # A requirement pip cannot satisfy fails in one line and leaves no layer behind.
    before = sorted(p.name for p in cache.envs.iterdir())
    with pytest.raises(KvforgeError) as exc:
        kvenv.layer_requirements(env, ["kvf_no_such_project"], cache)
    assert exc.value.exit_code == EXIT_ENV
    assert sorted(p.name for p in cache.envs.iterdir() if p.name.startswith("layer-") and p.is_dir()) == \
        sorted(n for n in before if n.startswith("layer-") and (cache.envs / n).is_dir())
    # The Layer puts the site on the path after the required tree's packages.
    lay = Layer("vllm", "patched", "c" * 40, "d", tmp_path / "tree", ["vllm"], requirements=["kvf_layer_probe"],
                site=site)
    assert lay.pythonpath() == [str(tmp_path / "tree"), str(site)]
    assert lay.to_json()["site"] == str(site) and lay.to_json()["requirements"] == ["kvf_layer_probe"]


def test_find_links_source_takes_a_local_cpu_wheel_for_this_python(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.delenv("KVFORGE_TORCH_WHEEL", raising=False)
    links = tmp_path / "wheels"
    links.mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    with pytest.raises(KvforgeError) as exc:
        torchsource.find_torch_wheel(Path(sys.executable), "2.13.0")
    assert exc.value.exit_code == EXIT_ENV and str(links) in str(exc.value)
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    import platform

    for local in ("", "+cpu"):
        (links / f"torch-2.13.0{local}-{tag}-{tag}-manylinux_2_28_{platform.machine()}.whl").write_bytes(b"")
    (links / f"torch-2.12.0+cpu-{tag}-{tag}-manylinux_2_28_{platform.machine()}.whl").write_bytes(b"")
    assert "+cpu" in torchsource.find_torch_wheel(Path(sys.executable), "2.13.0").name


def test_the_env_modules_import_as_a_dag():
    """torchsource imports neither env nor userenv; userenv never imports env at module level."""
    code = ("import sys, kvforge.env.torchsource as t; assert 'kvforge.env.userenv' not in sys.modules, 1\n"
            "import kvforge.env.userenv; assert 'kvforge.env.venv' not in sys.modules, 2")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


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


# ---------------------------------------------------------------- the user's own interpreter (--python)

def freeze(python: Path) -> str:
    return subprocess.run([str(python), "-m", "pip", "freeze", "--all"], capture_output=True, text=True,
                          check=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}).stdout


def small_spec() -> kvenv.EnvSpec:
    """An EnvSpec with a short needed set, so the overlay test installs a handful of packages, not vLLM's."""
    return kvenv.EnvSpec(python="3", torch="2.13.0", requirements=["tblib>=3"], xgrammar=None, source="test")


def fake_torch(where: Path) -> Path:
    """A FAKE torch distribution (not PyTorch): only what the interpreter probe looks at (its metadata)."""
    from test_env_sources import fake_torch_wheel

    return fake_torch_wheel(where, "fake torch of the user's interpreter")


@pytest.fixture(scope="module")
def user_python(tmp_path_factory) -> Path:
    """A user's venv: a FAKE torch and an old tblib (1.7.0), nothing else kvforge's tests need."""
    root = tmp_path_factory.mktemp("user") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True, capture_output=True)
    py = root / "bin" / "python"
    wheel = fake_torch(root.parent / "wheels")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "tblib==1.7.0"], check=True,
                   capture_output=True)
    return py


def test_user_python_gets_an_overlay_of_only_what_it_lacks_and_is_never_changed(user_python, tmp_path):
    cache = Cache(tmp_path / "cache")
    before = freeze(user_python)
    msgs: list[str] = []
    env = userenv.user_env(user_python, small_spec(), cache, "cpu", progress=msgs.append)
    assert freeze(user_python) == before
    assert env.external and not env.reused and env.overlay.parent == cache.envs
    assert env.overlay.name.startswith("overlay-") and not (env.overlay / "bin" / "python").exists()
    assert env.python == user_python and env.key.startswith("python-")
    lacked = json.loads((env.overlay / userenv.OVERLAY_MARKER).read_text())
    assert sorted(lacked["lacked"]) == sorted(["tblib 1.7.0 (needs >=3)", "apache-tvm-ffi (not installed)",
                                               "pytest (not installed)", "kvforge-cpu-platform (not installed)"])
    installed = {torchsource.canonical(n) for n in lacked["installed"]}
    # what it lacked, and what those need and it lacks too (pytest's and apache-tvm-ffi's dependencies)
    assert {"tblib", "pytest", "apache-tvm-ffi", "kvforge-cpu-platform", "pluggy", "iniconfig",
            "typing-extensions"} <= installed
    assert "torch" not in installed
    environ = env.environ()
    assert environ["PYTHONPATH"].split(os.pathsep) == [str(kvenv.DATA / "pytest-plugin"), str(env.overlay)]
    assert environ["VLLM_TARGET_DEVICE"] == "cpu"
    seen = subprocess.run([str(user_python), "-c",
                           "import importlib.metadata as m, pytest, tblib, torch; print(m.version('tblib'), torch.SOURCE,"
                           " [e.value for e in m.entry_points(group='vllm.platform_plugins')])"],
                          env=environ, capture_output=True, text=True, check=True).stdout
    assert seen.startswith("3.") and "fake torch" in seen and kvenv.PLUGIN_ENTRY_POINT in seen
    env.check()
    # Unchanged interpreter, same needs: the overlay is reused as it is.
    again = userenv.user_env(user_python, small_spec(), cache, "cpu")
    assert again.reused and again.overlay == env.overlay and again.key == env.key
    assert [p.name for p in cache.envs.iterdir() if p.name.startswith("overlay-") and p.is_dir()] == [env.overlay.name]
    assert freeze(user_python) == before


def test_user_python_without_torch_is_refused_in_one_line_and_nothing_is_installed(tmp_path):
    cache = Cache(tmp_path / "cache")
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, capture_output=True)
    with pytest.raises(KvforgeError) as exc:
        userenv.user_env(bare / "bin" / "python", small_spec(), cache, "cpu")
    msg = str(exc.value)
    assert exc.value.exit_code == EXIT_ENV and "\n" not in msg
    assert "has no torch; it lacks: torch (not installed), tblib (not installed)" in msg
    assert "pytest (not installed)" in msg and "kvforge-cpu-platform (not installed)" in msg
    assert not [p for p in cache.envs.iterdir() if p.name.startswith(("overlay-", ".overlay-")) and p.is_dir()]
    with pytest.raises(KvforgeError, match="no such interpreter"):
        userenv.user_env(tmp_path / "nowhere" / "python", small_spec(), cache, "cpu")


def test_user_python_for_cuda_gets_no_cpu_plugin_and_no_cpu_device(tmp_path):
    env = kvenv.Env(path=tmp_path, python=Path(sys.executable), key="k", hf_home=tmp_path / "hf", external=True,
                    overlay=tmp_path / "overlay-x", platform="cuda")
    environ = env.environ()
    assert "VLLM_TARGET_DEVICE" not in environ or environ["VLLM_TARGET_DEVICE"] == os.environ.get("VLLM_TARGET_DEVICE")
    assert environ["PYTHONPATH"].endswith(os.pathsep + str(tmp_path / "overlay-x"))
    probe = userenv.Interpreter(Path(sys.executable), {"markers": {}, "dists": [{"name": "torch", "version": "2.9.0",
                                                                                  "requires": [], "location": "/x"}],
                                                       "entry_points": []})
    spec = kvenv.EnvSpec(python="3", torch="2.13.0", requirements=[], xgrammar=None, source="test")
    names = [lack.name for lack in userenv.lacks(probe, spec, "cuda")]
    assert "kvforge-cpu-platform" not in names and "kvforge-cpu-platform" in [
        lack.name for lack in userenv.lacks(probe, spec, "cpu")]


def test_a_non_cpu_platform_needs_the_users_python(tmp_path, monkeypatch):
    from types import SimpleNamespace

    monkeypatch.delenv("KVFORGE_TEST_PYTHON", raising=False)
    ctx = SimpleNamespace(python=None, torch_index=None, cache=Cache(tmp_path / "cache"), progress=lambda _m: None,
                          target=None, base=lambda: pytest.fail("no base is needed to refuse"))
    for name in ("cuda", "npu"):
        with pytest.raises(KvforgeError) as exc:
            kvenv.target_env(ctx, platform=name)
        assert exc.value.exit_code == EXIT_USAGE and "pass --python PATH" in str(exc.value)


# ---------------------------------------------------------------- platforms as data

def test_platforms_are_data_with_their_environment_and_labels():
    from kvforge.project import platforms

    cpu, cuda, npu = platforms.get("cpu"), platforms.get("cuda"), platforms.get("npu")
    assert cpu.available(None) == (True, "any CPU") and cpu.cpu_plugin and not cpu.needs_python
    assert cpu.environ == {"VLLM_TARGET_DEVICE": "cpu"} and cuda.environ == {} == npu.environ
    assert not cuda.cpu_plugin and cuda.needs_python and npu.needs_python
    assert cpu.labels("github") == ("ubuntu-latest",) and "gpu" in cuda.labels("github")
    assert platforms.HARDWARE["cuda"].startswith("an NVIDIA GPU") and "cpu" not in platforms.HARDWARE
    with pytest.raises(KvforgeError) as exc:
        platforms.get("tpu")
    assert exc.value.exit_code == EXIT_USAGE


def test_hardware_command_is_what_a_runner_runs():
    from kvforge.ci import runner
    from kvforge.project.targets import Component, Release, Target

    comp = Component("vllm", "https://github.com/vllm-project/vllm.git", "v0.20.1", Release("vllm", "0.20.1"),
                     Path("patches/v0.20.1"), ("cpu", "cuda"), {"cuda": ("tests/v1/core",)})
    target = Target("v0.20.1", "", Path("targets/v0.20.1.toml"), (comp,))
    assert runner.hardware_command(target, comp, "cuda", ["tests/v1/core", "tests/x.py::t"], False) == (
        "kvforge apply --target v0.20.1 --into vllm-v0.20.1 && cd vllm-v0.20.1 && "
        "VLLM_USE_PRECOMPILED=1 pip install -e . pytest tblib && python -m pytest -o junit_family=xunit2 "
        "--junitxml=kvforge-v0.20.1-cuda.xml tests/v1/core tests/x.py::t")
    assert runner.hardware_command(target, comp, "npu", ["tests/v1/core"], True) == (
        "git clone --depth 1 -b v0.20.1 https://github.com/vllm-project/vllm.git vllm-v0.20.1-base && "
        "cd vllm-v0.20.1-base && pip install -e . pytest tblib vllm-ascend && python -m pytest "
        "-o junit_family=xunit2 --junitxml=kvforge-v0.20.1-npu.xml tests/v1/core")
    assert runner.hardware_command(target, comp, "cuda", [], False, python="/srv/gpu env/bin/python") == (
        "kvforge test --platform cuda --python '/srv/gpu env/bin/python' --target v0.20.1")
    assert runner.hardware_command(target, comp, "cuda", [], True, python=Path("/g/python")).endswith(
        "--target v0.20.1 --base")


def fake_gpu_python(tmp_path: Path, cuda: str | None, available: bool) -> Path:
    """An interpreter (a wrapper around this one) that imports a FAKE torch module saying what CUDA it has."""
    pkg = tmp_path / "fake" / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "import types\n__version__ = '2.13.0' + ('+cu' if %r else '+cpu')\n"
        "version = types.SimpleNamespace(cuda=%r)\n"
        "cuda = types.SimpleNamespace(is_available=lambda: %r, device_count=lambda: 1,"
        " get_device_name=lambda i: 'Fake GPU')\n" % (cuda, cuda, available))
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={tmp_path / 'fake'} exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


@pytest.mark.parametrize("cuda, available, ok, says", [
    (None, False, False, "is not a CUDA build"),
    ("12.8", False, False, "sees no GPU: torch.cuda.is_available() is False"),
    ("12.8", True, True, "sees 1 CUDA device(s): Fake GPU"),
])
def test_cuda_is_available_only_when_the_interpreters_torch_sees_a_gpu(tmp_path, cuda, available, ok, says):
    from kvforge.project import platforms

    python = fake_gpu_python(tmp_path, cuda, available)
    got, why = platforms.get("cuda").available(python)
    assert got is ok and says in why
    if not ok:
        with pytest.raises(KvforgeError) as exc:
            platforms.require_available("cuda", python)
        assert exc.value.exit_code == 7 and says in str(exc.value)
    no_torch, why = platforms.get("cuda").available(Path(sys.executable))
    assert no_torch is False and "cannot import torch" in why


# ---------------------------------------------------------------- done when: verify with the user's python

@pytest.mark.slow
def test_verify_v0_20_1_with_the_users_python_builds_no_env_and_leaves_it_unchanged(tmp_path, monkeypatch):
    """`kvforge verify --target v0.20.1 --python PY` proves the real series on the real vLLM 0.20.1
    tree with the user's interpreter: no venv is built, and PY's `pip freeze` is unchanged.

    PY, "the user's env", is a hard-linked copy of kvforge's own v0.20.1 environment (built once into
    the shared cache, like tests/test_verify_slow.py does) from which the CPU platform plugin and
    tblib are uninstalled. A copy, because it is an honest existing venv with torch and vLLM's
    requirements that costs seconds rather than the minutes of a fresh install, and because the
    shared environment itself must not be touched. What the copy lacks must come back through an
    overlay in verify's cache, and nothing in verify's cache may be a venv. The project is a copy
    whose v0.20.1 regression selection is one module: the whole selection is CI's verify lane.
    """
    from click.testing import CliRunner

    from kvforge.core.cache import default_cache_dir
    from kvforge.cli import main
    from kvforge.git.context import Context

    user_cache = default_cache_dir()  # resolved before KVFORGE_CACHE points anywhere else
    shared_envs = Path(os.environ.get("KVFORGE_TEST_ENVS") or user_cache / "envs")
    for var in ("KVFORGE_TEST_PYTHON", "KVFORGE_PYTHON", "KVFORGE_ROOT", "KVFORGE_CACHE"):
        monkeypatch.delenv(var, raising=False)
    project = tmp_path / "project"
    shutil.copytree(REPO_ROOT / "targets", project / "targets")
    shutil.copytree(REPO_ROOT / "patches" / "v0.20.1", project / "patches" / "v0.20.1")
    toml = project / "targets" / "v0.20.1.toml"
    text = toml.read_text()
    start = text.index("cpu = [")
    toml.write_text(text[:start] + 'cpu = ["tests/v1/core/test_kv_cache_utils.py"]' + text[text.index("]", start) + 1:])
    monkeypatch.setenv("KVFORGE_ROOT", str(project))
    monkeypatch.setenv("KVFORGE_OFFLINE", "1")
    cache = Cache(tmp_path / "cache")
    sdist = user_cache / "downloads" / "vllm-0.20.1.tar.gz"
    ctx = Context.load(cache, "v0.20.1", progress=print)
    if not sdist.is_file():
        from kvforge.git.bases import download_sdist

        download_sdist(ctx.component, Cache(user_cache), print)
    shutil.copy2(sdist, cache.downloads / sdist.name)

    # kvforge's own v0.20.1 environment, from the shared cache (built there once if missing).
    shared = Cache(tmp_path / "shared")
    shared_envs.mkdir(parents=True, exist_ok=True)
    shared.root.mkdir(parents=True)
    (shared.root / "envs").symlink_to(shared_envs, target_is_directory=True)
    base = ctx.base()
    spec = kvenv.env_spec(kvenv.tree_reader(base.repo, base.commit), "v0.20.1")
    built = kvenv.ensure_env(spec, shared, progress=print)

    user = tmp_path / "user-venv"
    if subprocess.run(["cp", "-al", str(built.path), str(user)], capture_output=True).returncode != 0:
        shutil.rmtree(user, ignore_errors=True)  # another file system: a full copy
        shutil.copytree(built.path, user, symlinks=True)
    py = user / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "kvforge-cpu-platform", "tblib"], check=True,
                   capture_output=True)
    before = freeze(py)
    assert "kvforge-cpu-platform" not in before and "tblib" not in before
    assert "torch" in subprocess.run([str(py), "-m", "pip", "list"], capture_output=True, text=True).stdout

    res = CliRunner().invoke(main, ["--cache-dir", str(cache.root), "verify", "--target", "v0.20.1", "--python",
                                    str(py), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["ok"] and report["env"].startswith("python-")
    assert all(p["status"] in ("proven", "pass-to-pass") for p in report["patches"]), report["patches"]
    assert report["regression"]["ok"] and report["regression"]["passed"] > 0

    assert freeze(py) == before
    made = [p for p in cache.envs.iterdir() if p.is_dir()]
    assert not [p for p in made if (p / "bin" / "python").exists() or (p / kvenv.MARKER).exists()], made
    overlays = [p for p in made if p.name.startswith("overlay-")]
    assert len(overlays) == 1
    lacked = json.loads((overlays[0] / userenv.OVERLAY_MARKER).read_text())["lacked"]
    assert sorted(lacked) == ["kvforge-cpu-platform (not installed)", "tblib (not installed)"]
