"""Release targets: which upstream source a series is carried on, and how it is tested.

One TOML file per target in targets/. A target has one or more components (vllm; v0.20.2rc also
vllm-ascend), each with its own upstream, offline release source, series, platforms and tests.
A component may build on an earlier component of the same target (`requires = "vllm"`): its
series is applied after that one's, and its tests run with that component's patched tree
importable (kvforge/env/components.py). `[components.tests] standins` names the modules its CPU
tests may replace with kvforge's declared stand-ins (kvforge/data/standins); `[components.tests]
requirements` names the PyPI requirements its CPU tests import that the required component's
environment lacks (installed into the component's environment layer, kvforge/env/venv.py).
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from kvforge import DATA
from kvforge.core.errors import EXIT_ENV, EXIT_USAGE, KvforgeError
from kvforge.core.outcome import Done
from kvforge.project.platforms import PLATFORMS  # the platforms are data in one module
from kvforge.core.render import table


@dataclass(frozen=True)
class Release:
    """The offline source of a component: a PyPI sdist, pinned by its sha256."""

    package: str
    version: str
    sha256: str | None = None

    @property
    def filename(self) -> str:
        """The sdist's file name: the project name normalized as PyPI names sdists (PEP 625:
        lowercase, runs of '-', '_', '.' become '_'), so `vllm-ascend` and `vllm_ascend` both give
        vllm_ascend-0.20.2rc1.tar.gz."""
        return f"{re.sub(r'[-_.]+', '_', self.package).lower()}-{self.version}.tar.gz"


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
    wheels: "tuple[WheelPin, ...]" = ()  # [[components.wheels]]: the release wheels `kvforge build` overlays
    requires: str | None = None  # an earlier component whose patched tree this one's tests import
    standins: tuple[str, ...] = ()  # [components.tests] standins: modules its CPU tests may stand in for
    requirements: tuple[str, ...] = ()  # [components.tests] requirements: PEP 508 lines its CPU tests add

    def wheel_for(self, arch: str) -> "WheelPin | None":
        """The first pinned release wheel for a machine architecture (x86_64, aarch64), or None."""
        return next((w for w in self.wheels if w.arch == arch), None)

    @property
    def wheel(self) -> "WheelPin | None":
        """The x86_64 release wheel (the one `kvforge build` overlays on this kind of machine), or None."""
        return self.wheel_for("x86_64")


LIFECYCLES = ("maintained", "eol")  # `lifecycle = "eol"`: kept for reference; matrix and watch leave it out


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    path: Path
    components: tuple[Component, ...] = field(default_factory=tuple)
    lifecycle: str = "maintained"

    def component(self, name: str | None = None) -> Component:
        """The named component; without a name, the first (the one a single-component target has)."""
        if name is None:
            return self.components[0]
        for c in self.components:
            if c.name == name:
                return c
        known = ", ".join(c.name for c in self.components)
        raise KvforgeError(f"{self.path}: target {self.name} has no component {name!r} (it has: {known})")


def _is_project(d: Path) -> bool:
    try:
        return (d / "targets").is_dir() and (d / "patches").is_dir()
    except OSError:
        return False


def project_root() -> Path:
    """The kvforge project: where targets/ and patches/ live.

    In order: $KVFORGE_ROOT; the current directory or its nearest parent that has targets/ and
    patches/ (so a fork of the patch repository is used when you work in it, even with kvforge
    installed from another checkout); the checkout kvforge is installed from.
    """
    env = os.environ.get("KVFORGE_ROOT")
    if env:
        root = Path(env).expanduser().resolve()
        if not _is_project(root):
            raise KvforgeError(f"$KVFORGE_ROOT={env} is not a kvforge project (it needs targets/ and patches/)")
        return root
    try:
        cwd = Path.cwd()
    except OSError:  # the current directory was deleted
        cwd = None
    for d in (cwd, *cwd.parents) if cwd else ():
        if _is_project(d):
            return d
    here = DATA.parent.parent  # the checkout kvforge is installed from (editable install)
    if _is_project(here):
        return here
    raise KvforgeError("cannot find the kvforge project (targets/ and patches/); run from the checkout "
                       "or set KVFORGE_ROOT")


def targets_dir(root: Path | None = None) -> Path:
    return (root or project_root()) / "targets"


def known_targets(root: Path | None = None) -> list[str]:
    """Target names, releases in version order and moving branches (main) last."""
    def key(name: str):
        nums = [int(x) for x in re.findall(r"\d+", name)]
        return (not nums, nums, name)
    return sorted((p.stem for p in targets_dir(root).glob("*.toml")), key=key)


TARGET_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*", re.ASCII)
TARGET_NAME_MAX = 100  # a target name is a file name (targets/<name>.toml, patches/<name>-<component>...)


def target_name_problem(name: str) -> str | None:
    """Why `name` cannot be a target name (None when it can): ASCII letters, digits, '.', '_', '-', not
    starting with '.', at most TARGET_NAME_MAX characters (so every file named after it fits a file name)."""
    if len(name) > TARGET_NAME_MAX:
        return f"is {len(name)} characters long (at most {TARGET_NAME_MAX})"
    if not TARGET_NAME_RE.fullmatch(name):
        return "is not a target name (ASCII letters, digits, '.', '_', '-'; not starting with '.')"
    return None


def load_target(name: str, root: Path | None = None) -> Target:
    root = root or project_root()
    problem = target_name_problem(name)
    if problem is not None:
        shown = name if len(name) <= 40 else name[:37] + "..."
        raise KvforgeError(f"unknown target {shown!r}: the name {problem}")
    path = targets_dir(root) / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(known_targets(root)) or "none"
        raise KvforgeError(f"unknown target {name!r}; known targets: {known}")
    return parse_target(path, root)


def load_all(root: Path | None = None) -> list[Target]:
    root = root or project_root()
    return [load_target(n, root) for n in known_targets(root)]


SLUG_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")
PACKAGE_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?$")  # a PyPI project name
VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+!_-]*$")
SHA256_RE = re.compile(r"^[0-9a-fA-F]{64}$")
REF_CHARS_RE = re.compile(r"^[A-Za-z0-9._/+-]+$")
STANDINS_DIR = DATA / "standins"  # kvforge's declared stand-in modules
MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")  # a dotted Python module name

KEYS = {
    "target": ("name", "description", "lifecycle", "components"),
    "component": ("name", "repo", "ref", "series", "platforms", "release", "tests", "in_base", "wheel", "wheels", "requires"),
    "release": ("package", "version", "sha256"),
    "in_base": ("fix_id", "reason"),
    "wheel": ("filename", "sha256"),
}


def _valid_ref(ref: str) -> bool:
    """A branch or tag name git accepts (and that cannot be read as an option or a refspec)."""
    parts = ref.split("/")
    return bool(REF_CHARS_RE.match(ref)) and ".." not in ref and not ref.startswith("-") \
        and not ref.endswith((".lock", ".")) and all(p and not p.startswith(".") for p in parts)


def _relative_test_path(sel: str) -> bool:
    path = sel.split("::", 1)[0]
    parts = PurePosixPath(path).parts
    return bool(path) and not path.startswith("/") and "\\" not in path and ".." not in parts


def display_path(path: Path) -> str:
    """A path as messages show it: relative to the current directory when inside it."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except (ValueError, OSError):
        return str(path)


def parse_target(path: Path, root: Path) -> Target:
    """Read and check one target file; any wrong key or value is one KvforgeError naming file and key."""
    root = Path(root).resolve()
    shown = display_path(path)

    def fail(message: str) -> KvforgeError:
        return KvforgeError(f"{shown}: {message}", EXIT_USAGE)

    try:
        data = tomllib.loads(Path(path).read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise fail(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise fail(f"not valid TOML: {exc}") from None
    except OSError as exc:
        raise KvforgeError(f"{shown}: cannot read: {exc.strerror or exc}", EXIT_ENV) from None

    def table(value, where: str) -> dict:
        if not isinstance(value, dict):
            raise fail(f"{where} must be a table")
        return value

    def known(tbl: dict, kind: str, where: str) -> None:
        for key in tbl:
            if key not in KEYS[kind]:
                raise fail(f"{where} has an unknown key {key!r} (known: {', '.join(KEYS[kind])})")

    def string(tbl: dict, key: str, where: str, pattern=None, what: str = "") -> str:
        name = f"{where}.{key}" if where else key
        if key not in tbl:
            raise fail(f"{where or 'the target'} is missing '{key}'")
        value = tbl[key]
        if not isinstance(value, str):
            raise fail(f"{name} must be a string{(' (' + what + ')') if what else ''}, not {_toml_type(value)}")
        if pattern is not None and not pattern(value):
            raise fail(f"{name} {value!r} must be {what}")
        return value

    def optional(tbl: dict, key: str, where: str, pattern=None, what: str = "") -> str | None:
        return string(tbl, key, where, pattern, what) if key in tbl else None

    def strings(tbl: dict, key: str, where: str) -> list[str]:
        if key not in tbl:
            raise fail(f"{where} is missing '{key}'")
        value = tbl[key]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise fail(f"{where}.{key} must be a list of strings")
        return value

    data = table(data, "the file")
    known(data, "target", "the target")
    name = string(data, "name", "")
    if name != path.stem:
        raise fail(f"name {name!r} must match the file name {path.stem!r}")
    description = optional(data, "description", "") or ""
    lifecycle = optional(data, "lifecycle", "", pattern=lambda v: v in LIFECYCLES,
                         what="\"maintained\" or \"eol\"") or "maintained"
    comps = data.get("components")
    if not isinstance(comps, list) or not comps:
        raise fail("components must be a list of [[components]] tables (at least one)")
    components: list[Component] = []
    seen: set[str] = set()
    for i, c in enumerate(comps):
        where = f"components[{i}]"
        c = table(c, where)
        known(c, "component", where)
        cname = string(c, "name", where, pattern=SLUG_RE.match, what="a lowercase slug (letters, digits, '-')")
        if cname in seen:
            raise fail(f"{where}.name {cname!r} is used by an earlier component")
        seen.add(cname)
        repo = string(c, "repo", where, pattern=lambda v: bool(v) and not v.startswith("-"),
                      what="a git URL or directory")
        ref = string(c, "ref", where, pattern=_valid_ref, what="a git branch or tag name")
        series = string(c, "series", where, pattern=lambda v: not Path(v).is_absolute(),
                        what="a directory under patches/ in the project")
        series_dir, patches = (root / series).resolve(), (root / "patches").resolve()
        if not series_dir.is_relative_to(patches) or series_dir == patches:
            raise fail(f"{where}.series {series!r} must be a directory under patches/ in the project")
        rwhere = f"{where}.release"
        if "release" not in c:
            raise fail(f"{where} is missing 'release'")
        rel = table(c["release"], rwhere)
        known(rel, "release", rwhere)
        sha = rel.get("sha256")
        if sha is not None and not (isinstance(sha, str) and SHA256_RE.match(sha)):
            raise fail(f"{rwhere}.sha256 must be a 64-hex-digit string")
        release = Release(
            package=string(rel, "package", rwhere, pattern=PACKAGE_RE.match, what="a PyPI project name"),
            version=string(rel, "version", rwhere, pattern=VERSION_RE.match, what="a release version"),
            sha256=sha.lower() if sha else None,
        )
        platforms = tuple(strings(c, "platforms", where))
        for p in platforms:
            if p not in PLATFORMS:
                raise fail(f"{where}.platforms has {p!r}; known: {', '.join(PLATFORMS)}")
        if len(set(platforms)) != len(platforms):
            raise fail(f"{where}.platforms lists a platform twice")
        if "tests" not in c:
            raise fail(f"{where} is missing 'tests'")
        tests = dict(table(c["tests"], f"{where}.tests"))
        standins = tests.pop("standins", [])
        if not isinstance(standins, list) or not all(isinstance(v, str) and MODULE_RE.match(v) for v in standins):
            raise fail(f"{where}.tests.standins must be a list of Python module names (e.g. \"torch_npu\")")
        if len(set(standins)) != len(standins):
            raise fail(f"{where}.tests.standins lists a module twice")
        requirements = _test_requirements(tests.pop("requirements", []), f"{where}.tests.requirements", fail)
        requires = optional(c, "requires", where, pattern=SLUG_RE.match, what="a component name")
        if requires is not None and requires not in seen - {cname}:
            raise fail(f"{where}.requires {requires!r} must name an earlier component of this target "
                       f"(earlier: {', '.join(sorted(seen - {cname})) or 'none'})")
        if requires is not None and next(x for x in components if x.name == requires).requires:
            raise fail(f"{where}.requires {requires!r}: that component requires another one itself; one level only")
        for module in standins:
            if not (STANDINS_DIR / module / "__init__.py").is_file():
                raise fail(f"{where}.tests.standins names {module!r}, which kvforge does not ship "
                           f"(kvforge/data/standins/{module}/__init__.py)")
        if standins and requires is None:
            raise fail(f"{where}.tests.standins needs 'requires': stand-ins are for a component tested on "
                       "another one's tree")
        if requirements and requires is None:
            raise fail(f"{where}.tests.requirements needs 'requires': they are installed into the environment "
                       "layer of a component tested on another one's tree")
        for p, sel in tests.items():
            if p not in platforms:
                raise fail(f"{where}.tests.{p} names a platform the component is not tested on")
            if not isinstance(sel, list) or not all(isinstance(s, str) for s in sel):
                raise fail(f"{where}.tests.{p} must be a list of pytest paths or node ids")
            for s in sel:
                if not _relative_test_path(s):
                    raise fail(f"{where}.tests.{p} has {s!r}: tests are paths relative to the tree's root")
        entries = c.get("in_base", [])
        if not isinstance(entries, list):
            raise fail(f"{where}.in_base must be a list of [[components.in_base]] tables")
        in_base = []
        for k, e in enumerate(entries):
            ewhere = f"{where}.in_base[{k}]"
            e = table(e, ewhere)
            known(e, "in_base", ewhere)
            in_base.append(InBase(fix_id=string(e, "fix_id", ewhere, pattern=SLUG_RE.match, what="a Fix-Id"),
                                  reason=string(e, "reason", ewhere)))
        components.append(
            Component(name=cname, repo=repo, ref=ref, release=release, series_dir=series_dir, platforms=platforms,
                      tests={p: tuple(sel) for p, sel in tests.items()}, in_base=tuple(in_base),
                      wheels=parse_wheel_pins(c, where, release, fail),
                      requires=requires, standins=tuple(standins), requirements=requirements)
        )
    return Target(name=name, description=description, path=path, components=tuple(components), lifecycle=lifecycle)


def _test_requirements(value, where: str, fail) -> tuple[str, ...]:
    """`[components.tests] requirements`: PEP 508 requirement strings, each project named once."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise fail(f"{where} must be a list of PEP 508 requirements (e.g. \"scipy\", \"pandas>=2\")")
    if not value:
        return ()
    # packaging's requirement parser (~25 ms to import) loads where requirements are parsed, not with every target.
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    names = []
    for line in value:
        try:
            req = Requirement(line)
        except InvalidRequirement as exc:
            raise fail(f"{where} has {line!r}, not a PEP 508 requirement: {str(exc).splitlines()[0]}") from None
        if req.url:
            raise fail(f"{where} has {line!r}: a requirement names a PyPI project, not a URL")
        names.append(canonicalize_name(req.name))
    if len(set(names)) != len(names):
        raise fail(f"{where} names a project twice")
    return tuple(value)


def _toml_type(value) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a float", list: "an array", dict: "a table"}
    return next((n for t, n in names.items() if isinstance(value, t)), type(value).__name__)


# ---------------------------------------------------------------- [[components.wheels]] (kvforge build)

ARCHES = ("x86_64", "aarch64")  # the machine architectures a deployment installs release wheels on


@dataclass(frozen=True)
class WheelPin:
    """A release wheel `kvforge build` overlays: its PyPI file name, pinned by sha256. Its architecture and
    Python tags come from the file name's platform tags (PEP 427), never from a separate field."""

    filename: str
    sha256: str

    @property
    def arch(self) -> str | None:
        """x86_64 / aarch64 for a manylinux or linux wheel; None for a pure-Python or other wheel."""
        from packaging.utils import parse_wheel_filename  # (with packaging.tags) where a wheel name is read

        _n, _v, _b, tags = parse_wheel_filename(self.filename)
        for arch in ARCHES:
            if any(t.platform.endswith("_" + arch) for t in tags):
                return arch
        return None


def parse_wheel_pins(c: dict, where: str, release: Release, fail) -> tuple[WheelPin, ...]:
    """[[components.wheels]] (one table per release wheel, any number: one per architecture, and per Python for
    a package like vllm_ascend that builds per-interpreter wheels), or the older single [components.wheel]."""
    if "wheel" in c and "wheels" in c:
        raise fail(f"{where} has both 'wheel' and 'wheels': keep [[components.wheels]] only")
    if "wheel" in c:
        return (parse_wheel_pin(c["wheel"], f"{where}.wheel", release, fail),)
    value = c.get("wheels", [])
    if not isinstance(value, list):
        raise fail(f"{where}.wheels must be a list of [[components.wheels]] tables")
    pins = tuple(parse_wheel_pin(v, f"{where}.wheels[{k}]", release, fail) for k, v in enumerate(value))
    names = [p.filename for p in pins]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise fail(f"{where}.wheels lists {dup!r} twice")
    return pins


def parse_wheel_pin(value, where: str, release: Release, fail) -> WheelPin:
    """{filename, sha256}: a wheel of exactly the release's package and version."""
    from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
    from packaging.version import Version

    if not isinstance(value, dict):
        raise fail(f"{where} must be a table")
    for key in value:
        if key not in KEYS["wheel"]:
            raise fail(f"{where} has an unknown key {key!r} (known: {', '.join(KEYS['wheel'])})")
    filename, sha = value.get("filename"), value.get("sha256")
    if not isinstance(filename, str) or not isinstance(sha, str):
        raise fail(f"{where} needs 'filename' and 'sha256' strings")
    if not SHA256_RE.match(sha):
        raise fail(f"{where}.sha256 must be a 64-hex-digit string")
    try:
        if "/" in filename or "\\" in filename:
            raise InvalidWheelFilename("a path, not a file name")
        name, version, _build, _tags = parse_wheel_filename(filename)
    except (InvalidWheelFilename, ValueError) as exc:
        raise fail(f"{where}.filename {filename!r} is not a wheel file name ({exc})") from None
    if name != canonicalize_name(release.package) or version != Version(release.version):
        raise fail(f"{where}.filename {filename!r} is not a wheel of {release.package}=={release.version}")
    return WheelPin(filename=filename, sha256=sha.lower())


def targets_command() -> Done:
    """`kvforge targets`: one row per component of every target."""
    root = project_root()
    rows = [{"target": t.name, "component": c.name, "ref": c.ref, "release": f"{c.release.package}=={c.release.version}",
             "series": os.path.relpath(c.series_dir, root), "platforms": list(c.platforms),
             "description": t.description, "lifecycle": t.lifecycle} for t in load_all() for c in t.components]
    return Done(rows, table(["target", "component", "upstream ref", "offline source", "series", "platforms", "lifecycle"],
                            [[r["target"], r["component"], r["ref"], r["release"], r["series"], ",".join(r["platforms"]),
                              r["lifecycle"]] for r in rows]))
