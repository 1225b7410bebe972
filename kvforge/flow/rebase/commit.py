"""The rebase's one writing step: the new series directory, its ledger and the target file.

Nothing in patches/ or targets/ changes before every patch is decided. Then one transaction of the project
(kvforge.project.transaction, as every write of patches/ and targets/) checks that the files it replaces are
what the rebase read when it started (else the result is kept aside, `_keep_both`), stages the new series
directory complete (linted; the ledger patches/<t>/dropped.toml with this rebase's drops is one of its
files) and the new target file's bytes; the state then records phase "committing" with the target file's
text and the digest of the staged series, and the transaction commits (its journal is the commit point).
A kill is finished or undone by the next kvforge command that writes the project; `kvforge rebase` of that
target then sees its result written (or writes it again) and removes the state; `--abort` is refused while
the state says "committing".
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from kvforge.git import gitutil
from kvforge.project import ledger
from kvforge.project import seriesdir
from kvforge.project.transaction import Transaction, dir_digest, file_digest, open_transaction, text_digest
from kvforge.git.context import Context
from kvforge.git.engine import format_patch, format_patches
from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.flow.export import read_commit
from kvforge.project.targets import display_path
from kvforge.flow.rebase.result import RebaseResult, result_of
from kvforge.flow.rebase.targetfile import new_target_text
from kvforge.flow.rebase.state import DROPPED, Phase, State, Verdict, save
from kvforge.flow.rebase.steps import release_worktree


def commit(ctx: Context, st: State, start: float | None = None) -> RebaseResult:
    """Write the rebase's result (or see that a finished transaction wrote it, in phase "committing"); the
    state is removed."""
    start = start if start is not None else time.monotonic()
    t0 = time.monotonic()
    plan = st.plan
    dest, target_file = plan.series_dir, plan.target_file
    with open_transaction(plan.root, "rebase", ctx.say, dirs=[dest]) as tx:  # recovers a killed one first
        if not (st.phase is Phase.COMMITTING and written(st)):
            changed = changed_files(st)
            if changed:
                _keep_both(ctx, st, changed)
            if st.phase is not Phase.COMMITTING or st.target_text is None:
                st.target_text = new_target_text(plan, ctx, st)
            d = plan.digests
            running = st.phase is not Phase.COMMITTING  # committing again after an undone kill: checked above
            st.new_series_digest = stage_series(tx, st, dest, read=d.series if running else None)
            tx.stage_file(target_file, st.target_text.encode("utf-8"), read=d.target if running else None)
            if plan.old_series_dir != dest:
                tx.expect(plan.old_series_dir, d.old_series)
            if plan.old_target_file != target_file:
                tx.expect(plan.old_target_file, d.old_target)
            st.phase = Phase.COMMITTING
            save(st)  # what the next run compares the project with
            tx.commit()
    result = result_of(st, "done", start)
    result.range_diff = range_diff(st)
    result.written = [str(dest), str(target_file)]
    result.seconds["write"] = round(time.monotonic() - t0, 3)
    result.seconds["total"] = round(time.monotonic() - start, 3)
    if st.worktree_ready:
        release_worktree(plan.worktree)
    shutil.rmtree(plan.state_dir, ignore_errors=True)
    return result


def written(st: State) -> bool:
    """The project holds this rebase's result (phase "committing": a transaction wrote it before a kill)."""
    plan = st.plan
    return (st.new_series_digest is not None and st.target_text is not None
            and dir_digest(plan.series_dir) == st.new_series_digest
            and file_digest(plan.target_file) == text_digest(st.target_text))


def changed_files(st: State) -> list[Path]:
    """The project files the commit replaces that are no longer what the rebase started from (in phase
    "committing", the rebase's own new version counts as unchanged: a killed commit wrote it)."""
    plan, d = st.plan, st.plan.digests
    out = []
    ours_series = {d.series} | ({st.new_series_digest} if st.phase is Phase.COMMITTING else set())
    ours_target = {d.target} | ({text_digest(st.target_text)} if st.phase is Phase.COMMITTING
                                and st.target_text is not None else set())
    if st.phase is Phase.COMMITTING and dir_digest(plan.series_dir) == "absent":
        ours_series.add("absent")  # a killed fallback swap: the transaction's recovery puts it back
    if dir_digest(plan.series_dir) not in ours_series:
        out.append(plan.series_dir)
    if file_digest(plan.target_file) not in ours_target:
        out.append(plan.target_file)
    if plan.old_series_dir != plan.series_dir and dir_digest(plan.old_series_dir) != d.old_series:
        out.append(plan.old_series_dir)
    if plan.old_target_file != plan.target_file and file_digest(plan.old_target_file) != d.old_target:
        out.append(plan.old_target_file)
    return out


def _keep_both(ctx: Context, st: State, changed: list[Path]) -> None:
    """Someone changed the files the commit would replace since the rebase started (an export, an edit):
    write nothing there. The rebase's result goes to <cache>/rebase/kept/<target>-<component>-<time>/
    (patches/<series>/ and targets/<target>.toml, the same layout, one transaction rooted there), the state
    is removed, and the one-line error says where both are."""
    plan = st.plan
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    kept = plan.state_dir.parent / "kept" / f"{plan.state_dir.name}-{stamp}"
    kept.mkdir(parents=True, exist_ok=True)
    dest = kept / "patches" / plan.series_dir.name
    text = st.target_text if st.target_text is not None else new_target_text(plan, ctx, st)
    with open_transaction(kept, "rebase-kept", ctx.say, dirs=[dest]) as tx:
        stage_series(tx, st, dest)
        tx.stage_file(kept / "targets" / plan.target_file.name, text.encode("utf-8"))
        tx.commit()
    if st.worktree_ready:
        release_worktree(plan.worktree)
    shutil.rmtree(plan.state_dir, ignore_errors=True)
    shown = ", ".join(display_path(p) for p in changed)
    raise KvforgeError(f"{shown} changed since the rebase of {plan.target} started (an export or an edit); "
                       f"nothing was written there. Your files are as you left them; the rebase's result is in "
                       f"{kept} (compare, then copy or `kvforge export` what you keep)", EXIT_USAGE)


def stage_series(tx: Transaction, st: State, dest: Path, read: str | None = None) -> str:
    """Stage in `tx` the complete new series directory `dest` (linted): the carried commits, the series file, the
    ledger with this rebase's drops appended, and the old directory's other files; return its digest.
    `read`: dest's digest when the rebase started (the transaction refuses if it changed)."""
    plan = st.plan
    repo = plan.repo  # the worktree's commits are in its repository (it may never have been made)
    carried = [p for p in st.steps if p.verdict is Verdict.CARRIED]
    shas = gitutil.run(repo, "rev-list", "--reverse", f"{plan.new_base}..{st.head}").stdout.split()
    if len(shas) != len(carried):
        raise KvforgeError(f"the rebase's head holds {len(shas)} commits on the new base, the rebase "
                           f"carried {len(carried)} patches; nothing was written (--abort and start again)",
                           EXIT_USAGE)
    what = f"rebase of {plan.target} onto {plan.onto_ref}"
    commits = [read_commit(repo, sha, what) for sha in shas]
    names = [p.name for p in carried]
    old_dir = plan.old_series_dir
    listing = seriesdir.read_listing(old_dir)
    files = {name: c.raw for c, name in zip(commits, names)}
    files[seriesdir.SERIES_FILE] = seriesdir.listing_text(listing, names, {n: n for n in names}).encode("utf-8")
    entries = ledger.load(old_dir)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    for p in st.steps:
        if p.verdict in DROPPED:
            entries.append(ledger.Entry(file=p.name, fix_id=p.fix_id, decision=str(p.verdict), signals=p.signals,
                                        dropped_at=when, onto_version=plan.onto_version,
                                        onto_ref=plan.onto_ref, base_commit=plan.new_base, reason=p.reason))
    if entries:
        files[ledger.FILENAME] = ledger.render(entries).encode("utf-8")
    managed = set(listing.names if listing else []) | {seriesdir.SERIES_FILE, ledger.FILENAME}
    kept = sorted(q.name for q in old_dir.iterdir() if q.name not in managed) if old_dir.is_dir() else []
    return tx.stage_dir(dest, files, read=read, keep=kept, keep_from=old_dir,
                        blame={name: c.blame for c, name in zip(commits, names)})


HUNK_NUMBERS_RE = re.compile(rb"^@@ -[0-9]+(?:,[0-9]+)? \+[0-9]+(?:,[0-9]+)? @@", re.M)


def same_change(old: bytes, new: bytes) -> bool:
    """Two format-patch files that differ at most in their hunks' line numbers and the blob ids of their `index`
    lines (the change moved to a base where its files shifted): same message, author and change, so `git
    range-diff` pairs their commits as equal ("=")."""
    def normal(raw: bytes) -> bytes:
        head, sep, diff = raw.partition(b"\ndiff --git ")
        lines = [line for line in diff.split(b"\n") if not line.startswith(b"index ")]
        return head + sep + HUNK_NUMBERS_RE.sub(b"@@", b"\n".join(lines))
    return normal(old) == normal(new)


def equal_pairs(repo: Path, olds: list[str], news: list[str]) -> str | None:
    """What `git range-diff OLD NEW` prints when commit k of each side is the same change (same_change): one
    `k:  <old> = k:  <new> <subject>` line per pair, abbreviated and padded as git does; None when git's log
    does not list every commit once (the caller runs git range-diff)."""
    if len(olds) != len(news) or not olds:
        return None
    log = gitutil.run(repo, "log", "--no-walk=unsorted", "--format=%h%x00%s", *olds, *news, check=False)
    rows = [line.split("\0", 1) for line in log.stdout.splitlines()]
    if log.returncode != 0 or len(rows) != len(olds) + len(news) or any(len(r) != 2 for r in rows):
        return None
    width = len(str(1 + len(olds)))
    n = len(olds)
    return "".join(f"{k + 1:>{width}}:  {rows[k][0]} = {k + 1:>{width}}:  {rows[n + k][0]} {rows[n + k][1]}\n"
                   for k in range(n))


def range_diff(st: State) -> str:
    """`git range-diff` of the old series against the new (git needs two non-empty ranges: a side that
    is empty is shown in its format by hand). When every patch was carried and each new patch file is its old
    one with only line numbers moved (same_change), git's "=" lines are written from one `git log` instead:
    range-diff would diff every commit of both sides to say the same."""
    plan = st.plan
    repo = plan.repo
    if st.steps and all(p.verdict is Verdict.CARRIED and p.commit and p.old_commit for p in st.steps):
        news = [p.commit for p in st.steps if p.commit]
        olds = [p.old_commit for p in st.steps if p.old_commit]
        if plan.dry_run:
            format_patches(repo, plan.new_base, news)  # a real run formatted them as it applied them
        if all(same_change(st.patch_copy(p.name).read_bytes(), format_patch(repo, c))
               for p, c in zip(st.steps, news)):
            text = equal_pairs(repo, olds, news)
            if text is not None:
                return text
    sides = [(plan.old_base, plan.old_head), (plan.new_base, st.head)]
    if any(a == b for a, b in sides):
        lines = []
        for k, (a, b) in enumerate(sides):
            log = gitutil.run(repo, "log", "--reverse", "--format=%h %s", f"{a}..{b}", check=False).stdout.splitlines()
            for n, line in enumerate(log, 1):
                sha, _, subject = line.partition(" ")
                lines.append(f"{n}:  {sha} < -:  ------- {subject}" if k == 0
                             else f"-:  ------- > {n}:  {sha} {subject}")
        return "\n".join(lines) + ("\n" if lines else "")
    res = gitutil.run(repo, "range-diff", "--no-color", f"{plan.old_base}..{plan.old_head}",
                      f"{plan.new_base}..{st.head}", check=False)
    return res.stdout if res.returncode == 0 else f"(git range-diff failed: {res.stderr.strip()})"
