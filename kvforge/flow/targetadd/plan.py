"""The new target before any rebase: its name checked, the from-target, each component's release and pins.

Invariants. Reads the project and the package index, writes nothing. A new target's name is a valid target name
(kvforge.flow.targetadd.state.valid_name) and never names an existing target file or non-empty series directory;
every series directory it plans is inside the project's patches/ (parse_target checks that again when the
planned target text is read back from the state).
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

from packaging.version import InvalidVersion, Version

from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.flow.rebase.onto import Candidate, matching_release, release_pins, release_ref
from kvforge.flow.targetadd.state import AddState, valid_name
from kvforge.git.context import Progress
from kvforge.project.targets import Component, Release, Target, load_all, load_target, parse_target

# The component of a target made in a project that has none yet (kvforge init): vLLM, an empty series.
FRESH_VLLM = Component(name="vllm", repo="https://github.com/vllm-project/vllm.git", ref="v0",
                       release=Release("vllm", "0"), series_dir=Path("patches"), platforms=("cpu", "cuda"),
                       tests={"cpu": (), "cuda": ()})


def check_name(root: Path, name: str, what: str) -> None:
    """A new target's name: valid, and no target file or non-empty series directory of that name (never
    overwritten; nothing suggests deleting them)."""
    valid_name(name, what)
    if (root / "targets" / f"{name}.toml").exists():
        raise KvforgeError(f"{what} {name}: targets/{name}.toml exists; choose another name with --as NAME",
                           EXIT_USAGE)
    for d in (root / "patches").glob(f"{name}*") if (root / "patches").is_dir() else []:
        if d.name == name or d.name.startswith(f"{name}-"):
            if not d.is_dir() or any(d.iterdir()):
                raise KvforgeError(f"{what} {name}: patches/{d.name} exists and is not an empty directory; choose "
                                   "another name with --as NAME", EXIT_USAGE)


def _release_of(t: Target) -> Version | None:
    try:
        return Version(t.components[0].release.version)
    except InvalidVersion:
        return None


def from_target_of(root: Path, version: str, name: str | None) -> Target | None:
    """--from, or the newest maintained target whose vLLM base is older than `version`; None in a project with no
    target yet (a new patch repository, kvforge init): the new target starts with an empty series."""
    if name is not None:
        t = load_target(name, root)
        if t.components[0].release.package.replace("-", "_") != "vllm":
            raise KvforgeError(f"--from {name}: its first component is {t.components[0].release.package}, not vllm",
                               EXIT_USAGE)
        return t
    want = Version(version)
    if not list((root / "targets").glob("*.toml")):
        return None
    older = [(v, t) for t in load_all(root) if t.lifecycle == "maintained" and (v := _release_of(t)) is not None
             and v < want and t.components[0].release.package.replace("-", "_") == "vllm"]
    if not older:
        raise KvforgeError(f"no maintained target has a vLLM base older than {version} to seed the series from; "
                           "name one with --from TARGET", EXIT_USAGE)
    return max(older, key=lambda vt: (vt[0], len(vt[1].components)))[1]


def left_out_reason(package: str, version: str, looked: list[Candidate]) -> str:
    """Why a component is left out: what each nearby release of it is built on (its sdist's Dockerfile)."""
    if not looked:
        return (f"{package} has no release near vLLM {version} on the package index (none of its releases of the "
                "minor version, the one before or after); add the component when there is one")
    built = "; ".join(f"{package} {k.version} is built on {k.built_on}, not {version}" for k in looked)
    return (f"{built}: no {package} release on the package index is built on vLLM v{version} (its sdist's "
            "Dockerfile VLLM_TAG); add the component when there is one")


def plan_target(root: Path, old: Target | None, version: str, name: str, downloads: Path,
                 progress: Progress) -> tuple[Target, dict[str, str], list[str]]:
    """The new target before its series are rebased: each component's release and pins (a further component:
    the release whose sdist's Dockerfile builds on this vLLM, kvforge.flow.rebase.onto.matching_release; left out
    with a reason when there is none), series directories, the from-target's selections."""
    comps: list[Component] = []
    left_out: dict[str, str] = {}
    notes: list[str] = []
    vllm_version = version
    for i, c in enumerate(old.components if old else (FRESH_VLLM,)):
        package = c.release.package
        rel_version = version
        if i > 0:
            found, looked = matching_release(package, vllm_version, downloads, progress)
            if found is None:
                left_out[c.name] = left_out_reason(package, version, looked)
                continue
            notes += [f"{c.name}: {package} {k.version} is built on {k.built_on}, not {version}"
                      for k in looked if k.version != found]
            rel_version = found
        if c.requires and c.requires in left_out:
            left_out[c.name] = f"it requires {c.requires}, which is left out"
            continue
        pins = release_pins(package, rel_version)
        if pins is None:
            if i == 0:
                raise KvforgeError(f"VERSION {version}: vllm {version} is not a release with an sdist on the package "
                                   "index", EXIT_USAGE)
            left_out[c.name] = f"{package} {rel_version} has no sdist on the package index"
            continue
        if not pins.wheels:
            notes.append(f"{c.name}: the package index lists no manylinux wheel of {package} {rel_version}: no wheel "
                         "pinned (kvforge build --mode source)")
        progress(f"{c.name}: {package} {rel_version}, {len(pins.wheels)} wheels")
        series = root / "patches" / (name if i == 0 else f"{name}-{c.name}")
        comps.append(replace(c, ref=release_ref(package, rel_version), release=Release(package, rel_version,
                                                                                         pins.sha256),
                             wheels=pins.wheels, series_dir=series))
    for cname, why in left_out.items():
        notes.append(f"{cname} left out: {why}")
    asc = [f"{c.release.package} {c.release.version}" for c in comps[1:]]
    description = f"vLLM {version}" + (f" with {', '.join(asc)}" if asc else "")
    origin = f"from {old.name}" if old else "with an empty series"
    target = Target(name=name, description=f"{description} (kvforge target add {origin})",
                    path=root / "targets" / f"{name}.toml", components=tuple(comps), lifecycle="maintained")
    return target, left_out, notes


def target_of(ta: AddState, root: Path) -> Target:
    with tempfile.TemporaryDirectory(prefix="kvforge-target-") as d:
        probe = Path(d) / f"{ta.name}.toml"
        probe.write_text(ta.target_text, encoding="utf-8")
        t = parse_target(probe, root)
    return replace(t, path=root / "targets" / f"{ta.name}.toml")

