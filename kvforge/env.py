"""Test environments: the Python that runs a vLLM tree's scheduler-side code and its unit tests.

vLLM is never installed by kvforge: pytest runs from the root of a base or patched tree and imports
that tree's `vllm/` source. There are two kinds of environment (docs/environments.md):

A venv kvforge builds (cpu platform, the default), under `<cache>/envs/<key>`, holding

- torch, CPU build, from the first of these sources that works (`torch_sources`):
  1. `$KVFORGE_TORCH_WHEEL`, a wheel file;
  2. `--torch-index` / `$KVFORGE_TORCH_INDEX`: a package index URL, a local directory in PEP 503
     "simple" layout (DIR/torch/index.html) or a file:// URL of one;
  3. PyTorch's own CPU index, https://download.pytorch.org/whl/cpu (probed with a short timeout
     first; never tried with `$KVFORGE_OFFLINE=1`);
  4. pip's configured find-links directories.
  torch is installed on its own (`--no-deps`), with pip's configuration switched off so no
  configured index or find-links can supply it; from an index it is installed in pip's
  hash-checking mode with the sha256 values the index's links give (a link without one is
  refused). A torch that is a CUDA/ROCm build is refused. When no source works, one error line names
  every source tried and why it failed. Where torch came from is recorded, never part of the key;
- the pure-Python packages vLLM imports at import time, with the version specifiers of the tree's
  own requirements/common.txt (or its PKG-INFO), plus torch's own dependencies, installed with a
  constraints file pinning the torch just installed (pip never swaps it for PyPI's CUDA torch);
- xgrammar without its dependencies (they pull triton), then apache-tvm-ffi>=0.1.11;
- pytest and tblib (vLLM's conftest imports it);
- a tiny vLLM platform plugin that selects the CPU platform (kvforge/data/cpu-platform-plugin),
  installed only here.

Or the user's own interpreter (`--python` / `$KVFORGE_PYTHON`; required for cuda and npu): kvforge
probes what it lacks of the same set and installs only that into an overlay directory in the cache
(`<cache>/envs/overlay-<hash>`, put on PYTHONPATH for kvforge's runs), never into the interpreter.
torch is never installed into an overlay: without torch the interpreter is refused.

Beside both, an offline Hugging Face cache holding the config.json files some tests read
(kvforge/data/hf-configs). Built environments are keyed by a hash of everything that goes into them,
so targets whose requirements agree share one. Environments and overlays are built in a temporary
directory and renamed into place; the marker file is written last, so a half-built one never counts.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import html
import importlib.metadata
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from . import gitutil
from . import platforms as platforms_mod
from .cache import Cache
from .errors import EXIT_ENV, EXIT_USAGE, KvforgeError
from .fsutil import file_lock

Progress = Callable[[str], None]
DATA = Path(__file__).resolve().parent / "data"
RECIPE = 1  # bump when the way environments are built changes: every key changes with it
MARKER = "kvforge-env.json"
OVERLAY_MARKER = "kvforge-overlay.json"
TORCH = os.environ.get("KVFORGE_TORCH_VERSION", "2.13.0")
# The index PyTorch documents for CPU wheels (`pip install torch --index-url .../whl/cpu`).
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
INDEX_PROBE_TIMEOUT = float(os.environ.get("KVFORGE_INDEX_TIMEOUT", "5"))  # seconds
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
NO_DEPS = ("xgrammar",)  # installed without their dependencies (xgrammar's pull triton and torch)


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

    def environ(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "PYTEST_ADDOPTS")}
        path = [str(DATA / "pytest-plugin")] + ([str(self.overlay)] if self.overlay else [])
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
        env.update(extra or {})
        return env

    def to_json(self) -> dict:
        return {"path": str(self.path), "python": str(self.python), "key": self.key, "hf_home": str(self.hf_home),
                "reused": self.reused, "seconds": round(self.seconds, 1), "external": self.external,
                "platform": self.platform, "overlay": str(self.overlay) if self.overlay else None,
                "torch_source": self.torch_source,
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


def _packaging() -> SimpleNamespace:
    """packaging (a kvforge dependency through its tools), else the copy pip vendors."""
    try:
        from packaging import markers, requirements, specifiers, tags, utils, version
    except ImportError:  # pragma: no cover - depends on the installation
        from pip._vendor.packaging import markers, requirements, specifiers, tags, utils, version
    return SimpleNamespace(Requirement=requirements.Requirement, InvalidRequirement=requirements.InvalidRequirement,
                           SpecifierSet=specifiers.SpecifierSet, Version=version.Version,
                           InvalidVersion=version.InvalidVersion, sys_tags=tags.sys_tags,
                           parse_wheel_filename=utils.parse_wheel_filename, UndefinedName=markers.UndefinedEnvironmentName,
                           InvalidWheelFilename=utils.InvalidWheelFilename)


# ---------------------------------------------------------------- torch: where it comes from

class SourceFailed(Exception):
    """A torch source that did not give a usable torch; the message is the reason (a few words)."""


@dataclass(frozen=True)
class TorchSource:
    kind: str  # wheel | index | find-links
    label: str  # how messages name it
    location: str = ""  # the wheel file or index, as given
    default: bool = False  # PyTorch's own index: needs the network, skipped with $KVFORGE_OFFLINE=1

    @property
    def short(self) -> str:
        return {"wheel": "$KVFORGE_TORCH_WHEEL", "find-links": "pip's find-links"}.get(
            self.kind, "PyTorch's CPU index" if self.default else "--torch-index")


@dataclass
class TorchInstall:
    """Where the torch of a built environment came from (recorded in its marker, not in its key)."""

    source: str  # the source's label
    kind: str
    version: str  # as installed, e.g. 2.13.0+cpu
    file: str  # wheel path or URL
    sha256: str | None
    checked: str  # how the file was checked


def torch_sources(torch_index: str | None = None) -> list[TorchSource]:
    """The sources of torch, in the order they are tried (see the module docstring)."""
    out = []
    wheel = os.environ.get("KVFORGE_TORCH_WHEEL")
    if wheel:
        out.append(TorchSource("wheel", f"$KVFORGE_TORCH_WHEEL {wheel}", wheel))
    if torch_index:
        out.append(TorchSource("index", f"--torch-index {torch_index}", torch_index))
    out.append(TorchSource("index", f"PyTorch's CPU index {PYTORCH_CPU_INDEX}", PYTORCH_CPU_INDEX, default=True))
    out.append(TorchSource("find-links", "pip's find-links"))
    return out


def offline() -> bool:
    """$KVFORGE_OFFLINE set: no network probes (as for git remotes in kvforge.bases)."""
    return bool(os.environ.get("KVFORGE_OFFLINE"))


def install_torch(py: Path, version: str, torch_index: str | None, log: Path,
                  progress: Progress | None = None) -> TorchInstall:
    """Install torch `version` (CPU) alone into the venv of `py` from the first source that works.

    When none does, raise one line naming every source tried and why it failed (EXIT_ENV).
    """
    say = progress or (lambda _m: None)
    failures = []
    for src in torch_sources(torch_index):
        try:
            got = _install_from(src, py, version, log, say)
        except (SourceFailed, KvforgeError) as exc:
            reason = str(exc).replace("\n", " ")
            failures.append(f"{src.label}: {reason}")
            say(f"  torch from {src.label}: {reason}")
            continue
        say(f"  torch {got.version} from {src.label}" + (f" (sha256 {got.sha256[:16]}…, {got.checked})"
                                                         if got.sha256 else ""))
        return got
    tag = _best_tag()
    raise KvforgeError(f"no torch {version} CPU wheel for {tag} from any source: " + "; ".join(failures)
                       + " (set $KVFORGE_TORCH_WHEEL to a wheel file, or --torch-index to an index or directory "
                         "that has it)", EXIT_ENV)


def _install_from(src: TorchSource, py: Path, version: str, log: Path, say: Progress) -> TorchInstall:
    if src.kind == "wheel":
        wheel = Path(src.location).expanduser()
        if not wheel.is_file():
            raise SourceFailed("no such file")
        _check_wheel_name(wheel.name, version)
        digest = _sha256(wheel)
        _pip_torch(py, ["--no-index", str(wheel)], log)
        return _accept_torch(py, version, src, str(wheel), digest, "sha256 of the file, recorded")
    if src.kind == "index":
        url, page = _index_page(src)
        hashes = _index_hashes(page, version, url)
        reqs = log.parent / f"{log.stem}.torch-requirements.txt"
        reqs.write_text(f"torch=={version} " + " ".join(f"--hash=sha256:{h}" for h in hashes) + "\n",
                        encoding="utf-8")
        report = _pip_torch(py, ["--index-url", url, "--require-hashes", "-r", str(reqs)], log)
        reqs.unlink(missing_ok=True)
        info = (report.get("install") or [{}])[0].get("download_info", {})
        digest = (info.get("archive_info", {}).get("hashes") or {}).get("sha256")
        return _accept_torch(py, version, src, info.get("url", url), digest,
                             "pip checked it against the sha256 the index's link gives")
    dirs = pip_find_links(py)
    if not dirs:
        raise SourceFailed("none configured")
    try:
        wheel = find_torch_wheel(py, version, dirs)
    except KvforgeError:
        raise SourceFailed(f"no torch {version} wheel for {_best_tag()} in {', '.join(map(str, dirs))}") from None
    digest = _sha256(wheel)
    _pip_torch(py, ["--no-index", str(wheel)], log)
    return _accept_torch(py, version, src, str(wheel), digest, "sha256 of the file, recorded")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _best_tag() -> str:
    """This interpreter and platform in a few words (venvs are made from it), e.g. cp311 linux x86_64."""
    return f"cp{sys.version_info.major}{sys.version_info.minor} {sys.platform} {platform.machine()}"


def _wheel_info(name: str):
    """(distribution, Version, tags) of a wheel file name, or None when it is not one."""
    pk = _packaging()
    try:
        dist, ver, _build, tags = pk.parse_wheel_filename(name)
    except (pk.InvalidWheelFilename, pk.InvalidVersion):
        return None
    return dist, ver, tags


def _compatible(tags) -> bool:
    return not set(tags).isdisjoint(_packaging().sys_tags())


def _check_wheel_name(name: str, version: str) -> None:
    info = _wheel_info(name)
    if info is None or canonical(info[0]) != "torch":
        raise SourceFailed(f"{name} is not a torch wheel")
    if info[1].public != _packaging().Version(version).public:
        raise SourceFailed(f"{name} is torch {info[1]}, not {version}")
    if not _compatible(info[2]):
        raise SourceFailed(f"{name} does not install on this Python/platform ({_best_tag()})")


def _index_page(src: TorchSource) -> tuple[str, str]:
    """(the index URL for pip, the text of its torch page); local directories and file:// URLs read
    from disk; PyTorch's index is probed with a short timeout (never with $KVFORGE_OFFLINE=1)."""
    where = src.location
    if where.startswith("file:"):
        local: Path | None = Path(urllib.request.url2pathname(urllib.parse.urlparse(where).path))
    elif "://" not in where:
        local = Path(where).expanduser().resolve()
    else:
        local = None
    if local is not None:
        if not local.is_dir():
            raise SourceFailed(f"{local} is not a directory")
        page = local / "torch" / "index.html"
        if not page.is_file():
            raise SourceFailed(f"no {page} (a PEP 503 index directory has DIR/torch/index.html)")
        return local.as_uri(), page.read_text(encoding="utf-8", errors="replace")
    url = where.rstrip("/")
    if src.default and offline():
        raise SourceFailed("not tried: $KVFORGE_OFFLINE=1 (no network)")
    try:
        req = urllib.request.Request(f"{url}/torch/", headers={"Accept": "text/html", "User-Agent": "kvforge"})
        with urllib.request.urlopen(req, timeout=INDEX_PROBE_TIMEOUT) as resp:
            return url, resp.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        raise SourceFailed(f"{url}/torch/ answered HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        why = getattr(exc, "reason", exc)
        raise SourceFailed(f"unreachable ({why}; probed with a {INDEX_PROBE_TIMEOUT:g}s timeout)") from None


LINK_RE = re.compile(r"""<a\s[^>]*?href\s*=\s*["']([^"']+)["']""", re.I)


def _index_hashes(page: str, version: str, url: str) -> list[str]:
    """sha256 values the index's links give for the torch `version` wheels this interpreter can use.

    They go to pip as `--hash` in hash-checking mode, so pip refuses a file whose sha256 differs, and a
    wheel whose link gives no sha256 is refused here. The trust anchor is the index page itself: it
    guards against a corrupted or swapped download, not against a compromised index.
    """
    want = _packaging().Version(version).public
    hashed, unhashed, versions, other_platforms, gpu = [], [], set(), 0, 0
    for href in LINK_RE.findall(page):
        href = html.unescape(href)
        file_url, _, fragment = href.partition("#")
        name = urllib.parse.unquote(file_url.rsplit("/", 1)[-1])
        info = _wheel_info(name) if name.endswith(".whl") else None
        if info is None or canonical(info[0]) != "torch":
            continue
        versions.add(info[1].public)
        if info[1].public != want:
            continue
        if not _compatible(info[2]):
            other_platforms += 1
            continue
        if info[1].local and info[1].local.startswith(("cu", "rocm")):
            gpu += 1  # a GPU build on a mixed index
            continue
        m = re.search(r"(?:^|&)sha256=([0-9a-fA-F]{64})(?:&|$)", fragment)
        (hashed.append(m.group(1).lower()) if m else unhashed.append(name))
    if hashed:
        return hashed
    if unhashed:
        raise SourceFailed(f"its links give no sha256 for {', '.join(unhashed[:3])}: not installing an unchecked torch")
    if other_platforms or gpu:
        raise SourceFailed(f"torch {want} is there only as GPU builds or for other platforms than {_best_tag()}")
    have = ", ".join(sorted(versions, key=lambda v: _packaging().Version(v))[-5:]) or "none"
    raise SourceFailed(f"no torch {want} wheel at {url}/torch/ (versions there: {have})")


def pip_clean_env() -> dict[str, str]:
    """The environment for a pip that must see no configured index or find-links: no PIP_* variables,
    no config files (PIP_CONFIG_FILE=os.devnull makes pip skip every one of them)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PIP_") and k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


# pip settings that only say how to reach the network; carried over into the isolated torch step.
PIP_NETWORK = {"cert": "--cert", "client-cert": "--client-cert", "proxy": "--proxy", "trusted-host": "--trusted-host",
               "timeout": "--timeout", "default-timeout": "--timeout", "retries": "--retries",
               "cache-dir": "--cache-dir"}


def pip_config(py: Path) -> list[tuple[str, str, str]]:
    """pip's configuration as (section, key, value): config files and PIP_* variables (section ':env:')."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    try:
        res = subprocess.run([str(py), "-m", "pip", "config", "list"], capture_output=True, text=True, env=env,
                             timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return []
    out = []
    for line in res.stdout.splitlines():
        key, sep, value = line.partition("=")
        if not sep or "." not in key:
            continue
        section, name = key.rsplit(".", 1)
        out.append((section, name.replace("_", "-"), value.strip().strip("'\"")))
    return out


def pip_network_options(py: Path) -> list[str]:
    rank = {"global": 0, "install": 1, ":env:": 2}  # pip's precedence: environment over install over global
    chosen: dict[str, tuple[int, str]] = {}
    for section, name, value in pip_config(py):
        opt = PIP_NETWORK.get(name)
        if opt and section in rank and rank[section] >= chosen.get(opt, (-1, ""))[0]:
            chosen[opt] = (rank[section], value)
    args = []
    for opt, (_r, value) in sorted(chosen.items()):
        for v in (value.split() if opt == "--trusted-host" else [value]):
            args += [opt, v]
    return args


def _pip_torch(py: Path, args: list[str], log: Path) -> dict:
    """`pip install --no-deps` of torch alone, blind to pip's configuration; returns pip's --report."""
    report = log.parent / f"{log.stem}.torch-report.json"
    report.unlink(missing_ok=True)
    cmd = [str(py), "-m", "pip", "install", "--isolated", "--disable-pip-version-check", "--no-input",
           "--progress-bar", "off", "--no-deps", "--report", str(report), *pip_network_options(py), *args]
    with open(log, "a", encoding="utf-8") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=pip_clean_env(), cwd=log.parent)
        except OSError as exc:
            raise SourceFailed(f"cannot run {py}: {exc.strerror}") from None
        fh.write(proc.stdout)
    if proc.returncode != 0:
        raise SourceFailed(f"pip: {pip_failure(proc.stdout)} (log: {log})")
    try:
        data = json.loads(report.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = {}
    report.unlink(missing_ok=True)
    return data


def pip_failure(output: str) -> str:
    """The line of pip's output that says why it failed; a hash mismatch as expected/got."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    if any("DO NOT MATCH THE HASHES" in ln for ln in lines):
        expected = next((ln.split("Expected sha256", 1)[1].strip() for ln in lines if "Expected sha256" in ln), "?")
        got = next((ln.split("Got", 1)[1].strip() for ln in lines if ln.startswith("Got")), "?")
        return f"sha256 mismatch: the index says {expected[:16]}…, the downloaded file is {got[:16]}…"
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    return errors[-1][len("ERROR:"):].strip() if errors else (lines[-1] if lines else "no output")


def _site_packages(venv: Path) -> list[str]:
    return [str(p) for p in sorted(venv.glob("lib/python*/site-packages"))]


def _accept_torch(py: Path, version: str, src: TorchSource, file: str, digest: str | None,
                  checked: str) -> TorchInstall:
    """Refuse (and uninstall) a torch that is the wrong version or a CUDA/ROCm build."""
    pk = _packaging()
    venv = py.parent.parent
    dist = next(iter(importlib.metadata.distributions(name="torch", path=_site_packages(venv))), None)
    problem = None
    if dist is None:
        problem = "pip installed no torch"
    else:
        ver = pk.Version(dist.version)
        gpu = []
        for r in dist.requires or []:
            try:
                req = pk.Requirement(r)
                active = req.marker is None or req.marker.evaluate({"extra": ""})
            except (pk.InvalidRequirement, pk.UndefinedName):
                continue
            name = canonical(req.name)
            if active and (name.startswith("nvidia-") or name in ("triton", "pytorch-triton-rocm")):
                gpu.append(req.name)
        if ver.public != pk.Version(version).public:
            problem = f"it gave torch {ver}, not {version}"
        elif (ver.local or "").startswith(("cu", "rocm")) or gpu:
            problem = f"torch {ver} is a GPU build (needs {', '.join(gpu[:3]) or ver.local})"
    if problem:
        subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torch"], capture_output=True,
                       env=pip_clean_env())
        raise SourceFailed(problem)
    return TorchInstall(source=src.label, kind=src.kind, version=dist.version, file=file, sha256=digest,
                        checked=checked)


def pip_find_links(py: Path) -> list[Path]:
    """Local directories in pip's configured find-links (config files and $PIP_FIND_LINKS)."""
    values = [value for _section, name, value in pip_config(py) if name == "find-links"]
    values.append(os.environ.get("PIP_FIND_LINKS", ""))
    out: list[Path] = []
    for v in values:
        for item in v.split():
            item = urllib.request.url2pathname(urllib.parse.urlparse(item).path) if item.startswith("file:") else item
            p = Path(item).expanduser()
            if p.is_dir() and p not in out:
                out.append(p)
    return out


def find_torch_wheel(py: Path, version: str, dirs: list[Path] | None = None) -> Path:
    """A torch `version` wheel this interpreter can install, from local find-links directories (a
    +cpu build preferred)."""
    dirs = pip_find_links(py) if dirs is None else dirs
    found = []
    for d in dirs:
        for w in d.glob("torch-*.whl"):
            try:
                _check_wheel_name(w.name, version)
            except SourceFailed:
                continue
            found.append(w)
    cpu = [w for w in found if "+cpu" in w.name]
    if cpu or found:
        return sorted(cpu or found)[-1]
    where = ", ".join(map(str, dirs)) or "none configured"
    raise KvforgeError(f"no torch {version} wheel for {_best_tag()} in pip's find-links ({where})", EXIT_ENV)


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


# ---------------------------------------------------------------- the user's own interpreter

# Runs in the user's interpreter: what it sees (with the same PYTHONPATH the test runs get). Only the
# standard library; the marker environment is computed as packaging.markers.default_environment does.
PROBE = r"""
import importlib.metadata as md, importlib.util, json, os, platform, sys

def fmt(info):
    v = "%d.%d.%d" % (info.major, info.minor, info.micro)
    return v + (info.releaselevel[0] + str(info.serial) if info.releaselevel != "final" else "")

markers = {
    "implementation_name": sys.implementation.name,
    "implementation_version": fmt(sys.implementation.version),
    "os_name": os.name, "platform_machine": platform.machine(), "platform_release": platform.release(),
    "platform_system": platform.system(), "platform_version": platform.version(),
    "python_full_version": platform.python_version(),
    "platform_python_implementation": platform.python_implementation(),
    "python_version": ".".join(platform.python_version_tuple()[:2]), "sys_platform": sys.platform,
}
dists = []
for d in md.distributions():
    name = d.metadata["Name"]
    if name:
        dists.append({"name": name, "version": d.version, "requires": d.requires or [],
                      "location": str(d.locate_file(""))})
try:
    eps = [e.value for e in md.entry_points(group="vllm.platform_plugins")]
except TypeError:  # Python < 3.10
    eps = [e.value for e in md.entry_points().get("vllm.platform_plugins", [])]
print(json.dumps({"executable": sys.executable, "prefix": sys.prefix, "version": platform.python_version(),
                  "markers": markers, "pip": importlib.util.find_spec("pip") is not None,
                  "entry_points": eps, "dists": dists}))
"""


@dataclass(frozen=True)
class Lack:
    """Something an interpreter lacks: absent, or a version outside the specifier."""

    name: str  # canonical
    want: str  # what to install: 'name<specifier>' (or a wheel file)
    have: str | None = None
    needs: str = ""  # the specifier, for messages

    def __str__(self) -> str:
        if self.have is None:
            return f"{self.name} (not installed)"
        return f"{self.name} {self.have} (needs {self.needs})"


class Interpreter:
    """What one probe of a user's interpreter saw: its marker environment and distributions."""

    def __init__(self, python: Path, info: dict):
        self.python = python
        self.info = info
        self.markers = {**info["markers"], "extra": ""}
        self.dists: dict[str, dict] = {}
        for d in info["dists"]:  # sys.path order: the first one is what an import finds
            self.dists.setdefault(canonical(d["name"]), d)

    @property
    def entry_points(self) -> list[str]:
        return self.info.get("entry_points", [])

    def lack(self, requirement: str) -> Lack | None:
        """None when `requirement` is met (or its marker excludes this interpreter)."""
        pk = _packaging()
        req = pk.Requirement(requirement)
        if req.marker is not None and not req.marker.evaluate(self.markers):
            return None
        name = canonical(req.name)
        want = f"{req.name}{req.specifier}"
        have = self.dists.get(name)
        if have is None:
            return Lack(name, want)
        if not req.specifier:
            return None
        try:
            ok = req.specifier.contains(pk.Version(have["version"]), prereleases=True)
        except pk.InvalidVersion:
            ok = False
        return None if ok else Lack(name, want, have["version"], str(req.specifier))

    def unmet_dependencies(self, under: Path) -> list[Lack]:
        """Unmet Requires-Dist of the distributions found under `under` (the overlay), torch left out."""
        pk = _packaging()
        out: dict[str, Lack] = {}
        for d in self.dists.values():
            if not _inside(d["location"], under) or canonical(d["name"]) in NO_DEPS:
                continue
            for r in d["requires"]:
                try:
                    lack = self.lack(r)
                except (pk.InvalidRequirement, pk.UndefinedName):
                    continue
                if lack is not None and lack.name != "torch":
                    out.setdefault(lack.name, lack)
        return list(out.values())


def _inside(location: str, under: Path) -> bool:
    try:
        Path(location).resolve().relative_to(under.resolve())
        return True
    except ValueError:
        return False


def probe_interpreter(python: Path, environ: dict[str, str]) -> Interpreter:
    try:
        res = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, env=environ, timeout=300)
    except OSError as exc:
        raise KvforgeError(f"{python}: cannot run it: {exc.strerror}", EXIT_ENV) from None
    except subprocess.TimeoutExpired:
        raise KvforgeError(f"{python}: did not answer kvforge's probe within 300s", EXIT_ENV) from None
    try:
        info = json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise KvforgeError(f"{python}: is not a Python kvforge can use ({last})", EXIT_ENV) from None
    return Interpreter(python, info)


def needed_requirements(spec: EnvSpec) -> list[str]:
    """What the tests need besides torch (and, on cpu, the plugin): the same set a built env gets."""
    return [*spec.requirements, *([spec.xgrammar] if spec.xgrammar else []), XGRAMMAR_FFI, *TEST_TOOLS]


def lacks(interp: Interpreter, spec: EnvSpec, platform_name: str) -> list[Lack]:
    """Everything `interp` lacks for the tests, torch first when absent."""
    out = [] if "torch" in interp.dists else [Lack("torch", "torch")]
    seen = set()
    for r in needed_requirements(spec):
        lack = interp.lack(r)
        if lack is not None and lack.name not in seen:
            seen.add(lack.name)
            out.append(lack)
    if platforms_mod.get(platform_name).cpu_plugin and PLUGIN_ENTRY_POINT not in interp.entry_points:
        out.append(Lack("kvforge-cpu-platform", "kvforge-cpu-platform"))
    return out


def user_env(python: Path, spec: EnvSpec, cache: Cache, platform_name: str = "cpu", rebuild: bool = False,
             progress: Progress | None = None, origin: str = "--python") -> Env:
    """The user's interpreter, with what it lacks installed into an overlay in the cache (never into it)."""
    say = progress or (lambda _m: None)
    python = Path(os.path.abspath(Path(python).expanduser()))  # not resolved: a venv's python is a symlink
    if not python.exists():
        raise KvforgeError(f"{python}: no such interpreter ({origin})", EXIT_ENV)
    hf = ensure_hf_home(cache)
    bare = Env(path=python.parent.parent, python=python, key="", hf_home=hf, spec=spec, external=True,
               platform=platform_name)
    interp = probe_interpreter(python, bare.environ())
    missing = lacks(interp, spec, platform_name)
    if any(m.name == "torch" for m in missing):
        raise KvforgeError(f"{python} ({origin}) has no torch; it lacks: {', '.join(map(str, missing))}. kvforge never "
                           "installs torch into your interpreter or an overlay (it must match your hardware): "
                           "install torch there, or leave out --python to use a kvforge-built CPU environment",
                           EXIT_ENV)
    overlay = None
    reused = True
    start = time.monotonic()
    if missing:
        h = hashlib.sha256(json.dumps({"recipe": RECIPE, "python": str(python), "prefix": interp.info["prefix"],
                                       "version": interp.info["version"], "spec": spec.key, "platform": platform_name,
                                       "lacks": sorted(m.want for m in missing)}, sort_keys=True).encode()).hexdigest()[:16]
        overlay = cache.envs / f"overlay-{h}"
        with file_lock(cache.envs / f".overlay-{h}.lock", say, f"overlay {h}"):
            if rebuild and overlay.exists():
                say(f"removing overlay {overlay.name} (--rebuild)")
                shutil.rmtree(overlay)
            if (overlay / OVERLAY_MARKER).is_file() and not _still_lacking(bare, overlay, spec, platform_name):
                say(f"using {python} with overlay {overlay} ({len(missing)} packages it lacks)")
            else:
                reused = False
                _build_overlay(python, interp, bare, missing, spec, platform_name, overlay, cache, say)
    else:
        say(f"using {python} as it is: it has everything the tests need")
    env = Env(path=Path(interp.info["prefix"]), python=python, key="", hf_home=hf, spec=spec, reused=reused,
              seconds=time.monotonic() - start, external=True, overlay=overlay, platform=platform_name)
    env.key = "python-" + hashlib.sha256(f"{python}\0{spec.key}\0{platform_name}\0{overlay}".encode()).hexdigest()[:12]
    final = probe_interpreter(python, env.environ())
    env.packages = {d["name"]: d["version"] for d in final.dists.values()}
    return env


def _still_lacking(bare: Env, overlay: Path, spec: EnvSpec, platform_name: str) -> list[Lack]:
    view = replace(bare, overlay=overlay)
    interp = probe_interpreter(bare.python, view.environ())
    return lacks(interp, spec, platform_name) + interp.unmet_dependencies(overlay)


def _build_overlay(python: Path, interp: Interpreter, bare: Env, missing: list[Lack], spec: EnvSpec,
                   platform_name: str, final: Path, cache: Cache, say: Progress) -> None:
    """pip install --target, --no-deps, of what is missing; then of what those need and the interpreter
    lacks (their dependencies are checked against the interpreter plus the overlay), until nothing is."""
    start = time.monotonic()
    log = cache.envs / f"{final.name}.build.log"
    log.write_text("", encoding="utf-8")
    work = cache.envs / f".{final.name}.building-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    shown = ", ".join(map(str, missing))
    say(f"{python} lacks {len(missing)} of what the tests need: {shown}; installing them into the overlay "
        f"{final} (never into your interpreter; log: {log})")
    if interp.info.get("pip"):
        pip = [str(python), "-m", "pip"]
    else:  # an interpreter without pip (uv-made venvs): kvforge's own pip, pointed at it
        pip = [sys.executable, "-m", "pip", "--python", str(python)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PIP_NO_INPUT="1", PYTHONDONTWRITEBYTECODE="1")
    wants: dict[str, str] = {}
    for m in missing:
        wants[m.name] = str(build_plugin_wheel(work)) if m.name == "kvforge-cpu-platform" else m.want
    target = work / "overlay"
    try:
        for round_ in range(1, 8):
            shutil.rmtree(target, ignore_errors=True)
            reqs = work / "requirements.txt"
            reqs.write_text("\n".join(wants.values()) + "\n", encoding="utf-8")
            say(f"overlay {final.name}: round {round_}: pip install --target --no-deps {len(wants)} packages "
                f"({time.monotonic() - start:.0f}s)")
            _run([*pip, "install", "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
                  "--no-deps", "--target", str(target), "-r", str(reqs)], log,
                 f"pip install --target {final.name}", env=env)
            view = replace(bare, overlay=target)
            seen = probe_interpreter(python, view.environ())
            still = lacks(seen, spec, platform_name) + seen.unmet_dependencies(target)
            if not still:
                break
            grew = False
            for lack in still:
                if lack.name not in wants:
                    wants[lack.name], grew = lack.want, True
                elif lack.name != "kvforge-cpu-platform":
                    merged = _merge(wants[lack.name], lack.want)
                    grew, wants[lack.name] = grew or merged != wants[lack.name], merged
            if not grew:
                raise KvforgeError(f"overlay for {python}: pip cannot satisfy {', '.join(map(str, still))} "
                                   f"(log: {log})", EXIT_ENV)
        else:
            raise KvforgeError(f"overlay for {python}: still lacking {', '.join(map(str, still))} after "
                               f"{round_} rounds (log: {log})", EXIT_ENV)
        installed = {d["name"]: d["version"] for d in seen.dists.values() if _inside(d["location"], target)}
        (target / OVERLAY_MARKER).write_text(json.dumps(
            {"python": str(python), "prefix": interp.info["prefix"], "spec": spec.key, "platform": platform_name,
             "lacked": [str(m) for m in missing], "installed": dict(sorted(installed.items())),
             "built": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=2) + "\n", encoding="utf-8")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(target, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    shadowed = [f"{n} {interp.dists[canonical(n)]['version']}" for n in installed if canonical(n) in interp.dists]
    say(f"overlay {final.name}: {len(installed)} packages in {time.monotonic() - start:.0f}s"
        + (f"; for kvforge's runs they shadow your {', '.join(shadowed)}" if shadowed else ""))


def _merge(a: str, b: str) -> str:
    pk = _packaging()
    ra, rb = pk.Requirement(a), pk.Requirement(b)
    return f"{ra.name}{pk.SpecifierSet(str(ra.specifier)) & pk.SpecifierSet(str(rb.specifier))}"


# ---------------------------------------------------------------- the environment of a target

def target_env(ctx, rebuild: bool = False, base=None, platform: str = "cpu") -> Env:
    """The environment for ctx's component on `platform`, from its base's requirements.

    ctx.python (--python / $KVFORGE_PYTHON): that interpreter plus an overlay of what it lacks;
    required for cuda and npu (kvforge builds CPU environments only). Otherwise a kvforge-built venv
    whose torch comes from ctx.torch_index or the other sources (torch_sources). The deprecated
    $KVFORGE_TEST_PYTHON uses an interpreter exactly as it is: no check, no overlay.
    """
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
