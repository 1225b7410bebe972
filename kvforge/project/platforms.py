"""The platforms vLLM's tests run on (cpu, cuda, npu), as data: what hardware each needs, whether it is
here, how its test environment is made, the environment variables it sets, and the runner labels a
CI job for it asks for.

- cpu: any machine. The environment is the venv kvforge builds (kvforge/env/venv.py: torch CPU, vLLM's
  pure-Python requirements, kvforge's CPU platform plugin) or a user's interpreter with an overlay.
- cuda: an NVIDIA GPU visible to the user's interpreter (--python), which holds the target's CUDA
  torch and the tree's vLLM with its compiled extensions. kvforge never builds a CUDA env.
- npu: an Ascend NPU with CANN, torch-npu and vllm-ascend in the user's interpreter; CI jobs run
  in vllm-ascend's CANN container on its runner label.

Each platform also carries its CI job as data (CI: how the job tests, timeout, Buildkite emoji, vLLM's
Buildkite device name, the plugin a "tree" job installs), and JOB_KINDS (build plus one kind per
platform) is the one table of CI job kinds kvforge matrix and the CLI's --kind use. Runner labels are
defaults (GitHub Actions `runs-on`, Buildkite agent tags); a project overrides them in its CI files.
Nothing here runs a test; `available()` only looks.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from kvforge.core.errors import EXIT_NOT_RUN, EXIT_USAGE, KvforgeError

PROBE_TIMEOUT = 120  # seconds: importing torch (and torch_npu) can be slow on a cold disk


@dataclass(frozen=True)
class CI:
    """A platform's CI job, as `kvforge matrix` makes it (defaults; a project's CI files override them)."""

    recipe: str  # how the job tests: "verify" (kvforge verify, anywhere) | "wheel" (the build job's wheel
    #              in a venv, kvforge build --wheel) | "tree" (the patched tree and `plugin` over it, kvforge test)
    timeout_minutes: int
    emoji: str  # the Buildkite label's prefix
    vllm_device: str  # vLLM's own Buildkite (.buildkite/test_areas): its name for the device ("": its default GPU)
    vllm_image: str | None = None  # the image step vLLM's Buildkite builds for that device (depends_on)
    vllm_num_devices: int | None = None  # num_devices of vLLM's step (None: not set, the CPU)
    vllm_soft_fail: bool = False  # vLLM's step may fail without failing the build
    # recipe "tree": the out-of-tree platform plugin installed over the patched tree (its checkout is ./{plugin})
    plugin: str = ""
    plugin_repo: str = ""
    plugin_ref: str = ""  # its branch for a release target ({target}); for a target named main: main
    tree_setup: tuple[str, ...] = ()  # after `kvforge apply --into {tree}`: {tree}, {plugin}, {plugin_repo}, {ref}


@dataclass(frozen=True)
class JobKind:
    """One kind of CI job (build, or one per platform): the platform whose runner runs it and how."""

    name: str
    platform: str
    recipe: str  # "build" | CI.recipe
    timeout_minutes: int
    emoji: str


@dataclass(frozen=True)
class Platform:
    name: str
    hardware: str  # what a machine needs, in words (shown when a platform cannot run here)
    env_recipe: tuple[str, ...]  # how its test environment is made, step by step
    environ_items: tuple[tuple[str, str], ...]  # set for every test run on it, over kvforge's common ones
    cpu_plugin: bool  # kvforge's CPU platform plugin goes into its environment
    needs_python: bool  # kvforge cannot build its env: the user's interpreter (--python) is required
    install: str | None  # runner.hardware_command's install step in a fresh clone (None: kvforge env does it)
    runner_labels: tuple[tuple[str, tuple[str, ...]], ...]  # DEFAULTS per CI system; projects override
    probe: str  # how available() looks: "always" | "cuda" | "npu"
    ci: CI  # its CI job (kvforge matrix)
    container: str | None = None  # the CI image its jobs run in (None: the runner's own system)
    # For a component built on another (vllm-ascend on vllm): how the required tree and then the
    # component's tree are installed on this platform ({tree}, {version}: the required release).
    install_required: str | None = None
    install_component: str | None = None
    # Buildkite (kvforge's own pipeline): what the docker plugin passes into the container for the device
    docker_devices: tuple[str, ...] = ()
    docker_volumes: tuple[str, ...] = ()

    @property
    def environ(self) -> dict[str, str]:
        return dict(self.environ_items)

    def labels(self, ci: str) -> tuple[str, ...]:
        """Default runner labels for `ci` (github | buildkite)."""
        return dict(self.runner_labels).get(ci, ())

    def available(self, python: Path | None = None) -> tuple[bool, str]:
        """(True, what is here) or (False, why not): the hardware, as `python` (when given) sees it."""
        if self.probe == "always":
            return True, "any CPU"
        if self.probe == "cuda":
            return _probe_cuda(python)
        if self.probe == "npu":
            return _probe_npu(python)
        raise AssertionError(self.probe)


CPU = Platform(
    name="cpu",
    hardware="any x86_64 or aarch64 machine (torch CPU wheels)",
    env_recipe=(
        "a venv kvforge builds in its cache: torch CPU from $KVFORGE_TORCH_WHEEL, --torch-index, PyTorch's "
        "CPU index or pip's find-links (kvforge/env/torchsource.py)",
        "vLLM's import-time requirements with the tree's own specifiers, xgrammar --no-deps, pytest, tblib",
        "kvforge's CPU platform plugin (vllm.platform_plugins), installed only there",
        "or: --python PATH (an interpreter with torch); what it lacks goes into an overlay in the cache",
    ),
    # Newer vLLM (0.33.0) takes this as an explicit CPU platform; older ones use the plugin.
    environ_items=(("VLLM_TARGET_DEVICE", "cpu"),),
    cpu_plugin=True,
    needs_python=False,
    install=None,
    runner_labels=(("github", ("ubuntu-latest",)), ("buildkite", ("queue=cpu",))),
    probe="always",
    ci=CI(recipe="verify", timeout_minutes=60, emoji=":computer:", vllm_device="cpu-small",
          vllm_image="image-build-cpu"),
)

CUDA = Platform(
    name="cuda",
    hardware="an NVIDIA GPU and vLLM built for CUDA from the tree (VLLM_USE_PRECOMPILED=1 pip install -e .)",
    env_recipe=(
        "your interpreter (--python PATH) with the target's CUDA torch (the version the tree's "
        "requirements/cuda.txt pins)",
        "the tree's vLLM with its compiled extensions: `VLLM_USE_PRECOMPILED=1 pip install -e .` in the tree "
        "(or the patched wheel)",
        "pytest and tblib; anything else of vLLM's import-time requirements it lacks goes into an overlay "
        "in kvforge's cache (never into your interpreter); no CPU plugin",
    ),
    environ_items=(),
    cpu_plugin=False,
    needs_python=True,
    install="VLLM_USE_PRECOMPILED=1 pip install -e . pytest tblib",
    runner_labels=(("github", ("self-hosted", "linux", "x64", "gpu")), ("buildkite", ("queue=gpu_1_queue",))),
    probe="cuda",
    # vLLM's Buildkite: a step without `device` runs on its default GPU agents (the L4 queue), as its own
    # "V1 Spec Decode" step (.buildkite/test_areas/misc.yaml) does; "l4" is no device name it knows.
    ci=CI(recipe="wheel", timeout_minutes=90, emoji=":nvidia:", vllm_device="", vllm_image="image-build"),
)

NPU = Platform(
    name="npu",
    hardware="an Ascend NPU with CANN, torch-npu and vllm-ascend installed over the tree",
    env_recipe=(
        "your interpreter (--python PATH) on a machine with CANN, with torch and torch-npu of the versions "
        "vllm-ascend's release names",
        "the tree's vLLM (`pip install -e .` with VLLM_TARGET_DEVICE=empty) and vllm-ascend over it",
        "pytest and tblib; anything else it lacks goes into an overlay in kvforge's cache; no CPU plugin",
    ),
    environ_items=(),
    cpu_plugin=False,
    needs_python=True,
    install="pip install -e . pytest tblib vllm-ascend",
    # vllm-ascend's releases/v0.20.2rc CI (.github/workflows/pr_test_light.yaml, _e2e_test.yaml):
    # single-card e2e jobs run on linux-aarch64-a2b3-1 in this CANN 9.0.0 (Atlas A2, 910B) image.
    runner_labels=(("github", ("linux-aarch64-a2b3-1",)), ("buildkite", ("queue=ascend",))),
    probe="npu",
    # A vLLM component on npu: its patched tree without a device, vllm-ascend's release branch over it.
    ci=CI(recipe="tree", timeout_minutes=90, emoji=":zap:", vllm_device="ascend_npu", vllm_num_devices=1,
          vllm_soft_fail=True, plugin="vllm-ascend", plugin_repo="https://github.com/vllm-project/vllm-ascend.git",
          plugin_ref="releases/{target}",
          tree_setup=("VLLM_TARGET_DEVICE=empty python3 -m pip install -e {tree}",
                      "python3 -m pip uninstall -y triton",
                      "git clone --depth 1 -b {ref} {plugin_repo} {plugin}",
                      "python3 -m pip install -r {plugin}/requirements-dev.txt",
                      "python3 -m pip install --force-reinstall --no-deps triton-ascend==3.2.1",
                      "python3 -m pip install -e {plugin} pytest tblib")),
    container="swr.cn-southwest-2.myhuaweicloud.com/base_image/ascend-ci/cann:9.0.0-910b-ubuntu22.04-py3.11",
    # vLLM's own NPU step (v0.20.2 .buildkite/hardware_tests/ascend_npu.yaml runs
    # .buildkite/scripts/hardware_ci/run-npu-test.sh): its `docker run` passes the card, the Ascend device
    # nodes and the host's driver, npu-smi and dcmi into the container.
    docker_devices=("/dev/davinci0", "/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"),
    docker_volumes=("/usr/local/dcmi:/usr/local/dcmi", "/usr/local/bin/npu-smi:/usr/local/bin/npu-smi",
                    "/usr/local/Ascend/driver/lib64/:/usr/local/Ascend/driver/lib64/",
                    "/usr/local/Ascend/driver/version.info:/usr/local/Ascend/driver/version.info",
                    "/etc/ascend_install.info:/etc/ascend_install.info"),
    # vLLM without a device (vllm-ascend's CI does the same), at the release's exact version: a
    # VLLM_VERSION_OVERRIDE keeps it from being 0.20.2+empty, which vllm_version_is("0.20.2") rejects.
    # As vllm-ascend's releases/v0.20.2rc .github/workflows/_e2e_test.yaml does: vLLM from source without a
    # device, then `pip uninstall -y triton` ("Install vllm-project/vllm from source"); vllm-ascend's
    # requirements-dev.txt, triton-ascend reinstalled over what they pulled (--no-deps), then vllm-ascend
    # itself, whose kernels build against CANN ("Install vllm-project/vllm-ascend"). The Ascend package index
    # (PIP_EXTRA_INDEX_URL, its UV_EXTRA_INDEX_URL) is set by the job (ci/github/kvforge.yml).
    install_required="VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE={version} python3 -m pip install -e {tree} "
                     "&& python3 -m pip uninstall -y triton",
    install_component="python3 -m pip install -r {tree}/requirements-dev.txt "
                      "&& python3 -m pip install --force-reinstall --no-deps triton-ascend==3.2.1 "
                      "&& python3 -m pip install -e {tree} pytest tblib",
)

PLATFORMS: dict[str, Platform] = {p.name: p for p in (CPU, CUDA, NPU)}
# The kinds of CI job, in the order kvforge matrix lists them: the patched wheel's build (on a cpu
# runner), then one test job per platform. A new platform (rocm, tpu) is one entry in PLATFORMS.
BUILD = JobKind(name="build", platform="cpu", recipe="build", timeout_minutes=60, emoji=":package:")
JOB_KINDS: dict[str, JobKind] = {BUILD.name: BUILD, **{
    p.name: JobKind(p.name, p.name, p.ci.recipe, p.ci.timeout_minutes, p.ci.emoji) for p in PLATFORMS.values()}}
# What a runner for a platform kvforge cannot build needs (the text `kvforge test --platform` prints).
HARDWARE: dict[str, str] = {p.name: p.hardware for p in PLATFORMS.values() if p.needs_python}


def get(name: str) -> Platform:
    try:
        return PLATFORMS[name]
    except KeyError:
        raise KvforgeError(f"unknown platform {name!r} (known: {', '.join(PLATFORMS)})", EXIT_USAGE) from None


def require_available(name: str, python: Path | None) -> Platform:
    """The platform, or exit 7 (not run) with one line saying what is missing here."""
    plat = get(name)
    ok, why = plat.available(python)
    if not ok:
        raise KvforgeError(f"not run: {name} tests need {plat.hardware}; {why}", EXIT_NOT_RUN)
    return plat


# ---------------------------------------------------------------- availability probes

CUDA_PROBE = """\
import json
out = {}
try:
    import torch
except Exception as exc:
    out["error"] = f"cannot import torch ({type(exc).__name__}: {exc})"
else:
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    try:
        out["available"] = bool(torch.cuda.is_available())
        out["devices"] = torch.cuda.device_count() if out["available"] else 0
        out["name"] = torch.cuda.get_device_name(0) if out["devices"] else ""
    except Exception as exc:
        out["available"], out["error"] = False, f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""

NPU_PROBE = """\
import json
out = {}
try:
    import torch
    import torch_npu  # noqa: F401  (registers torch.npu)
except Exception as exc:
    out["error"] = f"cannot import torch_npu ({type(exc).__name__}: {exc})"
else:
    out["torch"] = torch.__version__
    try:
        out["available"] = bool(torch.npu.is_available())
        out["devices"] = torch.npu.device_count() if out["available"] else 0
    except Exception as exc:
        out["available"], out["error"] = False, f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def _run_probe(python: Path, code: str) -> tuple[dict | None, str]:
    if not Path(python).exists():
        return None, f"{python} does not exist"
    try:
        res = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=PROBE_TIMEOUT)
    except OSError as exc:
        return None, f"cannot run {python}: {exc.strerror}"
    except subprocess.TimeoutExpired:
        return None, f"{python} did not answer within {PROBE_TIMEOUT}s"
    try:
        return json.loads(res.stdout.strip().splitlines()[-1]), ""
    except (IndexError, ValueError):
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"{python} failed: {last}"


def _tool(cmd: list[str]) -> tuple[bool, str]:
    """Run a vendor tool (nvidia-smi, npu-smi): (ran and exited 0, first line of its output or why not)."""
    if shutil.which(cmd[0]) is None:
        return False, f"{cmd[0]} not found"
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{cmd[0]} failed ({exc})"
    first = next((ln.strip() for ln in (res.stdout + res.stderr).splitlines() if ln.strip()), "no output")
    return res.returncode == 0, first if res.returncode == 0 else f"`{' '.join(cmd)}` exited {res.returncode}: {first}"


def _probe_cuda(python: Path | None) -> tuple[bool, str]:
    if python is None:
        ok, line = _tool(["nvidia-smi", "-L"])
        return (True, line) if ok else (False, f"no NVIDIA GPU here ({line})")
    info, err = _run_probe(Path(python), CUDA_PROBE)
    if info is None:
        return False, err
    if "torch" not in info:
        return False, f"{python}: {info.get('error', 'no torch')}"
    if not info.get("cuda"):
        return False, f"torch {info['torch']} in {python} is not a CUDA build (torch.version.cuda is None)"
    if not info.get("available"):
        why = info.get("error") or "torch.cuda.is_available() is False"
        return False, f"torch {info['torch']} (CUDA {info['cuda']}) in {python} sees no GPU: {why}"
    return True, f"torch {info['torch']} in {python} sees {info['devices']} CUDA device(s): {info.get('name', '')}"


def _probe_npu(python: Path | None) -> tuple[bool, str]:
    if python is None:
        ok, line = _tool(["npu-smi", "info"])
        return (True, line) if ok else (False, f"no Ascend NPU here ({line})")
    info, err = _run_probe(Path(python), NPU_PROBE)
    if info is None:
        return False, err
    if "torch" not in info:
        return False, f"{python}: {info.get('error', 'no torch_npu')}"
    if not info.get("available"):
        why = info.get("error") or "torch.npu.is_available() is False"
        return False, f"torch {info['torch']} with torch_npu in {python} sees no NPU: {why}"
    return True, f"torch {info['torch']} in {python} sees {info['devices']} NPU(s)"


# ---------------------------------------------------------------- what `kvforge build` makes, as data

@dataclass(frozen=True)
class PackageBuild:
    """How `kvforge build` overlays the release wheel of one package (keyed by its PyPI name).

    An overlay replaces the package's Python files with the patched tree's and copies everything else
    as stored; what an overlay cannot carry honestly is refused (compiled inputs: the .so files would
    not match them; packaging inputs: the wheel's metadata or file list would not)."""

    package: str  # the PyPI project name, canonical (vllm, vllm-ascend)
    import_packages: tuple[str, ...]  # top-level import packages: a new .py file under one is added
    compile_prefixes: tuple[str, ...]
    compile_files: tuple[str, ...]
    packaging_prefixes: tuple[str, ...]
    packaging_files: tuple[str, ...]
    # How an installed wheel is exercised on a machine that can import it: "vllm" (import vllm, the
    # probe, then the series' Checks with vllm from the wheel); "plugin" (next to the required
    # component's patched tree, import each patched module; the Checks need the device and are not run).
    probe: str
    modules_need: tuple[str, ...] = ()  # modules only the device's stack provides: an import needing one is "not run"


PACKAGE_BUILDS: dict[str, PackageBuild] = {p.package: p for p in (
    PackageBuild(
        package="vllm", import_packages=("vllm",),
        compile_prefixes=("csrc/", "cmake/"), compile_files=("CMakeLists.txt",),
        packaging_prefixes=("requirements/build/",),
        packaging_files=("setup.py", "MANIFEST.in", "use_existing_torch.py", "requirements/build.txt",
                         "requirements/common.txt", "requirements/cuda.txt", "vllm/_version.py"),
        probe="vllm"),
    # vllm-ascend (setup.py builds csrc/ with CANN's toolchain via CMake and writes _build_info.py and
    # _version.py; requirements.txt becomes Requires-Dist).
    PackageBuild(
        package="vllm-ascend", import_packages=("vllm_ascend",),
        compile_prefixes=("csrc/", "cmake/"), compile_files=("CMakeLists.txt",),
        packaging_prefixes=(),
        packaging_files=("setup.py", "MANIFEST.in", "requirements.txt", "packages.txt", "vllm_ascend/_version.py",
                         "vllm_ascend/_build_info.py"),
        probe="plugin", modules_need=("torch_npu", "torchair", "acl", "tbe", "triton")),
)}


@dataclass(frozen=True)
class Device:
    """A `kvforge build --device` build: the package's own source build of the patched tree for a device
    vLLM builds no release wheel for. `empty`: VLLM_TARGET_DEVICE=empty, vLLM with no compiled part (the
    vLLM an out-of-tree platform such as vllm-ascend installs under itself), pure Python, any machine."""

    name: str
    packages: tuple[str, ...]  # which packages build it (PyPI names)
    environ_items: tuple[tuple[str, str], ...]  # set for the build
    # [build-system] requirements of the tree not installed for the build: the CPU env's torch stands in
    # for the pinned CUDA torch (setup.py only imports it when nothing is compiled); cmake and ninja are
    # not run without extensions.
    skip_build_requires: tuple[str, ...]
    import_check: tuple[str, ...]  # modules imported from the installed wheel with the CPU env's torch
    for_platforms: tuple[str, ...]  # kvforge matrix builds it for a target with a component on one of these


DEVICES: dict[str, Device] = {d.name: d for d in (
    Device(name="empty", packages=("vllm",), environ_items=(("VLLM_TARGET_DEVICE", "empty"),),
           skip_build_requires=("torch", "cmake", "ninja"), import_check=("vllm.v1.core",), for_platforms=("npu",)),
)}


def package_build(package: str) -> PackageBuild:
    """The overlay rules of a release package (PyPI name, any spelling); exit 2 for one kvforge has none."""
    key = package.lower().replace("_", "-").replace(".", "-")
    try:
        return PACKAGE_BUILDS[key]
    except KeyError:
        raise KvforgeError(f"kvforge build has no overlay rules for the package {package!r} (known: "
                           f"{', '.join(PACKAGE_BUILDS)}; kvforge/project/platforms.py PACKAGE_BUILDS)", EXIT_USAGE) from None
