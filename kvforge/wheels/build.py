"""`kvforge build`: the target's release wheel with the series overlaid, verified on every build.

Which wheels. One per release wheel the component pins ([[components.wheels]], one per platform tag;
--arch picks x86_64 (default), aarch64 or all; an architecture without a pin takes the index's wheel of
the same upload, `choose_wheels`). The package's overlay rules (its import packages, what is compiled or
packaging input) and how its installed wheel is exercised are data: platforms.PACKAGE_BUILDS (vllm;
vllm-ascend, imported next to the patched vLLM tree). A wheel this machine's CPU env cannot import
(aarch64 here, or vllm_ascend's cp310) is installed for its own tags (pip --platform/--abi) and checked by
RECORD, files, .so and metadata; its import and tests are reported "not run". --device (platforms.DEVICES;
empty): not an overlay but the package's own build of the patched tree for that device (build_device).

Overlay (the default mode). The series is applied in the cache (trees.open_stack: the patch files,
or the commits of --from); `git diff` between the base and the patched tree says which files it
changes. The pinned release wheel is downloaded into <cache>/downloads once, and the new wheel is written
member by member (kvforge.wheel): every member the series does not touch (compiled .so files,
third_party, data, dist-info) is copied as stored, without recompressing; the files the series
changes are replaced by the patched tree's, new vllm/**/*.py files are added and deleted ones
dropped; RECORD is rewritten (sha256 and size of every file). Before anything is replaced, each
of those files in the wheel must equal the base tree's, so an overlay never mixes a wheel with a
base it was not built from. Order of work (prepare_wheel, timed by bench/build_vs_cp.py): one `git
diff-tree`; git reads the changed files' blobs in a thread while the wheel's directory is read and the
members that sort before the first changed path are copied into the stage (the big ones by the writer's
thread); then the checks, the changed files and the dist-info. A refusal removes the stage.

Identity. The distribution version gets a local label (`local_version`: `0.20.2+kvforge.<target>.<digest>`,
what pip freeze/show and lock files show); `vllm.__version__` (vllm/_version.py) stays the release's, so
vllm-ascend's `vllm_version_is("0.20.2")` holds. The series is also recorded as
- a wheel build tag, `<upstream build + 1>_kvforge_<series digest>` (in the file name and as
  `Build:` in WHEEL): pip prefers it to the upstream wheel of the same version and tags;
- `<dist-info>/kvforge.json`: target, component, base (ref, commit), series (digest, origin,
  patches with Fix-Id, Kind and sha256), the upstream wheel and the files replaced, added and
  removed. pip installs it with the dist-info, so `importlib.metadata.distribution("vllm")
  .read_text("kvforge.json")` reads it.
The platform tags of the file name are upstream's (vLLM's WHEEL says `linux_x86_64`, its file name
`manylinux_2_35_x86_64`; pip goes by the file name).

Reproducible: same upstream wheel, base and series -> same bytes. Unchanged members are upstream's
bytes; new members are STORED with the newest upstream member's timestamp; entries are sorted
(package files by name, then dist-info, RECORD last); nothing depends on the clock, the machine,
the user or the zlib in use.

Refusals. A series that changes compiled inputs or packaging (csrc/, cmake/, CMakeLists.txt,
setup.py, build and runtime requirements, pyproject.toml's [build-system]/[project], MANIFEST.in,
vllm/_version.py) cannot be overlaid honestly: the error names the file and the source build that
can (`--mode source` prints it: vLLM's own `VLLM_USE_PRECOMPILED=1` build with
`VLLM_PRECOMPILED_WHEEL_LOCATION=<the release wheel>`, or a full compile for csrc/).

Verification (every build, before the wheel gets its name in --out; a failing wheel is deleted):
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
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import platform as host_platform
import sys
import threading
import time
import tomllib
import urllib.parse
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import NamedTuple

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from kvforge.git import gitutil
from kvforge.git.bases import STALE_DOWNLOAD, Base, Progress, download_pinned, parse_commit_id, release_files
from kvforge.core.cache import Cache
from kvforge.env.venv import Env, target_env
from kvforge.core.errors import EXIT_ENV, EXIT_INTERNAL, EXIT_NETWORK, EXIT_NOT_RUN, EXIT_TESTS, EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import (atomic_write_text, remember_sha256, remembered_sha256, remove_stale, sha256_file, sha256_memo,
                     stat_stamp)
from kvforge.core.outcome import Done
from kvforge.env.components import layer
from kvforge.project.platforms import DEVICES, PACKAGE_BUILDS, Device, PackageBuild, package_build, require_available
from kvforge.project.targets import ARCHES, Component, WheelPin
from kvforge.proof.testrun import run_properties, run_pytest, unique
from kvforge.git.trees import Stack, open_stack, resolve_from
from kvforge.core.wheel import (RawZipWriter, WheelError, date_time_of, format_record, local_spans, parse_record,
                    read_member, read_members, record_hash, wheel_sort_key)

# Writing to --out failed for a reason of its file system: full, over quota, file too large, read-only, denied
OUT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)
RECIPE = 1  # bump when the overlay's output bytes change for the same inputs
IDENTITY_FILE = "kvforge.json"
STALE_VERIFY = r"^\.verify-(?P<pid>\d+)$"
STALE_STAGE = r"^\.kvforge-build-(?P<pid>\d+)$"

# Inputs an overlay cannot carry, per package: kvforge/project/platforms.py PACKAGE_BUILDS (vLLM's kept here by name).
VLLM_RULES = PACKAGE_BUILDS["vllm"]
COMPILE_PREFIXES, COMPILE_FILES = VLLM_RULES.compile_prefixes, VLLM_RULES.compile_files
PACKAGING_PREFIXES, PACKAGING_FILES = VLLM_RULES.packaging_prefixes, VLLM_RULES.packaging_files


@dataclass
class Change:
    path: str
    status: str  # A | M | D (git diff --name-status)
    action: str = ""  # replace | add | remove | not packaged | refused
    why: str = ""


@dataclass
class Verification:
    ok: bool = False
    site: str = ""  # where the wheel was installed (removed afterwards)
    python: str = ""
    platform: str = "cpu"
    record: dict = field(default_factory=dict)
    modules: dict = field(default_factory=dict)
    probe: dict = field(default_factory=dict)
    tests: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    seconds: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class BuildResult:
    target: str
    component: str
    mode: str  # overlay | source | device
    version: str
    local_version: str = ""  # the wheel's version: the release's + kvforge's local label (local_version)
    base: str = ""
    base_ref: str = ""
    series: str = ""
    origin: str = "series"
    fix_ids: list[str] = field(default_factory=list)
    upstream: dict = field(default_factory=dict)  # filename, sha256, path
    wheel: str | None = None  # the verified wheel in --out (None: not built, or refused)
    filename: str = ""
    sha256: str = ""
    size: int = 0
    build_tag: str = ""
    changes: list[Change] = field(default_factory=list)
    verification: Verification | None = None
    command: str | None = None  # --mode source: the build to run on a build machine
    seconds: dict = field(default_factory=dict)
    ok: bool = False
    reason: str = ""
    report: str | None = None
    arch: str | None = "x86_64"  # the release wheel's machine architecture (None: pure Python, --device)
    device: str = ""  # --device NAME: the package's own build for that device (empty), not an overlay
    variant: str = ""  # what tells this wheel from the component's others: "", "aarch64", "cp311-x86_64", "empty"
    pinned: bool = True  # False: the target pins no wheel for this architecture; chosen from the index's list

    def to_json(self) -> dict:
        data = {k: v for k, v in self.__dict__.items() if k not in ("changes", "verification")}
        data["changes"] = [c.__dict__ for c in self.changes]
        data["verification"] = self.verification.to_json() if self.verification else None
        return data


class BuildRefused(KvforgeError):
    """The series changes something an overlay cannot build; `command` is the source build that can."""

    def __init__(self, message: str, command: str):
        super().__init__(message, EXIT_USAGE)
        self.command = command


# ---------------------------------------------------------------- the upstream wheel

def download_wheel(component: Component, cache: Cache, say: Progress, pin: WheelPin | None = None) -> Path:
    """The pinned release wheel (`pin`, default the x86_64 one) in <cache>/downloads; only a complete file
    with the pinned sha256 gets its name."""
    pin = pin or component.wheel
    assert pin is not None, "build_target refuses a component without a wheel pin"
    downloads = cache.downloads
    with contextlib.suppress(OSError):
        remove_stale(downloads, STALE_DOWNLOAD)
    dest = downloads / pin.filename
    if dest.is_file():
        return dest  # its sha256 is checked while the overlay reads it (check_download)
    index, files = release_files(component.release.package, component.release.version)
    entry = next((f for f in files if f.get("filename") == pin.filename and isinstance(f.get("url"), str)), None)
    if entry is None:
        raise KvforgeError(f"{index}: no file {pin.filename} in {component.release.package}=="
                           f"{component.release.version}", EXIT_NETWORK)
    listed = (entry.get("digests") or {}).get("sha256")
    if listed and listed != pin.sha256:
        raise KvforgeError(f"{pin.filename}: the index says sha256 {listed}, the target pins {pin.sha256}",
                           EXIT_NETWORK)
    url, size = urllib.parse.urljoin(index, entry["url"]), int(entry.get("size") or 0)
    path = download_pinned(url, dest, size, pin.sha256, say, mb_digits=0, pinned="the pinned ")
    Hasher.stamp_checked(path, pin.sha256)  # hashed while downloading: the first build need not hash it again
    return path


def choose_wheels(package: str, version: str, upload: int | None = None) -> dict[str, WheelPin]:
    """{architecture: pin} for a release, chosen from the package index's file list (PyPI's JSON API or
    $KVFORGE_PYPI_URL): per architecture, the manylinux wheel of exactly `version` from the first upload (no
    build number, or the lowest; with `upload`, only that build number: the same upload as the wheels a
    target already pins), whatever its manylinux tag (2_35 for 0.20.2, 2_24 for 0.21.0, 2_28 for 0.22.0),
    pinned by the sha256 the index lists. Not the highest build number: PyPI's rebuilds of vLLM come from
    other commits than the release's sdist (0.20.1-1 and 0.21.0-1: `vllm/_version.py` says ad7125a43 where
    0.21.0's sdist and first wheels say 9da56fd18), and an overlay must sit on the sdist's commit
    (`check_same_commit` refuses any other). The one choice rebase, target add and watch make."""
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


def wheel_commit(path: Path, members: list, package: str) -> str | None:
    """The upstream commit a release wheel was built from: its `<package>/_version.py` `__commit_id__`
    (vLLM's; None for a wheel that records none)."""
    name = f"{canonicalize_name(package).replace('-', '_')}/_version.py"
    member = next((m for m in members if m.name == name), None)
    return parse_commit_id(read_member(path, member).decode("utf-8", "replace")) if member else None


def check_same_commit(path: Path, members: list, package: str, base: Base, pin: WheelPin) -> None:
    """Refuse (exit 2) a release wheel built from another upstream commit than the base the series is
    applied to: its unpatched files would be another commit's, so the overlay would mix two trees."""
    built, want = wheel_commit(path, members, package), base.upstream_commit
    if built and want and not (want.startswith(built) or built.startswith(want)):
        raise KvforgeError(f"{pin.filename} was built from upstream commit {built}, the base {base.ref} from "
                           f"{want[:12]}: an overlay would mix two commits; pin the release wheel built from "
                           f"{want[:9]} (PyPI's first upload of the release; a later build number is a rebuild)",
                           EXIT_USAGE)


class Hasher(threading.Thread):
    """sha256 of the cached release wheel, in a thread (hashlib releases the GIL) while the overlay copies it.

    A file's sha256 is remembered beside it (fsutil.remember_sha256: `.<file>.sha256` with its size, inode,
    mtime and ctime); while its stat still says the same, the sha256 is taken from there, as git trusts its
    index for unchanged files. ctime cannot be set back by a user, so any rewrite of the file is hashed
    again. (Every build's verification then checks each installed file against RECORD as well.)
    """

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.digest, self.stamped = path, "", False
        self.error: OSError | None = None
        self.key = ""

    @property
    def stamp(self) -> Path:
        return sha256_memo(self.path)

    def run(self) -> None:
        try:
            known = remembered_sha256(self.path)
            if known is not None:
                self.digest, self.stamped = known, True
                return
            self.key = stat_stamp(self.path)
            self.digest = sha256_file(self.path)
        except OSError as exc:
            self.error = exc

    @classmethod
    def stamp_checked(cls, path: Path, sha256: str) -> None:
        """Remember the sha256 of a file that was just checked (download_pinned's)."""
        remember_sha256(path, sha256)

    def record(self) -> None:
        """Remember the file's sha256 (call once it matched the pin)."""
        if not self.stamped and not self.error:
            remember_sha256(self.path, self.digest, self.key)


# ---------------------------------------------------------------- what the series changes

def read_blobs(repo: Path, specs: list[str]) -> dict[str, bytes | None]:
    """`git cat-file --batch` for rev:path specs -> their bytes (None when missing)."""
    if not specs:
        return {}
    out = gitutil.run(repo.parent, "cat-file", "--batch", stdin="".join(s + "\n" for s in specs), binary=True,
                      env={"GIT_DIR": str(repo)}).stdout
    res: dict[str, bytes | None] = {}
    pos = 0
    for spec in specs:
        nl = out.index(b"\n", pos)
        head = out[pos:nl].split()
        pos = nl + 1
        if len(head) == 2 and head[1] == b"missing":
            res[spec] = None
            continue
        size = int(head[2])
        res[spec] = out[pos:pos + size]
        pos += size + 1
    return res


def diff_paths(repo: Path, base: str, head: str) -> list[Change]:
    return diff_raw(repo, base, head)[0]


NO_BLOB = "0" * 40


def diff_raw(repo: Path, base: str, head: str) -> tuple[list[Change], dict[str, tuple[str, str]]]:
    """`git diff --raw` between two commits: the changed paths (sorted) and, per path, its blob ids
    (base, head), NO_BLOB on the side where it does not exist."""
    out = gitutil.run(repo.parent, "diff-tree", "-r", "--raw", "--no-renames", "--no-abbrev", "-z", base, head,
                      env={"GIT_DIR": str(repo)}, binary=True).stdout.decode("utf-8", "surrogateescape")
    items = out.split("\0")
    changes, ids = [], {}
    for head_fields, path in zip(items[0::2], items[1::2]):
        if path:
            _old_mode, _new_mode, old, new, status = head_fields.lstrip(":").split(" ")
            changes.append(Change(path=path, status=status[:1]))
            ids[path] = (old, new)
    return sorted(changes, key=lambda c: c.path), ids


def changed_blobs(repo: Path, rev: dict, ids: dict[str, tuple[str, str]], rules: PackageBuild) -> dict[str, bytes | None]:
    """The bytes on both sides of each changed path an overlay may read (its import packages' files and
    pyproject.toml; `ids`: diff_raw's), as read_blobs keys them ("<commit>:<path>", None where the path does
    not exist): a `git cat-file --batch` by blob id per side, the two at once, no tree walked (prepare_wheel
    runs this in a thread while it reads the wheel). write_overlay reads any other it needs."""
    packages = tuple(f"{name}/" for name in rules.import_packages)
    ids = {path: pair for path, pair in ids.items() if path.startswith(packages) or path == "pyproject.toml"}
    base_ids = sorted({old for old, _new in ids.values() if old != NO_BLOB})
    base_side = Background(lambda: read_blobs(repo, base_ids))
    base_side.start()
    objects = read_blobs(repo, sorted({new for _old, new in ids.values() if new != NO_BLOB} - set(base_ids)))
    objects.update(base_side.result())
    blobs: dict[str, bytes | None] = {}
    for path, pair in ids.items():
        for which, oid in zip(("base", "patched"), pair):
            blobs[f"{rev[which]}:{path}"] = None if oid == NO_BLOB else objects[oid]
    return blobs


def changed_files(repo: Path, rev: dict, rules: PackageBuild) -> tuple[list[Change], dict[str, bytes | None]]:
    """What the series changes (one `git diff-tree --raw`) and changed_blobs' bytes."""
    changes, ids = diff_raw(repo, rev["base"], rev["patched"])
    return changes, changed_blobs(repo, rev, ids, rules)


class Background(threading.Thread):
    """fn() in a thread; result() waits for it and returns its value or raises its exception."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.value, self.error = fn, None, None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:  # noqa: BLE001 - raised again by result()
            self.error = exc

    def result(self):
        self.join()
        if self.error is not None:
            raise self.error
        return self.value


def _pyproject_build_changed(before: bytes | None, after: bytes | None) -> bool:
    def tables(raw):
        try:
            data = tomllib.loads((raw or b"").decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError):
            return None
        return data.get("build-system"), data.get("project")
    return tables(before) != tables(after)


def classify(changes: list[Change], members: set[str], read, rules: PackageBuild = VLLM_RULES) -> None:
    """Decide what the overlay does with each changed path (read(rev, path) -> bytes | None), by the
    package's rules (kvforge/project/platforms.py PACKAGE_BUILDS)."""
    packages = tuple(f"{name}/" for name in rules.import_packages)
    for c in changes:
        p = c.path
        if p.startswith(rules.compile_prefixes) or p in rules.compile_files:
            c.action, c.why = "refused", "compile"
        elif p.startswith(rules.packaging_prefixes) or p in rules.packaging_files:
            c.action, c.why = "refused", "packaging"
        elif p == "pyproject.toml":
            if _pyproject_build_changed(read("base", p), read("patched", p)):
                c.action, c.why = "refused", "packaging"
            else:
                c.action, c.why = "not packaged", "only tool settings changed"
        elif p in members:
            c.action = "remove" if c.status == "D" else "replace"
        elif p.startswith(packages):
            if c.status == "A" and p.endswith(".py"):
                c.action = "add"
            elif c.status == "D":
                c.action, c.why = "not packaged", "not in the wheel"
            else:
                c.action, c.why = "refused", "packaging"  # setup.py's package_data decides; only a build knows
        else:
            c.action, c.why = "not packaged", f"outside {', '.join(packages)}"


def source_command(ctx, wheel_path: str, out: Path, compile_needed: bool) -> str:
    """vLLM's own build of the patched tree (what --mode source prints)."""
    t = ctx.target.name
    rel = ctx.component.release
    if ctx.from_rev:
        repo, commit = resolve_from(ctx.from_rev)
        get_tree = f"cd {shlex.quote(str(repo))} && git checkout --detach {commit[:12]}"
    else:
        tree = f"{ctx.component.name}-{t}"
        get_tree = f"kvforge apply --target {shlex.quote(t)} --into {tree} && cd {tree}"
    env = [f"VLLM_VERSION_OVERRIDE={rel.version}"]
    if not compile_needed:
        env += ["VLLM_USE_PRECOMPILED=1", f"VLLM_PRECOMPILED_WHEEL_LOCATION={shlex.quote(wheel_path)}"]
    return (f"{get_tree} && {' '.join(env)} python -m pip wheel --no-deps --wheel-dir "
            f"{shlex.quote(str(Path(out).absolute()))} .")


# ---------------------------------------------------------------- the overlay

def build_tag_for(upstream_filename: str, digest: str) -> str:
    _n, _v, build, _t = parse_wheel_filename(upstream_filename)
    number = build[0] if build else 0
    return f"{number + 1}_kvforge_{digest}"


def output_filename(upstream_filename: str, build_tag: str, version: str | None = None) -> str:
    """Upstream's name with the build tag (replacing upstream's) and, when given, the local version:
    name-version-BUILD-py-abi-platform.whl."""
    parts = upstream_filename[:-len(".whl")].split("-")
    name, tags = parts[0], parts[-3:]
    return "-".join([name, version or parts[1], build_tag, *tags]) + ".whl"


def _wheel_text(text: str, build_tag: str) -> bytes:
    lines = [ln for ln in text.splitlines() if not ln.startswith("Build:")]
    while lines and not lines[-1].strip():
        lines.pop()
    return ("\n".join(lines) + f"\nBuild: {build_tag}\n\n").encode()


def local_version(release: str, target: str, digest: str) -> str:
    """The patched wheel's version: the release's with a PEP 440 local label naming kvforge, the target and
    the series digest (`0.20.2+kvforge.v0.20.2rc.3ade4a00e47759bf`): what pip freeze, pip show, lock files
    and importlib.metadata show. Characters a local label cannot hold become '.'. A version that has a
    local label already (vLLM's own `0.20.2+empty`) keeps it first and gets kvforge's after a '.', the way
    vLLM's setup.py appends its device to a local version: `0.20.2+empty.kvforge.v0.20.2rc.<digest>`."""
    label = re.sub(r"[^A-Za-z0-9.]+", ".", target).strip(".").lower()
    ours = f"kvforge.{label}.{digest}" if label else f"kvforge.{digest}"
    return f"{release}{'.' if '+' in release else '+'}{ours}"


def _metadata_text(text: str, version: str) -> bytes:
    """METADATA with its Version: header set to `version` (nothing else changes)."""
    head, sep, body = text.partition("\n\n")
    lines = [f"Version: {version}" if ln.startswith("Version:") else ln for ln in head.split("\n")]
    return ("\n".join(lines) + sep + body).encode()


@dataclass
class ReleaseWheel:
    """A release wheel's directory, checked, and what an overlay reads of it. index(): one .dist-info
    directory with RECORD and WHEEL, every local header agreeing with the central directory (enough to start
    copying); check(): RECORD lists exactly the archive's files, each with its size, and the dist-info's files
    are read. prepare_wheel starts the copies between the two, while git reads the changed files."""

    path: Path
    members: list
    by_name: dict
    info: str  # the .dist-info directory
    present: set[str]  # the archive's files but RECORD and its signatures
    spans: dict[str, tuple[int, int]]  # each member's local header + data, checked (wheel.local_spans)
    record: dict[str, tuple[str, str]] = field(default_factory=dict)  # check()'s
    texts: dict[str, bytes] = field(default_factory=dict)  # the dist-info's files (check()'s)
    checked: bool = False

    @classmethod
    def read(cls, path: Path, members=None) -> "ReleaseWheel":
        return cls.index(path, members).check()

    @classmethod
    def index(cls, path: Path, members=None) -> "ReleaseWheel":
        members = members if members is not None else read_members(path)
        by_name = {m.name: m for m in members}
        infos = {m.name.split("/", 1)[0] for m in members if m.name.split("/", 1)[0].endswith(".dist-info")}
        if len(infos) != 1:
            raise WheelError(f"{path.name}: expected one .dist-info directory, found {sorted(infos) or 'none'}")
        info = infos.pop()
        record_name = f"{info}/RECORD"
        if record_name not in by_name or f"{info}/WHEEL" not in by_name:
            raise WheelError(f"{path.name}: {info} lacks RECORD or WHEEL")
        present = {m.name for m in members if not m.is_dir} - {record_name, f"{info}/RECORD.jws", f"{info}/RECORD.p7s"}
        return cls(path, members, by_name, info, present, local_spans(path, members))

    def check(self) -> "ReleaseWheel":
        if self.checked:
            return self
        path, info, by_name, present = self.path, self.info, self.by_name, self.present
        texts = {m.name: read_member(path, m) for m in self.members if m.name.startswith(info + "/") and not m.is_dir}
        record_name = f"{info}/RECORD"
        record = parse_record(texts[record_name].decode("utf-8"), path.name)
        listed = set(record) - {record_name}
        if listed != present:
            extra, missing = sorted(listed - present)[:3], sorted(present - listed)[:3]
            raise WheelError(f"{path.name}: RECORD and the archive disagree (listed, not in the zip: {extra}; "
                             f"in the zip, not listed: {missing})")
        for name in present:
            if record[name][1] != str(by_name[name].file_size):
                raise WheelError(f"{path.name}: RECORD gives {name} {record[name][1]} bytes, the zip "
                                 f"{by_name[name].file_size}")
        self.record, self.texts, self.checked = record, texts, True
        return self


class Overlay:
    """An overlay being written to `out_path`: opened on the release wheel, with the package files that sort
    before the first path the series may change (`changed`: any changed path in the wheel or in its import
    packages) copied at once, since their places depend on nothing else (prepare_wheel does it while git
    reads the changed files); finish() writes the rest. abort() closes the files (the caller removes them)."""

    def __init__(self, release: ReleaseWheel, out_path: Path, changed: set[str]):
        self.release, self.out_path = release, out_path
        t = time.monotonic()
        first = min(changed, default=None)
        info = release.info + "/"
        self.prefix = sorted(n for n in release.present if not n.startswith(info) and (first is None or n < first))
        self.src = open(release.path, "rb")
        try:
            self.dst = open(out_path, "wb")
        except BaseException:
            self.src.close()
            raise
        self.w = RawZipWriter(self.dst)
        try:
            for name in self.prefix:
                self.w.copy(self.src, release.by_name[name], release.path.name, release.spans[name])
            self.w.flush()
        except BaseException:
            self.abort()
            raise
        self.seconds = time.monotonic() - t

    def abort(self) -> None:
        self.w.abort()
        self.dst.close()
        self.src.close()

    def finish(self, replace: dict[str, bytes], add: dict[str, bytes], remove: set[str], identity: dict,
               build_tag: str, version: str | None = None) -> dict:
        """Write the rest and close; return {"members", "copied", "written", "dist_info"}. See overlay()."""
        try:
            return self._finish(replace, add, remove, identity, build_tag, version)
        finally:
            self.abort()

    def _finish(self, replace, add, remove, identity, build_tag, version) -> dict:
        release, w, upstream = self.release.check(), self.w, self.release.path
        members, by_name, info, record, present = (release.members, release.by_name, release.info, release.record,
                                                   release.present)
        record_name, wheel_name, meta_name = f"{info}/RECORD", f"{info}/WHEEL", f"{info}/METADATA"
        for name in add:
            if name in by_name:
                raise WheelError(f"{upstream.name}: {name} is added by the series but already in the wheel")
        new: dict[str, bytes] = {**replace, **add}
        generated = {wheel_name, f"{info}/{IDENTITY_FILE}"} | (
            {meta_name} if version is not None and meta_name in by_name else set())
        names = (present | set(new) | generated) - remove
        final_info, moved = info, {}
        if version is not None:  # the dist-info directory is named after the version: every member moves
            final_info = f"{info[:-len('.dist-info')].rsplit('-', 1)[0]}-{version}.dist-info"
            moved = {n: final_info + n[len(info):] for n in names if n.startswith(info + "/")}
            names = (names - set(moved)) | set(moved.values())
        final_record = f"{final_info}/RECORD"
        order = sorted(names, key=lambda n: wheel_sort_key(n, final_info)) + [final_record]
        done = len(self.prefix)
        if order[:done] != self.prefix:  # the series changed a path before the first one it was said to change
            raise KvforgeError(f"{upstream.name}: the overlay's first {done} members are not the wheel's; a "
                               "kvforge bug", EXIT_INTERNAL)
        stamp = max(date_time_of(m) for m in members)
        new[wheel_name] = _wheel_text(release.texts[wheel_name].decode("utf-8"), build_tag)
        new[f"{info}/{IDENTITY_FILE}"] = (json.dumps(identity, indent=2, sort_keys=True) + "\n").encode()
        if version is not None and meta_name in generated:
            new[meta_name] = _metadata_text(release.texts[meta_name].decode("utf-8"), version)
        source = {new_name: old_name for old_name, new_name in moved.items()}
        for old_name, new_name in moved.items():
            new[new_name] = new.pop(old_name) if old_name in new else release.texts[old_name]
        rows = []
        for name in order[:-1]:
            if name in new:
                rows.append((name, record_hash(new[name]), str(len(new[name]))))
            else:
                rows.append((name, *record[source.get(name, name)]))
        rows.append((final_record, "", ""))
        new[final_record] = format_record(rows)
        copied, written = done, 0
        for name in order[done:]:
            if name in new:
                old = source.get(name, name)
                w.add(name, new[name], stamp, (by_name[old].mode & 0o7777 if old in by_name else 0o644) or 0o644)
                written += 1
            else:
                w.copy(self.src, by_name[name], upstream.name, release.spans[name])
                copied += 1
        w.close()
        self.dst.flush()
        return {"members": len(order), "copied": copied, "written": written, "dist_info": final_info}


def overlay(upstream: Path, out_path: Path, replace: dict[str, bytes], add: dict[str, bytes], remove: set[str],
            identity: dict, build_tag: str, members=None, version: str | None = None,
            release: ReleaseWheel | None = None) -> dict:
    """Write the new wheel to `out_path`; return {"members", "copied", "written"}. With `version`, the
    dist-info says that version (its directory renamed, METADATA's Version:), the package files are unchanged.
    `release`: upstream's ReleaseWheel, when the caller has read it. Members in wheel order: package files by
    name, then the dist-info, RECORD last; unchanged ones copied as stored, new ones STORED."""
    release = release or ReleaseWheel.read(upstream, members)
    return Overlay(release, out_path, set(replace) | set(add) | set(remove)).finish(
        replace, add, remove, identity, build_tag, version)


# ---------------------------------------------------------------- the command

def _identity(ctx, stack, upstream_pin, changes: list[Change], build_tag: str, version: str | None = None,
              device: str = "") -> dict:
    pats = stack.series.patches
    ident = {
        "schema": 1,
        "recipe": RECIPE,
        "target": ctx.target.name,
        "component": ctx.component.name,
        "version": ctx.component.release.version,
        "local_version": version or local_version(ctx.component.release.version, ctx.target.name, stack.digest),
        "build_tag": build_tag,
        "base": {"ref": stack.base.ref, "commit": stack.base.commit, "source": stack.base.source},
        "series": {"digest": stack.digest, "origin": "series" if stack.origin == "series" else "commits",
                   "patches": [{"name": p.name, "fix_id": p.fix_id, "kind": p.kind,
                                "upstream_status": p.upstream_status, "sha256": p.sha256} for p in pats]},
        "fix_ids": [p.fix_id for p in pats],
        "upstream_wheel": {"filename": upstream_pin.filename, "sha256": upstream_pin.sha256} if upstream_pin else None,
        "files": {a: [c.path for c in changes if c.action == a] for a in ("replace", "add", "remove")},
    }
    if device:  # built from the patched tree by the package's own build, not overlaid on a release wheel
        ident["device"] = device
    return ident


def builds_dir(ctx, digest: str) -> Path:
    """<cache>/builds/<target>/<component>/<digest>: build reports, verification JUnit and logs."""
    path = ctx.cache.root / "builds" / ctx.target.name / ctx.component.name / digest
    path.mkdir(parents=True, exist_ok=True)
    return path


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


def build_target(ctx, out: Path, mode: str = "overlay", tests: str = "checks", platform: str = "cpu",
                 wheel: Path | None = None, shard: tuple[int, int] = (1, 1), pin: WheelPin | None = None,
                 pinned: bool = True) -> BuildResult:
    """Build (or, with `wheel`, only verify) the target's patched wheel of the release wheel `pin` (default:
    the component's x86_64 pin); see the module docstring."""
    prep = prepare_wheel(ctx, out, mode, platform, wheel, pin, pinned)
    if isinstance(prep, BuildResult):  # --mode source: the command to run elsewhere
        return prep
    result, stack, built, changes, rev, rules, pin, t0 = prep
    return _verify_and_place(ctx, stack, result, built, wheel, out, t0,
                             lambda: verify_wheel(ctx, stack, built, changes, rev, tests, platform, shard, pin=pin,
                                                  suffix=_suffix(result), version=result.local_version, rules=rules),
                             platform)


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


def prepare_wheel(ctx, out: Path, mode: str = "overlay", platform: str = "cpu", wheel: Path | None = None,
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


def _verify_and_place(ctx, stack, result: BuildResult, built: Path, wheel: Path | None, out: Path, t0: float,
                      verify, platform: str) -> BuildResult:
    """Hash and verify the built wheel (`verify()`); a verified wheel gets its name in --out in one step, a
    failing one is deleted; the report goes to the build directory."""
    try:
        v0 = time.monotonic()
        result.sha256, result.size = sha256_file(built), built.stat().st_size
        result.seconds["hash"] = round(time.monotonic() - v0, 3)
        result.verification = verify()
        result.seconds["verify"] = round(time.monotonic() - v0, 3)
        result.ok = result.verification.ok
        if not result.ok:
            result.reason = "verification failed: " + "; ".join(result.verification.problems[:3])
    except BaseException:
        if wheel is None:
            shutil.rmtree(built.parent, ignore_errors=True)
        raise
    if wheel is None:
        if result.ok:
            final = out / result.filename
            try:
                with open(built, "rb") as fh:
                    os.fsync(fh.fileno())
                os.replace(built, final)  # the verified wheel gets its name in --out in one step
            except OSError as exc:
                shutil.rmtree(built.parent, ignore_errors=True)
                raise out_error(out, exc) from None
            result.wheel = str(final)
        shutil.rmtree(built.parent, ignore_errors=True)
    else:
        result.wheel = str(wheel) if result.ok else None
    result.seconds["total"] = round(time.monotonic() - t0, 3)
    report = builds_dir(ctx, stack.digest) / f"build-{platform}{_suffix(result)}.json"
    report.write_text(json.dumps(result.to_json(), indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
    result.report = str(report)
    return result


# ---------------------------------------------------------------- --device: the package's own source build

STALE_DEVICE = r"^\.device-(?P<pid>\d+)$"


def build_tools(ctx, env: Env, tree: Path, device: Device) -> Path:
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


def build_device(ctx, out: Path, device: Device, tests: str = "checks", shard: tuple[int, int] = (1, 1)) -> BuildResult:
    """`kvforge build --device NAME`: the package's own build of the patched tree for a device vLLM ships no
    release wheel for (empty: VLLM_TARGET_DEVICE=empty, pure Python), in the target's CPU env with
    --no-build-isolation (vLLM's setup.py imports torch; the env's CPU torch stands in for the pinned one) and
    the tree's other build requirements; reproducible (SOURCE_DATE_EPOCH = the patched commit's time, then
    rewritten by kvforge.wheel: members in a fixed order, new members STORED). Its version is vLLM's own
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
        identity = _identity(ctx, stack, None, changes, result.build_tag, result.local_version, device.name)
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
    return _verify_and_place(ctx, stack, result, built, None, out, t0,
                             lambda: verify_wheel(ctx, stack, built, changes, rev, tests, "cpu", shard, pin=None,
                                                  suffix=_suffix(result), version=result.local_version,
                                                  import_check=device.import_check), "cpu")


def _suffix(result: BuildResult) -> str:
    """The report's and JUnit file's suffix: none for the component's default wheel (its names stay)."""
    return f"-{result.variant}" if result.variant else ""


def out_error(out: Path, exc: OSError) -> KvforgeError:
    """A wheel that cannot be written to --out (full disk, quota, read-only, no permission): exit 5, one line."""
    return KvforgeError(f"--out {out}: cannot write the wheel there ({exc.strerror or exc}); nothing was written",
                        EXIT_ENV)


def make_stage(out: Path) -> Path:
    """`out` (made if missing) and in it a new stage directory of this process, <out>/.kvforge-build-<pid>
    (stale ones of dead processes removed): the wheel is written there, and named in `out` once verified."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KvforgeError(f"--out {out}: cannot create it ({exc.strerror or exc})", EXIT_ENV) from None
    with contextlib.suppress(OSError):
        remove_stale(out, STALE_STAGE)
    stage = out / f".kvforge-build-{os.getpid()}"  # pip installs only a file named like a wheel
    shutil.rmtree(stage, ignore_errors=True)
    try:
        stage.mkdir()
    except OSError as exc:
        raise out_error(out, exc) from None
    return stage


@contextlib.contextmanager
def writing_stage(out: Path, stage: Path, part: Path):
    """Errors while the wheel is written: the stage is removed; a write --out's disk refuses is exit 5, one
    line (an error reading the cached wheel is not)."""
    try:
        yield
    except OSError as exc:
        shutil.rmtree(stage, ignore_errors=True)
        if exc.errno not in OUT_ERRNOS or exc.filename not in (None, str(part), part):
            raise
        raise out_error(out, exc) from None
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def changed_package_paths(changes: list[Change], release: ReleaseWheel, rules: PackageBuild) -> set[str]:
    """The changed paths an overlay may replace, add or remove: those in the wheel or in its import packages."""
    packages = tuple(f"{name}/" for name in rules.import_packages)
    return {c.path for c in changes if c.path in release.by_name or c.path.startswith(packages)}


def write_overlay(ctx, stack, upstream: Path, out: Path, changes: list[Change], rev: dict, result,
                  members=None, blobs: dict[str, bytes | None] | None = None,
                  release: ReleaseWheel | None = None, started: Overlay | None = None) -> tuple[Path, dict]:
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
    identity = _identity(ctx, stack, pin, changes, result.build_tag)
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


# ---------------------------------------------------------------- verification

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


def verify_wheel(ctx, stack, wheel: Path, changes: list[Change], rev: dict, tests: str, platform: str,
                 shard: tuple[int, int] = (1, 1), pin: WheelPin | None = None, suffix: str = "",
                 version: str | None = None, rules: PackageBuild = VLLM_RULES, import_check: tuple[str, ...] = ()) -> Verification:
    """Install the wheel with --no-deps into a directory and check it (see the module docstring). What this
    machine cannot import (another architecture or Python) is installed for the wheel's own platform tags and
    checked by RECORD, file and metadata only; its import and tests are labelled not run."""
    say = ctx.progress
    v = Verification(platform=platform)
    env = target_env(ctx, base=stack.base, platform=platform) if rules.probe == "vllm" else \
        target_env(ctx.for_component(ctx.component.requires), platform=platform)
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


def _vllm_probe_and_tests(ctx, stack, v: Verification, env: Env, wheel: Path, site: Path, troot: Path, work: Path, rev: dict,
                          tests: str, platform: str, shard: tuple[int, int], suffix: str, version: str | None,
                          import_check: tuple[str, ...]) -> None:
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


def check_metadata(site: Path, version: str | None, stack) -> dict:
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


def plugin_probe(ctx, env: Env, site: Path, changes: list[Change], rules: PackageBuild) -> dict:
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


def check_modules(stack, site: Path, changes: list[Change], rev: dict) -> dict:
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


# ---------------------------------------------------------------- rendering

def verdict(result: BuildResult) -> tuple[int, str | None]:
    if result.mode == "source":
        return EXIT_NOT_RUN, result.reason
    if not result.ok:
        return EXIT_TESTS, f"{result.target}: {result.reason}"
    return 0, None


def render(result: BuildResult) -> str:
    """The text of `kvforge build`: the source build's command, or the changes, the verification and the wheel."""
    lines: list[str] = []
    echo = lines.append
    if result.mode == "source":
        echo(f"# {result.target}: vLLM's own build of the patched tree (on a build machine):")
        echo(result.command or "")  # click.echo(None) printed an empty line
        return "\n".join(lines)
    echo(f"{result.target}/{result.component}: base {result.base_ref} ({result.base[:12]}), series {result.series} "
         f"({len(result.fix_ids)} patches: {', '.join(result.fix_ids) or 'none'})")
    if result.device:
        echo(f"built for device {result.device} by {result.upstream.get('built_by')}: {result.upstream.get('filename')} "
             f"-> version {result.local_version}")
    else:
        echo(f"upstream {result.upstream.get('filename')} (sha256 {result.upstream.get('sha256', '')[:16]}...)"
             + ("" if result.pinned else "; not pinned in the target: chosen from the index's file list"))
    for c in result.changes:
        echo(f"  {c.action:<13} {c.path}" + (f"  ({c.why})" if c.why else ""))
    v = result.verification
    if v is not None:
        echo(f"verification ({v.platform}, {v.python}):")
        if v.record:
            echo(f"  RECORD: {v.record['checked']} files checked against the installed wheel (sha256 and size)")
        if v.modules:
            echo(f"  patched files installed = patched tree: {len(v.modules['equal'])} equal")
        if v.record.get("compiled"):
            cc = v.record["compiled"]
            echo(f"  compiled files (.so): {cc['equal']} of {cc['files']} equal to the release wheel's")
        if v.record.get("metadata"):
            md = v.record["metadata"]
            echo(f"  installed {md.get('dist_info')}: Version {md.get('version')}, kvforge.json {md.get('identity')}")
        p = v.probe
        if p and p.get("not_run") and isinstance(p["not_run"], str):
            echo(f"  NOT RUN {p['not_run']}")
        if p and "imported" in p and "vllm_file" not in p:
            echo(f"  import next to {p.get('required')}: {len(p['imported'])} modules imported from the wheel")
            for mod, why in sorted((p.get("not_run") or {}).items()):
                echo(f"    NOT RUN import {mod}: {why}")
        if v.tests.get("note") and not v.tests.get("selected"):
            echo(f"  tests: {v.tests['note']}")
        if p and "vllm_file" in p:
            echo(f"  import vllm -> {p['vllm_file']} (version {p['version']}, metadata {p['metadata_version']}, "
                 f"== release: {p['version_is_release']}; WHEEL Build: {', '.join(p['wheel_build'])})")
            echo(f"  {p['compiled']}; platform {p['platform']}; torch {p['torch']}")
            for mod, where in (p.get("imported") or {}).items():
                echo(f"  import {mod} -> {where or (p.get('import_errors') or {}).get(mod)}")
        if v.tests.get("selected"):
            tt = v.tests
            echo(f"  tests ({tt['mode']}, shard {tt['shard']}): {tt.get('passed', 0)} passed, {tt.get('failed', 0)} "
                 f"failed, {tt.get('errors', 0)} errors, {tt.get('skipped', 0)} skipped in {tt.get('seconds', 0)}s; "
                 f"{tt.get('vllm_modules_loaded', 0)} vllm modules loaded, all from the installed wheel: "
                 f"{not tt.get('vllm_modules_elsewhere')}")
            if tt.get("junit"):
                echo(f"  JUnit XML: {tt['junit']}")
        for prob in v.problems:
            echo(f"  PROBLEM {prob}")
    if result.ok:
        echo(f"{result.wheel}")
        echo(f"sha256 {result.sha256}  {result.size} bytes; seconds: "
             + ", ".join(f"{k} {v}" for k, v in result.seconds.items()))
    return "\n".join(lines)


def wheels_to_build(ctx, arch: str | None) -> list[tuple[WheelPin, bool]]:
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


def build_command(ctx, out: Path, mode: str, tests: str, platform: str, wheel_path: Path | None,
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
        match = [(w, True) for w in ctx.component.wheels
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
