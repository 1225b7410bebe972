"""History first (--source git): whether a release has a fix, read from a git clone of upstream."""

from __future__ import annotations

from pathlib import Path

from kvforge.git import gitutil
from kvforge.project.series import Patch

def by_history(clone: Path, tag: str, old_ref: str | None, patch: Patch) -> str | None:
    """Why the release `tag` has the fix by a git clone of upstream's history, or None (no answer: not evidence
    that it lacks it): every recorded Upstream-Commit is an ancestor of the tag, or a commit since `old_ref` (the
    old base) has the patch's `git patch-id --stable`. Reads the clone only."""
    if gitutil.run(clone, "rev-parse", "--verify", "--quiet", f"{tag}^{{commit}}", check=False).returncode != 0:
        return None
    commits = patch.values("Upstream-Commit")
    if commits and all(gitutil.run(clone, "merge-base", "--is-ancestor", c, tag, check=False).returncode == 0
                       for c in commits):
        verb = "is an ancestor" if len(commits) == 1 else "are ancestors"
        return f"Upstream-Commit {', '.join(commits)} {verb} of {tag}"
    old_ref = next((r for r in (old_ref, f"origin/{old_ref}") if old_ref and gitutil.run(
        clone, "rev-parse", "--verify", "--quiet", f"{r}^{{commit}}", check=False).returncode == 0), None)
    if old_ref is None:
        return None
    mine = gitutil.run(clone, "patch-id", "--stable", stdin=patch.raw.decode("utf-8", "replace"), check=False)
    want = mine.stdout.split()[0] if mine.stdout.split() else None
    if not want:
        return None
    log = gitutil.run(clone, "log", "-p", "--no-merges", "--format=commit %H", f"{old_ref}..{tag}", check=False)
    ids = gitutil.run(clone, "patch-id", "--stable", stdin=log.stdout, check=False)
    for line in ids.stdout.splitlines():
        pid, _, commit = line.partition(" ")
        if pid == want:
            return f"commit {commit[:12]} since {old_ref} has the patch's git patch-id --stable"
    return None
