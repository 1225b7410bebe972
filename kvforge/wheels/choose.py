"""Which release wheels a build overlays: the index's choice for a release (choose_wheels, the one choice
rebase, target add and watch make too), the wheels --arch selects from a target's pins, and the labels
that tell a component's release wheels apart.

Kept light: `kvforge rebase`, `target add` and `watch` import this module for choose_wheels alone, so it
imports nothing that builds, installs or verifies a wheel.
"""

from __future__ import annotations

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.core.index import pypi_url, refuse_offline, release_files
from kvforge.git.context import Context
from kvforge.project.targets import ARCHES, Component, WheelPin


def choose_wheels(package: str, version: str, upload: int | None = None) -> dict[str, WheelPin]:
    """{architecture: pin} for a release, chosen from the package index's file list (PyPI's JSON API or
    $KVFORGE_PYPI_URL): per architecture, the manylinux wheel of exactly `version` from the first upload (no
    build number, or the lowest; with `upload`, only that build number: the same upload as the wheels a
    target already pins), whatever its manylinux tag (2_35 for 0.20.2, 2_24 for 0.21.0, 2_28 for 0.22.0),
    pinned by the sha256 the index lists. Not the highest build number: PyPI's rebuilds of vLLM come from
    other commits than the release's sdist (0.20.1-1 and 0.21.0-1: `vllm/_version.py` says ad7125a43 where
    0.21.0's sdist and first wheels say 9da56fd18), and an overlay must sit on the sdist's commit
    (`check_same_commit` refuses any other). The one choice rebase, target add and watch make."""
    refuse_offline(f"choosing the release wheels of {package} {version} reads its files from the package index "
                   f"{pypi_url()}", pypi_url())
    _index, files = release_files(package, version)
    best: dict[str, tuple[tuple, WheelPin]] = {}
    for f in files:
        name, sha = f.get("filename") or "", (f.get("digests") or {}).get("sha256")
        if not name.endswith(".whl") or not sha:
            continue
        try:
            dist, ver, build, tags = parse_wheel_filename(name)
        except (InvalidWheelFilename, InvalidVersion):
            continue
        if dist != canonicalize_name(package) or ver != Version(version):
            continue
        if upload is not None and (build[0] if build else 0) != upload:
            continue
        for arch in ARCHES:
            if any(t.platform.startswith("manylinux") and t.platform.endswith("_" + arch) for t in tags):
                key = (build[0] if build else 0, name)
                if arch not in best or key < best[arch][0]:
                    best[arch] = (key, WheelPin(filename=name, sha256=sha.lower()))
    return {arch: pin for arch, (_k, pin) in sorted(best.items())}


def wheels_to_build(ctx: Context, arch: str | None) -> list[tuple[WheelPin, bool]]:
    """[(release wheel, pinned)] for --arch: none given, the component's x86_64 pins (vLLM's one, or
    vllm_ascend's per Python); `all`, every pin; an architecture, its pins. An architecture the target pins
    no wheel for (a target written before it had pins, or by an older `rebase --as`) takes the index's
    choice (choose_wheels: that release's first upload), reported as not pinned."""
    comp = ctx.component
    arches = list(ARCHES) if arch == "all" else [arch or "x86_64"]
    out: list[tuple[WheelPin, bool]] = []
    chosen: dict[str, WheelPin] | None = None
    for a in arches:
        pins = [w for w in comp.wheels if w.arch == a]
        if pins:
            out += [(w, True) for w in pins]
            continue
        if chosen is None:
            ctx.say(f"{ctx.target.path.name}: no {a} wheel pinned for {comp.name}; choosing from the index's file list")
            # the same upload as the wheels it does pin (v0.20.1 pins the first upload, not the -1- rebuild)
            uploads = {(parse_wheel_filename(w.filename)[2] or (0,))[0] for w in comp.wheels}
            chosen = choose_wheels(comp.release.package, comp.release.version,
                                   uploads.pop() if len(uploads) == 1 else None)
        if a in chosen:
            out.append((chosen[a], False))
        elif arch != "all":
            raise KvforgeError(f"{ctx.target.path}: component {comp.name} pins no {a} release wheel and the index "
                               f"has none for {comp.release.package}=={comp.release.version}", EXIT_USAGE)
    if not out:
        raise KvforgeError(f"{ctx.target.path}: component {comp.name} pins no release wheel and the index has none "
                           f"for {comp.release.package}=={comp.release.version}", EXIT_USAGE)
    return out


def variant_of(comp: Component, pin: WheelPin) -> str:
    """"" for the component's default wheel (its first x86_64 pin), else what tells this one apart: the
    architecture, with the Python tag for a per-interpreter wheel (vllm_ascend's cp310/cp311)."""
    default = pin == comp.wheel or (comp.wheel is None and pin.arch == "x86_64")  # unpinned: the index's x86_64
    return "" if default else pin_label(pin)


def pin_label(pin: WheelPin) -> str:
    """A release wheel's kind: its architecture, with the Python tag of a per-interpreter wheel (cp311-x86_64)."""
    _n, _v, _b, tags = parse_wheel_filename(pin.filename)
    pys = sorted({t.interpreter for t in tags if t.abi != "abi3" and t.interpreter.startswith("cp")})
    return "-".join([*pys, pin.arch or "any"])
