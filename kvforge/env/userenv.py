"""The user's own interpreter (`--python` / `$KVFORGE_PYTHON`; required for cuda and npu).

kvforge probes what the interpreter sees (PROBE: one run, standard library only, with the PYTHONPATH
the test runs get), works out what it lacks of what the tests need (`lacks`: torch, the same set a
built environment gets with the tree's specifiers and, on cpu, kvforge's CPU platform plugin), and
installs only that into an overlay directory in the cache (`<cache>/envs/overlay-<hash>`, `pip install
--target --no-deps`, round by round until the interpreter plus the overlay lack nothing), put on
PYTHONPATH for kvforge's runs.

Invariants:
- Nothing is ever installed, upgraded or uninstalled in the user's interpreter: everything it lacks
  goes into the overlay; `pip freeze` of it is the same afterwards.
- torch is never installed, into the interpreter or an overlay (it must match the hardware): an
  interpreter without torch is refused in one line naming everything it lacks.
- An overlay is keyed by the interpreter (path, prefix, version), the EnvSpec's key, the platform and
  what it lacks; it is built in a temporary directory, its marker (OVERLAY_MARKER) included, and
  renamed into place, so a half-built one never counts. One is reused only while a fresh probe finds
  nothing lacking.

Ownership: Env, EnvSpec, the needed set's fixed part, the CPU plugin wheel, the Hugging Face cache
and the logged command runner are envcore.py's, shared with env.py (which imports this module; this
one never imports env.py). The package-name helpers come from torchsource.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from packaging.markers import UndefinedEnvironmentName
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from kvforge.project import platforms as platforms_mod
from kvforge.core.cache import Cache
from kvforge.env.common import PLUGIN_ENTRY_POINT, RECIPE, Env, EnvSpec, build_plugin_wheel, ensure_hf_home, \
    needed_requirements, run_logged
from kvforge.core.errors import EXIT_ENV, KvforgeError
from kvforge.core.fsutil import file_lock
from kvforge.env.torchsource import Progress, canonical

OVERLAY_MARKER = "kvforge-overlay.json"
NO_DEPS = ("xgrammar",)  # installed without their dependencies (xgrammar's pull triton and torch)


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
        req = Requirement(requirement)
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
            ok = req.specifier.contains(Version(have["version"]), prereleases=True)
        except InvalidVersion:
            ok = False
        return None if ok else Lack(name, want, have["version"], str(req.specifier))

    def unmet_dependencies(self, under: Path) -> list[Lack]:
        """Unmet Requires-Dist of the distributions found under `under` (the overlay), torch left out."""
        out: dict[str, Lack] = {}
        for d in self.dists.values():
            if not _inside(d["location"], under) or canonical(d["name"]) in NO_DEPS:
                continue
            for r in d["requires"]:
                try:
                    lack = self.lack(r)
                except (InvalidRequirement, UndefinedEnvironmentName):
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
            run_logged([*pip, "install", "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
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
    ra, rb = Requirement(a), Requirement(b)
    return f"{ra.name}{SpecifierSet(str(ra.specifier)) & SpecifierSet(str(rb.specifier))}"
