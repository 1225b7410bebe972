"""The rebase's state: what was planned, each patch's step and verdict, where the rebase is.

Loaded and saved only here: `<cache>/rebase/<target>-<component>/state.json`, written atomically,
versioned (STATE_VERSION) and type-checked on load. A state file of another version, or one that does
not have exactly this shape (a malformed or forged file), is a one-line KvforgeError naming the file;
`kvforge rebase --abort` removes it.
"""

from __future__ import annotations

import json
import shutil
import types
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any, Sequence, Union, get_args, get_origin, get_type_hints

from kvforge.git.context import Context
from kvforge.core.errors import EXIT_ENV, EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import atomic_write_text, file_lock
from kvforge.project.series import Patch

STATE_VERSION = 2


class Verdict(StrEnum):
    """What the rebase did with a patch (a string in JSON and in messages)."""

    CARRIED = "carried"  # applied on the new base; its commit is kept
    UPSTREAM = "upstream"  # the new base has it: dropped (into the ledger)
    CONFLICT = "conflict"  # does not apply: the rebase stopped there
    DISAGREE = "disagree"  # the signals (or git am) disagree: the rebase stopped there
    SKIPPED = "skipped"  # dropped by the user (--skip), or nothing to carry
    PENDING = "pending"  # not reached yet


DROPPED = (Verdict.UPSTREAM, Verdict.SKIPPED)  # the verdicts the ledger records


class Phase(StrEnum):
    RUNNING = "running"  # applying patches; patches/ and targets/ untouched
    COMMITTING = "committing"  # past the commit point: every run finishes the commit


class StopKind(StrEnum):
    CONFLICT = "conflict"
    DISAGREE = "disagree"


@dataclass
class Step:
    """One patch of the series: the signals' decision, then what applying it did."""

    name: str
    fix_id: str
    verdict: Verdict
    reason: str = ""
    decision: str = ""  # what kvforge.flow.upstream.decide said: upstream | carried | disagree
    signals: list[dict[str, Any]] = field(default_factory=list)  # {"name", "fired", "strong", "detail"}
    how: str = ""  # git am: applied | applied (3-way) | no change | conflict | resolved | not applied
    commit: str | None = None  # its commit on the new base (carried)
    old_commit: str | None = None  # its commit on the old base

    @property
    def fired(self) -> list[str]:
        return [s["name"] for s in self.signals if s.get("fired") is True]

    @property
    def against(self) -> list[str]:
        return [s["name"] for s in self.signals if s.get("fired") is False]


@dataclass
class Digests:
    """The files the commit replaces, as they were when the rebase started (changed since: refused)."""

    series: str
    target: str
    old_series: str
    old_target: str


@dataclass
class Plan:
    """Fixed when the rebase starts."""

    target: str
    component: str
    new_target: str  # == target unless --as
    dry_run: bool
    root: Path
    target_file: Path  # the target file the commit writes
    old_target_file: Path
    series_dir: Path  # the series directory the commit writes
    old_series_dir: Path
    state_dir: Path  # holds state.json and patches/ (the copies the rebase applies)
    worktree: Path
    onto: str
    onto_ref: str
    onto_version: str | None  # None when --onto is not a release
    sha256: str | None
    sha256_source: str  # pypi | local archive (offline) | git
    wheel: tuple[str, str] | None  # (filename, sha256) of the new wheel pin
    old_base: str
    old_head: str
    new_base: str
    repo: Path  # the new base's repository (the worktree's)
    source: str
    repo_url: str | None
    digests: Digests
    started: str  # UTC, ISO 8601
    root_id: str = ""  # the project directory's identity (device:inode): the state is bound to it


@dataclass
class Stop:
    kind: StopKind
    applied: bool  # disagree: the patch applied (its commit is HEAD^ + 1 in the worktree)


@dataclass
class State:
    plan: Plan
    steps: list[Step]
    head: str  # the commit the worktree must be at
    position: int = 0  # index of the next step to decide
    phase: Phase = Phase.RUNNING
    stopped: Stop | None = None
    notes: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # base, plan, checks, apply
    worktree_ready: bool = False  # the worktree was positioned for this rebase
    target_text: str | None = None  # committing: the new target file
    new_series_digest: str | None = None  # committing: the staged series directory

    @property
    def step(self) -> Step:
        return self.steps[self.position]

    def dropped_fix_ids(self, before: int) -> set[str]:
        return {s.fix_id for s in self.steps[:before] if s.verdict in DROPPED}

    def where(self) -> str:
        if self.stopped is None:
            return "interrupted" if self.phase is Phase.RUNNING else str(self.phase)
        return f"stopped at {self.step.name}: {self.stopped.kind}"

    def patch_copy(self, name: str) -> Path:
        return self.plan.state_dir / "patches" / name


# ---------------------------------------------------------------- where, and the lock


def state_dir(ctx: Context) -> Path:
    return ctx.cache.root / "rebase" / f"{ctx.target.name}-{ctx.component.name}"


def fresh_state_dir(ctx: Context, patches: Sequence[Patch]) -> Path:
    """The rebase's state directory, emptied, holding the old series' patch files (what --continue re-reads)."""
    sdir = state_dir(ctx)
    if sdir.exists():
        shutil.rmtree(sdir)
    (sdir / "patches").mkdir(parents=True)
    for p in patches:
        (sdir / "patches" / p.name).write_bytes(p.raw)
    return sdir


def lock(ctx: Context) -> AbstractContextManager[None]:
    """One rebase of a target at a time. An unusable cache (a path under a file, read-only) is one
    error here (EXIT_ENV), before anything else."""
    d = state_dir(ctx)
    ctx.cache.writable("rebase")
    ctx.cache.writable("trees", ".work")
    return file_lock(d.parent / f".{d.name}.lock", ctx.progress, f"the rebase of {ctx.label}")


# ---------------------------------------------------------------- load and save


def save(st: State) -> None:
    data = {"version": STATE_VERSION, **asdict(st)}
    atomic_write_text(st.plan.state_dir / "state.json",
                      json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")


def load(ctx: Context) -> State | None:
    """The state of ctx's rebase, None when there is none."""
    path = state_dir(ctx) / "state.json"
    if not path.is_file():
        return None
    abort = f"`kvforge rebase -t {ctx.target.name} --abort` removes it"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise KvforgeError(f"{path}: unreadable rebase state ({exc}); {abort}", EXIT_ENV) from None
    if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
        raise KvforgeError(f"{path}: rebase state of another kvforge version; {abort}", EXIT_ENV)
    data = {k: v for k, v in data.items() if k != "version"}
    try:
        st = _decode(State, data, "state")
        if not 0 <= st.position <= len(st.steps) or (st.stopped is not None and st.position == len(st.steps)):
            raise _Malformed(f"state.position {st.position} is not a step of the {len(st.steps)}")
        for i, step in enumerate(st.steps):
            for j, s in enumerate(step.signals):
                if not (isinstance(s.get("name"), str) and s.get("fired") in (True, False, None)
                        and isinstance(s.get("strong"), bool) and isinstance(s.get("detail"), str)):
                    raise _Malformed(f"state.steps[{i}].signals[{j}] needs name, fired, strong and detail")
    except _Malformed as exc:
        raise KvforgeError(f"{path}: malformed rebase state ({exc}); {abort}", EXIT_USAGE) from None
    return st


class _Malformed(Exception):
    pass


def _decode(tp: Any, value: Any, where: str) -> Any:
    """`value` (parsed JSON) as type `tp` (the annotations above), or _Malformed naming `where`."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _decode(inner, value, where)
    if is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, dict):
            raise _Malformed(f"{where} is not an object")
        hints = get_type_hints(tp)
        names = {f.name for f in fields(tp)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise _Malformed(f"{where} has an unknown key {unknown[0]!r}")
        kwargs = {name: _decode(hints[name], value[name], f"{where}.{name}") for name in names if name in value}
        try:
            return tp(**kwargs)
        except TypeError:
            missing = sorted(n for n in names if n not in value)
            raise _Malformed(f"{where} lacks {missing[0] if missing else 'a key'}") from None
    if origin is list:
        if not isinstance(value, list):
            raise _Malformed(f"{where} is not a list")
        return [_decode(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, list) or len(value) != len(args):
            raise _Malformed(f"{where} is not a list of {len(args)}")
        return tuple(_decode(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise _Malformed(f"{where} is not an object")
        return {k: _decode(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if isinstance(tp, type) and issubclass(tp, Enum):
        try:
            return tp(value)
        except ValueError:
            raise _Malformed(f"{where} is {value!r}, not one of {', '.join(str(m.value) for m in tp)}") from None
    if tp is Path:
        if not isinstance(value, str) or not value:
            raise _Malformed(f"{where} is not a path")
        return Path(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Malformed(f"{where} is not a number")
        return float(value)
    if tp in (str, bool, int):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise _Malformed(f"{where} is not a {tp.__name__}")
        return value
    raise _Malformed(f"{where}: no decoder for {tp!r}")  # a type added above without one here


# ---------------------------------------------------------------- the project the state belongs to


def project_id(root: Path) -> str:
    """The project directory's identity: device and inode (a copy or another checkout differs)."""
    st = root.stat()
    return f"{st.st_dev}:{st.st_ino}"


def bound_elsewhere(st: State, root: Path) -> str | None:
    """None when `st` belongs to the project at `root`; else why not (one clause)."""
    if st.plan.root.resolve() != root.resolve():
        return f"it was started in the project {st.plan.root}, not {root}"
    if st.plan.root_id and st.plan.root_id != project_id(root):
        return f"it was started in another project that was at {st.plan.root} (the directory was replaced)"
    return None


def check_project(st: State, root: Path, label: str) -> None:
    """Refuse to act on a rebase another checkout (KVFORGE_ROOT) started: it writes that checkout's files."""
    why = bound_elsewhere(st, root)
    if why is not None:
        raise KvforgeError(f"the rebase of {label} in progress is not this project's: {why}; run kvforge there "
                           f"(KVFORGE_ROOT={st.plan.root}); this project's patches/ and targets/ were not touched",
                           EXIT_USAGE)


