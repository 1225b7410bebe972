"""The watch run: every (target, component, new release) as a dry-run rebase, its rows decided, the wheels
read; and --apply's target adds."""

from __future__ import annotations

import time
from typing import Callable

from packaging.version import InvalidVersion, Version

from kvforge.core.cache import Cache
from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.core.index import pypi_url
from kvforge.flow import behaviour
from kvforge.flow.rebase import RebaseResult
from kvforge.flow.rebase.command import rebase
from kvforge.flow.targetadd import TargetAddResult, add
from kvforge.flow.watch.decide import carried_under, checks_budget, decide_rows
from kvforge.flow.watch.releases import IndexRelease, index_releases, new_releases
from kvforge.flow.watch.report import FORMATS, GOOD, Check, PatchRow, ReleaseReport, WatchResult
from kvforge.git.context import Context
from kvforge.project.targets import Component, Target, load_all, load_target
from kvforge.wheels.choose import choose_wheels


def _patch_rows(result: RebaseResult) -> list[PatchRow]:
    rows = []
    for s in result.patches:
        dw = next((g for g in s.signals if g.get("name") == "drop-when"), None)
        state = None
        if dw is not None:
            fired = dw.get("fired")
            state = "met" if fired is True else "not met" if fired is False else "cannot tell"
        rows.append(PatchRow(s.name, s.fix_id, str(s.verdict), list(s.fired), list(s.against), s.reason, s.how,
                             state, str(dw.get("detail", "")) if dw else ""))
    return rows


def _watched(targets: list[Target]) -> list[tuple[Target, Component]]:
    return [(t, c) for t in targets for c in t.components]


def watch(cache: Cache, target_names: tuple[str, ...] = (), since: str | None = None, fmt: str = "table",
          source: str = "sdist", progress: Callable[[str], None] = lambda _m: None,
          apply: bool = False, checks: int | None = None) -> WatchResult:
    """The CLI's one call (see the module docstring)."""
    start = time.monotonic()
    if fmt not in FORMATS:
        raise KvforgeError(f"--format {fmt!r}: one of {', '.join(FORMATS)}", EXIT_USAGE)
    budget = behaviour.Budget(checks_budget(checks))
    since_v = None
    if since is not None:
        try:
            since_v = Version(since.removeprefix("v"))
        except InvalidVersion:
            raise KvforgeError(f"--since {since!r} is not a release version (e.g. 0.20.2)", EXIT_USAGE) from None
    targets = [load_target(n) for n in dict.fromkeys(target_names)] if target_names else load_all()
    skipped = [t.name for t in targets if t.lifecycle == "eol"]
    targets = [t for t in targets if t.lifecycle != "eol"]
    pairs, notes = [], []
    for t, c in _watched(targets):
        try:
            Version(c.release.version)
            pairs.append((t, c))
        except InvalidVersion:
            notes.append(f"{t.name}/{c.name}: its release version {c.release.version!r} is not a PEP 440 version; "
                         "not watched")
    packages = list(dict.fromkeys(c.release.package for _t, c in pairs))
    listed: dict[str, list[IndexRelease]] = {}
    for pkg in packages:
        progress(f"watch: reading {pkg}'s releases from {pypi_url()}")
        listed[pkg] = index_releases(pkg)
    reports: dict[tuple[str, str], ReleaseReport] = {}
    todo: list[tuple[Target, Component, IndexRelease]] = []
    for t, c in pairs:
        for r in new_releases(c, listed[c.release.package], since_v):
            todo.append((t, c, r))
            reports.setdefault((r.package, r.version),
                               ReleaseReport(r.package, r.version, r.sdist, r.sdist_sha256, r.uploaded))
    wheels_read: set[tuple[str, str]] = set()
    for n, (t, c, r) in enumerate(todo, 1):
        rep = reports[(r.package, r.version)]
        if (r.package, r.version) not in wheels_read:  # once per release, whichever targets move to it
            wheels_read.add((r.package, r.version))
            try:
                rep.wheels = {a: {"filename": p.filename, "sha256": p.sha256}
                              for a, p in choose_wheels(r.package, r.version).items()}
            except KvforgeError as exc:
                rep.wheels_error = str(exc)
        progress(f"watch: [{n}/{len(todo)}] {t.name}/{c.name} {c.release.version} -> {r.version} (dry-run rebase)")
        rep.checks.append(_check(cache, t, c, r, rep, source, progress, budget))
    ordered = sorted(reports.values(), key=lambda x: (x.package, Version(x.version)))
    watched = [{"target": t.name, "component": c.name, "package": c.release.package, "base": c.release.version}
               for t, c in pairs]
    result = WatchResult(pypi_url(), since, watched, ordered, fmt, skipped, time.monotonic() - start, notes)
    result.checks_run = budget.used
    if apply:
        result.applied = apply_clean(cache, result, progress)
        result.seconds = time.monotonic() - start
    return result


def apply_clean(cache: Cache, result: WatchResult, progress: Callable[[str], None]) -> list[TargetAddResult]:
    """--apply: `target add` for each clean new vLLM release no target has yet, oldest first; the first one
    that stops ends it (its state is resumable). vllm-ascend releases are not added on their own: a target
    follows vLLM, and target add pairs the vllm-ascend release built on it."""
    have = {c.release.version for t in load_all() for c in t.components if c.release.package == "vllm"}
    done: list[TargetAddResult] = []
    for r in result.releases:
        if r.package != "vllm" or r.status != "clean" or r.version in have or not r.checks:
            continue
        # from the newest of the targets this release is clean for (the one the fewest releases away)
        src = max(r.checks, key=lambda c: Version(c.from_version)).target
        progress(f"watch --apply: kvforge target add {r.version} --from {src}")
        added = add(cache, r.version, from_target=src, progress=progress)
        done.append(added)
        if added.state == "stopped":
            break
    return done


def _check(cache: Cache, t: Target, c: Component, r: IndexRelease, rep: ReleaseReport, source: str,
           progress: Callable[[str], None], budget: behaviour.Budget | None = None) -> Check:
    t0 = time.monotonic()
    chk = Check(t.name, c.name, c.release.version)
    try:
        ctx = Context(cache, t, c, source=source, progress=progress)
        # A git base is the release's tag (vX.Y.Z, vX.Y.ZrcN: both upstreams tag so); an sdist base the version.
        result = rebase(ctx, f"v{r.version}" if source == "git" else r.version, dry_run=True)
        chk.patches = _patch_rows(result)
        chk.notes = [n for n in result.notes if not n.startswith("no wheel like")]  # the wheels are said apart
        decide_rows(ctx, r, chk, budget or behaviour.Budget(None), carried_under(result))
    except KvforgeError as exc:
        chk.error, chk.exit = str(exc).splitlines()[0] if str(exc) else type(exc).__name__, exc.exit_code
        for p in chk.patches:  # every row has a decision, whatever stopped the others
            if not p.decision:
                p.decision, p.why = "needs a person", f"not decided: {chk.error}"
    pinned = sorted({w.arch for w in c.wheels if w.arch})
    if rep.wheels_error is None:
        chk.missing_wheels = [a for a in pinned if a not in rep.wheels]
    if chk.error or chk.missing_wheels or any(p.verdict not in GOOD for p in chk.patches):
        chk.status = "attention"
    chk.seconds = time.monotonic() - t0
    return chk
