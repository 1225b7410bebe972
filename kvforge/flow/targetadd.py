"""`kvforge target add VERSION`: a complete new target for an upstream release, in one step (all files or none).

Owns the new target: which release of each component it follows and the pins of each (the sdist's sha256 and
release wheels per architecture from the package index, kvforge.flow.rebase.onto; the upstream commit the sdist
records, kvforge.git.bases), each component's series seeded by rebasing the nearest older target's series with the
rebase library (kvforge.flow.rebase.steps: signals, `git am -3`, stops and resumes), the selections checked against
the new base (and the CPU one rescanned statically, kvforge.proof.selection), `lifecycle = "maintained"`, and the one
write of targets/NAME.toml and every patches/ directory it makes.

State. `<cache>/targetadd/<NAME>/state.json` (this module's: the release, the from-target, the planned target
file, the components done) plus one rebase state per component (`<cache>/rebase/<NAME>-<component>/`,
kvforge.flow.rebase.state). It is bound to the project that started it. Nothing in targets/ or patches/ is written
before every patch of every component is decided; a conflict stops (exit 3) with the worktree named;
`--continue` takes the resolution, `--abort` removes the state (the project was never touched).

Commit. The target file and the new series directories did not exist (checked at the start and again here).
One transaction of the project (kvforge.project.transaction) stages every series directory (linted) and the
target file's bytes; the state records phase "committing" with the target file's text and each directory's
digest; then the transaction commits: a target appears only with all its series. A kill is finished (past
the transaction's commit point) or undone by the next kvforge command that writes the project; `--continue`
then sees the target written (or writes it again), and `--abort` takes back, in one transaction, only the
files whose bytes are still this command's own output.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from kvforge.project import seriesdir
from kvforge.git.bases import ensure_base
from kvforge.core.cache import Cache
from kvforge.git.context import Context, Progress, quiet
from kvforge.core.errors import EXIT_APPLY, EXIT_NETWORK, EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import atomic_write_text, crashpoint, file_lock
from kvforge.project.transaction import ABSENT, dir_digest, file_digest, open_transaction, text_digest
from kvforge.flow.rebase.commit import stage_series
from kvforge.flow.rebase.onto import RELEASE_RE, Candidate, matching_release, release_pins, release_ref
from kvforge.flow.rebase.retarget import complete_component, render_target, selection_comments
from kvforge.flow.rebase.state import Digests, Plan, State, StopKind, Step, load, project_id, save, state_dir
from kvforge.flow.rebase.steps import apply_steps, old_commits, plan, release_worktree, resume, skip, worktree_path
from kvforge.ci.scaffold import CORE_TESTS, core_cpu_suites, first_selection_comment
from kvforge.core.render import table
from kvforge.proof.selection import scan_target
from kvforge.project.targets import Component, Release, Target, display_path, load_all, load_target, parse_target, \
    project_root, target_name_problem
from kvforge.git.trees import open_stack

STATE_VERSION = 1
# The component of a target made in a project that has none yet (kvforge init): vLLM, an empty series.
FRESH_VLLM = Component(name="vllm", repo="https://github.com/vllm-project/vllm.git", ref="v0",
                       release=Release("vllm", "0"), series_dir=Path("patches"), platforms=("cpu", "cuda"),
                       tests={"cpu": (), "cuda": ()})
ACTIONS = ("start", "continue", "skip", "abort")


# ---------------------------------------------------------------- the result


@dataclass
class ComponentResult:
    """One component of the new target: its release and pins, its series' verdicts, or why it is left out."""

    name: str
    package: str
    version: str | None = None
    ref: str | None = None
    sha256: str | None = None
    upstream_commit: str | None = None
    wheels: list[dict[str, str]] = field(default_factory=list)  # {"filename", "sha256", "arch"}
    series: str | None = None  # relative to the project
    from_series: str | None = None
    patches: list[Step] = field(default_factory=list)
    left_out: str | None = None  # why the component is not in the new target
    selection: dict[str, Any] = field(default_factory=dict)  # per platform: kept, dropped; cpu: scan

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for p, d in zip(self.patches, data["patches"]):
            d["fired"] = p.fired
        return data


@dataclass
class TargetAddResult:
    """What `kvforge target add` returns (an Outcome): done, planned (--dry-run), stopped (exit 3) or aborted."""

    name: str
    version: str
    from_target: str
    state: str  # done | planned | stopped | aborted
    components: list[ComponentResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    written: list[str] = field(default_factory=list)
    message: str = ""
    worktree: str | None = None
    stopped_component: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return EXIT_APPLY if self.state == "stopped" else 0

    @property
    def error(self) -> str | None:
        return self.message if self.state == "stopped" else None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["components"] = [c.to_json() for c in self.components]
        if self.state == "stopped":
            data.update({"error": self.message, "exit": self.exit_code})
        return data

    def render(self) -> str:
        if self.state == "aborted":
            return self.message
        out = []
        for c in self.components:
            if c.left_out:
                out.append(f"{c.name}: left out: {c.left_out}")
                continue
            up = (f", built from upstream commit {c.upstream_commit}" if c.upstream_commit
                  else ", its sdist names no upstream commit")
            out.append(f"{c.name}: {c.package} {c.version} ({c.ref}{up}), sdist sha256 {(c.sha256 or '')[:12]}…, "
                       f"series {c.series} " + (f"from {c.from_series}" if c.from_series else "(empty: a first target)"))
            for w in c.wheels:
                out.append(f"  wheel {w['arch']}: {w['filename']} (sha256 {w['sha256'][:12]}…)")
            if c.patches:
                rows = []
                for n, p in enumerate(c.patches, 1):
                    sig = ", ".join(p.fired) or "-"
                    if p.against:
                        sig += " (not: " + ", ".join(p.against) + ")"
                    rows.append([n, p.name, p.verdict, sig, p.how, p.reason])
                out.append(table(["#", "patch", "verdict", "signals fired", "git am", "why"], rows))
            for plat, s in c.selection.items():
                line = f"  tests {plat}: {len(s.get('kept', []))} selectors kept"
                if "scan" in s:
                    line += (f"; rescanned: the series reaches {len(s['scan'])} test modules "
                             f"({len(s.get('judged_before', []))} left out in {self.from_target} as not CPU)")
                if s.get("dropped"):
                    line += f"; dropped (not in {c.version}): {', '.join(s['dropped'])}"
                if s.get("added"):
                    line += f"; added (new in {c.version}, run on CPU: --try): {', '.join(s['added'])}"
                if s.get("unlisted"):
                    line += (f"; new in {c.version}, not tried on CPU (`kvforge test -t {self.name} --scan --try`): "
                             f"{', '.join(s['unlisted'])}")
                out.append(line)
        head = {"done": "added", "planned": "plan (dry run, nothing written)", "stopped": "stopped"}[self.state]
        out.append(f"{head}: target {self.name} for vLLM {self.version} "
                   + (f"from {self.from_target}" if self.from_target else "(the project's first target)"))
        if self.written:
            out.append("written: " + ", ".join(self.written))
        if self.seconds:
            out.append("time: " + ", ".join(f"{k} {v:.1f}s" for k, v in self.seconds.items()))
        return "\n".join(out)  # the notes go to stderr as warnings, a stop's message as the error line (cli.finish)


# ---------------------------------------------------------------- the state


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


def _ta_dir(cache: Cache, name: str) -> Path:
    return cache.root / "targetadd" / name


def _save(cache: Cache, ta: AddState) -> None:
    atomic_write_text(_ta_dir(cache, ta.name) / "state.json",
                      json.dumps({**asdict(ta), "state_version": STATE_VERSION}, indent=1, sort_keys=True) + "\n")


def _load(cache: Cache, name: str) -> AddState | None:
    path = _ta_dir(cache, name) / "state.json"
    if not path.is_file():
        return None
    abort = f"`kvforge target add --abort --as {name}` removes it"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.pop("state_version", None) != STATE_VERSION:
            raise ValueError("another kvforge version's state")
        ta = AddState(**data)
        if not (isinstance(ta.components, list) and isinstance(ta.done, list) and isinstance(ta.left_out, dict)
                and isinstance(ta.target_text, str) and ta.phase in ("running", "committing")):
            raise ValueError("unexpected value types")
    except (OSError, ValueError, TypeError) as exc:
        raise KvforgeError(f"{path}: unreadable target add state ({exc}); {abort}", EXIT_USAGE) from None
    return ta


def _pending(cache: Cache, root: Path) -> list[str]:
    """The names of the target adds in progress started in this project."""
    d = cache.root / "targetadd"
    out = []
    for p in sorted(d.glob("*/state.json")) if d.is_dir() else []:
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            out.append(p.parent.name)  # unreadable: named, so --abort can remove it
            continue
        if isinstance(data, dict) and data.get("root") == str(root):
            out.append(p.parent.name)
    return out


def _lock(cache: Cache, name: str, progress: Progress):
    cache.writable("targetadd")
    cache.writable("rebase")
    cache.writable("trees", ".work")
    return file_lock(cache.root / "targetadd" / f".{name}.lock", progress, f"the target add of {name}")


# ---------------------------------------------------------------- the library entry point


def add(cache: Cache, version: str, *, from_target: str | None = None, as_name: str | None = None,
        dry_run: bool = False, try_cpu: bool = False, progress: Progress = quiet) -> TargetAddResult:
    """Add the target for vLLM `version` (a release on the package index): see the module docstring.

    Returns a TargetAddResult (an Outcome): state "done" (every file written), "planned" (dry_run: nothing
    written, every patch given a verdict), or "stopped" (exit 3: a patch does not apply or the signals
    disagree; `add_continue` / `add_abort`). `try_cpu`: the CPU selection's rescan also runs the modules new in
    the release on the new base in its CPU test environment (kvforge.proof.selection.scan_target, as `kvforge test
    --scan --try`) and adds those that run; slow (the environment, then pytest). Bad input is a KvforgeError
    exit 2 before any work (a version that is not X.Y.Z[rcN], a name that is taken, an unknown --from); no
    package index (offline, $KVFORGE_OFFLINE=1, unreachable) is exit 6: a complete target needs its sha256
    pins from the index. An error after the work began (a download) keeps the state: --continue or --abort."""
    start = time.monotonic()
    root = project_root()
    if not isinstance(version, str) or not RELEASE_RE.fullmatch(version):
        raise KvforgeError(f"VERSION {str(version)[:40]!r} is not a vLLM release version (X.Y.Z, e.g. 0.21.0)",
                           EXIT_USAGE)
    name = as_name if as_name is not None else f"v{version}"
    _check_name(root, name, "--as" if as_name is not None else "the target name")
    old = _from_target(root, version, from_target)
    if os.environ.get("KVFORGE_OFFLINE"):
        raise KvforgeError("target add reads the package index (sha256 pins, wheels, the matching vllm-ascend "
                           "release) and $KVFORGE_OFFLINE is set; run it online", EXIT_NETWORK)
    with _lock(cache, name, progress):
        if _load(cache, name) is not None:
            raise KvforgeError(f"a target add of {name} is in progress; `kvforge target add --continue --as {name}` "
                               f"or `--abort --as {name}`", EXIT_USAGE)
        progress(f"reading the package index for vllm {version}")
        t0 = time.monotonic()
        new_target, left_out, notes = _plan_target(root, old, version, name, cache.downloads, progress)
        ta = AddState(name=name, version=version, from_target=old.name if old else "", root=str(root),
                      root_id=project_id(root),
                      target_text=render_target(new_target, root), components=[c.name for c in new_target.components],
                      left_out=left_out, upstream={}, notes=notes, try_cpu=try_cpu,
                      started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        seconds = {"index": round(time.monotonic() - t0, 3)}
        if not dry_run:
            _save(cache, ta)
            crashpoint("targetadd:planned")
        return _drive(cache, ta, old, new_target, dry_run, False, progress, start, seconds)


def add_continue(cache: Cache, name: str | None = None, progress: Progress = quiet,
                 skip_patch: bool = False) -> TargetAddResult:
    """Resume the target add stopped at a patch (the user's resolution is taken; `skip_patch`: the patch is
    dropped instead, recorded in the new series' ledger as `skipped`), or finish an interrupted one."""
    start = time.monotonic()
    root = project_root()
    name = _which(cache, root, name, "skip" if skip_patch else "continue")
    with _lock(cache, name, progress):
        ta = _require(cache, root, name)
        old = load_target(ta.from_target, root) if ta.from_target else None
        new = _target_of(ta, root)
        if skip_patch:
            st = next((s for c in new.components if c.name not in ta.done
                       and (s := load(Context(cache, new, c, source="sdist"))) is not None), None)
            if ta.phase != "running" or st is None or st.stopped is None:
                raise KvforgeError(f"the target add of {name} is not stopped at a patch; nothing to skip (--continue "
                                   "goes on)", EXIT_USAGE)
            skip(st)
        return _drive(cache, ta, old, new, False, not skip_patch, progress, start, {})


def add_abort(cache: Cache, name: str | None = None, progress: Progress = quiet) -> TargetAddResult:
    """Stop a target add: its state and worktrees' `git am` go; the project is as it was (after a kill inside
    the commit, the files it wrote are removed only where they are still exactly its own output)."""
    root = project_root()
    name = _which(cache, root, name, "abort")
    with _lock(cache, name, progress):
        try:
            ta = _require(cache, root, name)
        except KvforgeError as exc:
            if "unreadable" not in str(exc):
                raise
            shutil.rmtree(_ta_dir(cache, name), ignore_errors=True)
            return TargetAddResult(name, "", "", "aborted", message=f"target add of {name} aborted (its state was "
                                   "unreadable and is removed); targets/ and patches/ were not touched")
        new_target = _target_of(ta, root)
        kept: list[str] = []
        if ta.phase == "committing":  # what its transaction wrote (finished now if a kill cut it) is taken back
            tfile = root / "targets" / f"{name}.toml"
            with open_transaction(root, "targetadd", progress,
                                  dirs=[c.series_dir for c in new_target.components]) as tx:
                if file_digest(tfile) == text_digest(ta.final_text):
                    tx.remove_file(tfile, read=text_digest(ta.final_text))
                for c in new_target.components:
                    digest = ta.series_digests.get(c.name)
                    if digest and dir_digest(c.series_dir) == digest:
                        tx.remove_dir(c.series_dir, read=digest)
                    elif c.series_dir.exists() and any(c.series_dir.iterdir()):
                        kept.append(display_path(c.series_dir))
                tx.commit()
        _discard(cache, ta, new_target)
        msg = f"target add of {name} aborted: targets/ and patches/ are as they were"
        if kept:
            msg += f" (except {', '.join(kept)}, which changed since kvforge wrote it: left as it is)"
        return TargetAddResult(name, ta.version, ta.from_target, "aborted", message=msg)


def run(cache: Cache, action: str, version: str | None = None, *, from_target: str | None = None,
        as_name: str | None = None, dry_run: bool = False, try_cpu: bool = False,
        progress: Progress = quiet) -> TargetAddResult:
    """The CLI's one call: action start | continue | skip | abort."""
    if action == "start":
        if not version:
            raise KvforgeError("VERSION is required (e.g. `kvforge target add 0.21.0`), or --continue / --abort",
                               EXIT_USAGE)
        return add(cache, version, from_target=from_target, as_name=as_name, dry_run=dry_run, try_cpu=try_cpu,
                   progress=progress)
    if version or from_target or dry_run or try_cpu:
        raise KvforgeError(f"--{action} takes no VERSION, --from, --dry-run or --try: they were fixed when the target add "
                           "started (--as NAME says which one)", EXIT_USAGE)
    if action in ("continue", "skip"):
        return add_continue(cache, as_name, progress, skip_patch=action == "skip")
    if action == "abort":
        return add_abort(cache, as_name, progress)
    raise KvforgeError(f"unknown target add action {action!r} (one of {', '.join(ACTIONS)})", EXIT_USAGE)


# ---------------------------------------------------------------- planning the target


def _check_name(root: Path, name: str, what: str) -> None:
    """A new target's name: valid, and no target file or non-empty series directory of that name (never
    overwritten; nothing suggests deleting them)."""
    problem = target_name_problem(name)
    if problem is not None:
        shown = name if len(name) <= 40 else name[:37] + "..."
        raise KvforgeError(f"{what} {shown!r} {problem}", EXIT_USAGE)
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


def _from_target(root: Path, version: str, name: str | None) -> Target | None:
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


def _plan_target(root: Path, old: Target | None, version: str, name: str, downloads: Path,
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


def _target_of(ta: AddState, root: Path) -> Target:
    with tempfile.TemporaryDirectory(prefix="kvforge-target-") as d:
        probe = Path(d) / f"{ta.name}.toml"
        probe.write_text(ta.target_text, encoding="utf-8")
        t = parse_target(probe, root)
    return replace(t, path=root / "targets" / f"{ta.name}.toml")


# ---------------------------------------------------------------- rebasing each component


def _contexts(cache: Cache, old: Target, new: Target, cname: str, progress: Progress) -> tuple[Context, Context]:
    return (Context(cache, old, old.component(cname), source="sdist", progress=progress),
            Context(cache, new, new.component(cname), source="sdist", progress=progress))


def _start_component(ctx_old: Context, ctx_new: Context, ta: AddState, dry_run: bool) -> State:
    """The rebase of one component's series onto its new base, planned (signals per patch) and saved."""
    root = Path(ta.root)
    series = ctx_old.series()
    old_base = ctx_old.base()
    stack = open_stack(ctx_old)
    comp = ctx_new.component
    ctx_new.say(f"{comp.name}: new base {comp.release.package} {comp.release.version} ({comp.ref})")
    new_base = ensure_base(comp, ctx_new.cache, "sdist", None, ctx_new.progress)
    ta.upstream[comp.name] = new_base.upstream_commit or ""
    olds = old_commits(ctx_new, stack, old_base, new_base)
    sdir = state_dir(ctx_new)
    if sdir.exists():
        shutil.rmtree(sdir)
    (sdir / "patches").mkdir(parents=True)
    for p in series.patches:
        (sdir / "patches" / p.name).write_bytes(p.raw)
    target_file = root / "targets" / f"{ta.name}.toml"
    the_plan = Plan(
        target=ctx_old.target.name, component=comp.name, new_target=ta.name, dry_run=dry_run, root=root,
        target_file=target_file, old_target_file=ctx_old.target.path, series_dir=comp.series_dir,
        old_series_dir=ctx_old.component.series_dir, state_dir=sdir, worktree=worktree_path(ctx_new, new_base.repo),
        onto=comp.release.version, onto_ref=comp.ref, onto_version=comp.release.version,
        sha256=comp.release.sha256, sha256_source="pypi", wheel=(comp.wheel.filename, comp.wheel.sha256)
        if comp.wheel else None, old_base=old_base.commit, old_head=stack.commits[-1], new_base=new_base.commit,
        repo=new_base.repo, source=new_base.source, repo_url=None,
        digests=Digests(series=dir_digest(comp.series_dir), target=file_digest(target_file),
                        old_series=dir_digest(ctx_old.component.series_dir), old_target=file_digest(ctx_old.target.path)),
        started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), root_id=ta.root_id)
    t0 = time.monotonic()
    steps, _t_checks = plan(ctx_new, comp, new_base, series.patches, olds, False)
    st = State(plan=the_plan, steps=steps, head=new_base.commit, seconds={"plan": round(time.monotonic() - t0, 3)})
    save(st)
    return st


def _drive(cache: Cache, ta: AddState, old: Target | None, new: Target, dry_run: bool, resuming: bool, progress: Progress,
           start: float, seconds: dict[str, float]) -> TargetAddResult:
    """Rebase every component not done yet (resuming the one stopped), then write the target."""
    states: dict[str, State] = {}
    for comp in new.components:
        if old is None:
            break
        ctx_old, ctx_new = _contexts(cache, old, new, comp.name, progress)
        st = load(ctx_new)
        if comp.name in ta.done and st is not None:
            states[comp.name] = st
            continue
        t0 = time.monotonic()
        if st is None or dry_run:
            st = _start_component(ctx_old, ctx_new, ta, dry_run)
        elif resuming and ta.phase == "running":
            resume(st)
        if ta.phase == "running" and not apply_steps(ctx_new, st):
            if not dry_run:
                _save(cache, ta)
            seconds[f"rebase {comp.name}"] = round(time.monotonic() - t0, 3)
            return _stopped(ta, new, states, st, seconds, start)
        save(st)
        seconds[f"rebase {comp.name}"] = round(time.monotonic() - t0, 3)
        states[comp.name] = st
        if not dry_run and comp.name not in ta.done:
            ta.done.append(comp.name)
            _save(cache, ta)
            crashpoint("targetadd:component-done")
    if old is None:  # a first target: its bases are imported for their upstream commit and selection; no rebase
        firsts = []
        for comp in new.components:
            base = ensure_base(comp, cache, "sdist", None, progress)
            ta.upstream[comp.name] = base.upstream_commit or ""
            firsts.append(_first_selection(comp, base.repo, base.commit))
        new = replace(new, components=tuple(firsts))
    t0 = time.monotonic()
    final, selections = _final_target(new, old, states)
    seconds["selections"] = round(time.monotonic() - t0, 3)
    result = _result(ta, final, states, selections, "planned" if dry_run else "done")
    if dry_run:
        for st in states.values():
            release_worktree(st.plan.worktree)
            shutil.rmtree(st.plan.state_dir, ignore_errors=True)
        result.seconds = {**seconds, "total": round(time.monotonic() - start, 3)}
        return result
    t0 = time.monotonic()
    result.written = _commit(cache, ta, final, states, selections, progress)
    seconds["write"] = round(time.monotonic() - t0, 3)
    _discard(cache, ta, new)
    result.seconds = {**seconds, "total": round(time.monotonic() - start, 3)}
    return result


def _stopped(ta: AddState, new: Target, states: dict[str, State], st: State, seconds: dict[str, float],
             start: float) -> TargetAddResult:
    result = _result(ta, new, {**states, st.plan.component: st}, {}, "stopped")
    p = st.step
    result.stopped_component, result.worktree = st.plan.component, str(st.plan.worktree)
    cont = f"`kvforge target add --continue --as {ta.name}`"
    if st.stopped is not None and st.stopped.kind is StopKind.CONFLICT:
        result.message = (f"{st.plan.component}: {p.name} does not apply to {st.plan.onto_ref}: {p.reason}. Resolve "
                          f"the conflict in {st.plan.worktree} (git am is stopped there), `git add` the files, then "
                          f"{cont}; `--skip --as {ta.name}` drops the patch, `--abort --as {ta.name}` stops (nothing "
                          "was written to targets/ or patches/)")
    else:
        result.message = (f"{st.plan.component}: {p.name}: the signals disagree whether {st.plan.onto_ref} already "
                          f"has it ({p.reason}). {cont} carries it, `--skip --as {ta.name}` drops it; "
                          f"`--abort --as {ta.name}` stops (nothing was "
                          "written to targets/ or patches/)")
    result.seconds = {**seconds, "total": round(time.monotonic() - start, 3)}
    return result


# ---------------------------------------------------------------- selections on the new base


def _first_selection(comp: Component, repo: Path, commit: str) -> Component:
    """A first target's vLLM selections, as `kvforge init --release` writes them: CPU, vLLM's own CPU-marked core
    suites of this base (kvforge.ci.scaffold.core_cpu_suites); CUDA, the core tests' directory."""
    if comp.name != "vllm":
        return comp
    return replace(comp, tests={**comp.tests, "cpu": core_cpu_suites(repo, commit), "cuda": (CORE_TESTS.rstrip("/"),)})


def _final_target(new: Target, old: Target | None, states: dict[str, State]) -> tuple[Target, dict[str, dict]]:
    """The new target with every component completed on its new base (kvforge.flow.rebase.retarget.complete_component:
    selections checked, the CPU one rescanned), and what that did per component."""
    comps = []
    report: dict[str, dict] = {}
    for c in new.components:
        st = states.get(c.name)
        if st is None or old is None:  # a first target: empty series and selections
            comps.append(c)
            continue
        done, report[c.name] = complete_component(c, old.component(c.name), st.plan.repo, st.plan.new_base, st.head,
                                                  st.plan.old_base, st.plan.old_head)
        comps.append(done)
    return replace(new, components=tuple(comps)), report


# ---------------------------------------------------------------- the one write


def _header(ta: AddState) -> list[str]:
    lines = [f"Made by `kvforge target add {ta.version}{' --from ' + ta.from_target if ta.from_target else ''}` "
             f"({ta.started}): every component's"]
    lines += ["release pinned from the package index, its series rebased from the from-target's, its selections",
              "checked against the new base."] if ta.from_target else \
        ["release pinned from the package index; the project had no target: an empty series, and as CPU selection",
         "vLLM's own CPU-marked core suites of the release (as `kvforge init --release` selects)."]
    for cname, why in ta.left_out.items():
        lines.append(f"{cname} is left out: {why}")
    return lines


def _commit(cache: Cache, ta: AddState, final: Target, states: dict[str, State], selections: dict[str, dict],
            progress: Progress) -> list[str]:
    """Write every series directory and the target file in one transaction (see the module docstring); after a
    kill, what a finished transaction wrote is kept and an undone one is written again."""
    root = Path(ta.root)
    tfile = root / "targets" / f"{ta.name}.toml"
    written = [display_path(c.series_dir) for c in final.components] + [display_path(tfile)]
    with open_transaction(root, "targetadd", progress, dirs=[c.series_dir for c in final.components]) as tx:
        if ta.phase == "committing" and file_digest(tfile) == text_digest(ta.final_text) and all(
                dir_digest(c.series_dir) == ta.series_digests.get(c.name) for c in final.components):
            return written
        if ta.phase != "committing":
            comments = {c.name: selection_comments(c, selections.get(c.name, {}), ta.from_target, ta.name,
                                                   ta.upstream.get(c.name)) for c in final.components}
            if not ta.from_target:
                for c in final.components:
                    if c.tests.get("cpu"):
                        comments[c.name]["cpu"] = first_selection_comment(tuple(c.tests["cpu"]))
            ta.final_text = render_target(final, root, _header(ta), comments)
        if tfile.exists():
            raise KvforgeError(f"{display_path(tfile)} appeared since the target add of {ta.name} started; nothing "
                               f"more was written (`kvforge target add --abort --as {ta.name}` removes what it "
                               "wrote)", EXIT_USAGE)
        for c in final.components:
            dest = c.series_dir
            if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
                raise KvforgeError(f"{display_path(dest)} appeared since the target add of {ta.name} started; it is "
                                   f"left as it is and nothing more was written (`kvforge target add --abort --as "
                                   f"{ta.name}` removes what it wrote)", EXIT_USAGE)
        for c in final.components:
            st = states.get(c.name)
            dest = c.series_dir
            read = dir_digest(dest)  # absent, or an empty directory (_check_name)
            ta.series_digests[c.name] = (stage_series(tx, st, dest, read=read) if st is not None
                                         else tx.stage_dir(dest, {seriesdir.SERIES_FILE: b""}, read=read))
        if ta.try_cpu and ta.phase != "committing":
            final = _try_new_modules(cache, ta, final, selections, progress,
                                     {c.name: tx.staged_copy(c.series_dir) for c in final.components})
        tx.stage_file(tfile, ta.final_text.encode("utf-8"), read=ABSENT)
        ta.phase = "committing"
        _save(cache, ta)  # what the next run compares the project with
        tx.commit()
    return written


def _try_new_modules(cache: Cache, ta: AddState, final: Target, selections: dict[str, dict], progress: Progress,
                     staged: dict[str, Path]) -> Target:
    """--try: run the modules the rescan found new in the release on the new base in the component's CPU test
    environment (kvforge.proof.selection.scan_target with try_cpu, which `kvforge test --scan --try` runs), on the
    staged series (`staged`: component -> its staged copy; nothing is written to the project yet); those that
    run join the CPU selection. The target file's text is rendered again; returns the target with them."""
    root = Path(ta.root)
    comps = []
    for c in final.components:
        rep = selections.get(c.name, {}).get("cpu", {})
        if not rep.get("unlisted"):
            comps.append(c)
            continue
        # What the old release's scan found and its target left out counts as covered: only the new modules are tried.
        probe = replace(c, tests={**c.tests, "cpu": (*c.tests["cpu"], *rep.get("judged_before", []))},
                        series_dir=staged.get(c.name, c.series_dir))
        progress(f"{c.name}: trying {len(rep['unlisted'])} modules new in {c.release.version} on CPU (--try)")
        trials = scan_target(Context(cache, replace(final, components=(probe,)), probe, source="sdist",
                                     progress=progress), try_cpu=True).trials
        runs = [t.module for t in trials if t.runs]
        rep["tried"] = [t.to_json() for t in trials]
        rep["unlisted"] = [m for m in rep["unlisted"] if m not in runs]
        rep["added"] = runs
        comps.append(replace(c, tests={**c.tests, "cpu": (*c.tests["cpu"], *runs)}))
    final = replace(final, components=tuple(comps))
    comments = {c.name: selection_comments(c, selections.get(c.name, {}), ta.from_target, ta.name,
                                           ta.upstream.get(c.name)) for c in final.components}
    ta.final_text = render_target(final, root, _header(ta), comments)
    return final


def _discard(cache: Cache, ta: AddState, new: Target) -> None:
    for c in new.components:
        ctx = Context(cache, new, c, source="sdist")
        try:
            st = load(ctx)
        except KvforgeError:
            st = None
        if st is not None:
            release_worktree(st.plan.worktree)
        shutil.rmtree(state_dir(ctx), ignore_errors=True)
    shutil.rmtree(_ta_dir(cache, ta.name), ignore_errors=True)


# ---------------------------------------------------------------- helpers


def _which(cache: Cache, root: Path, name: str | None, action: str) -> str:
    if name is not None:
        return name
    pending = _pending(cache, root)
    if not pending:
        raise KvforgeError("no target add in progress in this project", EXIT_USAGE)
    if len(pending) > 1:
        raise KvforgeError(f"target adds in progress: {', '.join(pending)}; say which: `kvforge target add --{action} "
                           "--as NAME`", EXIT_USAGE)
    return pending[0]


def _require(cache: Cache, root: Path, name: str) -> AddState:
    ta = _load(cache, name)
    if ta is None:
        raise KvforgeError(f"no target add of {name} in progress", EXIT_USAGE)
    if Path(ta.root) != root or (Path(ta.root).exists() and ta.root_id != project_id(Path(ta.root))):
        raise KvforgeError(f"the target add of {name} in progress is not this project's: it was started in {ta.root}; "
                           f"run kvforge there (KVFORGE_ROOT={ta.root})", EXIT_USAGE)
    return ta


def _result(ta: AddState, target: Target, states: dict[str, State], selections: dict[str, dict],
            state: str) -> TargetAddResult:
    root = Path(ta.root)
    old_series = {c.name: c for c in load_target(ta.from_target, root).components} if ta.from_target else {}
    comps: list[ComponentResult] = []
    for cname in [*ta.components, *ta.left_out]:
        if cname in ta.left_out:
            comps.append(ComponentResult(cname, old_series[cname].release.package if cname in old_series else "",
                                         left_out=ta.left_out[cname]))
            continue
        c = target.component(cname)
        st = states.get(cname)
        comps.append(ComponentResult(
            cname, c.release.package, c.release.version, c.ref, c.release.sha256, ta.upstream.get(cname),
            [{"filename": w.filename, "sha256": w.sha256, "arch": w.arch or ""} for w in c.wheels],
            display_path(c.series_dir), display_path(old_series[cname].series_dir) if cname in old_series else None,
            list(st.steps) if st else [], None, selections.get(cname, {})))
    notes = list(ta.notes)
    for st in states.values():
        notes += [f"{st.plan.component}: {n}" for n in st.notes]
    return TargetAddResult(ta.name, ta.version, ta.from_target, state, comps, notes)

