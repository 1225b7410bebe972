"""`kvforge build --device NAME` (platforms.DEVICES; empty): not an overlay but the package's own build of
the patched tree for a device vLLM ships no release wheel for, rewritten reproducibly by the overlay's
writer and verified like an overlay.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import time
import tomllib
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

from kvforge.core.errors import EXIT_ENV, EXIT_NETWORK, EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import remove_stale
from kvforge.core.wheel import read_members
from kvforge.env.venv import Env, target_env
from kvforge.git import gitutil
from kvforge.git.context import Context
from kvforge.git.trees import open_stack
from kvforge.project.platforms import Device
from kvforge.wheels.changes import classify, diff_paths
from kvforge.wheels.overlay import build_tag_for, identity_record, local_version, output_filename, overlay
from kvforge.wheels.result import BuildResult
from kvforge.wheels.stage import builds_dir, out_error, place, report_suffix
from kvforge.wheels.verify import verify_wheel

STALE_DEVICE = r"^\.device-(?P<pid>\d+)$"


def build_tools(ctx: Context, env: Env, tree: Path, device: Device) -> Path:
    """<cache>/build-tools/<hash>: the tree's [build-system] requirements but those the device skips (the CPU
    env's torch stands in), installed once with pip --target for the CPU env's Python; made in a temporary
    directory renamed into place, so a directory of that name is complete."""
    try:
        data = tomllib.loads((tree / "pyproject.toml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise KvforgeError(f"{tree / 'pyproject.toml'}: cannot read [build-system] ({exc})", EXIT_USAGE) from None
    reqs = sorted(r for r in data.get("build-system", {}).get("requires", [])
                  if canonicalize_name(re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0]) not in device.skip_build_requires)
    key = hashlib.sha256(json.dumps([str(env.python), reqs]).encode()).hexdigest()[:16]
    root = ctx.cache.root / "build-tools"
    final = root / key
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{key}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    ctx.say(f"installing the build's tools for {env.python}: {', '.join(reqs)}")
    res = subprocess.run([str(env.python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-input",
                          "--target", str(tmp), *reqs], capture_output=True, text=True, env=env.environ())
    if res.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        last = (res.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise KvforgeError(f"cannot install the build requirements {', '.join(reqs)}: {last}", EXIT_NETWORK)
    try:
        os.rename(tmp, final)
    except OSError:  # another build made it first
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_device(ctx: Context, out: Path, device: Device, tests: str = "checks",
                 shard: tuple[int, int] = (1, 1)) -> BuildResult:
    """`kvforge build --device NAME`: the package's own build of the patched tree for a device vLLM ships no
    release wheel for (empty: VLLM_TARGET_DEVICE=empty, pure Python), in the target's CPU env with
    --no-build-isolation (vLLM's setup.py imports torch; the env's CPU torch stands in for the pinned one) and
    the tree's other build requirements; reproducible (SOURCE_DATE_EPOCH = the patched commit's time, then
    rewritten by the overlay's writer: members in a fixed order, new members STORED). Its version is vLLM's own
    (`0.20.2+empty`) with kvforge's local label after it; verified like an overlay (installed, RECORD, the
    patched files, import of `device.import_check` with the CPU env's torch, the series' Checks)."""
    comp, say = ctx.component, ctx.progress
    if canonicalize_name(comp.release.package) not in device.packages:
        raise KvforgeError(f"--device {device.name} builds {', '.join(device.packages)}; component {comp.name} is "
                           f"{comp.release.package}", EXIT_USAGE)
    t0 = time.monotonic()
    result = BuildResult(ctx.target.name, comp.name, "device", comp.release.version, arch=None, device=device.name,
                         variant=device.name)
    stack = open_stack(ctx)
    result.seconds["stack"] = round(time.monotonic() - t0, 3)
    patched = stack.commits[-1]
    rev = {"base": stack.base.commit, "patched": patched}
    result.base, result.base_ref, result.series = stack.base.commit, stack.base.ref, stack.digest
    result.origin, result.fix_ids = stack.origin, [p.fix_id for p in stack.series.patches]
    env = target_env(ctx, base=stack.base)
    env.check()
    root = ctx.cache.root / "builds"
    root.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        remove_stale(root, STALE_DEVICE)
    work = root / f".device-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        tree, dist = work / "tree", work / "dist"
        gitutil.export(stack.base.repo.parent, patched, tree, env={"GIT_DIR": str(stack.base.repo)})
        tools = build_tools(ctx, env, tree, device)
        epoch = gitutil.run(stack.base.repo.parent, "log", "-1", "--format=%ct", patched,
                            env={"GIT_DIR": str(stack.base.repo)}).stdout.strip()
        e = env.environ({**dict(device.environ_items), "SOURCE_DATE_EPOCH": epoch,
                         "SETUPTOOLS_SCM_PRETEND_VERSION": comp.release.version})
        e["PYTHONPATH"] = os.pathsep.join([str(tools), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        cmd = [str(env.python), "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
               "--disable-pip-version-check", "--no-input", "-w", str(dist), str(tree)]
        result.command = " ".join([*(f"{k}={v}" for k, v in device.environ_items), f"SOURCE_DATE_EPOCH={epoch}",
                                   f"SETUPTOOLS_SCM_PRETEND_VERSION={comp.release.version}",
                                   f"PYTHONPATH={tools}", *map(shlex.quote, cmd)])
        say(f"building {comp.name} for device {device.name} from the patched tree ({patched[:12]}) with its own "
            "setup.py")
        b0 = time.monotonic()
        log = builds_dir(ctx, stack.digest) / f"build-{device.name}.log"
        with open(log, "w", encoding="utf-8") as fh:
            res = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, text=True, env=e, cwd=tree)
        result.seconds["source_build"] = round(time.monotonic() - b0, 3)
        made = sorted(dist.glob("*.whl"))
        if res.returncode != 0 or len(made) != 1:
            raise KvforgeError(f"{ctx.label}: {comp.name}'s own build for device {device.name} failed (exit "
                               f"{res.returncode}); its log: {log}", EXIT_ENV)
        upstream = made[0]
        _n, own_version, _b, _t = parse_wheel_filename(upstream.name)
        result.local_version = local_version(str(own_version), ctx.target.name, stack.digest)
        result.build_tag = build_tag_for(upstream.name, stack.digest)
        result.filename = output_filename(upstream.name, result.build_tag, result.local_version)
        result.upstream = {"filename": upstream.name, "built_by": f"{comp.name}'s setup.py", "log": str(log)}
        members = read_members(upstream)
        changes = diff_paths(stack.base.repo, stack.base.commit, patched)
        classify(changes, {m.name for m in members}, lambda *_: None)
        for c in changes:
            if c.action == "refused":
                c.action, c.why = "built", f"{c.why} input: built from the patched tree"
        result.changes = changes
        identity = identity_record(ctx, stack, None, changes, result.build_tag, result.local_version, device.name)
        try:
            out.mkdir(parents=True, exist_ok=True)
            stage = out / f".kvforge-build-{os.getpid()}"
            shutil.rmtree(stage, ignore_errors=True)
            stage.mkdir()
        except OSError as exc:
            raise out_error(out, exc) from None
        built = stage / result.filename
        w0 = time.monotonic()
        try:
            overlay(upstream, built, {}, {}, set(), identity, result.build_tag, members, result.local_version)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        result.seconds["rewrite"] = round(time.monotonic() - w0, 3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return place(ctx, stack, result, built, None, out, t0,
                 lambda: verify_wheel(ctx, stack, built, changes, rev, tests, "cpu", shard, pin=None,
                                      suffix=report_suffix(result), version=result.local_version,
                                      import_check=device.import_check), "cpu")
