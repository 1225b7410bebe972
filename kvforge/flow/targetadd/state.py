"""target add's own state: `<cache>/targetadd/<NAME>/state.json`, its lock, and the name rule every entry checks.

Invariants. Every path here is built from a NAME that passed `valid_name` (the rule and the one-line message of a
new target's name, kvforge.project.targets.target_name_problem), so it is one entry directly inside
`<cache>/targetadd/`; `own_dir` refuses a directory that is not a real one there (a symlink, a path that resolves
elsewhere). The state file is type-checked field by field on load: a corrupt or wrong-typed state is one
KvforgeError (exit 2) naming it, never an exception later. The rebase of each component keeps its own state
(kvforge.flow.rebase.state); this module owns only target add's.
"""

from __future__ import annotations

import fcntl
import json
import os
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

from kvforge.core.cache import Cache
from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import atomic_write_text
from kvforge.flow.rebase.onto import RELEASE_RE
from kvforge.git.context import Progress
from kvforge.project.targets import target_name_problem

STATE_VERSION = 1
PHASES = ("running", "committing")


class UnreadableState(KvforgeError):
    """A target add state that is not JSON, another version's, or of the wrong types (exit 2)."""


@dataclass
class AddState:
    """target add's own state (the rebase of each component keeps its own, kvforge.flow.rebase.state)."""

    name: str
    version: str
    from_target: str
    root: str
    root_id: str
    target_text: str  # the planned target file (the from-target's selections): components, pins, series
    components: list[str]  # the new target's components, in order
    left_out: dict[str, str]  # component -> why it is not in the new target
    upstream: dict[str, str]  # component -> the upstream commit its release was built from ("": its sdist records none)
    done: list[str] = field(default_factory=list)  # components whose every patch is decided
    phase: str = "running"  # running | committing
    final_text: str = ""  # committing: the target file written
    series_digests: dict[str, str] = field(default_factory=dict)  # committing: component -> written directory
    notes: list[str] = field(default_factory=list)
    started: str = ""
    try_cpu: bool = False  # --try: the modules new in the release tried on CPU (kvforge test --scan --try)


def valid_name(name: str, what: str) -> str:
    """`name` when it is a valid target name; else exit 2 with the message a new target's name gets."""
    problem = target_name_problem(name) if isinstance(name, str) else "is not a target name"
    if problem is not None:
        shown = name if len(name) <= 40 else name[:37] + "..."
        raise KvforgeError(f"{what} {shown!r} {problem}", EXIT_USAGE)
    return name


def ta_dir(cache: Cache, name: str) -> Path:
    """The state directory of the target add of `name` (a valid target name: one entry inside <cache>/targetadd)."""
    return cache.root / "targetadd" / valid_name(name, "--as")


def own_dir(cache: Cache, name: str) -> Path | None:
    """ta_dir(name) when it is kvforge's own: a real directory (no symlink) directly inside <cache>/targetadd."""
    d = ta_dir(cache, name)
    if d.is_symlink() or not d.is_dir() or d.resolve().parent != (cache.root / "targetadd").resolve():
        return None
    return d


def save_state(cache: Cache, ta: AddState) -> None:
    atomic_write_text(ta_dir(cache, ta.name) / "state.json",
                      json.dumps({**asdict(ta), "state_version": STATE_VERSION}, indent=1, sort_keys=True) + "\n")


def _type_problem(data: dict) -> str | None:
    """Why `data` is not an AddState's fields with their types (None when it is)."""
    hints = typing.get_type_hints(AddState)
    known = {f.name for f in fields(AddState)}
    unknown = sorted(set(data) - known)
    if unknown:
        return f"unknown field {unknown[0]!r}"
    for f in fields(AddState):
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                return f"no field {f.name!r}"
            continue
        value, hint = data[f.name], hints[f.name]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin is list:
            ok = isinstance(value, list) and all(isinstance(v, args[0]) for v in value)
        elif origin is dict:
            ok = isinstance(value, dict) and all(isinstance(k, args[0]) and isinstance(v, args[1])
                                                 for k, v in value.items())
        else:
            ok = type(value) is hint
        if not ok:
            return f"{f.name!r} is not {hint.__name__ if origin is None else hint}"
    return None


def load_state(cache: Cache, name: str) -> AddState | None:
    """The state of the target add of `name`, or None when there is none; a corrupt, wrong-typed or foreign
    state is one KvforgeError (exit 2) that names the file and how to remove it."""
    path = ta_dir(cache, name) / "state.json"
    if not path.is_file():
        return None
    abort = f"`kvforge target add --abort --as {name}` removes it"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.pop("state_version", None) != STATE_VERSION:
            raise ValueError("another kvforge version's state")
        problem = _type_problem(data)
        if problem is not None:
            raise ValueError(problem)
        ta = AddState(**data)
        if ta.name != name:
            raise ValueError(f"it is the state of {ta.name!r}")
        if ta.phase not in PHASES:
            raise ValueError(f"phase {ta.phase!r}")
        if not RELEASE_RE.fullmatch(ta.version):
            raise ValueError(f"version {ta.version[:40]!r}")
        if ta.from_target and target_name_problem(ta.from_target) is not None:
            raise ValueError(f"from_target {ta.from_target[:40]!r}")
        if not Path(ta.root).is_absolute():
            raise ValueError(f"root {ta.root[:80]!r} is not an absolute path")
    except (OSError, UnicodeDecodeError, ValueError, TypeError, RecursionError) as exc:
        raise UnreadableState(f"{path}: unreadable target add state ({exc}); {abort}", EXIT_USAGE) from None
    return ta


def pending_names(cache: Cache, root: Path) -> list[str]:
    """The names of the target adds in progress started in this project (directories whose name is not a target
    name were not made by kvforge: never named)."""
    d = cache.root / "targetadd"
    out = []
    for p in sorted(d.glob("*/state.json")) if d.is_dir() else []:
        if target_name_problem(p.parent.name) is not None:
            continue
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError):
            out.append(p.parent.name)  # unreadable: named, so --abort can remove it
            continue
        if isinstance(data, dict) and data.get("root") == str(root):
            out.append(p.parent.name)
    return out


@contextmanager
def lock(cache: Cache, name: str, progress: Progress) -> Iterator[None]:
    """One target add of `name` at a time (an unusable cache is one error, EXIT_ENV, first). A lock file this call
    made is removed before the lock is released (a dry run or a refusal leaves none); so every holder checks,
    once it holds the lock, that the file it locked is still the one at the path, and locks the new one when not."""
    cache.writable("targetadd")
    cache.writable("rebase")
    cache.writable("trees", ".work")
    path = ta_dir(cache, name).with_name(f".{name}.lock")
    while True:
        made = not path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                progress(f"waiting for another kvforge that is using the target add of {name}")
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                current = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                try:
                    yield
                finally:
                    if made:
                        path.unlink(missing_ok=True)
                return
        finally:
            os.close(fd)
