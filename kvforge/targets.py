"""Release targets: which upstream source a series is carried on, and how it is tested.

One TOML file per target in targets/. A target has one or more components (vllm today; vllm-ascend
joins later), each with its own upstream, offline release source, series, platforms and tests.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .errors import KvforgeError

PLATFORMS = ("cpu", "cuda", "npu")


@dataclass(frozen=True)
class Release:
    """The offline source of a component: a PyPI sdist, pinned by its sha256."""

    package: str
    version: str
    sha256: str | None = None

    @property
    def filename(self) -> str:
        return f"{self.package}-{self.version}.tar.gz"


@dataclass(frozen=True)
class InBase:
    """A fix this target needs no patch for, and why (shown by `kvforge status`)."""

    fix_id: str
    reason: str


@dataclass(frozen=True)
class Component:
    name: str
    repo: str
    ref: str
    release: Release
    series_dir: Path
    platforms: tuple[str, ...]
    tests: dict[str, tuple[str, ...]]
    in_base: tuple[InBase, ...] = ()


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    path: Path
    components: tuple[Component, ...] = field(default_factory=tuple)

    def component(self, name: str | None = None) -> Component:
        if name is None:
            return self.components[0]
        for c in self.components:
            if c.name == name:
                return c
        known = ", ".join(c.name for c in self.components)
        raise KvforgeError(f"{self.path}: target {self.name} has no component {name!r} (it has: {known})")


def project_root() -> Path:
    """The kvforge checkout: where targets/ and patches/ live (overridable with $KVFORGE_ROOT)."""
    import os

    env = os.environ.get("KVFORGE_ROOT")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve().parent.parent
    if (here / "targets").is_dir():
        return here
    cwd = Path.cwd()
    for d in (cwd, *cwd.parents):
        if (d / "targets").is_dir() and (d / "patches").is_dir():
            return d
    raise KvforgeError("cannot find the kvforge project (targets/ and patches/); run from the checkout or set KVFORGE_ROOT")


def targets_dir(root: Path | None = None) -> Path:
    return (root or project_root()) / "targets"


def known_targets(root: Path | None = None) -> list[str]:
    """Target names, releases in version order and moving branches (main) last."""
    def key(name: str):
        nums = [int(x) for x in re.findall(r"\d+", name)]
        return (not nums, nums, name)
    return sorted((p.stem for p in targets_dir(root).glob("*.toml")), key=key)


def load_target(name: str, root: Path | None = None) -> Target:
    root = root or project_root()
    path = targets_dir(root) / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(known_targets(root)) or "none"
        raise KvforgeError(f"unknown target {name!r}; known targets: {known}")
    return parse_target(path, root)


def load_all(root: Path | None = None) -> list[Target]:
    root = root or project_root()
    return [load_target(n, root) for n in known_targets(root)]


def parse_target(path: Path, root: Path) -> Target:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise KvforgeError(f"{path}: not valid TOML: {exc}") from None

    def need(table: dict, key: str, where: str, kind=str):
        if key not in table:
            raise KvforgeError(f"{path}: {where} is missing '{key}'")
        value = table[key]
        if not isinstance(value, kind):
            raise KvforgeError(f"{path}: {where}.{key} must be a {kind.__name__}")
        return value

    name = need(data, "name", "target")
    if name != path.stem:
        raise KvforgeError(f"{path}: name {name!r} must match the file name {path.stem!r}")
    comps = data.get("components")
    if not isinstance(comps, list) or not comps:
        raise KvforgeError(f"{path}: needs at least one [[components]] table")
    components = []
    for i, c in enumerate(comps):
        where = f"components[{i}]"
        rel = need(c, "release", where, dict)
        release = Release(
            package=need(rel, "package", f"{where}.release"),
            version=need(rel, "version", f"{where}.release"),
            sha256=rel.get("sha256"),
        )
        platforms = tuple(need(c, "platforms", where, list))
        for p in platforms:
            if p not in PLATFORMS:
                raise KvforgeError(f"{path}: {where}.platforms has {p!r}; known: {', '.join(PLATFORMS)}")
        tests = need(c, "tests", where, dict)
        for p, sel in tests.items():
            if p not in platforms:
                raise KvforgeError(f"{path}: {where}.tests.{p} names a platform the component is not tested on")
            if not isinstance(sel, list) or not all(isinstance(s, str) for s in sel):
                raise KvforgeError(f"{path}: {where}.tests.{p} must be a list of pytest paths or node ids")
        in_base = tuple(
            InBase(fix_id=need(e, "fix_id", f"{where}.in_base"), reason=need(e, "reason", f"{where}.in_base"))
            for e in c.get("in_base", [])
        )
        components.append(
            Component(
                name=need(c, "name", where),
                repo=need(c, "repo", where),
                ref=need(c, "ref", where),
                release=release,
                series_dir=(root / need(c, "series", where)).resolve(),
                platforms=platforms,
                tests={p: tuple(sel) for p, sel in tests.items()},
                in_base=in_base,
            )
        )
    return Target(name=name, description=data.get("description", ""), path=path, components=tuple(components))
