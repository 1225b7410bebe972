"""Test environments: the Python that runs a vLLM tree's scheduler-side code and its unit tests.

vLLM is never installed by kvforge: pytest runs from the root of a base or patched tree and imports
that tree's `vllm/` source. There are two kinds of environment (docs/environments.md):

A venv kvforge builds (cpu platform, the default), under `<cache>/envs/<key>`, holding

- torch, CPU build, installed alone from the first source that works (kvforge/env/torchsource.py:
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
lacks of the same set in an overlay in the cache, never installed into it (kvforge/env/userenv.py).

A component built on another (vllm-ascend on vllm) adds, on cpu, the PyPI requirements its tests
import and the required environment lacks (`[components.tests] requirements`): `pip install --target`
by that environment's interpreter into `<cache>/envs/layer-<hash>`, with every package the environment
already has pinned to its version (constraints), keyed by the environment's key and the list
(`layer_requirements`), and put on PYTHONPATH by the Layer. The environment's key names the layer, so
records keyed by it (baselines) follow a changed list.

Beside both, an offline Hugging Face cache holding the config.json files some tests read
(kvforge/data/hf-configs). Built environments are keyed by a hash of everything that goes into them
(EnvSpec.key: Python, torch version, requirements, recipe, plugin), so targets whose requirements
agree share one. Environments are built in a temporary directory and renamed into place; the marker
file is written last, so a half-built one never counts.

Modules: this one owns the needed set, building a venv and the public entry points (target_env,
external_env). EnvSpec, Env, the plugin wheel, the HF cache and the logged command runner are
envcore.py's (shared with userenv.py). It imports torchsource.py (where torch comes from), envcore.py
and userenv.py (the user's interpreter); none of them imports it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from kvforge.git import gitutil
from kvforge.project import platforms as platforms_mod
from kvforge.core.cache import Cache
from kvforge.env.components import layer
from kvforge.core.errors import EXIT_ENV, EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import file_lock
from kvforge.env.common import (DATA, PLUGIN_ENTRY_POINT, RECIPE, TEST_TOOLS, XGRAMMAR_FFI, Env, EnvSpec, build_plugin_wheel,
                      ensure_hf_home, run_logged)
from kvforge.core.outcome import Done
from kvforge.env.torchsource import Progress, canonical, install_torch, torch_sources
from kvforge.env.userenv import user_env

MARKER = "kvforge-env.json"
LAYER_MARKER = "kvforge-layer.json"
TORCH = os.environ.get("KVFORGE_TORCH_VERSION", "2.13.0")

# Distributions vLLM's scheduler side and its CPU unit tests import, by canonical name. Each gets
# the tree's own specifier when its requirements name it. A tuple lists names one package went by.
NEEDED: tuple[str | tuple[str, ...], ...] = (
    "numpy", "packaging", "psutil", "pyzmq", "urllib3", "regex", "msgspec", "pydantic", "cbor2",
    "huggingface-hub", "safetensors", "transformers", "tokenizers", "gguf", "aiohttp", "requests",
    ("openai-harmony", "oss-harmony"), "openai", "pillow", "pybase64", "cachetools", "cloudpickle",
    "uvloop", "py-cpuinfo", "prometheus-client", "llguidance", "einops", "fastapi", "partial-json-parser",
    "blake3", "sentencepiece", "tqdm", "protobuf", "typing-extensions", "filelock", "pyyaml",
)


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
        run_logged([sys.executable, "-m", "venv", str(tmp)], log, "python -m venv")
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
        run_logged([*pip, "-c", str(constraints), "-r", str(reqs)], log, "pip install (vLLM requirements)")

        xgrammar = spec.xgrammar
        assert xgrammar is not None, "env_spec always names xgrammar"
        begin(f"installing {xgrammar.split(';')[0].strip()} without its dependencies (they pull triton)")
        run_logged([*pip, "--no-deps", xgrammar], log, f"pip install --no-deps {xgrammar}")

        begin("installing kvforge's CPU platform plugin (vllm.platform_plugins; this environment only)")
        plugin = build_plugin_wheel(tmp)
        run_logged([*pip, "--no-deps", "--no-index", str(plugin)], log, "pip install kvforge-cpu-platform")
        plugin.unlink()

        begin("checking imports")
        probe = ("import importlib.metadata as m, json, torch, transformers, xgrammar, pytest, tblib\n"
                 "eps = [e.value for e in m.entry_points(group='vllm.platform_plugins')]\n"
                 f"assert {PLUGIN_ENTRY_POINT!r} in eps, eps\n"
                 "assert torch.version.cuda is None, 'torch is a CUDA build: ' + torch.__version__\n"
                 "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))")
        packages = json.loads(run_logged([str(py), "-c", probe], log, "import check").strip().splitlines()[-1])
        if packages.get("torch") != torch.version:
            raise KvforgeError(f"torch changed from {torch.version} to {packages.get('torch')} while installing "
                               f"the requirements (log: {log})", EXIT_ENV)

        begin("finishing")
        (tmp / "vllm-cache").mkdir(exist_ok=True)
        seconds = time.monotonic() - start
        info: dict[str, Any] = {
            "key": spec.key, "spec": asdict(spec), "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "seconds": round(seconds, 1), "torch_source": asdict(torch), "packages": dict(sorted(packages.items()))}
        os.replace(tmp, final)  # `python -m` use of a venv survives the move: nothing below needs the old path
        (final / MARKER).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"env {spec.key} built in {seconds:.0f}s")
    return Env(path=final, python=final / "bin" / "python", key=spec.key, hf_home=hf, spec=spec, reused=False,
               seconds=seconds, packages=info["packages"], torch_source=info["torch_source"])


# ---------------------------------------------------------------- the environment of a target

def target_env(ctx, rebuild: bool = False, base=None, platform: str = "cpu") -> Env:
    """The environment for ctx's component on `platform`, from its base's requirements.

    A component that `requires` another (vllm-ascend) gets that component's environment; on cpu
    with a Layer (kvforge/env/components.py): the required component's patched tree and the declared
    stand-ins on PYTHONPATH. On npu the runner's interpreter has both trees installed itself.

    ctx.python (--python / $KVFORGE_PYTHON): that interpreter plus an overlay of what it lacks;
    required for cuda and npu (kvforge builds CPU environments only). Otherwise a kvforge-built venv
    whose torch comes from ctx.torch_index or the other sources (torch_sources). The deprecated
    $KVFORGE_TEST_PYTHON uses an interpreter exactly as it is: no check, no overlay.
    """
    requires = getattr(getattr(ctx, "component", None), "requires", None)
    if requires:  # built on another component: its env, plus (cpu) its tree and stand-ins
        env = target_env(ctx.for_component(requires), rebuild, None, platform)
        if platform == "cpu":
            env.layer = layer(ctx)
            # The key names what the tests ran with: records keyed by it (baselines) follow the required tree.
            key = f"{env.key}-on-{env.layer.requires}-{env.layer.commit[:12]}"
            if env.layer.requirements:
                env.layer.site = layer_requirements(env, env.layer.requirements, ctx.cache, ctx.progress,
                                                    rebuild)
                key += f"-with-{env.layer.site.name.removeprefix('layer-')}"
            env.key = key
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


def layer_key(env: Env, requirements: list[str]) -> str:
    """The hash naming a requirements layer: the environment it sits on and the list, in order."""
    payload = {"recipe": RECIPE, "env": env.key, "python": str(env.python), "requirements": list(requirements)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def layer_requirements(env: Env, requirements: list[str], cache: Cache, progress: Progress | None = None,
                       rebuild: bool = False) -> Path:
    """`<cache>/envs/layer-<hash>`: `requirements` installed for env's interpreter, never into it.

    `pip install --target` by env's python, with every distribution env already has pinned to its
    version (a constraints file), so a dependency pip installs again (numpy) is the same version and
    torch is never replaced. Built in a temporary directory with its marker (LAYER_MARKER) and renamed
    into place: a directory of that name is always complete. Reused while the marker is there."""
    say = progress or (lambda _m: None)
    h = layer_key(env, requirements)
    final = cache.envs / f"layer-{h}"
    cache.envs.mkdir(parents=True, exist_ok=True)
    with file_lock(cache.envs / f".layer-{h}.lock", say, f"requirements layer {h}"):
        if rebuild and final.exists():
            say(f"removing requirements layer {final.name} (--rebuild)")
            shutil.rmtree(final)
        if (final / LAYER_MARKER).is_file():
            return final
        shutil.rmtree(final, ignore_errors=True)
        start = time.monotonic()
        tmp = cache.envs / f".layer-{h}.building-{os.getpid()}"
        log = cache.envs / f"layer-{h}.build.log"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        log.write_text("", encoding="utf-8")
        say(f"installing the component's test requirements {', '.join(requirements)} into {final} (log: {log})")
        try:
            constraints = tmp / "kvforge-constraints.txt"
            constraints.write_text("".join(f"{n}=={v}\n" for n, v in sorted(env.packages.items())), encoding="utf-8")
            reqs = tmp / "kvforge-requirements.txt"
            reqs.write_text("\n".join(requirements) + "\n", encoding="utf-8")
            run_logged([str(env.python), "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
                        "--progress-bar", "off", "--target", str(tmp), "-c", str(constraints), "-r", str(reqs)],
                       log, f"pip install --target {final.name}")
            info = {"key": h, "env": env.key, "requirements": list(requirements),
                    "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seconds": round(time.monotonic() - start, 1)}
            (tmp / LAYER_MARKER).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    say(f"requirements layer {final.name} built in {time.monotonic() - start:.0f}s")
    return final


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
