"""What a series changes and whether an overlay can carry it: the changed paths from one `git diff-tree
--raw`, the bytes on both sides from `git cat-file --batch` (by blob id, in a thread), each path's action
by the package's rules (classify; kvforge/project/platforms.py PACKAGE_BUILDS), and the source build that
can do what an overlay refuses.

Refusals. A series that changes compiled inputs or packaging (csrc/, cmake/, CMakeLists.txt, setup.py,
build and runtime requirements, pyproject.toml's [build-system]/[project], MANIFEST.in, vllm/_version.py)
cannot be overlaid honestly: the error (BuildRefused) names the file and the source build that can
(`--mode source` prints it: vLLM's own `VLLM_USE_PRECOMPILED=1` build with
`VLLM_PRECOMPILED_WHEEL_LOCATION=<the release wheel>`, or a full compile for csrc/).
"""

from __future__ import annotations

import shlex
import threading
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.git import gitutil
from kvforge.git.context import Context
from kvforge.git.trees import resolve_from
from kvforge.project.platforms import PACKAGE_BUILDS, PackageBuild
from kvforge.wheels.result import Change

# Inputs an overlay cannot carry, per package: kvforge/project/platforms.py PACKAGE_BUILDS (vLLM's kept here by name).
VLLM_RULES = PACKAGE_BUILDS["vllm"]
COMPILE_PREFIXES, COMPILE_FILES = VLLM_RULES.compile_prefixes, VLLM_RULES.compile_files
PACKAGING_PREFIXES, PACKAGING_FILES = VLLM_RULES.packaging_prefixes, VLLM_RULES.packaging_files


class BuildRefused(KvforgeError):
    """The series changes something an overlay cannot build; `command` is the source build that can."""

    def __init__(self, message: str, command: str):
        super().__init__(message, EXIT_USAGE)
        self.command = command


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
    """The paths changed between two commits, sorted (diff_raw's)."""
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

    def __init__(self, fn: Callable[[], Any]):
        super().__init__(daemon=True)
        self.fn: Callable[[], Any] = fn
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:  # noqa: BLE001 - raised again by result()
            self.error = exc

    def result(self) -> Any:
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


def classify(changes: list[Change], members: set[str], read: Callable[[str, str], bytes | None],
             rules: PackageBuild = VLLM_RULES) -> None:
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


def source_command(ctx: Context, wheel_path: str, out: Path, compile_needed: bool) -> str:
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
