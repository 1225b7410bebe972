"""Test environments: the Python that runs a vLLM tree's scheduler-side code and its unit tests.

vLLM is never installed by kvforge: pytest runs from the root of a base or patched tree and imports
that tree's `vllm/` source. There are two kinds of environment (docs/environments.md):

A venv kvforge builds (cpu platform, the default), under `<cache>/envs/<key>`, holding

- torch, CPU build, installed alone from the first source that works (kvforge/torchsource.py:
  `$KVFORGE_TORCH_WHEEL`, `--torch-index`, PyTorch's CPU index, pip's find-links); where it came from
  is recorded in the marker, never part of the key;
- the pure-Python packages vLLM imports at import time, with the version specifiers of the tree's
  own requirements/common.txt (or its PKG-INFO), plus torch's own dependencies, installed with a
  constraints file pinning the torch just installed (pip never swaps it for PyPI's CUDA torch);
- xgrammar without its dependencies (they pull triton), then apache-tvm-ffi>=0.1.11;
- pytest and tblib (vLLM's conftest imports it);
- a tiny vLLM platform plugin that selects the CPU platform (kvforge/data/cpu-platform-plugin),
  installed only here (and into overlays).

Or the user's own interpreter (`--python` / `$KVFORGE_PYTHON`; required for cuda and npu), with what it
lacks of the same set in an overlay in the cache, never installed into it (kvforge/userenv.py).

Beside both, an offline Hugging Face cache holding the config.json files some tests read
(kvforge/data/hf-configs). Built environments are keyed by a hash of everything that goes into them
(EnvSpec.key: Python, torch version, requirements, recipe, plugin), so targets whose requirements
agree share one. Environments are built in a temporary directory and renamed into place; the marker
file is written last, so a half-built one never counts.

Modules: this one owns EnvSpec and Env, the needed set, building a venv, the plugin wheel, the HF
cache and the public entry points (target_env, external_env). It imports torchsource.py (where
torch comes from) and userenv.py (the user's interpreter); neither imports it at module level.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from . import gitutil
from . import platforms as platforms_mod
from .cache import Cache
from .errors import EXIT_ENV, EXIT_USAGE, KvforgeError
from .fsutil import file_lock
from .outcome import Done
from .torchsource import Progress, canonical, install_torch, torch_sources
from .userenv import user_env

if TYPE_CHECKING:
    from .components import Layer

DATA = Path(__file__).resolve().parent / "data"
RECIPE = 1  # bump when the way environments are built changes: every key changes with it
MARKER = "kvforge-env.json"
TORCH = os.environ.get("KVFORGE_TORCH_VERSION", "2.13.0")
PLUGIN_ENTRY_POINT = "kvforge_cpu_platform:register"

# Distributions vLLM's scheduler side and its CPU unit tests import, by canonical name. Each gets
# the tree's own specifier when its requirements name it. A tuple lists names one package went by.
NEEDED: tuple[str | tuple[str, ...], ...] = (
    "numpy", "packaging", "psutil", "pyzmq", "urllib3", "regex", "msgspec", "pydantic", "cbor2",
    "huggingface-hub", "safetensors", "transformers", "tokenizers", "gguf", "aiohttp", "requests",
    ("openai-harmony", "oss-harmony"), "openai", "pillow", "pybase64", "cachetools", "cloudpickle",
    "uvloop", "py-cpuinfo", "prometheus-client", "llguidance", "einops", "fastapi", "partial-json-parser",
    "blake3", "sentencepiece", "tqdm", "protobuf", "typing-extensions", "filelock", "pyyaml",
)
TEST_TOOLS = ("pytest>=8", "tblib")
XGRAMMAR_FFI = "apache-tvm-ffi>=0.1.11"  # vLLM 0.20.x pins 0.1.9, which breaks xgrammar


@dataclass
class EnvSpec:
    """What goes into an environment; its hash is the environment's key (not where torch came from)."""

    python: str  # X.Y.Z of the interpreter the venv is made from
    torch: str
    requirements: list[str]  # the needed set, with the tree's specifiers
    xgrammar: str | None
    source: str  # where the specifiers were read: requirements/common.txt or PKG-INFO
    data: str = ""  # hash of the plugin source shipped with kvforge

    @property
    def key(self) -> str:
        payload = {"recipe": RECIPE, "python": self.python, "torch": self.torch, "requirements": self.requirements,
                   "xgrammar": self.xgrammar, "ffi": XGRAMMAR_FFI, "tools": TEST_TOOLS, "data": self.data}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Env:
    """A usable environment: run `python -m pytest` with `environ()` from a tree's root."""

    path: Path
    python: Path
    key: str
    hf_home: Path
    spec: EnvSpec | None = None
    reused: bool = True
    seconds: float = 0.0
    external: bool = False  # an interpreter kvforge did not build (--python, $KVFORGE_TEST_PYTHON)
    packages: dict[str, str] = field(default_factory=dict)
    overlay: Path | None = None  # what an external interpreter lacked, installed in the cache (PYTHONPATH)
    platform: str = "cpu"
    torch_source: dict | None = None  # where a built env's torch came from (never part of the key)
    # A component built on another (vllm-ascend on vllm): that one's patched tree and the declared
    # stand-ins on top of this env (kvforge/components.py); None for a component of its own.
    layer: "Layer | None" = None

    def environ(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "PYTEST_ADDOPTS",
                            "KVFORGE_STANDINS", "KVFORGE_STANDINS_DIR")}
        path = ([str(DATA / "pytest-plugin")] + (self.layer.pythonpath() if self.layer else [])
                + ([str(self.overlay)] if self.overlay else []))
        env.update({
            "HF_HOME": str(self.hf_home),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "VLLM_USAGE_STATS_DISABLED": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "VLLM_CACHE_ROOT": str(self.path / "vllm-cache") if not self.external else str(self.hf_home.parent / "vllm-cache"),
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONPATH": os.pathsep.join(path),
        })
        env.update(platforms_mod.get(self.platform).environ)  # cpu: VLLM_TARGET_DEVICE=cpu
        env.update(self.layer.environ if self.layer else {})  # VLLM_PLUGINS, KVFORGE_STANDINS(_DIR)
        env.update(extra or {})
        return env

    def to_json(self) -> dict:
        return {"path": str(self.path), "python": str(self.python), "key": self.key, "hf_home": str(self.hf_home),
                "reused": self.reused, "seconds": round(self.seconds, 1), "external": self.external,
                "platform": self.platform, "overlay": str(self.overlay) if self.overlay else None,
                "torch_source": self.torch_source, "layer": self.layer.to_json() if self.layer else None,
                "spec": asdict(self.spec) if self.spec else None, "packages": self.packages}

    def check(self) -> None:
        """Fail with one line when the interpreter is gone or cannot import pytest."""
        if not self.python.exists():
            raise KvforgeError(f"{self.python}: the test environment's python does not exist"
                               + ("" if self.external else "; rebuild it with `kvforge env --target NAME --rebuild`"),
                               EXIT_ENV)
        try:
            res = subprocess.run([str(self.python), "-c", "import pytest"], capture_output=True, text=True,
                                 env=self.environ(), timeout=120)
        except OSError as exc:
            raise KvforgeError(f"{self.python}: cannot run the test environment's python: {exc.strerror}",
                               EXIT_ENV) from None
        if res.returncode != 0:
            last = (res.stderr.strip().splitlines() or ["failed"])[-1]
            raise KvforgeError(f"{self.python}: the test environment is broken ({last})", EXIT_ENV)


def needed_requirements(spec: EnvSpec) -> list[str]:
    """What the tests need besides torch (and, on cpu, the plugin): the same set a built env gets."""
    return [*spec.requirements, *([spec.xgrammar] if spec.xgrammar else []), XGRAMMAR_FFI, *TEST_TOOLS]


# ---------------------------------------------------------------- requirements from the tree

REQ_RE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*([^;]*?)\s*(?:;\s*(.+?))?\s*$")


def parse_requirements(text: str, where: str) -> dict[str, str]:
    """Requirement lines -> {canonical name: 'name<specifiers>[; marker]'}, extras dropped."""
    out: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = re.sub(r"(^|\s)#.*$", "", raw).strip()
        if not line or line.startswith("-"):
            continue
        m = REQ_RE.match(line)
        if not m:
            raise KvforgeError(f"{where}:{n}: cannot read requirement {raw.strip()!r}", EXIT_ENV)
        name, spec, marker = m.group(1), re.sub(r"\s+", "", m.group(3)), m.group(4)
        out[canonical(name)] = name + spec + (f"; {marker}" if marker else "")
    return out


def pkg_info_requirements(text: str) -> str:
    lines = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            value = line.split(":", 1)[1].strip()
            if "extra ==" not in value:
                lines.append(value)
    return "\n".join(lines)


def tree_reader(repo: Path, commit: str) -> Callable[[str], str | None]:
    """Read a file of a commit without a checkout."""

    def read(path: str) -> str | None:
        res = gitutil.run(repo, "show", f"{commit}:{path}", check=False)
        return res.stdout if res.returncode == 0 else None

    return read


def dir_reader(root: Path) -> Callable[[str], str | None]:
    def read(path: str) -> str | None:
        p = root / path
        return p.read_text(encoding="utf-8") if p.is_file() else None

    return read


def env_spec(read: Callable[[str], str | None], where: str) -> EnvSpec:
    """The environment a tree needs, from requirements/common.txt (git or sdist) or PKG-INFO (sdist)."""
    text = read("requirements/common.txt")
    source = "requirements/common.txt"
    if text is None:
        info = read("PKG-INFO")
        if info is None:
            raise KvforgeError(f"{where}: has neither requirements/common.txt nor PKG-INFO: "
                               "cannot tell which packages vLLM needs", EXIT_ENV)
        text, source = pkg_info_requirements(info), "PKG-INFO"
    reqs = parse_requirements(text, f"{where}:{source}")
    chosen = []
    for entry in NEEDED:
        names = entry if isinstance(entry, tuple) else (entry,)
        found = next((reqs[n] for n in names if n in reqs), None)
        chosen.append(found or names[0])
    return EnvSpec(python=platform.python_version(), torch=TORCH, requirements=chosen,
                   xgrammar=reqs.get("xgrammar", "xgrammar"), source=source, data=_data_hash())


def _data_hash() -> str:
    h = hashlib.sha256()
    for p in sorted((DATA / "cpu-platform-plugin").rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(DATA)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- building

def ensure_env(spec: EnvSpec, cache: Cache, rebuild: bool = False, progress: Progress | None = None,
               torch_index: str | None = None) -> Env:
    """Return the environment for `spec`, building it on first use (or with `rebuild`)."""
    say = progress or (lambda _m: None)
    hf = ensure_hf_home(cache)
    final = cache.envs / spec.key
    with file_lock(cache.envs / f".{spec.key}.lock", say, f"environment {spec.key}"):
        if rebuild and final.exists():
            say(f"removing environment {spec.key} (--rebuild)")
            shutil.rmtree(final)
        marker = final / MARKER
        if marker.is_file():
            info = json.loads(marker.read_text(encoding="utf-8"))
            env = Env(path=final, python=final / "bin" / "python", key=spec.key, hf_home=hf, spec=spec,
                      reused=True, seconds=0.0, packages=info.get("packages", {}),
                      torch_source=info.get("torch_source"))
            if not env.python.exists():
                raise KvforgeError(f"{final}: environment {spec.key} is broken ({env.python} is missing); "
                                   "rebuild it with `kvforge env --target NAME --rebuild`", EXIT_ENV)
            return env
        if final.exists():  # no marker: a build that never finished
            say(f"removing unfinished environment {final}")
            shutil.rmtree(final)
        return _build(spec, cache, final, hf, say, torch_index)


def _build(spec: EnvSpec, cache: Cache, final: Path, hf: Path, say: Progress, torch_index: str | None = None) -> Env:
    start = time.monotonic()
    tmp = cache.envs / f".{spec.key}.building-{os.getpid()}"
    log = cache.envs / f"{spec.key}.build.log"
    shutil.rmtree(tmp, ignore_errors=True)
    steps = 7
    step = 0

    def begin(what: str) -> None:
        nonlocal step
        step += 1
        say(f"env {spec.key} [{step}/{steps}] {what} ({time.monotonic() - start:.0f}s)")

    say(f"building test environment {spec.key} in {final} (log: {log})")
    log.write_text("", encoding="utf-8")
    try:
        begin(f"creating a venv with {sys.executable} (Python {spec.python})")
        _run([sys.executable, "-m", "venv", str(tmp)], log, "python -m venv")
        py = tmp / "bin" / "python"
        pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
               "--progress-bar", "off"]

        begin(f"installing torch {spec.torch} (CPU) alone, from the first of: "
              + ", ".join(s.short for s in torch_sources(torch_index)))
        torch = install_torch(py, spec.torch, torch_index, log, say)
        constraints = tmp / "kvforge-constraints.txt"
        constraints.write_text(f"torch=={torch.version}\n", encoding="utf-8")

        begin(f"installing torch's dependencies, {len(spec.requirements)} vLLM import-time requirements "
              f"({spec.source} specifiers), {XGRAMMAR_FFI}, {' '.join(TEST_TOOLS)}")
        reqs = tmp / "kvforge-requirements.txt"
        # "torch" (pinned by the constraints to the one installed) brings its own dependencies.
        reqs.write_text("\n".join(["torch", *spec.requirements, XGRAMMAR_FFI, *TEST_TOOLS]) + "\n", encoding="utf-8")
        _run([*pip, "-c", str(constraints), "-r", str(reqs)], log, "pip install (vLLM requirements)")

        begin(f"installing {spec.xgrammar.split(';')[0].strip()} without its dependencies (they pull triton)")
        _run([*pip, "--no-deps", spec.xgrammar], log, f"pip install --no-deps {spec.xgrammar}")

        begin("installing kvforge's CPU platform plugin (vllm.platform_plugins; this environment only)")
        plugin = build_plugin_wheel(tmp)
        _run([*pip, "--no-deps", "--no-index", str(plugin)], log, "pip install kvforge-cpu-platform")
        plugin.unlink()

        begin("checking imports")
        probe = ("import importlib.metadata as m, json, torch, transformers, xgrammar, pytest, tblib\n"
                 "eps = [e.value for e in m.entry_points(group='vllm.platform_plugins')]\n"
                 f"assert {PLUGIN_ENTRY_POINT!r} in eps, eps\n"
                 "assert torch.version.cuda is None, 'torch is a CUDA build: ' + torch.__version__\n"
                 "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))")
        packages = json.loads(_run([str(py), "-c", probe], log, "import check").strip().splitlines()[-1])
        if packages.get("torch") != torch.version:
            raise KvforgeError(f"torch changed from {torch.version} to {packages.get('torch')} while installing "
                               f"the requirements (log: {log})", EXIT_ENV)

        begin("finishing")
        (tmp / "vllm-cache").mkdir(exist_ok=True)
        seconds = time.monotonic() - start
        info = {"key": spec.key, "spec": asdict(spec), "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "seconds": round(seconds, 1), "torch_source": asdict(torch), "packages": dict(sorted(packages.items()))}
        os.replace(tmp, final)  # `python -m` use of a venv survives the move: nothing below needs the old path
        (final / MARKER).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"env {spec.key} built in {seconds:.0f}s")
    return Env(path=final, python=final / "bin" / "python", key=spec.key, hf_home=hf, spec=spec, reused=False,
               seconds=seconds, packages=info["packages"], torch_source=info["torch_source"])


def _run(cmd: list[str], log: Path, what: str, env: dict[str, str] | None = None) -> str:
    with open(log, "a", encoding="utf-8") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        if env is None:
            env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
            env["PIP_NO_INPUT"] = "1"
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=fh, text=True, env=env, cwd=log.parent)
        except OSError as exc:
            raise KvforgeError(f"{what}: cannot run {cmd[0]}: {exc.strerror}", EXIT_ENV) from None
        fh.write(proc.stdout)
    if proc.returncode != 0:
        text = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
        errors = [ln.strip() for ln in text if ln.strip().startswith(("ERROR:", "error:", "AssertionError",
                                                                       "ModuleNotFoundError", "ImportError"))]
        last = errors[-1] if errors else (text[-1].strip() if text else "no output")
        raise KvforgeError(f"{what} failed: {last} (full log: {log})", EXIT_ENV)
    return proc.stdout


def build_plugin_wheel(where: Path) -> Path:
    """Make the CPU platform plugin's wheel from the source shipped in kvforge/data."""
    src = DATA / "cpu-platform-plugin"
    meta = (src / "METADATA").read_text(encoding="utf-8")
    name = re.search(r"^Name: (.+)$", meta, re.M).group(1).strip()
    version = re.search(r"^Version: (.+)$", meta, re.M).group(1).strip()
    dist = f"{name.replace('-', '_')}-{version}"
    files = {f"{dist}.dist-info/METADATA": meta.encode(),
             f"{dist}.dist-info/entry_points.txt": (src / "entry_points.txt").read_bytes(),
             f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: kvforge\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    for p in sorted((src / "kvforge_cpu_platform").rglob("*.py")):
        files[str(p.relative_to(src))] = p.read_bytes()
    from .wheel import format_record, record_hash

    rows = [(path, record_hash(data), str(len(data))) for path, data in files.items()]
    files[f"{dist}.dist-info/RECORD"] = format_record([*rows, (f"{dist}.dist-info/RECORD", "", "")])
    wheel = where / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            zf.writestr(zipfile.ZipInfo(path, date_time=(2026, 1, 1, 0, 0, 0)), data)
    return wheel


def ensure_hf_home(cache: Cache) -> Path:
    """An offline Hugging Face cache (hub layout) with the config.json files vLLM's CPU tests read."""
    src = DATA / "hf-configs"
    h = hashlib.sha256()
    configs = sorted(src.glob("*--*/config.json"))
    for c in configs:
        h.update(c.parent.name.encode() + b"\0" + c.read_bytes())
    key = h.hexdigest()[:12]
    home = cache.envs / f"hf-{key}"
    if (home / ".complete").is_file():
        return home
    tmp = cache.envs / f".hf-{key}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for c in configs:
        rev = hashlib.sha1(c.read_bytes()).hexdigest()  # a stable stand-in for the hub's commit id
        model = tmp / "hub" / f"models--{c.parent.name}"
        (model / "snapshots" / rev).mkdir(parents=True)
        shutil.copyfile(c, model / "snapshots" / rev / "config.json")
        (model / "refs").mkdir()
        (model / "refs" / "main").write_text(rev, encoding="utf-8")
    (tmp / ".complete").write_text(key + "\n", encoding="utf-8")
    try:
        os.replace(tmp, home)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return home


# ---------------------------------------------------------------- the environment of a target

def target_env(ctx, rebuild: bool = False, base=None, platform: str = "cpu") -> Env:
    """The environment for ctx's component on `platform`, from its base's requirements.

    A component that `requires` another (vllm-ascend) gets that component's environment; on cpu
    with a Layer (kvforge/components.py): the required component's patched tree and the declared
    stand-ins on PYTHONPATH. On npu the runner's interpreter has both trees installed itself.

    ctx.python (--python / $KVFORGE_PYTHON): that interpreter plus an overlay of what it lacks;
    required for cuda and npu (kvforge builds CPU environments only). Otherwise a kvforge-built venv
    whose torch comes from ctx.torch_index or the other sources (torch_sources). The deprecated
    $KVFORGE_TEST_PYTHON uses an interpreter exactly as it is: no check, no overlay.
    """
    comp = getattr(ctx, "component", None)
    if getattr(comp, "requires", None):  # built on another component: its env, plus (cpu) its tree and stand-ins
        from .components import layer

        env = target_env(ctx.for_component(comp.requires), rebuild, None, platform)
        if platform == "cpu":
            env.layer = layer(ctx)
            # The key names what the tests ran with: records keyed by it (baselines) follow the required tree.
            env.key = f"{env.key}-on-{env.layer.requires}-{env.layer.commit[:12]}"
        return env
    plat = platforms_mod.get(platform)
    python = getattr(ctx, "python", None)
    if python is None and os.environ.get("KVFORGE_TEST_PYTHON"):
        return external_env(Path(os.environ["KVFORGE_TEST_PYTHON"]), ctx.cache, ctx.progress, platform)
    if python is None and plat.needs_python:
        raise KvforgeError(f"--platform {platform}: kvforge builds CPU environments only; pass --python PATH "
                           f"(an interpreter on a machine with {plat.hardware})", EXIT_USAGE)
    if base is None:
        base = ctx.base()
    spec = env_spec(tree_reader(base.repo, base.commit), f"{ctx.target.name} base {base.commit[:12]}")
    if python is not None:
        return user_env(Path(python), spec, ctx.cache, platform, rebuild, ctx.progress)
    return ensure_env(spec, ctx.cache, rebuild, ctx.progress, torch_index=getattr(ctx, "torch_index", None))


def external_env(python: Path, cache: Cache, progress: Progress | None = None, platform: str = "cpu") -> Env:
    """$KVFORGE_TEST_PYTHON (deprecated; use --python): an interpreter used exactly as it is."""
    python = python.expanduser()
    if progress:
        progress(f"using {python} from $KVFORGE_TEST_PYTHON as it is, unchecked (deprecated: --python or "
                 "$KVFORGE_PYTHON checks it and supplies what it lacks)")
    return Env(path=python.parent.parent, python=python, key="external", hf_home=ensure_hf_home(cache),
               external=True, platform=platform)


def env_command(ctx, rebuild: bool = False, platform: str = "cpu") -> Done:
    """`kvforge env`: the target's environment (built once), and how it came to be."""
    env = target_env(ctx, rebuild=rebuild, platform=platform)
    how = "external" if env.external else ("reused" if env.reused else f"built in {env.seconds:.0f}s")
    return Done(env.to_json(), f"{ctx.target.name}: env {env.key} ({how}): {env.python}"
                + (f"; overlay {env.overlay}" if getattr(env, "overlay", None) else ""))
