"""An overlay wheel up to its verification (prepare_wheel; bench/build_vs_cp.py times exactly this): the
series applied in the cache (trees.open_stack: the patch files, or the commits of --from), what it
changes, the refusals, the release wheel's sha256, and the overlay written into a stage directory of --out.

Order of work: one `git diff-tree`; git reads the changed files' blobs in a thread while the wheel's
directory is read and the members that sort before the first changed path are copied into the stage (the
big ones by the writer's thread); then the checks, the changed files and the dist-info. Before anything is
replaced, each of those files in the wheel must equal the base tree's (write_overlay). A refusal removes
the stage.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path
from typing import NamedTuple

from kvforge.core.errors import EXIT_NETWORK, EXIT_USAGE, KvforgeError
from kvforge.core.wheel import Member, read_member, read_members
from kvforge.git.context import Context
from kvforge.git.trees import Stack, open_stack
from kvforge.project.platforms import PackageBuild, package_build, require_available
from kvforge.project.targets import WheelPin
from kvforge.wheels.changes import (COMPILE_FILES, COMPILE_PREFIXES, Background, BuildRefused, changed_blobs, classify,
                                    diff_raw, read_blobs, source_command)
from kvforge.wheels.choose import variant_of
from kvforge.wheels.download import Hasher, check_same_commit, download_wheel
from kvforge.wheels.overlay import Overlay, ReleaseWheel, build_tag_for, identity_record, local_version, output_filename
from kvforge.wheels.result import BuildResult, Change
from kvforge.wheels.stage import make_stage, writing_stage


class Prepared(NamedTuple):
    """A wheel ready for verification (prepare_wheel): the overlay in its stage directory, or --wheel FILE."""

    result: BuildResult
    stack: Stack
    built: Path
    changes: list[Change]
    rev: dict
    rules: PackageBuild
    pin: WheelPin
    t0: float


def prepare_wheel(ctx: Context, out: Path, mode: str = "overlay", platform: str = "cpu", wheel: Path | None = None,
                  pin: WheelPin | None = None, pinned: bool = True) -> Prepared | BuildResult:
    """What build_target does before verification: the stack, the changed files, the refusals, the
    release wheel's sha256 and the overlay written into a stage directory of `out` (or, with `wheel`, that
    file). --mode source: the BuildResult with the command. bench/build_vs_cp.py times exactly this."""
    comp, say = ctx.component, ctx.progress
    t0 = time.monotonic()
    result = BuildResult(ctx.target.name, comp.name, mode, comp.release.version)
    pin = pin or comp.wheel
    if pin is None:
        raise KvforgeError(f"{ctx.target.path}: component {comp.name} pins no release wheel: add "
                           "[[components.wheels]] tables (filename, sha256) to build one", EXIT_USAGE)
    rules = package_build(comp.release.package)
    result.arch, result.variant, result.pinned = pin.arch, variant_of(comp, pin), pinned
    if platform != "cpu" and ctx.python is None:
        raise KvforgeError(f"--platform {platform}: pass --python PATH, the interpreter set up on a {platform} runner",
                           EXIT_USAGE)
    if platform != "cpu":
        require_available(platform, ctx.python)  # exit 7 (not run) where the hardware is missing
    result.upstream = {"filename": pin.filename, "sha256": pin.sha256, "pinned": pinned}
    stack = open_stack(ctx)
    result.seconds["stack"] = round(time.monotonic() - t0, 3)  # the series parsed, its stack's refs read
    patched = stack.commits[-1]
    result.base, result.base_ref, result.series = stack.base.commit, stack.base.ref, stack.digest
    result.origin, result.fix_ids = stack.origin, [p.fix_id for p in stack.series.patches]
    result.build_tag = build_tag_for(pin.filename, stack.digest)
    result.local_version = local_version(comp.release.version, ctx.target.name, stack.digest)
    result.filename = output_filename(pin.filename, result.build_tag, result.local_version)
    out = Path(out)
    repo = stack.base.repo
    rev = {"base": stack.base.commit, "patched": patched}
    changes, ids = diff_raw(repo, stack.base.commit, patched)
    result.changes = changes

    if mode == "source":
        compile_needed = any(c.path.startswith(COMPILE_PREFIXES) or c.path in COMPILE_FILES for c in changes)
        wheel_path = str(ctx.cache.root / "downloads" / pin.filename)
        result.command = source_command(ctx, wheel_path, out, compile_needed)
        result.reason = ("not run: vLLM's source build downloads its build requirements (torch " 
                         "for CUDA) and, for csrc/ changes, compiles for hours with nvcc; run the command "
                         "on a build machine" if compile_needed else
                         "not run: vLLM's precompiled source build installs its build requirements (torch "
                         "for CUDA, GBs); run the command on a build machine")
        return result

    git_side = Background(lambda: changed_blobs(repo, rev, ids, rules))  # git reads while the wheel is read
    git_side.start()
    upstream = wheel or download_wheel(comp, ctx.cache, say, pin)
    hasher = Hasher(upstream) if wheel is None else None
    if hasher:
        hasher.start()
    out_existed, started, stage = out.exists(), None, None
    try:
        members = read_members(upstream)
        check_same_commit(upstream, members, comp.release.package, stack.base, pin)
        if wheel is None:  # the members before the first changed path copied (the big ones by a thread) ...
            release = ReleaseWheel.index(upstream, members)
            stage = make_stage(out)
            with writing_stage(out, stage, stage / result.filename):
                started = Overlay(release, stage / result.filename, changed_package_paths(changes, release, rules))
            release.check()  # ... while RECORD is checked
        else:
            release = None
        blobs = git_side.result()
        classify(changes, {m.name for m in members}, lambda which, p: blobs.get(f"{rev[which]}:{p}"), rules)
        refused = [c for c in changes if c.action == "refused"]
        if refused:
            compile_needed = any(c.why == "compile" for c in refused)
            cmd = source_command(ctx, str(upstream), out, compile_needed)
            first = refused[0]
            what = ("a compiled input (the .so files would not match it)" if first.why == "compile" else
                    "packaging input (the wheel's metadata or file list would not match it)")
            more = f" (and {len(refused) - 1} more: {', '.join(c.path for c in refused[1:4])})" if len(refused) > 1 else ""
            raise BuildRefused(f"{ctx.label}: the series changes {first.path}, {what}{more}; an overlay cannot build "
                               f"that honestly. Build from source with vLLM's own build: `kvforge build --target "
                               f"{ctx.target.name} --mode source` prints it: {cmd}", cmd)
        result.upstream["path"] = str(upstream)
        if wheel is not None:
            built = Path(wheel)
            result.seconds["prepare"] = round(time.monotonic() - t0, 3)
        else:
            built, info = write_overlay(ctx, stack, upstream, out, changes, rev, result, members, blobs, release,
                                        started)
            result.seconds.update(info)
    except BaseException:
        if started is not None:
            started.abort()
        if stage is not None:  # refused, or failed: nothing of this build stays in --out
            shutil.rmtree(stage, ignore_errors=True)
            if not out_existed:
                with contextlib.suppress(OSError):
                    out.rmdir()
        raise
    finally:
        if hasher:
            hasher.join()
    if hasher and (hasher.error or hasher.digest != pin.sha256):
        shutil.rmtree(built.parent, ignore_errors=True)
        why = hasher.error or f"sha256 {hasher.digest}"
        with contextlib.suppress(OSError):
            upstream.unlink()  # a corrupt download: the next build fetches it again
        with contextlib.suppress(OSError):
            hasher.stamp.unlink()
        raise KvforgeError(f"{upstream}: {why} does not match the pinned {pin.sha256}; removed it, run the "
                           "build again to download it", EXIT_NETWORK)
    if hasher:
        hasher.record()
    return Prepared(result, stack, built, changes, rev, rules, pin, t0)


def changed_package_paths(changes: list[Change], release: ReleaseWheel, rules: PackageBuild) -> set[str]:
    """The changed paths an overlay may replace, add or remove: those in the wheel or in its import packages."""
    packages = tuple(f"{name}/" for name in rules.import_packages)
    return {c.path for c in changes if c.path in release.by_name or c.path.startswith(packages)}


def write_overlay(ctx: Context, stack: Stack, upstream: Path, out: Path, changes: list[Change], rev: dict,
                  result: BuildResult, members: list[Member] | None = None,
                  blobs: dict[str, bytes | None] | None = None, release: ReleaseWheel | None = None,
                  started: Overlay | None = None) -> tuple[Path, dict]:
    """The overlay of `changes` (classified) on `upstream`, written into a stage directory of `out` (or
    finished in `started`'s, begun by prepare_wheel); `blobs` (changed_files') or read here: the changed
    files on both sides. The wheel's files the series changes must equal the base's before any is written."""
    t = time.monotonic()
    touched = [c for c in changes if c.action in ("replace", "remove", "add")]
    specs = [f"{rev['base']}:{c.path}" for c in touched if c.action != "add"] + \
            [f"{rev['patched']}:{c.path}" for c in touched if c.action != "remove"]
    blobs = dict(blobs or {})
    blobs.update(read_blobs(stack.base.repo, [spec for spec in specs if spec not in blobs]))
    members = members if members is not None else read_members(upstream)
    by_name = {m.name: m for m in members}
    for c in touched:
        if c.action == "add":
            continue
        if read_member(upstream, by_name[c.path]) != blobs[f"{rev['base']}:{c.path}"]:
            raise KvforgeError(f"{upstream.name}: its {c.path} differs from the base's ({stack.base.ref}, "
                               f"{stack.base.commit[:12]}): this wheel was not built from this base; pin the "
                               "wheel of the same release", EXIT_USAGE)

    def patched(path: str) -> bytes:
        data = blobs[f"{rev['patched']}:{path}"]
        assert data is not None, f"{path}: git diff lists it as in the patched tree"
        return data

    replace = {c.path: patched(c.path) for c in touched if c.action == "replace"}
    add = {c.path: patched(c.path) for c in touched if c.action == "add"}
    remove = {c.path for c in touched if c.action == "remove"}
    pin = WheelPin(result.upstream["filename"], result.upstream["sha256"]) if result.upstream.get("filename") \
        else ctx.component.wheel
    identity = identity_record(ctx, stack, pin, changes, result.build_tag)
    earlier = started.seconds if started is not None else 0.0  # the copies prepare_wheel made
    if started is None:
        stage = make_stage(out)
        part = stage / result.filename
    else:
        part = started.out_path
        stage = part.parent
    prepare = time.monotonic() - t
    w0 = time.monotonic()
    with writing_stage(out, stage, part):
        if started is None:
            release = release or ReleaseWheel.read(upstream, members)
            started = Overlay(release, part, changed_package_paths(changes, release, package_build(
                ctx.component.release.package)))
        stats = started.finish(replace, add, remove, identity, result.build_tag, result.local_version or None)
    seconds = time.monotonic() - w0 + earlier
    ctx.say(f"wrote {result.filename}: {stats['copied']} members copied as stored, {stats['written']} written "
            f"({len(replace)} replaced, {len(add)} added, {len(remove)} removed) in {seconds:.2f}s")
    return part, {"prepare": round(prepare, 3), "overlay": round(seconds, 3)}
