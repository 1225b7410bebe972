"""Test environments: a venv that runs a vLLM tree's scheduler-side code and CPU unit tests.

vLLM is never installed into it: pytest runs from the root of a base or patched tree and imports
that tree's `vllm/` source. What the venv holds:

- torch, from a local CPU wheel found in pip's configured find-links (pip is never left to pick a
  torch from the index: that is a CUDA build and GBs of nvidia packages);
- the pure-Python packages vLLM imports at import time, with the version specifiers of the tree's
  own requirements/common.txt (or its PKG-INFO);
- xgrammar without its dependencies (they pull triton), then apache-tvm-ffi>=0.1.11;
- pytest and tblib (vLLM's conftest imports it);
- a tiny vLLM platform plugin that selects the CPU platform (kvforge/data/cpu-platform-plugin),
  installed only here.

Beside it, an offline Hugging Face cache holding the config.json files some tests read
(kvforge/data/hf-configs). Environments are keyed by a hash of everything that goes into them, so
targets whose requirements agree share one. An environment is built in a temporary directory and
renamed into place; the marker file is written last, so a half-built one never counts.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
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
from typing import Callable

from . import gitutil
from .cache import Cache
from .errors import EXIT_ENV, KvforgeError
from .fsutil import file_lock

Progress = Callable[[str], None]
DATA = Path(__file__).resolve().parent / "data"
RECIPE = 1  # bump when the way environments are built changes: every key changes with it
MARKER = "kvforge-env.json"
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
TEST_TOOLS = ("pytest>=8", "tblib")
XGRAMMAR_FFI = "apache-tvm-ffi>=0.1.11"  # vLLM 0.20.x pins 0.1.9, which breaks xgrammar


@dataclass
class EnvSpec:
    """What goes into an environment; its hash is the environment's key."""

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
    external: bool = False  # $KVFORGE_TEST_PYTHON: an interpreter kvforge did not build
    packages: dict[str, str] = field(default_factory=dict)

    def environ(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "PYTEST_ADDOPTS")}
        env.update({
            "HF_HOME": str(self.hf_home),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "VLLM_USAGE_STATS_DISABLED": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "VLLM_CACHE_ROOT": str(self.path / "vllm-cache") if not self.external else str(self.hf_home.parent / "vllm-cache"),
            # Newer vLLM (0.33.0) takes this as an explicit CPU platform; older ones use the plugin.
            "VLLM_TARGET_DEVICE": "cpu",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONPATH": str(DATA / "pytest-plugin"),
        })
        env.update(extra or {})
        return env

    def to_json(self) -> dict:
        return {"path": str(self.path), "python": str(self.python), "key": self.key, "hf_home": str(self.hf_home),
                "reused": self.reused, "seconds": round(self.seconds, 1), "external": self.external,
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


# ---------------------------------------------------------------- requirements from the tree

REQ_RE = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*([^;]*?)\s*(?:;\s*(.+?))?\s*$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


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

def ensure_env(spec: EnvSpec, cache: Cache, rebuild: bool = False, progress: Progress | None = None) -> Env:
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
                      reused=True, seconds=0.0, packages=info.get("packages", {}))
            if not env.python.exists():
                raise KvforgeError(f"{final}: environment {spec.key} is broken ({env.python} is missing); "
                                   "rebuild it with `kvforge env --target NAME --rebuild`", EXIT_ENV)
            return env
        if final.exists():  # no marker: a build that never finished
            say(f"removing unfinished environment {final}")
            shutil.rmtree(final)
        return _build(spec, cache, final, hf, say)


def _build(spec: EnvSpec, cache: Cache, final: Path, hf: Path, say: Progress) -> Env:
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

        begin(f"installing torch {spec.torch} from a local CPU wheel")
        wheel = find_torch_wheel(py, spec.torch)
        say(f"  {wheel}")
        _run([*pip, str(wheel)], log, f"pip install {wheel.name}")
        installed = _run([str(py), "-c", "import importlib.metadata as m; print(m.version('torch'))"], log,
                         "torch check").strip()
        constraints = tmp / "kvforge-constraints.txt"
        constraints.write_text(f"torch=={installed}\n", encoding="utf-8")

        begin(f"installing {len(spec.requirements)} vLLM import-time requirements ({spec.source} specifiers), "
              f"{XGRAMMAR_FFI}, {' '.join(TEST_TOOLS)}")
        reqs = tmp / "kvforge-requirements.txt"
        reqs.write_text("\n".join([*spec.requirements, XGRAMMAR_FFI, *TEST_TOOLS]) + "\n", encoding="utf-8")
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
                 "assert 'kvforge_cpu_platform:register' in eps, eps\n"
                 "assert torch.version.cuda is None, 'torch is a CUDA build: ' + torch.__version__\n"
                 "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))")
        packages = json.loads(_run([str(py), "-c", probe], log, "import check").strip().splitlines()[-1])

        begin("finishing")
        (tmp / "vllm-cache").mkdir(exist_ok=True)
        seconds = time.monotonic() - start
        info = {"key": spec.key, "spec": asdict(spec), "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "seconds": round(seconds, 1), "packages": dict(sorted(packages.items()))}
        os.replace(tmp, final)  # `python -m` use of a venv survives the move: nothing below needs the old path
        (final / MARKER).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"env {spec.key} built in {seconds:.0f}s")
    return Env(path=final, python=final / "bin" / "python", key=spec.key, hf_home=hf, spec=spec, reused=False,
               seconds=seconds, packages=info["packages"])


def _run(cmd: list[str], log: Path, what: str) -> str:
    with open(log, "a", encoding="utf-8") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
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


def pip_find_links(py: Path) -> list[Path]:
    """Local directories in pip's configured find-links (config files and $PIP_FIND_LINKS)."""
    res = subprocess.run([str(py), "-m", "pip", "config", "list"], capture_output=True, text=True)
    values = []
    for line in res.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".find-links") or key.endswith(".find_links"):
            values.append(value.strip().strip("'\""))
    values.append(os.environ.get("PIP_FIND_LINKS", ""))
    out: list[Path] = []
    for v in values:
        for item in v.split():
            item = item[len("file://"):] if item.startswith("file://") else item
            p = Path(item).expanduser()
            if p.is_dir() and p not in out:
                out.append(p)
    return out


def find_torch_wheel(py: Path, version: str) -> Path:
    explicit = os.environ.get("KVFORGE_TORCH_WHEEL")
    if explicit:
        p = Path(explicit).expanduser()
        if not p.is_file():
            raise KvforgeError(f"$KVFORGE_TORCH_WHEEL {p}: no such file", EXIT_ENV)
        return p
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    machine = platform.machine()
    dirs = pip_find_links(py)
    found = []
    for d in dirs:
        for w in d.glob(f"torch-{version}*.whl"):
            parts = w.name[:-4].split("-")
            if len(parts) >= 5 and parts[1].split("+")[0] == version and tag in parts[-3] and machine in parts[-1]:
                found.append(w)
    cpu = [w for w in found if "+cpu" in w.name]
    if cpu or found:
        return sorted(cpu or found)[-1]
    where = ", ".join(map(str, dirs)) or "none configured"
    raise KvforgeError(f"no torch {version} CPU wheel for {tag} {machine} in pip's find-links ({where}); kvforge "
                       "does not let pip take torch from the index (a CUDA build, GBs of downloads): put "
                       f"torch-{version}+cpu-{tag}-...whl in a find-links directory or set $KVFORGE_TORCH_WHEEL",
                       EXIT_ENV)


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
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        writer.writerow([path, f"sha256={digest}", len(data)])
    writer.writerow([f"{dist}.dist-info/RECORD", "", ""])
    files[f"{dist}.dist-info/RECORD"] = record.getvalue().encode()
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


def target_env(ctx, rebuild: bool = False, base=None) -> Env:
    """The environment for ctx's component, from its base's requirements ($KVFORGE_TEST_PYTHON wins)."""
    external = os.environ.get("KVFORGE_TEST_PYTHON")
    if external:
        return external_env(Path(external), ctx.cache, ctx.progress)
    if base is None:
        base = ctx.base()
    spec = env_spec(tree_reader(base.repo, base.commit), f"{ctx.target.name} base {base.commit[:12]}")
    return ensure_env(spec, ctx.cache, rebuild, ctx.progress)


def external_env(python: Path, cache: Cache, progress: Progress | None = None) -> Env:
    """An interpreter the user provides ($KVFORGE_TEST_PYTHON): used as it is, nothing installed into it."""
    python = python.expanduser()
    if progress:
        progress(f"using {python} from $KVFORGE_TEST_PYTHON (not a kvforge-built environment)")
    return Env(path=python.parent.parent, python=python, key="external", hf_home=ensure_hf_home(cache),
               external=True)
