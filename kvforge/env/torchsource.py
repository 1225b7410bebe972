"""Where torch comes from: the source chain of the venvs kvforge builds (kvforge/env/venv.py).

torch, CPU build, is taken from the first of these sources that works (`torch_sources`):
  1. `$KVFORGE_TORCH_WHEEL`, a wheel file;
  2. `--torch-index` / `$KVFORGE_TORCH_INDEX`: a package index URL, a local directory in PEP 503
     "simple" layout (DIR/torch/index.html) or a file:// URL of one;
  3. PyTorch's own CPU index, https://download.pytorch.org/whl/cpu (probed with a short timeout
     first; never tried with `$KVFORGE_OFFLINE=1`);
  4. pip's configured find-links directories.
When no source works, one error line (EXIT_ENV) names every source tried and why it failed.

Invariants:
- torch is never taken from PyPI's CUDA build, nor from any index or find-links pip is configured
  with: it is installed on its own (`--no-deps`) with pip's configuration switched off (`--isolated`,
  PIP_CONFIG_FILE=os.devnull, no PIP_* variables; only how to reach the network carries over), from
  the sources above only. A torch that is a CUDA/ROCm build (or the wrong version) is uninstalled and
  the next source tried. env.py then pins the torch installed with a constraints file, so installing
  the requirements never swaps it.
- From an index, torch is installed in pip's hash-checking mode with the sha256 values the index's
  links give; a link without one is refused. A wheel file's sha256 is recorded.
- It installs only into the venv whose python it is given: one env.py is building. Nothing here
  touches a user's interpreter (userenv.py never installs torch at all).
- Where torch came from (TorchInstall) is recorded in the environment's marker by env.py, never part
  of its key: the same requirements give the same environment whichever source supplied torch.

Dependencies: this module imports neither env.py nor userenv.py. It also holds the few small helpers
all three share (Progress, canonical), so the import graph stays a DAG.
"""

from __future__ import annotations

import html
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from packaging.markers import UndefinedEnvironmentName
from packaging.requirements import InvalidRequirement, Requirement
from packaging.tags import sys_tags
from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from kvforge.core.errors import EXIT_ENV, KvforgeError
from kvforge.core.fsutil import sha256_file

Progress = Callable[[str], None]
# The index PyTorch documents for CPU wheels (`pip install torch --index-url .../whl/cpu`).
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
INDEX_PROBE_TIMEOUT = float(os.environ.get("KVFORGE_INDEX_TIMEOUT", "5"))  # seconds


# ---------------------------------------------------------------- package names and versions (shared)

def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


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
    """$KVFORGE_OFFLINE set: no network probes (as for git remotes in kvforge.git.bases)."""
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
        digest = sha256_file(wheel)
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
        index_digest = (info.get("archive_info", {}).get("hashes") or {}).get("sha256")
        return _accept_torch(py, version, src, info.get("url", url), index_digest,
                             "pip checked it against the sha256 the index's link gives")
    dirs = pip_find_links(py)
    if not dirs:
        raise SourceFailed("none configured")
    try:
        wheel = find_torch_wheel(py, version, dirs)
    except KvforgeError:
        raise SourceFailed(f"no torch {version} wheel for {_best_tag()} in {', '.join(map(str, dirs))}") from None
    digest = sha256_file(wheel)
    _pip_torch(py, ["--no-index", str(wheel)], log)
    return _accept_torch(py, version, src, str(wheel), digest, "sha256 of the file, recorded")


def _best_tag() -> str:
    """This interpreter and platform in a few words (venvs are made from it), e.g. cp311 linux x86_64."""
    return f"cp{sys.version_info.major}{sys.version_info.minor} {sys.platform} {platform.machine()}"


def _wheel_info(name: str):
    """(distribution, Version, tags) of a wheel file name, or None when it is not one."""
    try:
        dist, ver, _build, tags = parse_wheel_filename(name)
    except (InvalidWheelFilename, InvalidVersion):
        return None
    return dist, ver, tags


def _compatible(tags) -> bool:
    return not set(tags).isdisjoint(sys_tags())


def _check_wheel_name(name: str, version: str) -> None:
    info = _wheel_info(name)
    if info is None or canonical(info[0]) != "torch":
        raise SourceFailed(f"{name} is not a torch wheel")
    if info[1].public != Version(version).public:
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
    want = Version(version).public
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
    have = ", ".join(sorted(versions, key=lambda v: Version(v))[-5:]) or "none"
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
    venv = py.parent.parent
    dist = next(iter(importlib.metadata.distributions(name="torch", path=_site_packages(venv))), None)
    problem = None
    if dist is None:
        problem = "pip installed no torch"
    else:
        ver = Version(dist.version)
        gpu = []
        for r in dist.requires or []:
            try:
                req = Requirement(r)
                active = req.marker is None or req.marker.evaluate({"extra": ""})
            except (InvalidRequirement, UndefinedEnvironmentName):
                continue
            name = canonical(req.name)
            if active and (name.startswith("nvidia-") or name in ("triton", "pytorch-triton-rocm")):
                gpu.append(req.name)
        if ver.public != Version(version).public:
            problem = f"it gave torch {ver}, not {version}"
        elif (ver.local or "").startswith(("cu", "rocm")) or gpu:
            problem = f"torch {ver} is a GPU build (needs {', '.join(gpu[:3]) or ver.local})"
    if problem:
        subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torch"], capture_output=True,
                       env=pip_clean_env())
        raise SourceFailed(problem)
    assert dist is not None  # else problem is set
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
