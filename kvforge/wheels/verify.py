"""Verification, on every build, before the wheel gets its name in --out (a failing wheel is deleted):
1. `pip install --no-deps --no-compile --target DIR` of the new wheel with the test environment's
   python;
2. RECORD: every line of the wheel's RECORD against the installed file (sha256 and size), and no
   installed file that pip's RECORD does not list;
3. every file the series changes, as installed, equals the patched tree's (and removed ones are gone);
4. `import vllm` from DIR in the CPU test environment: where `vllm.__file__` points, the version
   against the release (the check vllm-ascend makes), the identity file, and whether the compiled
   `vllm._C` loads (a CUDA wheel's does not on a CPU-only machine: it needs libcuda; vLLM imports
   it lazily and the scheduler side does not need it);
5. the series' Checks (plus, with --tests all, the platform's selection) with pytest from a
   directory holding only the patched tree's tests/ and pyproject.toml, so `import vllm` resolves
   to DIR; a pytest plugin records the file of every vllm module the tests loaded, and each must
   lie in DIR.
A wheel this machine's CPU env cannot import (aarch64 here, or vllm_ascend's cp310) is installed for its
own tags (pip --platform/--abi) and checked by RECORD, files, .so and metadata; its import and tests are
reported "not run". A plugin package (vllm-ascend) is imported next to the patched vLLM tree instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform as host_platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

from packaging.utils import parse_wheel_filename

from kvforge.core.fsutil import remove_stale
from kvforge.core.wheel import parse_record, read_member, read_members, record_hash
from kvforge.env.components import layer
from kvforge.env.venv import Env, target_env
from kvforge.git import gitutil
from kvforge.git.context import Context
from kvforge.git.trees import Stack
from kvforge.project.platforms import PackageBuild
from kvforge.project.targets import WheelPin
from kvforge.proof.testrun import run_properties, run_pytest, unique
from kvforge.wheels.changes import VLLM_RULES, read_blobs
from kvforge.wheels.overlay import IDENTITY_FILE, local_version
from kvforge.wheels.result import Change, Verification
from kvforge.wheels.stage import builds_dir

STALE_VERIFY = r"^\.verify-(?P<pid>\d+)$"

PROBE = r"""
import importlib.metadata as md, json, os, sys
from packaging.version import Version
out = {"sys_path0": sys.path[:3]}
import vllm
out["vllm_file"] = vllm.__file__
out["version"] = vllm.__version__
out["metadata_version"] = md.version("vllm")
out["version_is_release"] = Version(vllm.__version__) == Version(os.environ["KVFORGE_RELEASE"])
dist = md.distribution("vllm")
out["identity"] = json.loads(dist.read_text("kvforge.json") or "null")
out["wheel_build"] = [ln.split(":", 1)[1].strip() for ln in (dist.read_text("WHEEL") or "").splitlines()
                      if ln.startswith("Build:")]
try:
    import vllm._C  # noqa: F401
    out["compiled"] = "vllm._C loaded"
except Exception as exc:
    out["compiled"] = f"vllm._C does not load: {type(exc).__name__}: {str(exc)[:200]}"
try:
    from vllm.platforms import current_platform
    out["platform"] = type(current_platform).__name__
except Exception as exc:
    out["platform"] = f"{type(exc).__name__}: {exc}"
import torch
out["torch"] = torch.__version__
out["imported"] = {}
for name in filter(None, os.environ.get("KVFORGE_IMPORT_CHECK", "").split(",")):
    try:
        out["imported"][name] = __import__("importlib").import_module(name).__file__
    except Exception as exc:
        out["imported"][name] = None
        out["import_errors"] = {**out.get("import_errors", {}), name: f"{type(exc).__name__}: {str(exc)[:200]}"}
print("KVFORGE-PROBE " + json.dumps(out))
"""

ORIGIN_PLUGIN = '''\
"""kvforge build: after the session, record the file of every vllm module the tests loaded."""
import json, os, sys


def pytest_sessionfinish(session, exitstatus):
    mods = {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())
            if (n == "vllm" or n.startswith("vllm.")) and getattr(m, "__file__", None)}
    with open(os.environ["KVFORGE_VLLM_ORIGIN"], "w", encoding="utf-8") as fh:
        json.dump(mods, fh, indent=1, sort_keys=True)
'''


@dataclass
class SiteEnv(Env):
    """An Env whose runs import vllm from `site` (the installed wheel) and load the origin plugin."""

    site: Path = Path()
    extra: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, env: Env, site: Path, extra: dict[str, str]) -> SiteEnv:
        return cls(**{f.name: getattr(env, f.name) for f in fields(Env)}, site=site, extra=extra)

    def environ(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        e = super().environ({**self.extra, **(extra or {})})
        e["PYTHONPATH"] = os.pathsep.join([str(self.site), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        e["PYTEST_ADDOPTS"] = "-p kvforge_vllm_origin"
        return e


def _shard(items: list[str], shard: tuple[int, int]) -> list[str]:
    k, n = shard
    return [s for i, s in enumerate(sorted(items)) if i % n == k - 1]


def machine_arch() -> str:
    """This machine's architecture as wheel tags name it (x86_64, aarch64)."""
    m = host_platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def _env_python_tag(env: Env) -> str:
    """cpXY of the environment's interpreter."""
    res = subprocess.run([str(env.python), "-c", "import sys; print('cp%d%d' % sys.version_info[:2])"],
                         capture_output=True, text=True, env=env.environ())
    return res.stdout.strip() or f"cp{sys.version_info[0]}{sys.version_info[1]}"


def foreign_reason(pin: WheelPin | None, py_tag: str) -> str:
    """"" when this machine's CPU env can import the wheel; else why not (its import is then "not run")."""
    if pin is None:
        return ""
    _n, _v, _b, tags = parse_wheel_filename(pin.filename)
    if pin.arch and pin.arch != machine_arch():
        return f"an {pin.arch} wheel on this {machine_arch()} machine"
    pys = {t.interpreter for t in tags if t.abi != "abi3"}
    if pys and py_tag not in pys:
        return f"a {'/'.join(sorted(pys))} wheel; the CPU env's Python is {py_tag}"
    return ""


def install_args(pin: WheelPin | None, foreign: str) -> list[str]:
    """pip's options to install a wheel for another platform or Python into --target (the wheel's own tags)."""
    if pin is None or not foreign:
        return []
    _n, _v, _b, tags = parse_wheel_filename(pin.filename)
    args: list[str] = []
    for plat in sorted({t.platform for t in tags}):
        args += ["--platform", plat]
    abis = sorted({t.abi for t in tags})
    cps = sorted({t.interpreter for t in tags if t.interpreter.startswith("cp")})
    if cps and abis != ["abi3"]:
        args += ["--python-version", f"{cps[0][2]}.{cps[0][3:]}"]
    for abi in abis:
        args += ["--abi", abi]
    return args + ["--implementation", "cp", "--only-binary=:all:"]


def verify_wheel(ctx: Context, stack: Stack, wheel: Path, changes: list[Change], rev: dict, tests: str, platform: str,
                 shard: tuple[int, int] = (1, 1), pin: WheelPin | None = None, suffix: str = "",
                 version: str | None = None, rules: PackageBuild = VLLM_RULES,
                 import_check: tuple[str, ...] = ()) -> Verification:
    """Install the wheel with --no-deps into a directory and check it (see the module docstring). What this
    machine cannot import (another architecture or Python) is installed for the wheel's own platform tags and
    checked by RECORD, file and metadata only; its import and tests are labelled not run."""
    say = ctx.progress
    v = Verification(platform=platform)
    if rules.probe == "vllm":
        env = target_env(ctx, base=stack.base, platform=platform)
    else:  # a plugin package is imported next to the component it requires (plugin_probe)
        assert ctx.component.requires, f"{ctx.component.name} requires no other component"
        env = target_env(ctx.for_component(ctx.component.requires), platform=platform)
    env.check()
    v.python = str(env.python)
    foreign = foreign_reason(pin, _env_python_tag(env))
    root = ctx.cache.root / "builds"
    root.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        remove_stale(root, STALE_VERIFY)
    work = root / f".verify-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    site, troot = work / "site", work / "root"
    try:
        t = time.monotonic()
        say(f"verifying {wheel.name}: pip install --no-deps --target" + (f" (for its own tags: {foreign})" if foreign else
                                                                         f" (with {env.python})"))
        res = subprocess.run([str(env.python), "-m", "pip", "install", "--no-deps", "--no-compile", "--no-index",
                              "--disable-pip-version-check", "--no-input", "-q", *install_args(pin, foreign),
                              "--target", str(site), str(wheel)],
                             capture_output=True, text=True, env=env.environ())
        v.seconds["install"] = round(time.monotonic() - t, 3)
        if res.returncode != 0:
            last = (res.stderr.strip().splitlines() or ["pip failed"])[-1]
            v.problems.append(f"pip could not install the wheel: {last}")
            return v
        v.site = str(site)
        t = time.monotonic()
        v.record = check_record(wheel, site)
        v.problems += v.record.pop("problems")
        v.seconds["record"] = round(time.monotonic() - t, 3)
        v.modules = check_modules(stack, site, changes, rev)
        v.problems += v.modules.pop("problems")
        if pin is not None and (ctx.cache.downloads / pin.filename).is_file():
            v.record["compiled"] = check_compiled(ctx.cache.downloads / pin.filename, wheel)
            v.problems += v.record["compiled"].pop("problems")
        v.record["metadata"] = check_metadata(site, version, stack)
        v.problems += v.record["metadata"].pop("problems")
        if foreign:
            v.probe = {"not_run": f"import and tests not run: {foreign} (checked by RECORD, files and metadata)"}
        elif rules.probe == "plugin":
            v.probe = plugin_probe(ctx, env, site, changes, rules)
            v.problems += v.probe.pop("problems")
            v.tests = {"note": "the series' Checks of this component need its device (npu): not run here; "
                               "kvforge verify runs them on CPU from the tree with stand-ins"}
        else:
            _vllm_probe_and_tests(ctx, stack, v, env, wheel, site, troot, work, rev, tests, platform, shard, suffix,
                                  version, import_check)
        v.ok = not v.problems
        return v
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _vllm_probe_and_tests(ctx: Context, stack: Stack, v: Verification, env: Env, wheel: Path, site: Path, troot: Path,
                          work: Path, rev: dict, tests: str, platform: str, shard: tuple[int, int], suffix: str,
                          version: str | None, import_check: tuple[str, ...]) -> None:
    say = ctx.progress
    # Probe and tests run from a directory holding only the patched tree's tests/ and pyproject.toml.
    troot.mkdir(parents=True, exist_ok=True)
    _extract(stack.base.repo, rev["patched"], ["tests", "pyproject.toml"], troot)
    (troot / "kvforge_vllm_origin.py").write_text(ORIGIN_PLUGIN, encoding="utf-8")
    origin = work / "vllm-origin.json"
    senv = SiteEnv.of(env, site, {"KVFORGE_RELEASE": ctx.component.release.version,
                                  "KVFORGE_VLLM_ORIGIN": str(origin),
                                  "KVFORGE_IMPORT_CHECK": ",".join(import_check)})
    t = time.monotonic()
    v.probe = _probe(senv, troot)
    v.seconds["import"] = round(time.monotonic() - t, 3)
    if "error" in v.probe:
        v.problems.append(f"import vllm from the installed wheel failed: {v.probe['error']}")
        return
    if not Path(v.probe["vllm_file"]).resolve().is_relative_to(site.resolve()):
        v.problems.append(f"vllm imported from {v.probe['vllm_file']}, not from the installed wheel")
    if not v.probe["version_is_release"]:
        v.problems.append(f"vllm.__version__ {v.probe['version']} != the release {ctx.component.release.version}")
    want = version or local_version(ctx.component.release.version, ctx.target.name, stack.digest)
    if v.probe.get("metadata_version") != want and wheel.name.split("-")[1] == want:
        v.problems.append(f"importlib.metadata says vllm {v.probe.get('metadata_version')}, the wheel {want}")
    for mod, where in (v.probe.get("imported") or {}).items():
        if not where or not Path(where).resolve().is_relative_to(site.resolve()):
            v.problems.append(f"import {mod}: {where or 'failed'}")
    ident = v.probe.get("identity") or {}
    if ident.get("series", {}).get("digest") != stack.digest or ident.get("base", {}).get("commit") != stack.base.commit:
        v.problems.append("the installed kvforge.json does not name this base and series")
    checks = unique(c for p in stack.series.patches for c in p.checks)
    selection = list(checks)
    if tests == "all":
        selection = unique([*ctx.component.tests.get(platform, ()), *checks])
    selection = _shard(selection, shard)
    v.tests = {"selected": selection, "mode": tests, "shard": f"{shard[0]}/{shard[1]}"}
    if not selection:
        v.tests["note"] = "nothing to run: the series names no Checks" if tests == "checks" else "nothing selected"
        if tests == "all":
            v.problems.append(f"no tests selected for {platform} (shard {shard[0]}/{shard[1]})")
        return
    rdir = builds_dir(ctx, stack.digest)
    say(f"running {len(selection)} tests with vllm from {site} ({platform})")
    run = run_pytest(senv, troot, selection, rdir / f"verify-{platform}{suffix}.xml",
                     {**run_properties(ctx.target, ctx.component, stack, platform, "wheel", rev["patched"]),
                      "wheel": wheel.name}, "wheel", rev["patched"])
    c = run.counts()
    v.tests.update({**c, "junit": str(run.junit) if run.junit else None, "log": str(run.log) if run.log else None,
                    "seconds": round(run.seconds, 2), "missing": run.not_in_tree + run.missing,
                    "problems": run.problems()})
    if c["failed"] or c["errors"] or not run.cases or run.not_in_tree or run.missing:
        v.problems.append(f"tests: {c['passed']} passed, {c['failed']} failed, {c['errors']} errors, "
                          f"{len(run.not_in_tree) + len(run.missing)} missing (log: {run.log})")
    loaded = json.loads(origin.read_text()) if origin.is_file() else {}
    elsewhere = sorted(n for n, f in loaded.items() if not Path(f).resolve().is_relative_to(site.resolve()))
    v.tests["vllm_modules_loaded"] = len(loaded)
    v.tests["vllm_modules_elsewhere"] = elsewhere[:20]
    if not loaded:
        v.problems.append("the tests loaded no vllm module (the origin plugin wrote nothing)")
    if elsewhere:
        v.problems.append(f"{len(elsewhere)} vllm modules came from outside the installed wheel: {elsewhere[:3]}")
    v.seconds["tests"] = round(run.seconds, 2)


def check_compiled(upstream: Path, wheel: Path) -> dict:
    """Every compiled file (.so) of the release wheel is in the new wheel with the same RECORD hash and size
    (so the installed .so, checked against RECORD, is the release's byte for byte)."""
    def rows(path: Path) -> dict[str, tuple[str, str]]:
        members = read_members(path)
        rec = next(m for m in members if m.name.endswith(".dist-info/RECORD") and m.name.count("/") == 1)
        return parse_record(read_member(path, rec).decode("utf-8"), path.name)
    old, new = rows(upstream), rows(wheel)
    so = sorted(p for p in old if p.endswith(".so") or ".so." in p)
    problems = [f"{p}: not the release wheel's" for p in so if new.get(p) != old[p]]
    return {"files": len(so), "equal": len(so) - len(problems), "problems": problems[:5]}


def check_metadata(site: Path, version: str | None, stack: Stack) -> dict:
    """The installed dist-info: its METADATA Version (the local label) and kvforge.json (base and series)."""
    infos = sorted(site.glob("*.dist-info"))
    problems: list[str] = []
    if len(infos) != 1:
        return {"problems": [f"expected one installed .dist-info, found {[p.name for p in infos]}"]}
    meta = (infos[0] / "METADATA").read_text(encoding="utf-8", errors="replace")
    got = next((ln.split(":", 1)[1].strip() for ln in meta.splitlines() if ln.startswith("Version:")), None)
    if version and got != version:
        problems.append(f"installed METADATA says Version {got}, expected {version}")
    try:
        ident = json.loads((infos[0] / IDENTITY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        ident = {}
    if ident.get("series", {}).get("digest") != stack.digest or ident.get("base", {}).get("commit") != stack.base.commit:
        problems.append(f"the installed {IDENTITY_FILE} does not name this base and series")
    return {"dist_info": infos[0].name, "version": got, "identity": bool(ident), "problems": problems}


PLUGIN_PROBE = r"""
import importlib, json, os, sys, traceback
out = {}
for name in os.environ["KVFORGE_MODULES"].split(","):
    try:
        m = importlib.import_module(name)
        out[name] = {"file": getattr(m, "__file__", None)}
    except BaseException as exc:
        out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}",
                     "missing": getattr(exc, "name", None) if isinstance(exc, ImportError) else None}
print("KVFORGE-PROBE " + json.dumps(out))
"""


def plugin_probe(ctx: Context, env: Env, site: Path, changes: list[Change], rules: PackageBuild) -> dict:
    """A plugin package (vllm-ascend) installed in `site`, next to the required component's patched tree
    (its package on PYTHONPATH, as kvforge verify layers it; no stand-ins): import the package and every
    module the series replaces or adds. A module that needs the device's stack (torch_npu, ...) is "not
    run"; any other failure, or a module imported from elsewhere than `site`, is a problem."""
    lay = layer(ctx)
    mods = [rules.import_packages[0]] + sorted(
        c.path[:-3].replace("/", ".").removesuffix(".__init__") for c in changes
        if c.action in ("replace", "add") and c.path.endswith(".py"))
    e = env.environ({k: v for k, v in lay.environ.items() if not k.startswith("KVFORGE_STANDINS")})
    e["PYTHONPATH"] = os.pathsep.join([str(site), str(lay.path)])
    e["KVFORGE_MODULES"] = ",".join(unique(mods))
    try:
        res = subprocess.run([str(env.python), "-c", PLUGIN_PROBE], capture_output=True, text=True, env=e,
                             cwd=site, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"problems": [f"the import probe failed: {exc}"]}
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("KVFORGE-PROBE ")), None)
    if line is None:
        return {"problems": [f"the import probe failed: {(res.stderr.strip().splitlines() or ['no output'])[-1]}"]}
    found = json.loads(line.split(" ", 1)[1])
    imported, not_run, problems = [], {}, []
    for name, r in found.items():
        missing = (r.get("missing") or "").split(".")[0]
        if "file" in r:
            if r["file"] and Path(r["file"]).resolve().is_relative_to(site.resolve()):
                imported.append(name)
            else:
                problems.append(f"import {name}: from {r['file']}, not from the installed wheel")
        elif missing in rules.modules_need:
            not_run[name] = f"needs {missing} (the device's stack): not run"
        else:
            problems.append(f"import {name}: {r['error']}")
    return {"required": f"{lay.requires} patched tree {lay.commit[:12]} ({lay.path})", "imported": imported,
            "not_run": not_run, "problems": problems}


def check_record(wheel: Path, site: Path) -> dict:
    """The wheel's own RECORD against the installed files; and nothing installed that pip did not record."""
    members = read_members(wheel)
    rec_member = next(m for m in members if m.name.endswith(".dist-info/RECORD") and m.name.count("/") == 1)
    info = rec_member.name.split("/", 1)[0]
    record = parse_record(read_member(wheel, rec_member).decode("utf-8"), wheel.name)
    problems, checked = [], 0
    for path, (digest, size) in record.items():
        if not digest:
            continue
        f = site / path
        try:
            data = f.read_bytes()
        except OSError:
            problems.append(f"RECORD lists {path}, not installed")
            continue
        checked += 1
        if record_hash(data) != digest or str(len(data)) != size:
            problems.append(f"{path}: installed file does not match RECORD")
    installed = parse_record((site / info / "RECORD").read_text(encoding="utf-8"), "installed")
    on_disk = {str(p.relative_to(site)) for p in site.rglob("*") if p.is_file() and p.parent.name != "__pycache__"}
    recorded = {p for p in installed if not p.startswith("../")}
    stray = sorted(on_disk - recorded - {"bin/" + Path(p).name for p in installed if p.startswith("../")})
    if stray:
        problems.append(f"{len(stray)} installed files are in no RECORD: {stray[:3]}")
    return {"files": len(record), "checked": checked, "stray": stray[:20], "problems": problems}


def check_modules(stack: Stack, site: Path, changes: list[Change], rev: dict) -> dict:
    """Every file the series replaces or adds, as installed, equals the patched tree's; removed ones are gone."""
    touched = [c for c in changes if c.action in ("replace", "add", "remove")]
    blobs = read_blobs(stack.base.repo, [f"{rev['patched']}:{c.path}" for c in touched if c.action != "remove"])
    problems, equal = [], []
    for c in touched:
        f = site / c.path
        if c.action == "remove":
            (problems.append(f"{c.path}: removed by the series, still installed") if f.exists() else equal.append(c.path))
            continue
        if not f.is_file() or f.read_bytes() != blobs[f"{rev['patched']}:{c.path}"]:
            problems.append(f"{c.path}: installed file differs from the patched tree's")
        else:
            equal.append(c.path)
    return {"equal": equal, "problems": problems}


def _extract(repo: Path, commit: str, paths: list[str], dest: Path) -> None:
    present = [p for p in paths if gitutil.run(repo.parent, "cat-file", "-e", f"{commit}:{p}", check=False,
                                             env={"GIT_DIR": str(repo)}).returncode == 0]
    gitutil.export(repo.parent, commit, dest, present, env={"GIT_DIR": str(repo)})


def _probe(senv: SiteEnv, cwd: Path) -> dict:
    env = senv.environ()
    env.pop("PYTEST_ADDOPTS", None)
    try:
        res = subprocess.run([str(senv.python), "-c", PROBE], capture_output=True, text=True, cwd=cwd, env=env,
                             timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": str(exc)}
    for line in res.stdout.splitlines():
        if line.startswith("KVFORGE-PROBE "):
            return json.loads(line.split(" ", 1)[1])
    last = (res.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": last}
