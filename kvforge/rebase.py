"""`kvforge rebase`: move a target's series onto a new upstream release, dropping what upstream has.

Owns the rebase engine, its state in the cache and the one step that writes the result. The
per-patch "is it upstream?" signals and the decision come from kvforge.upstream (not here).

For each patch, in series order: the signals are gathered against the new base and decided
(upstream | carried | disagree); then the patch is applied three-way (`git am -3`, never fuzz) in
a worktree of the cache's base repository, one `git am` per patch:
- upstream: dropped (a ledger entry, kvforge.ledger);
- carried and applies: its new commit is kept;
- does not apply: the rebase stops with the worktree at that patch (conflict markers, `git am` in
  progress, rerere enabled so a recorded resolution is replayed next time);
- disagree (or git am finds it changes nothing while the signals do not say upstream): the rebase
  stops and shows the signals; `--continue` carries it, `--skip` drops it.

State. `<cache>/rebase/<target>-<component>/state.json` (written atomically after every patch)
holds the plan, the verdicts, the position and the commit the worktree must be at; the patch
files are copied beside it, so edits to patches/ during a rebase change nothing. A rebase killed
at any point resumes with `--continue` (the worktree is put back to the last recorded commit) or
is undone with `--abort` (the state is removed; patches/ and targets/ were never touched). The
worktree (<cache>/trees/.work/rebase-<target>-<component>) is kept for the next rebase. One flock
per target: two rebases of one target never run at once.

Commit. Nothing in patches/ or targets/ changes before every patch is decided. Then one step:
the new series directory is staged complete (export's transaction: a hidden sibling, linted),
the state records phase "committing" with the new target file's text and the digests of both
results, then the series directory is swapped in (one rename exchange) and the target file
replaced (one rename). A kill between those renames leaves the state in "committing": any
`kvforge rebase` of that target (with or without --continue) finishes it, idempotently, before
anything else; `--abort` is then refused (the new series is already in place).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from . import gitutil, ledger, seriesdir
from .bases import Base, ensure_base, release_files
from .context import Context
from .engine import AM_OPTS, add_worktree, am_in_progress, diagnose
from .export import read_commit
from .errors import EXIT_APPLY, EXIT_ENV, EXIT_NETWORK, EXIT_USAGE, KvforgeError
from .fsutil import atomic_write_text, crashpoint, file_lock, sha256_file
from .series import Patch, lint_directory, parse_patch
from .targets import Component, Release, parse_target, project_root

STATE_VERSION = 1
VERDICTS = ("carried", "upstream", "conflict", "disagree", "skipped", "pending")
VERSION_ONTO_RE = re.compile(r"^v?(\d+\.\d+(?:\.\d+)?(?:[A-Za-z0-9.+-]*)?)$")
REF_REBASE = "refs/kvforge/rebase"  # old series commits copied into the new base's repository


# ---------------------------------------------------------------- results


@dataclass
class PatchResult:
    name: str
    fix_id: str
    verdict: str  # carried | upstream | conflict | disagree | skipped | pending
    reason: str = ""
    decision: str = ""  # what kvforge.upstream.decide said: upstream | carried | disagree
    signals: list[dict] = field(default_factory=list)
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
class RebaseResult:
    target: str
    component: str
    new_target: str  # == target unless --as
    onto_version: str | None
    onto_ref: str
    old_base: str
    new_base: str
    sha256: str | None
    sha256_source: str  # pypi | local archive (offline) | git
    state: str  # done | stopped | planned
    patches: list[PatchResult]
    worktree: str | None = None
    stopped_at: int | None = None  # index into patches
    stop_kind: str | None = None  # conflict | disagree
    message: str = ""
    range_diff: str = ""
    written: list[str] = field(default_factory=list)  # project files the commit wrote
    seconds: dict = field(default_factory=dict)  # base, plan (signals), checks, apply, write, total
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        data = asdict(self)
        for p, d in zip(self.patches, data["patches"]):
            d["fired"] = p.fired
        return data

    def count(self, verdict: str) -> int:
        return sum(1 for p in self.patches if p.verdict == verdict)


# ---------------------------------------------------------------- state


def state_dir(ctx: Context) -> Path:
    return ctx.cache.root / "rebase" / f"{ctx.target.name}-{ctx.component.name}"


def _lock(ctx: Context):
    d = state_dir(ctx)
    d.parent.mkdir(parents=True, exist_ok=True)
    return file_lock(d.parent / f".{d.name}.lock", ctx.progress, f"the rebase of {ctx.label}")


def _load_state(ctx: Context) -> dict | None:
    path = state_dir(ctx) / "state.json"
    if not path.is_file():
        return None
    try:
        st = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise KvforgeError(f"{path}: unreadable rebase state ({exc}); `kvforge rebase -t {ctx.target.name} "
                           "--abort` removes it", EXIT_ENV) from None
    if st.get("version") != STATE_VERSION:
        raise KvforgeError(f"{path}: rebase state of another kvforge version; `kvforge rebase -t "
                           f"{ctx.target.name} --abort` removes it", EXIT_ENV)
    return st


def _save_state(ctx: Context, st: dict) -> None:
    atomic_write_text(state_dir(ctx) / "state.json", json.dumps(st, indent=1, sort_keys=True) + "\n")


def _patches(st: dict) -> list[PatchResult]:
    return [PatchResult(**p) for p in st["patches"]]


def _set_patches(st: dict, patches: list[PatchResult]) -> None:
    st["patches"] = [asdict(p) for p in patches]


def _file_digest(path: Path) -> str:
    return sha256_file(path) if path.is_file() else "absent"


def _dir_digest(path: Path) -> str:
    """Names and bytes of every file under `path` ("absent" when it does not exist)."""
    if not path.is_dir():
        return "absent"
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file() and not p.is_symlink():
            h.update(str(p.relative_to(path)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


# ---------------------------------------------------------------- the new base


def _sha_of(files: list[dict], filename: str) -> str | None:
    for f in files:
        if f.get("filename") == filename:
            sha = (f.get("digests") or {}).get("sha256")
            return sha if isinstance(sha, str) else None
    return None


def resolve_onto(ctx: Context, onto: str, repo_url: str | None) -> tuple[Component, str, list[str]]:
    """The component moved onto `onto`: (component, where its sha256 came from, notes).

    VERSION (no --repo): the PyPI sdist of that release, its sha256 taken from PyPI's JSON (offline:
    from an archive already in the cache, and said so). REF with --repo/--source git: that ref; a
    version-like ref (v0.21.0) also moves the offline source to that release.
    """
    comp = ctx.component
    notes: list[str] = []
    m = VERSION_ONTO_RE.match(onto)
    repo_url = repo_url or os.environ.get(f"KVFORGE_{comp.name.upper().replace('-', '_')}_REPO")
    use_git = bool(repo_url) or ctx.source == "git"
    if not m and not use_git:
        raise KvforgeError(f"--onto {onto!r} is not a release version (e.g. 0.20.2); a git ref needs --repo URL|DIR",
                           EXIT_USAGE)
    if m and not use_git:
        ref = onto if onto.startswith("v") else f"v{onto}"
    else:
        ref = onto
        if gitutil.run(Path.cwd(), "check-ref-format", "--allow-onelevel", ref, check=False).returncode != 0:
            raise KvforgeError(f"--onto {onto!r} is not a valid git ref name", EXIT_USAGE)
    if not m:
        notes.append(f"the offline source stays {comp.release.package}=={comp.release.version}: {onto} is not a "
                     "release version; edit [components.release] by hand if it should change")
        return replace(comp, ref=ref), "git", notes
    version = m.group(1)
    release = Release(comp.release.package, version, None)
    wheel_sha: tuple[str, str] | None = None
    if os.environ.get("KVFORGE_OFFLINE"):
        files = None
    else:
        try:
            _, files = release_files(release.package, version)
        except KvforgeError as exc:
            notes.append(f"{exc}; falling back to the cached archive")
            files = None
    if files is not None:
        sha = _sha_of(files, release.filename)
        if sha is None:
            raise KvforgeError(f"PyPI has no sdist {release.filename} for {release.package}=={version}", EXIT_NETWORK)
        source = "pypi"
        if comp.wheel is not None:
            wanted = comp.wheel.filename.replace(f"-{comp.release.version}-", f"-{version}-", 1)
            wsha = _sha_of(files, wanted)
            if wsha:
                wheel_sha = (wanted, wsha)
    else:
        local = ctx.cache.downloads / release.filename
        if not local.is_file():
            raise KvforgeError(f"cannot take the sha256 of {release.filename} from PyPI (offline or unreachable) and "
                               "the cache has no copy of it", EXIT_NETWORK)
        sha = sha256_file(local)
        source = "local archive (offline: not checked against PyPI)"
        notes.append(f"sha256 of {release.filename} taken from the cached archive, not from PyPI (offline)")
    new = replace(comp, ref=ref, release=replace(release, sha256=sha), wheel=None)
    if comp.wheel is not None:
        if wheel_sha:
            from .targets import WheelPin

            new = replace(new, wheel=WheelPin(*wheel_sha))
        else:
            notes.append(f"no wheel like {comp.wheel.filename} found for {version}: [components.wheel] is removed "
                         "(pin one by hand for `kvforge build`)")
    return new, source, notes


# ---------------------------------------------------------------- entry points


def rebase(ctx: Context, onto: str, as_target: str | None = None, dry_run: bool = False,
           checks: bool = False) -> RebaseResult:
    """Start a rebase of ctx's series onto `onto` (see the module docstring)."""
    start = time.monotonic()
    root = project_root()
    if as_target is not None:
        _check_new_target(root, ctx, as_target)
    with _lock(ctx):
        st = _load_state(ctx)
        if st is not None and st.get("dry_run") and st.get("phase") == "running":
            _discard_state(ctx, st)  # an interrupted dry run: nothing to keep
            st = None
        if st is not None and st.get("phase") == "committing":
            ctx.say("finishing an interrupted rebase commit first")
            _commit(ctx, st)
            st = None
        if st is not None:
            raise KvforgeError(f"a rebase of {ctx.label} onto {st['onto_ref']} is in progress "
                               f"({_where(st)}); `kvforge rebase -t {ctx.target.name} --continue`, --skip or --abort",
                               EXIT_USAGE)
        series = ctx.series()
        t0 = time.monotonic()
        old_base = ctx.base()
        from .trees import open_stack

        stack = open_stack(ctx)
        new_comp, sha_source, notes = resolve_onto(ctx, onto, ctx.repo_url)
        ctx.say(f"new base: {new_comp.release.package} {new_comp.ref}")
        new_base = ensure_base(new_comp, ctx.cache, ctx.source, ctx.repo_url, ctx.progress)
        old_commits = _old_commits(ctx, stack, old_base, new_base)
        t_base = time.monotonic() - t0

        sdir = state_dir(ctx)
        if sdir.exists():
            shutil.rmtree(sdir)
        (sdir / "patches").mkdir(parents=True)
        for p in series.patches:
            (sdir / "patches" / p.name).write_bytes(p.raw)
        target_name = as_target or ctx.target.name
        series_dir = (root / "patches" / as_target) if as_target else ctx.component.series_dir
        st = {
            "version": STATE_VERSION, "phase": "running", "dry_run": dry_run,
            "target": ctx.target.name, "component": ctx.component.name, "new_target": target_name,
            "root": str(root), "target_file": str(root / "targets" / f"{target_name}.toml"),
            "old_target_file": str(ctx.target.path), "series_dir": str(series_dir),
            "old_series_dir": str(ctx.component.series_dir),
            "onto": onto, "onto_ref": new_comp.ref,
            "onto_version": new_comp.release.version if sha_source != "git" else None,
            "sha256": new_comp.release.sha256, "sha256_source": sha_source,
            "wheel": [new_comp.wheel.filename, new_comp.wheel.sha256] if new_comp.wheel else None,
            "old_base": old_base.commit, "old_head": stack.commits[-1], "new_base": new_base.commit,
            "repo": str(new_base.repo), "source": new_base.source, "repo_url": ctx.repo_url,
            "head": new_base.commit, "position": 0, "stopped": None, "notes": notes,
            "digests": {"series": _dir_digest(series_dir),
                        "target": _file_digest(root / "targets" / f"{target_name}.toml"),
                        "old_series": _dir_digest(ctx.component.series_dir),
                        "old_target": _file_digest(ctx.target.path)},
            "seconds": {"base": round(t_base, 3)},
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        t0 = time.monotonic()
        nb = _new_base_info(new_base, new_comp)
        plan, t_checks = _plan(ctx, new_comp, nb, series.patches, old_commits, checks)
        st["seconds"]["plan"] = round(time.monotonic() - t0 - t_checks, 3)
        st["seconds"]["checks"] = round(t_checks, 3)
        _set_patches(st, plan)
        st["state_dir"] = str(sdir)
        st["worktree"] = str(worktree_path(ctx))  # positioned when the first patch is applied (_ensure_worktree)
        _save_state(ctx, st)
        crashpoint("rebase:planned")
        return _advance(ctx, st, start)


def rebase_continue(ctx: Context) -> RebaseResult:
    start = time.monotonic()
    with _lock(ctx):
        st = _require_state(ctx)
        if st.get("phase") == "committing":
            return _commit(ctx, st, start)
        worktree = Path(st["worktree"])
        patches = _patches(st)
        stop = st.get("stopped")
        i = st["position"]
        if stop is None:
            if st.get("worktree_ready"):
                _reset(worktree, st["head"])  # killed while running: back to the last recorded commit
        elif stop["kind"] == "conflict":
            p = patches[i]
            unmerged = gitutil.run(worktree, "diff", "--name-only", "--diff-filter=U", check=False).stdout.split()
            if unmerged:
                raise KvforgeError(f"{p.name}: unresolved conflicts in {', '.join(unmerged)} (in {worktree}); resolve "
                                   "them and `git add` the files, then --continue (or --skip to drop the patch)",
                                   EXIT_APPLY)
            if am_in_progress(worktree):
                res = gitutil.run(worktree, "am", "--continue", check=False)
                if res.returncode != 0:
                    last = (res.stdout + "\n" + res.stderr).strip().splitlines()
                    raise KvforgeError(f"{p.name}: git am --continue failed in {worktree}: "
                                       f"{last[0] if last else 'no output'}; resolve and `git add`, or --skip",
                                       EXIT_APPLY)
            head = gitutil.rev_parse(worktree, "HEAD")
            if head == st["head"] or gitutil.rev_parse(worktree, "HEAD^") != st["head"]:
                _reset(worktree, st["head"])  # nothing usable was committed: apply this patch again
                p.verdict, p.how = "pending", ""
            else:
                p.verdict, p.how, p.commit = "carried", "resolved", head
                st["head"], i = head, i + 1
        else:  # disagree: the user says carry it
            p = patches[i]
            head = gitutil.rev_parse(worktree, "HEAD")
            if stop.get("applied") and head and gitutil.rev_parse(worktree, "HEAD^") == st["head"]:
                p.verdict, p.commit, p.reason = "carried", head, f"carried by the user ({p.reason})"
                st["head"] = head
            else:
                p.verdict = "skipped"
                p.reason = "nothing to carry: applying it changes nothing on the new base"
            i += 1
        st["position"], st["stopped"] = i, None
        _set_patches(st, patches)
        _save_state(ctx, st)
        return _advance(ctx, st, start)


def rebase_skip(ctx: Context) -> RebaseResult:
    start = time.monotonic()
    with _lock(ctx):
        st = _require_state(ctx)
        if st.get("phase") == "committing":
            raise KvforgeError("the rebase is being committed; nothing to skip: --continue finishes it", EXIT_USAGE)
        if st.get("stopped") is None:
            raise KvforgeError(f"the rebase of {ctx.label} is not stopped at a patch (it was interrupted); "
                               "--continue resumes it", EXIT_USAGE)
        worktree = Path(st["worktree"])
        _reset(worktree, st["head"])
        patches = _patches(st)
        p = patches[st["position"]]
        p.verdict, p.how, p.commit = "skipped", "not applied", None
        p.reason = f"dropped by the user (kvforge rebase --skip){'; ' + p.reason if p.reason else ''}"
        st["position"] += 1
        st["stopped"] = None
        _set_patches(st, patches)
        _save_state(ctx, st)
        return _advance(ctx, st, start)


def rebase_abort(ctx: Context) -> str:
    """Remove the rebase's state and worktree; patches/ and targets/ were never touched."""
    with _lock(ctx):
        sdir = state_dir(ctx)
        st = None
        try:
            st = _load_state(ctx)
        except KvforgeError:
            pass  # an unreadable state is removed all the same
        if st is not None and st.get("phase") == "committing":
            raise KvforgeError(f"the rebase of {ctx.label} is past its commit point (the new series is being "
                               f"written); `kvforge rebase -t {ctx.target.name} --continue` finishes it", EXIT_USAGE)
        if not sdir.exists():
            raise KvforgeError(f"no rebase of {ctx.label} in progress", EXIT_USAGE)
        _discard_state(ctx, st)
        return f"rebase of {ctx.label} aborted: patches/ and targets/ are as they were"


def _discard_state(ctx: Context, st: dict | None) -> None:
    if st is not None and st.get("worktree"):
        _release_worktree(Path(st["worktree"]))  # also when a kill came before the state said it was used
    shutil.rmtree(state_dir(ctx), ignore_errors=True)


def _require_state(ctx: Context) -> dict:
    st = _load_state(ctx)
    if st is None:
        raise KvforgeError(f"no rebase of {ctx.label} in progress", EXIT_USAGE)
    return st


def _where(st: dict) -> str:
    stop = st.get("stopped")
    if stop is None:
        return "interrupted" if st.get("phase") == "running" else st.get("phase", "?")
    p = st["patches"][st["position"]]
    return f"stopped at {p['name']}: {stop['kind']}"


def _check_new_target(root: Path, ctx: Context, name: str) -> None:
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", name) or name.startswith("."):
        raise KvforgeError(f"--as {name!r} is not a target name (letters, digits, '.', '_', '-')", EXIT_USAGE)
    if (root / "targets" / f"{name}.toml").exists():
        raise KvforgeError(f"--as {name}: targets/{name}.toml exists; choose a new name", EXIT_USAGE)
    d = root / "patches" / name
    if d.exists() and any(d.iterdir()):
        raise KvforgeError(f"--as {name}: patches/{name} exists and is not empty; choose a new name", EXIT_USAGE)


# ---------------------------------------------------------------- planning: signals and decisions


def _old_commits(ctx: Context, stack, old_base: Base, new_base: Base) -> list[str | None]:
    """Each patch's commit in the old stack, reachable in the new base's repository."""
    if old_base.repo.resolve() != new_base.repo.resolve():
        gitutil.run(new_base.repo, "fetch", "-q", "--no-tags", str(old_base.repo),
                    f"+{stack.commits[-1]}:{REF_REBASE}/{ctx.target.name}/{ctx.component.name}/old")
    out: list[str | None] = []
    for n in range(1, stack.size + 1):
        out.append(None if stack.commits[n] == stack.commits[n - 1] else stack.commits[n])
    return out


def _new_base_info(base: Base, comp: Component):
    from . import upstream

    return upstream.new_base_info(base, comp)


def _plan(ctx: Context, new_comp: Component, nb, patches: list[Patch], old_commits: list[str | None],
          checks: bool) -> tuple[list[PatchResult], float]:
    from . import upstream

    out: list[PatchResult] = []
    t_checks = 0.0
    new_ctx = Context(ctx.cache, ctx.target, new_comp, ctx.source, ctx.repo_url, ctx.progress,
                      python=ctx.python, torch_index=ctx.torch_index)
    for p, old in zip(patches, old_commits):
        ctx.say(f"signals for {p.name}")
        timed = {"s": 0.0}

        def run_checks(p=p, timed=timed):
            t = time.monotonic()
            try:
                return upstream.checks_signal(new_ctx, nb, p)
            finally:
                timed["s"] += time.monotonic() - t

        signals = upstream.gather(nb, p, old, checks=run_checks if checks else None)
        t_checks += timed["s"]
        decision, reason = upstream.decide(signals)
        out.append(PatchResult(p.name, p.fix_id, "pending", reason, decision,
                               [_signal_dict(s) for s in signals], old_commit=old))
    return out, t_checks


def _signal_dict(s) -> dict:
    return {"name": s.name, "fired": s.fired, "strong": s.strong, "detail": s.detail}


# ---------------------------------------------------------------- applying


def worktree_path(ctx: Context) -> Path:
    """The target's rebase worktree: kept between rebases (moving it to a new base rewrites only the
    files that differ), owned by kvforge; the user works in it only to resolve a conflict."""
    path = ctx.cache.trees / ".work" / f"rebase-{ctx.target.name}-{ctx.component.name}"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _ensure_worktree(st: dict) -> None:
    """Put the rebase's worktree at st["head"] (rerere on), on first use only: a plan that applies
    nothing never touches it."""
    if st.get("worktree_ready"):
        return
    worktree, repo = Path(st["worktree"]), Path(st["repo"])
    listed = gitutil.run(repo, "worktree", "list", "--porcelain", check=False).stdout
    if (worktree / ".git").exists() and f"worktree {worktree}\n" in listed + "\n":
        _reset(worktree, st["head"])
    else:
        add_worktree(repo, worktree, st["head"])
    gitutil.run(worktree, "config", "rerere.enabled", "true")
    st["worktree_ready"] = True


def _ensure_worktree_at(worktree: Path) -> None:
    if not (worktree / ".git").exists():
        raise KvforgeError(f"the rebase worktree {worktree} is missing; --abort and start again", EXIT_ENV)


def _reset(worktree: Path, commit: str) -> None:
    _ensure_worktree_at(worktree)
    if am_in_progress(worktree):
        gitutil.run(worktree, "am", "--abort", check=False)
    gitutil.run(worktree, "reset", "--hard", "-q", commit)
    gitutil.run(worktree, "clean", "-ffdq")


def _am_one(worktree: Path, patch_path: Path, head: str) -> tuple[str, str | None, str]:
    """`git am -3` one patch: (how, new commit or None, output). how: applied | applied (3-way) |
    no change | conflict."""
    res = gitutil.run(worktree, *AM_OPTS, str(patch_path), check=False)
    out = res.stdout + "\n" + res.stderr
    if res.returncode != 0:
        return "conflict", None, out
    now = gitutil.rev_parse(worktree, "HEAD")
    if now == head:
        return "no change", None, out
    return ("applied (3-way)" if "Falling back to patching base and 3-way merge" in out else "applied"), now, out


def drop_depends_on(path: Path, dropped: set[str]) -> list[str]:
    """Remove `Depends-On: X` trailers naming dropped fixes from the state's copy of a patch (its
    header only); the series lint requires every Depends-On to be an earlier patch of the series."""
    raw = path.read_bytes()
    end = raw.find(b"\n---\n")
    if end < 0 or not dropped:
        return []
    head, tail = raw[:end + 1], raw[end + 1:]
    gone = []
    lines = head.split(b"\n")
    kept = []
    for line in lines:
        m = re.match(rb"^Depends-On:\s*(\S+)\s*$", line)
        if m and m.group(1).decode() in dropped:
            gone.append(m.group(1).decode())
            continue
        kept.append(line)
    if gone:
        path.write_bytes(b"\n".join(kept) + tail)
    return gone


def _fix_depends_on(st: dict, patches: list[PatchResult], i: int) -> None:
    dropped = {q.fix_id for q in patches[:i] if q.verdict in ("upstream", "skipped")}
    p = patches[i]
    gone = drop_depends_on(_patch_copy(st, p.name), dropped)
    if gone:
        st.setdefault("notes", []).append(f"{p.name}: Depends-On {', '.join(gone)} removed (dropped by this "
                                          "rebase: the new base has it, or it was skipped)")


def _patch_copy(st: dict, name: str) -> Path:
    return Path(st["state_dir"]) / "patches" / name


def _am_run(ctx: Context, st: dict, patches: list[PatchResult], worktree: Path) -> bool:
    """Apply the run of carried patches from st["position"] with ONE `git am -3` (the cost of plain git);
    patches the signals drop inside the run are left out. Stops short of a patch that conflicts or
    changes nothing (the per-patch path then handles it alone). False when the run is shorter than 2."""
    run: list[int] = []
    j = st["position"]
    while j < len(patches):
        q = patches[j]
        if q.verdict == "pending" and q.decision == "upstream":
            q.verdict, q.how = "upstream", "not applied"
        elif q.verdict == "pending" and q.decision == "carried":
            _fix_depends_on(st, patches, j)
            run.append(j)
        elif q.verdict not in ("upstream", "skipped"):
            break
        j += 1
    if len(run) < 2:
        return False
    ctx.say(f"applying {len(run)} patches ({patches[run[0]].name} .. {patches[run[-1]].name})")
    res = gitutil.run(worktree, *AM_OPTS, *[str(_patch_copy(st, patches[k].name)) for k in run], check=False)
    crashpoint("rebase:patch-applied")
    hows: list[str] = []
    for line in (res.stdout + "\n" + res.stderr).splitlines():
        if line.startswith("Applying: "):
            hows.append("applied")
        elif line.startswith("Falling back to patching base and 3-way merge") and hows:
            hows[-1] = "applied (3-way)"
        elif ("Patch already applied" in line or line.startswith("No changes")) and hows:
            hows[-1] = "no change"
    done = len(hows) if res.returncode == 0 else len(hows) - 1  # am stopped at the last one it began
    good = 0
    while good < done and hows[good] != "no change":
        good += 1
    commits = gitutil.run(worktree, "rev-list", "--reverse", f"{st['head']}..HEAD").stdout.split()[:good]
    if res.returncode != 0:
        gitutil.run(worktree, "am", "--quit", check=False)
    for k, c in zip(run[:good], commits):
        p = patches[k]
        p.verdict, p.how, p.commit = "carried", hows[run.index(k)], c
        st["head"] = c
    if res.returncode != 0 or good < len(run):
        _reset(worktree, st["head"])  # drop what came after the stop: that patch is applied alone next
    nxt = run[good] if good < len(run) else run[-1] + 1
    st["position"] = nxt
    _set_patches(st, patches)
    _save_state(ctx, st)
    crashpoint("rebase:state-saved")
    return True


def _advance(ctx: Context, st: dict, start: float) -> RebaseResult:
    """Apply from st["position"] on; stop at a conflict or a disagreement; commit when all are decided."""
    worktree = Path(st["worktree"])
    patches = _patches(st)
    dry = st["dry_run"]
    t0 = time.monotonic()
    sdir = state_dir(ctx)
    while st["position"] < len(patches):
        i = st["position"]
        p = patches[i]
        if p.decision == "upstream" and p.verdict == "pending":
            p.verdict, p.how = "upstream", "not applied"
        if p.verdict in ("upstream", "skipped", "carried"):
            st["position"] = i + 1
            continue
        _ensure_worktree(st)
        if not dry and _am_run(ctx, st, patches, worktree):
            continue  # a run of carried patches applied in one `git am`; st["position"] moved past it
        ctx.say(f"applying {p.name}")
        _fix_depends_on(st, patches, i)
        how, commit, out = _am_one(worktree, _patch_copy(st, p.name), st["head"])
        crashpoint("rebase:patch-applied")
        p.how = how
        stop = None
        if how == "conflict":
            p.verdict = "conflict"
            patch = parse_patch(_patch_copy(st, p.name))
            why = diagnose(worktree, patch, out)
            p.reason = f"{why}{'; signals: ' + p.reason if p.decision == 'disagree' else ''}"
            stop = {"kind": "conflict", "applied": False}
        elif how == "no change" and p.decision != "upstream":
            p.verdict = "disagree"
            p.reason = f"git am: it changes nothing on the new base, but the signals say {p.decision} ({p.reason})"
            stop = {"kind": "disagree", "applied": False}
        elif p.decision == "disagree":
            p.verdict, p.commit = "disagree", commit
            stop = {"kind": "disagree", "applied": True}
        else:
            p.verdict, p.commit = "carried", commit
            st["head"] = commit
        if stop is not None and dry:
            _reset(worktree, st["head"])  # a plan goes on past a stop
            stop = None
        if stop is not None:
            st["stopped"] = stop
            _set_patches(st, patches)
            st["seconds"]["apply"] = round(st["seconds"].get("apply", 0) + time.monotonic() - t0, 3)
            _save_state(ctx, st)
            return _result(st, "stopped", start)
        st["position"] = i + 1
        _set_patches(st, patches)
        _save_state(ctx, st)
        crashpoint("rebase:state-saved")
    st["seconds"]["apply"] = round(st["seconds"].get("apply", 0) + time.monotonic() - t0, 3)
    _set_patches(st, patches)
    if dry:
        result = _result(st, "planned", start)
        result.range_diff = _range_diff(st)
        if st.get("worktree_ready"):
            _release_worktree(worktree)
        shutil.rmtree(sdir, ignore_errors=True)
        return result
    return _commit(ctx, st, start)


# ---------------------------------------------------------------- the commit step


def _commit(ctx: Context, st: dict, start: float | None = None) -> RebaseResult:
    start = start if start is not None else time.monotonic()
    t0 = time.monotonic()
    worktree = Path(st["worktree"])
    dest, target_file = Path(st["series_dir"]), Path(st["target_file"])
    old_dir, old_target = Path(st["old_series_dir"]), Path(st["old_target_file"])
    patches = _patches(st)
    if st.get("phase") != "committing":
        digests = st["digests"]
        if _dir_digest(old_dir) != digests["old_series"] or _file_digest(old_target) != digests["old_target"]:
            raise KvforgeError(f"{old_dir} or {old_target} changed while the rebase ran; nothing was written. "
                               f"`kvforge rebase -t {st['target']} --abort` and start again", EXIT_USAGE)
        if _dir_digest(dest) != st["digests"]["series"] or _file_digest(target_file) != st["digests"]["target"]:
            raise KvforgeError(f"{dest} or {target_file} changed while the rebase ran; nothing was written. "
                               f"`kvforge rebase -t {st['target']} --abort` and start again", EXIT_USAGE)
        st["target_text"] = _new_target_text(st, ctx)
        st["phase"] = "committing"
        with seriesdir.transaction(dest, ctx.say, crash="rebase", lint=lint_directory) as tx:
            staged = _stage(tx, st, patches)
            st["new_series_digest"] = _dir_digest(staged)
            _save_state(ctx, st)  # the commit point: from here on, every run finishes this
            crashpoint("rebase:commit-staged")
            tx.commit()
    else:
        with seriesdir.transaction(dest, ctx.say, crash="rebase", lint=lint_directory, recover=False) as tx:
            if _dir_digest(dest) == st["new_series_digest"]:
                tx.recover()  # swapped before a kill: the old contents left beside it go
            else:
                staged = tx.staged()
                if not (staged is not None and _dir_digest(staged) == st["new_series_digest"]):
                    tx.recover()
                    _stage(tx, st, patches)
                tx.commit()
    crashpoint("rebase:series-swapped")
    if not target_file.is_file() or target_file.read_text(encoding="utf-8") != st["target_text"]:
        atomic_write_text(target_file, st["target_text"])
    crashpoint("rebase:target-written")
    result = _result(st, "done", start)
    result.range_diff = _range_diff(st)
    result.written = [str(dest), str(target_file)]
    result.seconds["write"] = round(time.monotonic() - t0, 3)
    result.seconds["total"] = round(time.monotonic() - start, 3)
    if st.get("worktree_ready"):
        _release_worktree(worktree)
    shutil.rmtree(state_dir(ctx), ignore_errors=True)
    return result


def _stage(tx: seriesdir.Transaction, st: dict, patches: list[PatchResult]) -> Path:
    """The complete new series directory staged by `tx` (linted): the carried commits, the series file, the
    ledger with this rebase's drops appended, and the old directory's other files."""
    repo = Path(st["repo"])  # the worktree's commits are in its repository (it may never have been made)
    carried = [p for p in patches if p.verdict == "carried"]
    shas = gitutil.run(repo, "rev-list", "--reverse", f"{st['new_base']}..{st['head']}").stdout.split()
    if len(shas) != len(carried):
        raise KvforgeError(f"the rebase's head holds {len(shas)} commits on the new base, the rebase "
                           f"carried {len(carried)} patches; nothing was written (--abort and start again)",
                           EXIT_USAGE)
    what = f"rebase of {st['target']} onto {st['onto_ref']}"
    commits = [read_commit(repo, sha, what) for sha in shas]
    names = [p.name for p in carried]
    old_dir = Path(st["old_series_dir"])
    listing = seriesdir.read_listing(old_dir)
    files = {name: c.raw for c, name in zip(commits, names)}
    files[seriesdir.SERIES_FILE] = seriesdir.listing_text(listing, names, {n: n for n in names}).encode("utf-8")
    entries = ledger.load(old_dir)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for p in patches:
        if p.verdict in ("upstream", "skipped"):
            entries.append(ledger.Entry(file=p.name, fix_id=p.fix_id, decision=p.verdict, signals=p.signals,
                                        dropped_at=when, onto_version=st.get("onto_version"),
                                        onto_ref=st["onto_ref"], base_commit=st["new_base"], reason=p.reason))
    if entries:
        files[ledger.FILENAME] = ledger.render(entries).encode("utf-8")
    managed = set(listing.names if listing else []) | {seriesdir.SERIES_FILE, ledger.FILENAME}
    kept = sorted(q.name for q in old_dir.iterdir() if q.name not in managed) if old_dir.is_dir() else []
    return tx.stage(files, keep=kept, keep_from=old_dir,
                    blame={name: c.blame for c, name in zip(commits, names)})


def _release_worktree(worktree: Path) -> None:
    """The rebase is over: no `git am` left stopped in the worktree (it is kept for the next rebase)."""
    if (worktree / ".git").exists() and am_in_progress(worktree):
        gitutil.run(worktree, "am", "--abort", check=False)


def _range_diff(st: dict) -> str:
    """`git range-diff` of the old series against the new (git needs two non-empty ranges: a side that
    is empty is shown in its format by hand)."""
    repo = Path(st["repo"])
    sides = [(st["old_base"], st["old_head"]), (st["new_base"], st["head"])]
    if any(a == b for a, b in sides):
        lines = []
        for k, (a, b) in enumerate(sides):
            log = gitutil.run(repo, "log", "--reverse", "--format=%h %s", f"{a}..{b}", check=False).stdout.splitlines()
            for n, line in enumerate(log, 1):
                sha, _, subject = line.partition(" ")
                lines.append(f"{n}:  {sha} < -:  ------- {subject}" if k == 0
                             else f"-:  ------- > {n}:  {sha} {subject}")
        return "\n".join(lines) + ("\n" if lines else "")
    res = gitutil.run(repo, "range-diff", "--no-color", f"{st['old_base']}..{st['old_head']}",
                      f"{st['new_base']}..{st['head']}", check=False)
    return res.stdout if res.returncode == 0 else f"(git range-diff failed: {res.stderr.strip()})"


def _result(st: dict, state: str, start: float) -> RebaseResult:
    patches = _patches(st)
    r = RebaseResult(
        target=st["target"], component=st["component"], new_target=st["new_target"],
        onto_version=st.get("onto_version"), onto_ref=st["onto_ref"], old_base=st["old_base"],
        new_base=st["new_base"], sha256=st.get("sha256"), sha256_source=st["sha256_source"], state=state,
        patches=patches, seconds=dict(st["seconds"]), notes=list(st.get("notes", [])))
    r.seconds["total"] = round(time.monotonic() - start, 3)  # this process's wall time
    if state == "stopped":
        i = st["position"]
        p = patches[i]
        r.stopped_at, r.stop_kind, r.worktree = i, st["stopped"]["kind"], st["worktree"]
        t = st["target"]
        if r.stop_kind == "conflict":
            r.message = (f"{p.name} does not apply to {st['onto_ref']}: {p.reason}. Resolve the conflict in "
                         f"{st['worktree']} (git am is stopped there; rerere is on), `git add` the files, then "
                         f"`kvforge rebase -t {t} --continue`; or `--skip` to drop the patch, `--abort` to stop")
        else:
            r.message = (f"{p.name}: the signals disagree whether {st['onto_ref']} already has it ({p.reason}). "
                         f"`kvforge rebase -t {t} --continue` carries it, `--skip` drops it (recorded in the ledger), "
                         f"`--abort` stops the rebase")
    return r


# ---------------------------------------------------------------- the target file


HEADER_RE = re.compile(r"^\s*(\[\[?)\s*([A-Za-z0-9_.-]+)\s*\]\]?\s*(#.*)?$")
STRING_RE = re.compile(r'^(\s*)([A-Za-z0-9_-]+)(\s*=\s*)"((?:[^"\\]|\\.)*)"(.*)$')


def _new_target_text(st: dict, ctx: Context) -> str:
    """The target file after the rebase: a text edit of the old one that keeps every comment."""
    comp_index = [c.name for c in ctx.target.components].index(st["component"])
    text = Path(st["old_target_file"]).read_text(encoding="utf-8")
    old_version = ctx.component.release.version
    new_version = st.get("onto_version")
    as_new = st["new_target"] != st["target"]
    root = Path(st["root"])
    out = retarget_text(
        text, comp_index, ref=st["onto_ref"], version=new_version, sha256=st.get("sha256"),
        wheel=tuple(st["wheel"]) if st.get("wheel") else None, old_version=old_version,
        name=st["new_target"] if as_new else None,
        series=os.path.relpath(st["series_dir"], root) if as_new else None)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvforge-rebase-") as d:
        probe = Path(d) / f"{st['new_target']}.toml"
        probe.write_text(out, encoding="utf-8")
        parse_target(probe, root)  # a target file kvforge would refuse is never written
    return out


def retarget_text(text: str, comp_index: int, *, ref: str, version: str | None, sha256: str | None,
                  wheel: tuple[str, str] | None, old_version: str, name: str | None = None,
                  series: str | None = None) -> str:
    """Edit a target file's text: component `comp_index` moves to `ref` (and release `version`/`sha256`;
    its wheel pin becomes `wheel` or is removed), optionally renamed (`name`, `series`). Comments stay;
    the description's old version becomes the new one."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    section, comp = "", -1
    dropping = False
    release_has_sha = False
    version_changes = version is not None and version != old_version

    def put(line: str, key: str, value: str) -> str:
        m = STRING_RE.match(line.rstrip("\n"))
        return f"{m.group(1)}{key}{m.group(3)}{json.dumps(value)}{m.group(5)}\n" if m else line

    for line in lines:
        h = HEADER_RE.match(line.rstrip("\n"))
        if h:
            if section == "components.release" and comp == comp_index and version_changes and sha256 \
                    and not release_has_sha:
                out.append(f"sha256 = {json.dumps(sha256)}\n")
            section = h.group(2)
            if section == "components" and h.group(1) == "[[":
                comp += 1
            dropping = section == "components.wheel" and comp == comp_index and version_changes and wheel is None
            if dropping:
                while out and out[-1].strip() == "" and len(out) > 1 and out[-2].strip() == "":
                    out.pop()
                continue
        elif dropping:
            continue
        m = STRING_RE.match(line.rstrip("\n"))
        key = m.group(2) if m else None
        if section == "" and key == "name" and name:
            line = put(line, "name", name)
        elif section == "" and key == "description" and version_changes:
            line = put(line, "description", m.group(4).replace(old_version, version))
        elif section == "components" and comp == comp_index and key == "ref":
            line = put(line, "ref", ref)
        elif section == "components" and comp == comp_index and key == "series" and series:
            line = put(line, "series", series)
        elif section == "components.release" and comp == comp_index and version_changes:
            if key == "version":
                line = put(line, "version", version)
            elif key == "sha256":
                release_has_sha = True
                if sha256:
                    line = put(line, "sha256", sha256)
                else:
                    continue
        elif section == "components.wheel" and comp == comp_index and version_changes and wheel:
            if line.lstrip().startswith("#"):
                continue  # comments about the old wheel
            if key == "filename":
                line = put(line, "filename", wheel[0])
            elif key == "sha256":
                line = put(line, "sha256", wheel[1])
        out.append(line)
    if section == "components.release" and comp == comp_index and version_changes and sha256 and not release_has_sha:
        out.append(f"sha256 = {json.dumps(sha256)}\n")
    result = "".join(out)
    while result.endswith("\n\n"):
        result = result[:-1]
    return result


# ---------------------------------------------------------------- rendering


def render(result: RebaseResult, echo) -> None:
    from .report import table

    rows = []
    for n, p in enumerate(result.patches, 1):
        sig = ", ".join(p.fired) or "-"
        if p.against:
            sig += " (not: " + ", ".join(p.against) + ")"
        rows.append([n, p.name, p.verdict, sig, p.how, p.reason])
    echo(table(["#", "patch", "verdict", "signals fired", "git am", "why"], rows))
    echo("")
    onto = f"{result.onto_ref} ({result.new_base[:12]}"
    onto += f", sha256 {result.sha256[:12]}… from {result.sha256_source})" if result.sha256 else ")"
    counts = ", ".join(f"{result.count(v)} {v}" for v in VERDICTS if result.count(v))
    head = {"done": "rebased", "planned": "plan (dry run, nothing written)", "stopped": "stopped"}[result.state]
    echo(f"{head}: {result.target} -> {result.new_target} onto {onto}: {counts}")
    for note in result.notes:
        echo(f"note: {note}")
    if result.range_diff.strip():
        echo("\nrange-diff (old series vs new):")
        echo(result.range_diff.rstrip())
    if result.written:
        echo("\nwritten: " + ", ".join(result.written))
    secs = ", ".join(f"{k} {v:.2f}s" for k, v in result.seconds.items())
    echo(f"time: {secs}")
    if result.message:
        echo(result.message)


def run(ctx: Context, action: str, onto: str | None = None, as_target: str | None = None, dry_run: bool = False,
        checks: bool = False) -> RebaseResult | str:
    """The CLI's one call: action start | continue | skip | abort. A stop raises nothing: the result says it."""
    if action == "start":
        if not onto:
            raise KvforgeError("--onto VERSION|REF is required to start a rebase (or --continue, --skip, --abort)",
                               EXIT_USAGE)
        return rebase(ctx, onto, as_target, dry_run, checks)
    if onto or as_target or dry_run:
        raise KvforgeError(f"--{action} takes no --onto, --as or --dry-run: they were fixed when the rebase started",
                           EXIT_USAGE)
    return {"continue": rebase_continue, "skip": rebase_skip, "abort": rebase_abort}[action](ctx)
