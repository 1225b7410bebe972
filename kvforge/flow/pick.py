"""`kvforge pick SOURCE`: one upstream change into every target's series, a verdict per target.

The change comes from kvforge.flow.picksource (a commit or range of a clone, a format-patch file, a PR) with
kvforge's header. Per (target, component) that has the change's component, in this order: `present` (the
target file lists the Fix-Id in `in_base`, or kvforge.flow.upstream's signals on the base decide "upstream": never
on one weak signal), `carried` (a patch with the Fix-Id or the same `git patch-id --stable`), then `git am -3`
on the target's stack tip (kvforge.git.trees) in a worktree of kvforge's own: `applies`, `applies
(3-way)`, or, when it fails, `needs prerequisite` (it does not apply to the bare base either: its
preimage comes from upstream changes the target lacks; with the source's history, the commits named)
or `conflict` (it applies to the base but not over the carried series). A failing target gets a tree
of the user's at the conflict (kvforge.flow.port's way: `apply_target` + preimages + `git am -3`); the
others are still decided. `disagree` (strong signals on both sides) stops like a conflict. `--after FIX`:
the change is applied on the series up to FIX and the later patches are re-applied over it (re-exported
under their names), or the pick is refused (exit 3, nothing written); `--verify` proves the picked patch
(kvforge.proof.verify with `prove`), wherever it sits.

Writing: kvforge.flow.pickwrite, one transaction of the project once every row is decided (and, with
--verify, proven); a SIGKILL at any of its steps ($KVFORGE_CRASH_AT=pick:<step>,
kvforge.project.transaction.CRASH_STEPS) leaves patches/ and targets/ the old ones or the complete new ones
once the next kvforge command that writes the project (every `kvforge pick` first) has recovered. A pick that
stopped keeps its state in <cache>/pick/<project>/state.json until `--continue` (reads the resolved trees,
then writes) or `--abort` (the user's trees stay). The state is type-checked on load (an unusable one is one
line, exit 2, naming the file; `--abort` forgets it). Options are checked before anything is made (`--fix-id`,
`--exclude`, every target's `--after`); a run that fails removes the trees it made; `--dry-run` writes nothing
in any state (`--continue --dry-run` leaves `git am --continue` to the user's tree).
"""

from __future__ import annotations

import base64
import contextlib
import re
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

from kvforge.git import gitutil
from kvforge.flow import upstream
from kvforge.flow.apply import apply_target
from kvforge.flow.picksource import Change, annotated, carrier, checks_of, default_fix_id, load_source
from kvforge.flow.pickstate import PickResult, load_state, save_state, state_path
from kvforge.flow.pickwrite import (CHANGED_HINT, STOPS, WRITTEN, Row, build_plan, commit_all, digests_of, recover,
                                    written_by)
from kvforge.core.cache import Cache
from kvforge.git.context import Context, Progress
from kvforge.git.engine import add_worktree, am_in_progress, am_one, diagnose, format_patch, remove_worktree
from kvforge.core.errors import EXIT_APPLY, EXIT_ENV, EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import file_lock
from kvforge.flow.port import copy_preimages
from kvforge.project.series import Patch, parse_patch, read_series
from kvforge.project.targets import Target, display_path, known_targets, load_target, project_root
from kvforge.git.trees import open_stack, scratch_dir
from kvforge.proof.verify import verify_target


# ---------------------------------------------------------------- per target



def _patch_id(raw: bytes) -> str | None:
    with tempfile.TemporaryDirectory() as tmp:
        out = gitutil.run(Path(tmp), "patch-id", "--stable", stdin=raw, check=False).stdout.split()
    return out[0] if out else None


def _applies_to(repo: Path, commit: str, diff_file: Path) -> tuple[bool, list[str]]:
    """`git apply --check` of the change against `commit` itself (a temporary index): (ok, failing files)."""
    with tempfile.TemporaryDirectory(prefix="kvforge-pick-") as tmp:
        env = {"GIT_DIR": str(repo), "GIT_INDEX_FILE": str(Path(tmp) / "index"), "GIT_WORK_TREE": tmp}
        gitutil.run(Path(tmp), "read-tree", commit, env=env)
        res = gitutil.run(Path(tmp), "apply", "--cached", "--check", str(diff_file), check=False, env=env)
    files = re.findall(r"error: (?:patch failed: )?([^:\s]+):", res.stderr)
    return res.returncode == 0, list(dict.fromkeys(files))


def _after_position(series, after: str, label: str) -> int:
    """--after FIX: how many patches of the series stay before the pick (FIX's 1-based position)."""
    for n, p in enumerate(series.patches, 1):
        if p.fix_id == after:
            return n
    raise KvforgeError(f"--after {after}: {label} carries no patch with Fix-Id {after} "
                       f"(its Fix-Ids: {', '.join(p.fix_id or p.name for p in series.patches) or 'none'})", EXIT_USAGE)


def decide_row(ctx: Context, change: Change, fix_id: str, signoff: str, work: Path, dry_run: bool,
               tree_dir: Path, after: str | None = None) -> Row:
    """The verdict for ctx's target and component (see the module docstring). `after`: the pick goes right
    after that Fix-Id's patch; the later patches are re-applied over it (cleanly, or the pick is refused)."""
    t, comp = ctx.target, ctx.component
    row = Row(t.name, comp.name, "")
    in_base = {e.fix_id: e.reason for e in comp.in_base}
    if fix_id in in_base:
        row.verdict, row.detail = "present", f"{display_path(t.path)} lists it in in_base: {in_base[fix_id]}"
        return row
    series = ctx.series()
    if fix_id in series.by_fix_id():
        row.verdict, row.detail = "carried", f"{series.by_fix_id()[fix_id].name} carries Fix-Id {fix_id}"
        return row
    want = _patch_id(change.diff)
    for p in series.patches:
        if want and _patch_id(p.raw) == want:
            row.verdict, row.detail = "carried", f"{p.name} (Fix-Id {p.fix_id}) is the same change (git patch-id)"
            return row
    base = ctx.base()
    checks = checks_of(change.diff)
    raw = annotated(change, fix_id, checks, signoff)
    patch_file = work / f"{t.name}-{comp.name}.patch"
    patch_file.write_bytes(raw)
    patch = parse_patch(patch_file, raw)
    nb = upstream.new_base_info(base, comp)
    t0 = time.monotonic()
    signals = upstream.gather(nb, patch, None)
    row.seconds = round(time.monotonic() - t0, 3)
    row.signals = [asdict(s) for s in signals if s.fired is not None or s.name in ("reverse-apply", "drop-when")]
    decision, reason = upstream.decide(signals)
    if decision == "upstream":
        row.verdict, row.detail = "present", reason
        return row
    stack = open_stack(ctx)
    k = _after_position(series, after, row.label) if after else len(series.patches)
    tip = stack.commits[k]
    wt = work / f"wt-{t.name}-{comp.name}"
    add_worktree(base.repo, wt, tip)
    later: list[tuple[str, str]] = []  # --after: (patch name, its commit re-applied over the pick)
    try:
        if change.git_dir:
            copy_preimages(patch, Path(change.git_dir), wt)
        how, commit, out = am_one(wt, patch_file, tip)
        if how == "conflict":
            row.detail = diagnose(wt, patch, out)
            if am_in_progress(wt):
                gitutil.run(wt, "am", "--abort", check=False)
            if after and k < len(series.patches) and decision != "disagree":
                raise KvforgeError(f"--after {after}: on {row.label} the change does not apply after "
                                   f"{series.patches[k - 1].name} ({row.detail}): pick it without --after (appended) "
                                   "or place it by hand; nothing written", EXIT_APPLY)
        elif commit is not None and k < len(series.patches):
            head = commit
            for p in series.patches[k:]:
                how_p, c_p, out_p = am_one(wt, p.path, head)
                if c_p is None:
                    why = diagnose(wt, p, out_p) if how_p == "conflict" else "it changes nothing any more"
                    if am_in_progress(wt):
                        gitutil.run(wt, "am", "--abort", check=False)
                    raise KvforgeError(f"--after {after}: on {row.label} {p.name} does not apply over the picked "
                                       f"change ({why}): pick it without --after (appended) or reorder by hand; "
                                       "nothing written", EXIT_APPLY)
                later.append((p.name, c_p))
                head = c_p
    finally:
        remove_worktree(base.repo, wt)
    if decision == "disagree":
        row.verdict, row.detail = "disagree", reason + (f"; git am -3 on the series: {how}" if how else "")
        return row
    if how == "no change":
        row.verdict, row.detail = "carried", "applying it over the series changes nothing: the series has it"
        return row
    if how != "conflict":
        assert commit is not None
        ref = f"refs/kvforge/pick/{t.name}/{comp.name}"
        tip_after = later[-1][1] if later else commit
        gitutil.run(base.repo, "update-ref", ref, tip_after)
        present = [c for c in checks if _has_test(base.repo, commit, c)]
        row.verdict, row.commit, row.repo, row.checks = (how.replace("applied", "applies"), tip_after, str(base.repo),
                                                         present)
        row.detail = f"on {base.ref} + {len(series.patches)} patches"
        row.data = base64.b64encode(format_patch(base.repo, commit)).decode()
        row.patch = _next_name(series.patches, fix_id)
        if after:
            row.position = k + 1
            row.rewrites = {name: base64.b64encode(format_patch(base.repo, c)).decode() for name, c in later}
            row.detail = (f"on {base.ref} + {k} patches, after {series.patches[k - 1].name}"
                          + (f"; {', '.join(n for n, _ in later)} re-applied over it" if later else ""))
        return row
    on_base, failing = _applies_to(base.repo, base.commit, patch_file)
    if not on_base:
        row.verdict = "needs prerequisite"
        row.prerequisites = _prerequisites(change, comp.release.version, failing)
        row.detail = (f"does not apply to the bare base {base.ref} either ({', '.join(failing) or row.detail}): "
                      "its preimage comes from upstream changes the target lacks")
    else:
        row.verdict = "conflict"
        touching = [p.name for p in series.patches if set(p.touched_paths) & set(change.paths)]
        row.detail += f" (applies to the base; conflicts with {', '.join(touching) or 'the series'})"
    if dry_run:
        return row
    dest = tree_dir / f"{comp.name}-{t.name}-pick-{fix_id}"
    if dest.exists() and any(dest.iterdir()):
        raise KvforgeError(f"{dest} exists and is not empty: a tree from an earlier pick? move it away (it may hold "
                           "your resolution) and pick again", EXIT_USAGE)
    made = apply_target(ctx, into=dest)
    if change.git_dir:
        copy_preimages(patch, Path(change.git_dir), dest)
    copy_preimages(patch, base.repo, dest)
    how2, commit2, out2 = am_one(dest, patch_file, made.head)
    row.tree, row.tree_head = str(dest), made.head
    if how2 != "conflict":  # the same git am in a fresh tree applied after all: take it
        assert commit2 is not None
        row.verdict, row.commit, row.repo = "resolved", commit2, str(dest)
        row.data = base64.b64encode(format_patch(dest, commit2)).decode()
        row.patch = _next_name(series.patches, fix_id)
        row.checks = [c for c in checks if _has_test(dest, commit2, c)]
        return row
    row.conflicts = gitutil.run(dest, "diff", "--name-only", "--diff-filter=U", check=False).stdout.split()
    if not am_in_progress(dest):
        row.detail += f"; git am did not stop in {dest}: {diagnose(dest, patch, out2)}"
    return row


def _has_test(repo: Path, commit: str, node: str) -> bool:
    path, _, name = node.partition("::")
    res = gitutil.run(repo, "cat-file", "blob", f"{commit}:{path}", check=False)
    return res.returncode == 0 and re.search(rf"^\s*(async )?def {re.escape(name)}\(", res.stdout, re.M) is not None


def _next_name(patches: list[Patch], fix_id: str) -> str:
    nums = [int(m.group(1)) for p in patches if (m := re.match(r"^(\d{4})-", p.name))]
    return f"{(max(nums) if nums else 0) + 1:04d}-{fix_id}.patch"


def _prerequisites(change: Change, version: str, files: list[str]) -> list[str]:
    """With the source's history: the commits between the target's release tag and the change's parent
    that touch the files whose preimage the target lacks."""
    if not change.git_dir or not change.commits:
        return []
    repo = Path(change.git_dir)
    env = {"GIT_DIR": str(repo)}
    first = change.commits[0]
    for tag in (f"v{version}", version):
        if gitutil.run(repo.parent, "rev-parse", "-q", "--verify", f"refs/tags/{tag}", check=False,
                       env=env).returncode == 0:
            out = gitutil.run(repo.parent, "log", "--format=%h %s", f"{tag}..{first}^", "--", *(files or change.paths),
                              check=False, env=env).stdout
            return out.splitlines()
    return []


# ---------------------------------------------------------------- the command


def _contexts(cache: Cache, component: str, targets: list[str] | None, progress: Progress,
              source: str) -> list[Context]:
    names = targets or known_targets()
    out = []
    for name in names:
        t: Target = load_target(name)
        if any(c.name == component for c in t.components):
            out.append(Context(cache, t, t.component(component), source=source, progress=progress))
        elif targets:
            raise KvforgeError(f"--target {name}: has no component {component!r} (the change is {component}'s)",
                               EXIT_USAGE)
    if not out:
        raise KvforgeError(f"no target has the component {component!r}", EXIT_USAGE)
    return out


def _prove(cache: Cache, rows: list[Row], progress: Progress) -> None:
    for r in rows:
        if r.verdict not in WRITTEN or not r.commit or not r.repo:
            continue
        t = load_target(r.target)
        ctx = Context(cache, t, t.component(r.component), progress=progress, from_rev=f"{r.repo}:{r.commit}")
        progress(f"verifying the pick on {r.label}")
        n = r.position or -1  # the picked patch; the series' own verify proved the rest
        report = verify_target(ctx, prove=[n])
        mine = report.patches[n - 1 if n > 0 else -1] if report.patches else None
        reg = report.regression
        r.evidence = {
            "status": mine.status if mine else None, "reason": mine.reason if mine else "",
            "checks": [{"node": c.node, "before": c.before, "before_how": c.before_how, "before_kind": c.before_kind,
                        "before_message": c.before_message, "after": c.after} for c in (mine.checks if mine else [])],
            "regression": {k: reg.get(k) for k in ("passed", "failed", "errors", "skipped", "ok", "reason")}
            | {"new_failures": (reg.get("compare") or {}).get("new_failures", 0),
               "pre_existing_failures": (reg.get("compare") or {}).get("pre_existing_failures", 0)},
            "report": report.report, "seconds": round(report.seconds, 1)}
        if report.ok:
            r.proof = "proven"
        else:
            why = "; ".join(report.problems()[:2]) or "verify failed"
            r.proof = f"failed: {why}"
        if mine is not None and not mine.ok and report.ok:
            r.proof = "failed: the picked patch's Checks"


@contextlib.contextmanager
def _state_lock(cache: Cache, spath: Path, progress: Progress, dry_run: bool) -> Iterator[None]:
    """The lock of the pick state (the cache checked writable first: exit 5); a dry run takes none (it writes
    nothing, and the state is replaced atomically)."""
    if dry_run:
        yield
        return
    cache.writable(spath.parent.parent.name)
    with file_lock(spath.parent.parent / f"{spath.parent.name}.lock", progress, "the pick state"):
        yield


def pick(cache: Cache, source: str | None, *, repo_dir: Path | None = None, targets: list[str] | None = None,
         component: str | None = None, fix_id: str | None = None, dry_run: bool = False, verify: bool = False,
         exclude: list[str] | None = None, action: str = "start", signoff: str | None = None,
         tree_dir: Path | None = None, base_source: str = "auto", after: str | None = None,
         progress: Progress = lambda m: None) -> PickResult:
    """Decide, and write when every target is decided; --continue / --abort a stopped pick."""
    start = time.monotonic()
    root = project_root()
    spath = state_path(cache, root)
    if fix_id is not None and not re.match(r"^[a-z0-9][a-z0-9-]*$", fix_id):
        raise KvforgeError(f"--fix-id {fix_id!r}: a Fix-Id is a lowercase slug [a-z0-9][a-z0-9-]*", EXIT_USAGE)
    if exclude:
        known = known_targets()
        unknown = [e for e in exclude if e not in known]
        if unknown:
            raise KvforgeError(f"--exclude {unknown[0]}: no such target (targets: {', '.join(known) or 'none'})",
                               EXIT_USAGE)
    with _state_lock(cache, spath, progress, dry_run):
        if not dry_run:
            recover(root, progress)
        state = load_state(spath, forgiving=action == "abort")
        finished = written_by(state) if state is not None and not dry_run else None
        if finished is not None:  # its write was finished (by whichever command came first): the pick is over
            spath.unlink(missing_ok=True)
            state = None
        if finished is not None and action == "continue":
            res = PickResult(finished.get("fix_id", "?"), finished.get("source", "?"), finished.get("subject", ""),
                             finished.get("upstream", {}), [Row(**r) for r in finished.get("rows", [])], "written")
            res.notes = ["an interrupted write of this pick was finished now"]
            return res
        if action == "abort":
            if state is None:
                raise KvforgeError("no pick in progress", EXIT_USAGE)
            trees = [r["tree"] for r in state["rows"] if r.get("tree")]
            res = PickResult(state["fix_id"], state["source"], state["subject"], state["upstream"], [],
                             "dry-run" if dry_run else "aborted")
            if dry_run:
                res.notes = [f"dry run: would forget the pick state {spath}"]
            else:
                shutil.rmtree(spath.parent, ignore_errors=True)
                if "unusable" in state:
                    res.notes = [f"forgot the unusable pick state {spath} ({state['unusable']})"]
            res.notes += [f"your tree {t} is left as it is" for t in trees]
            return res
        if action == "continue":
            if state is None:
                raise KvforgeError("no pick in progress (nothing to --continue)", EXIT_USAGE)
            return _continue(cache, root, spath, state, exclude or [], verify, dry_run, progress, start)
        if state is not None:
            raise KvforgeError(f"a pick of {state['fix_id']} is in progress: resolve its trees and `kvforge pick "
                               "--continue`, or `kvforge pick --abort`", EXIT_USAGE)
        if not source:
            raise KvforgeError("SOURCE is required (a patch file, a PR, or REV with --repo DIR)", EXIT_USAGE)
        change = load_source(source, repo_dir, component, cache, progress)
        fid = fix_id or change.fix_id or default_fix_id(change.subject)
        if not re.match(r"^[a-z0-9][a-z0-9-]*$", fid):
            what = "its Fix-Id" if fix_id is None else "--fix-id"
            raise KvforgeError(f"{change.source}: {what} {fid!r} is not a lowercase slug [a-z0-9][a-z0-9-]*; "
                               "give one with --fix-id", EXIT_USAGE)
        ident = carrier(root, signoff)
        ctxs = _contexts(cache, change.component, targets, progress, base_source)
        info = {"pr": change.pr_url, "commit": change.commits[-1][:12] if change.commits else None,
                "first_release": change.first_release, "open": change.pr_open, "paths": change.paths}
        result = PickResult(fid, change.source, change.subject, info, [], "stopped", verify=verify)
        result.digests = digests_of([Row(c.target.name, c.component.name, "") for c in ctxs])
        if after:
            for ctx in ctxs:
                if ctx.target.name not in (exclude or []):
                    _after_position(ctx.series(), after, ctx.label)
        t0 = time.monotonic()
        work = scratch_dir(cache, "pick")
        try:
            for ctx in ctxs:
                if ctx.target.name in (exclude or []):
                    result.rows.append(Row(ctx.target.name, ctx.component.name, "excluded", "--exclude"))
                    continue
                progress(f"deciding {ctx.label}")
                result.rows.append(decide_row(ctx, change, fid, ident, work, dry_run,
                                              Path(tree_dir or Path.cwd()).absolute(), after))
        except BaseException as exc:
            _forget_trees(result.rows)  # a refused pick leaves nothing of its own behind
            if isinstance(exc, OSError):
                raise _write_failed(exc, work) from None
            raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
        result.seconds["decide"] = round(time.monotonic() - t0, 3)
        result.seconds["signals"] = round(sum(r.seconds for r in result.rows), 3)
        return _finish(cache, root, spath, result, dry_run, progress, start)


def _forget_trees(rows: list[Row]) -> None:
    """Remove the trees this run made at a conflict (before any state names them, nobody else has them)."""
    for r in rows:
        if r.tree:
            shutil.rmtree(r.tree, ignore_errors=True)


def _write_failed(exc: OSError, where: Path) -> KvforgeError:
    """A full disk or an unwritable directory while picking: one line, exit 5, nothing of the pick kept."""
    path = exc.filename or where
    return KvforgeError(f"cannot write {path}: {exc.strerror or exc}; nothing of the pick was kept", EXIT_ENV)


def _finish(cache: Cache, root: Path, spath: Path, result: PickResult, dry_run: bool, progress: Progress,
            start: float) -> PickResult:
    rows = result.rows
    digests = result.digests
    if any(r.verdict in STOPS for r in rows):
        if dry_run:
            result.status = "dry-run"
            return result
        try:
            save_state(spath, result, rows, digests)
        except OSError as exc:
            _forget_trees(rows)
            raise _write_failed(exc, spath) from None
        result.next_steps = [f"resolve in {r.tree}, `git add` the files (kvforge runs `git am --continue`)"
                             for r in rows if r.tree and r.verdict in ("conflict", "needs prerequisite")]
        result.next_steps += ["kvforge pick --continue   (or --continue --exclude TARGET, or --abort)"]
        return result
    if result.verify and not dry_run:
        t0 = time.monotonic()
        _prove(cache, rows, progress)
        result.seconds["verify"] = round(time.monotonic() - t0, 3)
        if result.exit_code != 0:
            result.status = "verify failed"
            with contextlib.suppress(OSError):
                spath.unlink()
            return result
    plan = build_plan(rows, result.fix_id, result.upstream)
    if dry_run:
        result.status = "dry-run"
        result.notes.append("dry run: would write " + (", ".join(
            [display_path(Path(d)) for d in plan.dirs] + [display_path(Path(t)) for t in plan.targets]) or "nothing"))
        return result
    t0 = time.monotonic()
    summary = {"fix_id": result.fix_id, "source": result.source, "subject": result.subject,
               "upstream": result.upstream, "rows": [r.public() for r in rows]}
    result.written = commit_all(root, plan, digests, progress, spath, summary)
    result.seconds["write"] = round(time.monotonic() - t0, 3)
    result.seconds["total"] = round(time.monotonic() - start, 3)
    result.status = "written" if result.written else "nothing to write"
    with contextlib.suppress(OSError):
        spath.unlink()
    return result


def _continue(cache: Cache, root: Path, spath: Path, state: dict[str, Any], exclude: list[str], verify: bool,
              dry_run: bool, progress: Progress, start: float) -> PickResult:
    rows = [Row(**r) for r in state["rows"]]
    pending: list[str] = []  # --dry-run: what --continue would do in the user's trees
    for r in rows:
        if r.target in exclude and r.verdict not in ("present", "carried"):
            r.verdict, r.detail = "excluded", "--exclude" + (f"; your tree {r.tree} is left as it is" if r.tree else "")
            continue
        if r.verdict not in ("conflict", "needs prerequisite"):
            continue
        tree = Path(r.tree or "")
        if not (tree / ".git").exists():
            raise KvforgeError(f"{r.label}: the tree {tree} is gone; --exclude {r.target} or --abort", EXIT_USAGE)
        if am_in_progress(tree):
            unmerged = gitutil.run(tree, "diff", "--name-only", "--diff-filter=U", check=False).stdout.split()
            if unmerged:
                raise KvforgeError(f"{r.label}: {', '.join(unmerged)} still conflict in {tree}; resolve, `git add`, "
                                   "then --continue", EXIT_APPLY)
            if dry_run:  # `git am --continue` would commit in the user's tree
                pending.append(f"`git am --continue` in {tree}")
                r.detail = f"resolved in {tree}, not committed yet (was {r.verdict}: {r.detail})"
                r.verdict = "resolved"
                continue
            res = gitutil.run(tree, "am", "--continue", check=False)
            if res.returncode != 0:
                raise KvforgeError(f"{r.label}: `git am --continue` in {tree} failed: "
                                   f"{(res.stderr or res.stdout).strip().splitlines()[-1:]}", EXIT_APPLY)
        head = gitutil.rev_parse(tree, "HEAD") or ""
        commits = gitutil.run(tree, "rev-list", f"{r.tree_head}..{head}", check=False).stdout.split()
        if len(commits) != 1 or not gitutil.is_ancestor(tree, r.tree_head or "", head):
            raise KvforgeError(f"{r.label}: {tree} should hold exactly one commit on {str(r.tree_head)[:12]} (the "
                               f"resolved pick); it holds {len(commits)}", EXIT_USAGE)
        raw = format_patch(tree, head)
        p = parse_patch(Path(r.patch or "x.patch"), raw)
        if p.problems:
            raise KvforgeError(f"{r.label}: the resolved commit in {tree}: {p.problems[0].message}", EXIT_USAGE)
        if p.fix_id != state["fix_id"]:
            raise KvforgeError(f"{r.label}: the resolved commit's Fix-Id is {p.fix_id!r}, not {state['fix_id']!r}",
                               EXIT_USAGE)
        t = load_target(r.target)
        series = read_series(t.component(r.component).series_dir)
        r.detail = f"resolved in {tree} (was {r.verdict}: {r.detail})"
        r.verdict, r.commit, r.repo = "resolved", head, str(tree)
        r.data = base64.b64encode(raw).decode()
        r.patch = _next_name(series.patches, state["fix_id"])
        r.checks = p.checks
    result = PickResult(state["fix_id"], state["source"], state["subject"], state["upstream"], rows, "stopped",
                        verify=verify or state.get("verify", False))
    result.digests = state["digests"]
    now = digests_of(rows)
    changed = [k for k, v in state["digests"].items() if now.get(k) != v]
    if changed:
        raise KvforgeError(f"{display_path(Path(changed[0]))} changed since the pick read it; nothing was written"
                           + CHANGED_HINT, EXIT_USAGE)
    if pending:
        result.status = "dry-run"
        result.notes.append("dry run: would run " + ", ".join(pending) + ", then write the picked patches")
        return result
    return _finish(cache, root, spath, result, dry_run, progress, start)
