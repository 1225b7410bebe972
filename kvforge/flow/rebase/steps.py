"""The rebase's steps: each patch's signals and decision (planning), then the carried patches committed as
`git am` commits them, without a worktree while they apply as they are (engine.am_without_worktree), and
`git am -3` in the rebase's worktree for a patch that needs the 3-way merge, stopping at a conflict or a
disagreement.

Works on a State (kvforge.flow.rebase.state) and saves it after every patch; writes nothing in patches/ or
targets/ (kvforge.flow.rebase.commit does, once every step is decided).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Callable

from kvforge.git import gitutil
from kvforge.flow import upstream
from kvforge.git.bases import Base
from kvforge.git.context import Context
from kvforge.git.engine import am_in_progress, am_one, am_without_worktree, diagnose, ensure_worktree, format_patches
from kvforge.core.errors import EXIT_APPLY, EXIT_ENV, KvforgeError
from kvforge.core.fsutil import crashpoint
from kvforge.project.series import Patch, parse_patch
from kvforge.project.targets import Component
from kvforge.git.trees import Stack
from kvforge.flow.rebase.state import DROPPED, State, Step, Stop, StopKind, Verdict, save

REF_REBASE = "refs/kvforge/rebase"  # old series commits copied into the new base's repository

# Runs a patch's Checks on the new base without the fix (kvforge.flow.behaviour.checks_signal, handed in by the
# caller that wants them: the rebase does not import the env and proof layers it needs).
CheckRunner = Callable[[Context, upstream.NewBase, Patch], upstream.Signal]


# ---------------------------------------------------------------- planning: signals and decisions


def old_commits(ctx: Context, stack: Stack, old_base: Base, new_base: Base) -> list[str | None]:
    """Each patch's commit in the old stack, reachable in the new base's repository."""
    if old_base.repo.resolve() != new_base.repo.resolve():
        gitutil.run(new_base.repo, "fetch", "-q", "--no-tags", str(old_base.repo),
                    f"+{stack.commits[-1]}:{REF_REBASE}/{ctx.target.name}/{ctx.component.name}/old")
    out: list[str | None] = []
    for n in range(1, stack.size + 1):
        out.append(None if stack.commits[n] == stack.commits[n - 1] else stack.commits[n])
    return out


def plan(ctx: Context, new_comp: Component, new_base: Base, patches: list[Patch], olds: list[str | None],
         checks: CheckRunner | None) -> tuple[list[Step], float]:
    """Every patch's signals and decision on the new base: (pending steps, seconds the checks took); `checks`
    runs a patch's Checks (None: the Checks signal is not run)."""
    nb = upstream.new_base_info(new_base, new_comp)
    out: list[Step] = []
    t_checks = 0.0
    new_ctx = Context(ctx.cache, ctx.target, new_comp, ctx.source, ctx.repo_url, ctx.progress,
                      python=ctx.python, torch_index=ctx.torch_index)
    with upstream.Probe(nb, patches, olds) as probe:  # the base's reads, once for the whole series
        for p, old in zip(patches, olds):
            ctx.say(f"signals for {p.name}")
            timed = {"s": 0.0}

            def run_checks(p: Patch = p, timed: dict[str, float] = timed) -> upstream.Signal:
                assert checks is not None
                t = time.monotonic()
                try:
                    return checks(new_ctx, nb, p)
                finally:
                    timed["s"] += time.monotonic() - t

            signals = upstream.gather(nb, p, old, checks=run_checks if checks else None, probe=probe)
            t_checks += timed["s"]
            decision, reason = upstream.decide(signals)
            out.append(Step(p.name, p.fix_id, Verdict.PENDING, reason, decision,
                            [{"name": s.name, "fired": s.fired, "strong": s.strong, "detail": s.detail}
                             for s in signals], old_commit=old))
    return out, t_checks


# ---------------------------------------------------------------- the worktree


def worktree_path(ctx: Context, repo: Path) -> Path:
    """The target's rebase worktree of `repo` (the new base's repository): kept between rebases (moving it
    to a new base rewrites only the files that differ), owned by kvforge; the user works in it only to
    resolve a conflict. Keyed by the repository it belongs to (vllm-sdist, vllm-git, ...): a rebase from
    a git clone and one from the sdist never share (or fight over) one directory."""
    key = repo.name.removesuffix(".git")
    path = ctx.cache.trees / ".work" / f"rebase-{ctx.target.name}-{ctx.component.name}-{key}"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _ensure_worktree(st: State) -> None:
    """Put the rebase's worktree at st.head (rerere on), on first use only: a plan that applies
    nothing never touches it."""
    if st.worktree_ready:
        return
    worktree = st.plan.worktree
    if ensure_worktree(st.plan.repo, worktree, st.head):
        reset(worktree, st.head)
    if not rerere_enabled(st.plan.repo):
        gitutil.run(worktree, "config", "rerere.enabled", "true")
    st.worktree_ready = True


def rerere_enabled(repo: Path) -> bool:
    """`rerere.enabled = true` is in the repository's own config file, as `git config rerere.enabled true` in its
    worktree writes it (read from the file, so a rebase need not run git to set it again; False: set it)."""
    try:
        text = (repo / "config").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.lower()
        elif section == "[rerere]" and re.fullmatch(r"enabled\s*=\s*true", line):
            return True
    return False


def reset(worktree: Path, commit: str) -> None:
    """The worktree at `commit`, clean, no `git am` in progress."""
    if not (worktree / ".git").exists():
        raise KvforgeError(f"the rebase worktree {worktree} is missing; --abort and start again", EXIT_ENV)
    if am_in_progress(worktree):
        gitutil.run(worktree, "am", "--abort", check=False)
    gitutil.run(worktree, "reset", "--hard", "-q", commit)
    gitutil.run(worktree, "clean", "-ffdq")


def release_worktree(worktree: Path) -> None:
    """The rebase is over: no `git am` left stopped in the worktree (it is kept for the next rebase)."""
    if (worktree / ".git").exists() and am_in_progress(worktree):
        gitutil.run(worktree, "am", "--abort", check=False)


# ---------------------------------------------------------------- applying


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


def _fix_depends_on(st: State, i: int) -> None:
    p = st.steps[i]
    gone = drop_depends_on(st.patch_copy(p.name), st.dropped_fix_ids(i))
    if gone:
        st.notes.append(f"{p.name}: Depends-On {', '.join(gone)} removed (dropped by this "
                        "rebase: the new base has it, or it was skipped)")


def _carried_run(ctx: Context, st: State) -> bool:
    """Apply the run of carried patches from st.position without a worktree (engine.am_without_worktree: the
    commits `git am` makes of them); patches the signals drop inside the run are left out. Stops short of a patch
    that does not apply as it is or changes nothing: the per-patch path applies that one alone with `git am -3`
    in the worktree (the 3-way merge, a conflict to resolve, "no change"). True only when st.position moved."""
    steps = st.steps
    run: list[int] = []
    j = st.position
    while j < len(steps):
        q = steps[j]
        if q.verdict is Verdict.PENDING and q.decision == "upstream":
            q.verdict, q.how = Verdict.UPSTREAM, "not applied"
        elif q.verdict is Verdict.PENDING and q.decision == "carried":
            _fix_depends_on(st, j)
            run.append(j)
        elif q.verdict not in DROPPED:
            break
        j += 1
    if not run:
        return False
    ctx.say(f"applying {len(run)} patch{'es' if len(run) > 1 else ''} ({steps[run[0]].name} .. "
            f"{steps[run[-1]].name})")
    commits = am_without_worktree(st.plan.repo, st.head, [st.patch_copy(steps[k].name) for k in run])
    crashpoint("rebase:patch-applied")
    for k, c in zip(run, commits):
        p = steps[k]
        p.verdict, p.how, p.commit = Verdict.CARRIED, "applied", c
        st.head = c
    if not commits:
        save(st)  # nothing moved: the per-patch path decides run[0] (a stop, or a verdict) on this same call
        return False
    st.position = run[len(commits)] if len(commits) < len(run) else run[-1] + 1
    save(st)
    crashpoint("rebase:state-saved")
    return True


def apply_steps(ctx: Context, st: State) -> bool:
    """Apply from st.position on; True when every step is decided, False at a stop (st.stopped says
    which; a dry run goes on past a stop). Saves the state after every patch."""
    worktree = st.plan.worktree
    dry = st.plan.dry_run
    t0 = time.monotonic()
    moved = False  # commits were made without the worktree since it was last put at st.head
    while st.position < len(st.steps):
        i = st.position  # every pass of this loop moves st.position past i, or returns (a stop)
        p = st.steps[i]
        if p.decision == "upstream" and p.verdict is Verdict.PENDING:
            p.verdict, p.how = Verdict.UPSTREAM, "not applied"
        if p.verdict in (Verdict.UPSTREAM, Verdict.SKIPPED, Verdict.CARRIED):
            st.position = i + 1
            continue
        if _carried_run(ctx, st):
            assert st.position > i, f"rebase: a run of carried patches from {p.name} returned progress without moving"
            moved = True
            continue  # a run of carried patches applied without a worktree; st.position moved past it
        assert st.position == i, "rebase: a run of carried patches that made no progress moved the position"
        if moved and st.worktree_ready:
            reset(worktree, st.head)  # the worktree is behind the commits made without it
        _ensure_worktree(st)
        moved = False
        ctx.say(f"applying {p.name}")
        _fix_depends_on(st, i)
        how, commit, out = am_one(worktree, st.patch_copy(p.name), st.head)
        crashpoint("rebase:patch-applied")
        p.how = how
        stop = None
        if how == "conflict":
            p.verdict = Verdict.CONFLICT
            why = diagnose(worktree, parse_patch(st.patch_copy(p.name)), out)
            p.reason = f"{why}{'; signals: ' + p.reason if p.decision == 'disagree' else ''}"
            stop = Stop(StopKind.CONFLICT, applied=False)
        elif how == "no change" and p.decision != "upstream":
            p.verdict = Verdict.DISAGREE
            p.reason = f"git am: it changes nothing on the new base, but the signals say {p.decision} ({p.reason})"
            stop = Stop(StopKind.DISAGREE, applied=False)
        elif p.decision == "disagree":
            p.verdict, p.commit = Verdict.DISAGREE, commit
            stop = Stop(StopKind.DISAGREE, applied=True)
        else:
            p.verdict, p.commit = Verdict.CARRIED, commit
            if commit is not None:
                st.head = commit
        if stop is not None and dry:
            reset(worktree, st.head)  # a plan goes on past a stop
            stop = None
        if stop is not None:
            st.stopped = stop
            st.seconds["apply"] = round(st.seconds.get("apply", 0) + time.monotonic() - t0, 3)
            save(st)
            return False
        st.position = i + 1
        save(st)
        crashpoint("rebase:state-saved")
    if not dry:  # the commit formats every carried commit: one `git format-patch` for all of them, now
        format_patches(st.plan.repo, st.plan.new_base, [p.commit for p in st.steps
                                                        if p.verdict is Verdict.CARRIED and p.commit])
    st.seconds["apply"] = round(st.seconds.get("apply", 0) + time.monotonic() - t0, 3)
    return True


def resume(st: State) -> None:
    """--continue: take the user's resolution of the stop (or, after a kill, put the worktree back
    to the last recorded commit); the state is saved."""
    worktree = st.plan.worktree
    stop = st.stopped
    i = st.position
    if stop is None:
        if st.worktree_ready:
            reset(worktree, st.head)  # killed while running: back to the last recorded commit
    elif stop.kind is StopKind.CONFLICT:
        p = st.step
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
        if head is None or head == st.head or gitutil.rev_parse(worktree, "HEAD^") != st.head:
            reset(worktree, st.head)  # nothing usable was committed: apply this patch again
            p.verdict, p.how = Verdict.PENDING, ""
        else:
            p.verdict, p.how, p.commit = Verdict.CARRIED, "resolved", head
            st.head, i = head, i + 1
    else:  # disagree: the user says carry it
        p = st.step
        head = gitutil.rev_parse(worktree, "HEAD")
        if stop.applied and head and gitutil.rev_parse(worktree, "HEAD^") == st.head:
            p.verdict, p.commit, p.reason = Verdict.CARRIED, head, f"carried by the user ({p.reason})"
            st.head = head
        else:
            p.verdict = Verdict.SKIPPED
            p.reason = "nothing to carry: applying it changes nothing on the new base"
        i += 1
    st.position, st.stopped = i, None
    save(st)


def skip(st: State) -> None:
    """--skip: drop the patch the rebase stopped at (recorded in the ledger); the state is saved."""
    reset(st.plan.worktree, st.head)
    p = st.step
    p.verdict, p.how, p.commit = Verdict.SKIPPED, "not applied", None
    p.reason = f"dropped by the user (kvforge rebase --skip){'; ' + p.reason if p.reason else ''}"
    st.position += 1
    st.stopped = None
    save(st)
