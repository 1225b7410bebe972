"""`kvforge build`: the target's release wheel with the series overlaid, verified on every build.

Which wheels. One per release wheel the component pins ([[components.wheels]], one per platform tag;
--arch picks x86_64 (default), aarch64 or all; an architecture without a pin takes the index's wheel of
the same upload: kvforge.wheels.choose). The package's overlay rules (its import packages, what is compiled
or packaging input) and how its installed wheel is exercised are data: platforms.PACKAGE_BUILDS (vllm;
vllm-ascend, imported next to the patched vLLM tree). --device (platforms.DEVICES; empty): not an overlay
but the package's own build of the patched tree for that device (kvforge.wheels.device).

Overlay (the default mode): the series is applied in the cache, the pinned release wheel downloaded once
(kvforge.wheels.download), the changes classified (kvforge.wheels.changes), the new wheel written member
by member into a stage of --out (kvforge.wheels.prepare, kvforge.wheels.overlay), then installed and
checked (kvforge.wheels.verify); a verified wheel gets its name in --out, a failing one is deleted
(kvforge.wheels.stage). This module is the command the CLI calls (build_command) and build_target, one
wheel's build; kvforge.wheels.result is what both return and print.
"""

from __future__ import annotations

from pathlib import Path

from packaging.utils import parse_wheel_filename

from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.core.outcome import Done
from kvforge.git.context import Context
from kvforge.git.trees import open_stack
from kvforge.project.platforms import DEVICES
from kvforge.project.targets import WheelPin
from kvforge.wheels.changes import BuildRefused
from kvforge.wheels.choose import pin_label, wheels_to_build
from kvforge.wheels.device import build_device
from kvforge.wheels.overlay import build_tag_for, local_version, output_filename
from kvforge.wheels.prepare import prepare_wheel
from kvforge.wheels.result import BuildResult, render, verdict
from kvforge.wheels.stage import place, report_suffix
from kvforge.wheels.verify import verify_wheel


def build_command(ctx: Context, out: Path, mode: str, tests: str, platform: str, wheel_path: Path | None,
                  shard: tuple[int, int], arch: str | None = None, device: str | None = None) -> Done:
    """`kvforge build`: build (or verify --wheel FILE, or the wheel of this base and series in --wheel
    DIR) and end with the verdict; its JSON carries "exit" and "error" (null when it passed). One wheel:
    that build's object; several (--arch all, vllm_ascend's per-Python wheels): {"builds": [...], "ok",
    "exit", "error"}. A refused series ends as BuildRefused with {"target", "ok": false, "mode", "command"}."""
    if device is not None:
        if wheel_path is not None or mode != "overlay" or arch is not None:
            raise KvforgeError("--device builds from the patched tree: not with --wheel, --mode source or --arch",
                               EXIT_USAGE)
        result = build_device(ctx, out, DEVICES[device], tests, shard)
        code, error = verdict(result)
        return Done({**result.to_json(), "exit": code, "error": error}, render(result), code, error)
    targets: list[tuple[WheelPin | None, bool, Path | None]] = []
    if wheel_path is not None and wheel_path.is_dir():
        digest = open_stack(ctx).digest
        for want, pinned in wheels_to_build(ctx, arch):
            name = output_filename(want.filename, build_tag_for(want.filename, digest),
                                   local_version(ctx.component.release.version, ctx.target.name, digest))
            if not (wheel_path / name).is_file():
                raise KvforgeError(f"--wheel {wheel_path}: no {name} (the wheel of this base and series) in it",
                                   EXIT_USAGE)
            targets.append((want, pinned, wheel_path / name))
    elif wheel_path is not None:
        _n, _v, _b, tags = parse_wheel_filename(wheel_path.name)
        match: list[tuple[WheelPin | None, bool]] = [(w, True) for w in ctx.component.wheels
                 if parse_wheel_filename(w.filename)[3] == tags] or [(None, True)]
        targets.append((match[0][0], match[0][1], wheel_path))
    else:
        targets += [(pin, pinned, None) for pin, pinned in
                    ([(None, True)] if mode == "source" and arch is None else wheels_to_build(ctx, arch))]
    results: list[BuildResult] = []
    skipped: list[str] = []
    try:
        for pin, pinned, wheel in targets:
            if any(not r.ok for r in results):  # the same patched files: a wheel whose checks failed fails them all
                skipped.append(pin.filename if pin else "?")
                continue
            results.append(build_target(ctx, out, mode=mode, tests=tests, platform=platform, wheel=wheel,
                                        shard=shard, pin=pin, pinned=pinned))
    except BuildRefused as refused:
        refused.data = {"target": ctx.target.name, "ok": False, "mode": mode, "command": refused.command,
                        "error": str(refused)}
        raise
    verdicts = [verdict(r) for r in results]
    code = next((c for c, _e in verdicts if c), 0)
    error = "; ".join(e for _c, e in verdicts if e) or None
    text = "\n\n".join(render(r) for r in results)
    if skipped:
        text += "\n\nnot built (an earlier wheel of the same series failed): " + ", ".join(skipped)
    if len(results) == 1 and not skipped:
        return Done({**results[0].to_json(), "exit": code, "error": error}, text, code, error)
    summary = ["", "wheels:"] + [f"  {'ok  ' if r.ok else 'FAIL'} "
                                 f"{pin_label(WheelPin(r.upstream['filename'], '')) if not r.device else r.variant:<14} "
                                 f"{r.filename}" + ("" if r.pinned else "  (not pinned: chosen from the index)")
                                 for r in results]
    return Done({"builds": [r.to_json() for r in results], "ok": all(r.ok for r in results) and not skipped,
                 "not_built": skipped, "exit": code, "error": error}, text + "\n".join(summary), code, error)


def build_target(ctx: Context, out: Path, mode: str = "overlay", tests: str = "checks", platform: str = "cpu",
                 wheel: Path | None = None, shard: tuple[int, int] = (1, 1), pin: WheelPin | None = None,
                 pinned: bool = True) -> BuildResult:
    """Build (or, with `wheel`, only verify) the target's patched wheel of the release wheel `pin` (default:
    the component's x86_64 pin); see the module docstring."""
    prep = prepare_wheel(ctx, out, mode, platform, wheel, pin, pinned)
    if isinstance(prep, BuildResult):  # --mode source: the command to run elsewhere
        return prep
    result, stack, built, changes, rev, rules, pin, t0 = prep
    return place(ctx, stack, result, built, wheel, out, t0,
                 lambda: verify_wheel(ctx, stack, built, changes, rev, tests, platform, shard, pin=pin,
                                      suffix=report_suffix(result), version=result.local_version, rules=rules),
                 platform)
