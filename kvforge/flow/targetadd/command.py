"""The entries of `kvforge target add`: start, --continue, --skip, --abort, and `run`, the CLI's one call.

Invariants. Every entry checks a --as NAME with the new target's name rule (state.valid_name: one line, exit 2)
before any path is built from it, and holds the target add's lock for the rest. A state is used only when it is
this project's (its root and the root's identity). --abort removes an unreadable state only when its directory
is provably kvforge's own (state.own_dir) and otherwise leaves everything; after a kill inside the commit it takes
back only the files whose bytes are still this command's own output.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from kvforge.core.cache import Cache
from kvforge.core.errors import EXIT_NETWORK, EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import crashpoint
from kvforge.flow.rebase.onto import RELEASE_RE
from kvforge.flow.rebase.retarget import render_target
from kvforge.flow.rebase.state import load, project_id
from kvforge.flow.rebase.steps import skip
from kvforge.flow.targetadd.commit import discard
from kvforge.flow.targetadd.components import drive
from kvforge.flow.targetadd.plan import check_name, from_target_of, plan_target, target_of
from kvforge.flow.targetadd.result import TargetAddResult
from kvforge.flow.targetadd.state import AddState, UnreadableState, load_state, lock, own_dir, pending_names, \
    save_state, ta_dir, valid_name
from kvforge.git.context import Context, Progress, quiet
from kvforge.project.targets import display_path, load_target, project_root
from kvforge.project.transaction import dir_digest, file_digest, open_transaction, text_digest

ACTIONS = ("start", "continue", "skip", "abort")


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
    check_name(root, name, "--as" if as_name is not None else "the target name")
    old = from_target_of(root, version, from_target)
    if os.environ.get("KVFORGE_OFFLINE"):
        raise KvforgeError("target add reads the package index (sha256 pins, wheels, the matching vllm-ascend "
                           "release) and $KVFORGE_OFFLINE is set; run it online", EXIT_NETWORK)
    with lock(cache, name, progress):
        if load_state(cache, name) is not None:
            raise KvforgeError(f"a target add of {name} is in progress; `kvforge target add --continue --as {name}` "
                               f"or `--abort --as {name}`", EXIT_USAGE)
        progress(f"reading the package index for vllm {version}")
        t0 = time.monotonic()
        new_target, left_out, notes = plan_target(root, old, version, name, cache.downloads, progress)
        ta = AddState(name=name, version=version, from_target=old.name if old else "", root=str(root),
                      root_id=project_id(root),
                      target_text=render_target(new_target, root), components=[c.name for c in new_target.components],
                      left_out=left_out, upstream={}, notes=notes, try_cpu=try_cpu,
                      started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        seconds = {"index": round(time.monotonic() - t0, 3)}
        if not dry_run:
            save_state(cache, ta)
            crashpoint("targetadd:planned")
        return drive(cache, ta, old, new_target, dry_run, False, progress, start, seconds, fresh=True)


def add_continue(cache: Cache, name: str | None = None, progress: Progress = quiet,
                 skip_patch: bool = False) -> TargetAddResult:
    """Resume the target add stopped at a patch (the user's resolution is taken; `skip_patch`: the patch is
    dropped instead, recorded in the new series' ledger as `skipped`), or finish an interrupted one."""
    start = time.monotonic()
    root = project_root()
    name = _which(cache, root, name, "skip" if skip_patch else "continue")
    _require(cache, root, name)  # read-only: a refusal changes nothing, not even the cache's lock file
    with lock(cache, name, progress):
        ta = _require(cache, root, name)
        old = load_target(ta.from_target, root) if ta.from_target else None
        new = target_of(ta, root)
        if skip_patch:
            st = next((s for c in new.components if c.name not in ta.done
                       and (s := load(Context(cache, new, c, source="sdist"))) is not None), None)
            if ta.phase != "running" or st is None or st.stopped is None:
                raise KvforgeError(f"the target add of {name} is not stopped at a patch; nothing to skip (--continue "
                                   "goes on)", EXIT_USAGE)
            skip(st)
        return drive(cache, ta, old, new, False, not skip_patch, progress, start, {})


def add_abort(cache: Cache, name: str | None = None, progress: Progress = quiet) -> TargetAddResult:
    """Stop a target add: its state and worktrees' `git am` go; the project is as it was (after a kill inside
    the commit, the files it wrote are removed only where they are still exactly its own output)."""
    root = project_root()
    name = _which(cache, root, name, "abort")
    try:
        _require(cache, root, name)  # read-only: a refusal changes nothing, not even the cache's lock file
    except UnreadableState:
        _own_or_refuse(cache, name)
    with lock(cache, name, progress):
        try:
            ta = _require(cache, root, name)
        except UnreadableState:
            shutil.rmtree(_own_or_refuse(cache, name))
            return TargetAddResult(name, "", "", "aborted", message=f"target add of {name} aborted (its state was "
                                   "unreadable and is removed); targets/ and patches/ were not touched")
        new_target = target_of(ta, root)
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
        discard(cache, ta, new_target)
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


def _which(cache: Cache, root: Path, name: str | None, action: str) -> str:
    """--as NAME (checked with the new target's name rule before any path is built from it), or the one target
    add in progress in this project."""
    if name is not None:
        return valid_name(name, "--as")
    pending = pending_names(cache, root)
    if not pending:
        raise KvforgeError("no target add in progress in this project", EXIT_USAGE)
    if len(pending) > 1:
        raise KvforgeError(f"target adds in progress: {', '.join(pending)}; say which: `kvforge target add --{action} "
                           "--as NAME`", EXIT_USAGE)
    return pending[0]


def _own_or_refuse(cache: Cache, name: str) -> Path:
    """The directory of an unreadable state when --abort may remove it (kvforge's own, state.own_dir); else exit 2
    and nothing is removed."""
    own = own_dir(cache, name)
    if own is None:
        raise KvforgeError(f"{ta_dir(cache, name)}: an unreadable target add state in a directory that is not "
                           "kvforge's own (a symlink, or not a directory of the cache's targetadd/); nothing was "
                           "removed", EXIT_USAGE)
    return own


def _require(cache: Cache, root: Path, name: str) -> AddState:
    ta = load_state(cache, name)
    if ta is None:
        raise KvforgeError(f"no target add of {name} in progress", EXIT_USAGE)
    if Path(ta.root) != root or (Path(ta.root).exists() and ta.root_id != project_id(Path(ta.root))):
        raise KvforgeError(f"the target add of {name} in progress is not this project's: it was started in {ta.root}; "
                           f"run kvforge there (KVFORGE_ROOT={ta.root})", EXIT_USAGE)
    return ta

