"""Watch's open rows decided by behaviour (kvforge.flow.behaviour): history first with an upstream clone, then each
row's Checks without the fix on what it goes on in the series (the release with the patches carried before it),
and for a fix still needed a port of its nearest variant; the Checks budget."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from packaging.version import InvalidVersion, Version

from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.flow import behaviour
from kvforge.flow.rebase import RebaseResult
from kvforge.flow.rebase.state import Verdict
from kvforge.flow.upstream import NewBase, new_base_info
from kvforge.flow.watch.releases import IndexRelease
from kvforge.flow.watch.report import GOOD, Check, PatchRow
from kvforge.git import gitutil
from kvforge.git.bases import ensure_base
from kvforge.git.context import Context
from kvforge.project.series import Patch, read_series
from kvforge.project.targets import Release, load_all


def checks_budget(checks: int | None) -> int | None:
    """--checks N, else $KVFORGE_WATCH_CHECKS, else no limit (None); a negative or non-integer one is bad input."""
    where = "--checks"
    if checks is None:
        text = os.environ.get("KVFORGE_WATCH_CHECKS", "").strip()
        if not text:
            return None
        where = "$KVFORGE_WATCH_CHECKS"
        try:
            checks = int(text)
        except ValueError:
            raise KvforgeError(f"{where} {text!r}: not a number of Checks runs (e.g. 20; 0: none)", EXIT_USAGE) \
                from None
    if checks < 0:
        raise KvforgeError(f"{where} {checks}: not a number of Checks runs (0 or more)", EXIT_USAGE)
    return checks


def carried_under(result: RebaseResult) -> list[tuple[str | None, int]]:
    """For each patch of the dry run: the commit it goes on (the last carried patch's before it; None: the release
    itself) and how many carried patches that commit holds."""
    out: list[tuple[str | None, int]] = []
    head, carried = None, 0
    for s in result.patches:
        out.append((head, carried))
        if s.verdict == Verdict.CARRIED and s.commit:
            head, carried = s.commit, carried + 1
    return out


def decide_rows(ctx: Context, r: IndexRelease, chk: Check, budget: behaviour.Budget,
                under: list[tuple[str | None, int]] | None = None) -> None:
    """Each row's decision: the rebase's verdict where it settles it (upstream, carried), else the Checks without
    the fix and, for a fix still needed, a port of its nearest variant (kvforge.flow.behaviour), both on what the
    patch goes on in the series: the release with the patches carried before it (`under`: carried_under's list; a
    conflict earlier in the series is left out, as the dry run left it out)."""
    open_rows = [p for p in chk.patches if p.verdict not in GOOD]
    for p in chk.patches:
        if p.verdict in GOOD:
            p.decision, p.why = p.verdict, ""
    if not open_rows:
        return
    c = ctx.component
    new_comp = replace(c, ref=f"v{r.version}", release=Release(c.release.package, r.version, r.sdist_sha256))
    new_ctx = Context(ctx.cache, ctx.target, new_comp, ctx.source, ctx.repo_url, ctx.progress)
    nb = new_base_info(ensure_base(new_comp, ctx.cache, ctx.source, ctx.repo_url, ctx.progress), new_comp)
    by_name = {q.name: q for q in ctx.series().patches}
    old_commit = ctx.base().commit
    clone = upstream_clone(ctx)
    if clone is not None:  # history first: ancestry and patch-id
        for p in open_rows:
            found = behaviour.by_history(clone, f"v{r.version}", c.ref, by_name[p.name])
            if found:
                p.decision, p.why = "upstream", f"by history ({clone.name}): {found}"
        open_rows = [p for p in open_rows if not p.decision]
    index = {id(p): k for k, p in enumerate(chk.patches)}
    present: dict[str, bool] = {}  # a commit the dry run carried: still in the release's repository?

    def placed(p: PatchRow) -> tuple[NewBase, str]:
        """What row p goes on, and how its why says so ("": the bare release)."""
        head, carried = under[index[id(p)]] if under else (None, 0)
        if head is not None and head not in present:
            present[head] = gitutil.run(nb.repo.parent, "cat-file", "-e", f"{head}^{{commit}}", check=False,
                                        env={"GIT_DIR": str(nb.repo)}).returncode == 0
        if head is None or not present[head]:
            return nb, ""
        return replace(nb, commit=head), f"on the release with the {carried} patch{'es' if carried != 1 else ''} " \
                                         "carried before it"

    row_nb = {id(p): placed(p) for p in open_rows}
    groups: dict[str, list[PatchRow]] = {}
    for p in open_rows:
        groups.setdefault(row_nb[id(p)][0].commit, []).append(p)
    for rows in groups.values():  # the rows on one commit in as few pytest runs as their test files allow
        if len(rows) > 1:
            ctx.say(f"watch: {len(rows)} rows on {r.package} {r.version}: their Checks without the fixes")
            behaviour.prefetch(new_ctx, row_nb[id(rows[0])][0], [by_name[p.name] for p in rows], budget)
    for p in open_rows:
        patch = by_name[p.name]
        pnb, on = row_nb[id(p)]
        ctx.say(f"watch: {p.fix_id} on {r.package} {r.version}: its Checks without the fix{f' ({on})' if on else ''}")
        on = f"{on}: " if on else ""
        v = behaviour.without_fix(new_ctx, pnb, patch, budget)
        p.behaviour, p.evidence = v.state, v.evidence
        if v.state == behaviour.UPSTREAM:
            p.decision, p.why = behaviour.UPSTREAM, on + v.detail
            continue
        said = f"{on}{v.state} ({v.detail.split(' (evidence')[0]})"
        if v.state == behaviour.BUDGET:
            p.decision, p.why = "needs a person", v.detail
            continue
        # Needed, or the series' own Checks cannot run there: a variant's Checks, failing without it and passing
        # with it on the release, prove both that the fix is needed and the port.
        ctx.say(f"watch: {p.fix_id} on {r.version}: {v.state}; porting its nearest variant")
        got = behaviour.port(new_ctx, pnb, old_commit, variants(ctx, patch, r.version), budget, release=nb.commit)
        p.port = {"state": got.state, "detail": got.detail, "source": got.source, "patch_file": got.patch_file,
                  "conflict": got.conflict}
        if got.state == "port proven":
            p.decision = "port proven"
            p.why = (f"{said}; {got.detail}; ready: {got.patch_file} (kvforge target add {r.version} --from "
                     f"{ctx.target.name}, then `git am -3` it in place of {p.name})")
        else:
            p.decision, p.why = "needs a person", f"{said}; {got.detail}"


def upstream_clone(ctx: Context) -> Path | None:
    """With --source git: the local git clone of the component's upstream ($KVFORGE_<COMPONENT>_REPO, e.g.
    KVFORGE_VLLM_ASCEND_REPO, naming a directory) whose history answers before the Checks; else None."""
    if ctx.source != "git":
        return None
    where = ctx.repo_url or os.environ.get(f"KVFORGE_{ctx.component.name.upper().replace('-', '_')}_REPO")
    path = Path(where).expanduser() if where else None
    return path if path is not None and path.is_dir() else None


def variants(ctx: Context, patch: Patch, version: str) -> list[behaviour.Variant]:
    """Every variant of the patch's fix in a series of the same component (the patch's own included), the one
    whose target's release is nearest `version` first (ties: the newer release)."""
    want = Version(version)
    found: list[tuple[tuple[float, int, int], behaviour.Variant]] = []
    for t in load_all():
        comp = next((x for x in t.components if x.name == ctx.component.name), None)
        if comp is None:
            continue
        try:
            series = read_series(comp.series_dir)
        except (KvforgeError, OSError):
            continue
        for q in series.patches:
            if q.fix_id != patch.fix_id:
                continue
            try:
                rel = Version(comp.release.version)
            except InvalidVersion:
                continue
            # Its preimages, where the cache already holds its base (nothing is imported for them: a blob it lacks
            # is one git am -3 says it lacks).
            repo = ctx.cache.repos / f"{comp.name}-{'git' if ctx.source == 'git' else 'sdist'}.git"
            distance = abs(_position(rel) - _position(want))
            newer_first = 0 if rel >= want else 1
            found.append(((distance, newer_first, 0 if t.name != ctx.target.name else 1),
                          behaviour.Variant(t.name, comp.release.version, q, repo if repo.is_dir() else None)))
    seen: set[str] = set()
    out = []
    for _k, v in sorted(found, key=lambda x: x[0]):
        if v.patch.sha256 not in seen:
            seen.add(v.patch.sha256)
            out.append(v)
    return out


def _position(v: Version) -> float:
    """A release's place on one line: major * 1e6 + minor * 1e3 + micro (0.20.2 is nearer 0.22.0 than 0.20.1 is)."""
    r = v.release + (0, 0, 0)
    return r[0] * 1e6 + r[1] * 1e3 + r[2]
