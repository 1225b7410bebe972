"""What every test environment shares, whoever makes it (env.py: a venv kvforge builds; userenv.py: the
user's interpreter with an overlay): EnvSpec (what goes in; its hash is the key) and Env (a usable
environment), the needed set's fixed part, kvforge's CPU platform plugin wheel, the offline Hugging Face
cache and the logged command runner.

Both env.py and userenv.py import this module; it imports neither, so the two never import each other
in a loop.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvforge.project import platforms as platforms_mod
from kvforge.core.cache import Cache
from kvforge.env.components import Layer
from kvforge.core.errors import EXIT_ENV, KvforgeError
from kvforge.core.wheel import format_record, record_hash

from kvforge import DATA
RECIPE = 1  # bump when the way environments are built changes: every key changes with it
PLUGIN_ENTRY_POINT = "kvforge_cpu_platform:register"
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
    # stand-ins on top of this env (kvforge/env/components.py); None for a component of its own.
    layer: Layer | None = None

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


def run_logged(cmd: list[str], log: Path, what: str, env: dict[str, str] | None = None) -> str:
    """Run `cmd`, its output appended to `log`; on failure one line (EXIT_ENV) with the log's last error."""
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
    name, version = (_metadata_field(meta, key, src) for key in ("Name", "Version"))
    dist = f"{name.replace('-', '_')}-{version}"
    files = {f"{dist}.dist-info/METADATA": meta.encode(),
             f"{dist}.dist-info/entry_points.txt": (src / "entry_points.txt").read_bytes(),
             f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: kvforge\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    for p in sorted((src / "kvforge_cpu_platform").rglob("*.py")):
        files[str(p.relative_to(src))] = p.read_bytes()
    rows = [(path, record_hash(data), str(len(data))) for path, data in files.items()]
    files[f"{dist}.dist-info/RECORD"] = format_record([*rows, (f"{dist}.dist-info/RECORD", "", "")])
    wheel = where / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            zf.writestr(zipfile.ZipInfo(path, date_time=(2026, 1, 1, 0, 0, 0)), data)
    return wheel


def _metadata_field(meta: str, key: str, src: Path) -> str:
    m = re.search(rf"^{key}: (.+)$", meta, re.M)
    if m is None:
        raise KvforgeError(f"{src}/METADATA has no {key}: the CPU platform plugin shipped with kvforge is broken",
                           EXIT_ENV)
    return m.group(1).strip()


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
