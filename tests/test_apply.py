"""`kvforge apply` on the real vLLM v0.20.2 base: trees the user owns, transactional, reproducible."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from click.testing import CliRunner
from helpers import git, make_patch, write_series

from kvforge.cli import main

POOL = "vllm/v1/core/block_pool.py"
UTILS = "vllm/v1/core/kv_cache_utils.py"


def kvforge(*args: str):
    return CliRunner().invoke(main, list(args))


def state(repo: Path) -> tuple[str, list[str]]:
    """What apply may not leave in the cache repository: branches, tags, and worktrees other than
    kvforge's own reused stack worktree (trees/.work/). Stack refs are kvforge's cache, keyed by digest."""
    refs = git(repo, "for-each-ref", "--format=%(refname) %(objectname)", "refs/heads", "refs/tags")
    trees = [ln for ln in git(repo, "worktree", "list", "--porcelain").splitlines()
             if ln.startswith("worktree ") and "/trees/.work/" not in ln]
    return refs, trees


def two_patches(project: Path, base) -> list[str]:
    d = project / "patches" / "t"
    _, c1 = make_patch(base.repo, base.commit, {POOL: ("class BlockPool:", "class BlockPool:  # first")},
                       "[Core] first change", "first-fix", d / "0001-first-fix.patch")
    make_patch(base.repo, c1, {UTILS: ("class FreeKVCacheBlockQueue:", "class FreeKVCacheBlockQueue:  # second")},
               "[Core] second change", "second-fix", d / "0002-second-fix.patch")
    names = ["0001-first-fix.patch", "0002-second-fix.patch"]
    write_series(project, *names)
    return names


def test_apply_creates_branch_with_one_commit_per_patch(project, base_v0202, tmp_path):
    cache, base = base_v0202
    two_patches(project, base)
    into = tmp_path / "tree"
    res = kvforge("apply", "--target", "t", "--into", str(into), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [o["status"] for o in data["patches"]] == ["applied", "applied"]
    log = git(into, "log", "--format=%s", f"{base.commit}..HEAD").splitlines()
    assert log == ["[Core] second change", "[Core] first change"]  # subjects keep their [Core] tag
    assert git(into, "rev-parse", "--abbrev-ref", "HEAD").strip() == "kvforge/t"
    assert "# second" in (into / UTILS).read_text()
    # Same series, same base: the same commit ids on every run (committer = author identity and date).
    assert data["head"] == git(into, "rev-parse", "HEAD").strip()
    res2 = kvforge("apply", "--target", "t", "--into", str(tmp_path / "other"), "--branch", "again", "--json")
    assert json.loads(res2.stdout)["head"] == data["head"]


def test_rerun_is_noop_and_differing_branch_is_refused(project, base_v0202, tmp_path):
    cache, base = base_v0202
    names = two_patches(project, base)
    into = tmp_path / "tree"
    assert kvforge("apply", "-t", "t", "--into", str(into), "--branch", "rerun").exit_code == 0
    head = git(into, "rev-parse", "HEAD").strip()
    res = kvforge("apply", "-t", "t", "--into", str(into), "--branch", "rerun")
    assert res.exit_code == 0 and "nothing to do" in res.output
    # The user adds a commit of their own; a changed series must not destroy it.
    (into / "mine.txt").write_text("mine\n")
    git(into, "add", "mine.txt")
    git(into, "commit", "-qm", "my own work")
    mine = git(into, "rev-parse", "HEAD").strip()
    (project / "patches" / "t" / names[1]).unlink()
    write_series(project, names[0])
    res = kvforge("apply", "-t", "t", "--into", str(into), "--branch", "rerun")
    assert res.exit_code == 2 and "differs from the series" in res.output and "nothing was changed" in res.output
    assert git(into, "rev-parse", "HEAD").strip() == mine != head
    # The refusal names the real path and a rename, never a deletion; following it works.
    err = res.output.strip().splitlines()[-1]
    assert f"git -C {into} branch -m rerun rerun-mine" in err and "branch -D" not in err and "<dir>" not in err
    git(into, "branch", "-m", "rerun", "rerun-mine")
    res = kvforge("apply", "-t", "t", "--into", str(into), "--branch", "rerun")
    assert res.exit_code == 0, res.output
    assert git(into, "rev-parse", "rerun-mine").strip() == mine  # the work is kept
    assert git(into, "rev-list", "--count", f"{base.commit}..rerun").strip() == "1"
    assert git(into, "rev-parse", "--abbrev-ref", "HEAD").strip() == "rerun-mine"  # checkout untouched


def test_tree_survives_deleting_the_cache(project, base_v0202, tmp_path, monkeypatch):
    """--into makes a standalone repository: no alternates, no worktree link; the cache can go."""
    cache, base = base_v0202
    two_patches(project, base)
    own_cache = tmp_path / "cache"
    shutil.copytree(cache.root / "downloads", own_cache / "downloads")
    monkeypatch.setenv("KVFORGE_CACHE", str(own_cache))
    into = tmp_path / "tree"
    assert kvforge("apply", "-t", "t", "--into", str(into)).exit_code == 0
    assert (into / ".git").is_dir() and not (into / ".git" / "objects" / "info" / "alternates").exists()
    (into / "mine.txt").write_text("mine\n")
    git(into, "add", "mine.txt")
    git(into, "commit", "-qm", "unexported work")
    shutil.rmtree(own_cache)
    assert git(into, "log", "--format=%s").splitlines()[:3] == ["unexported work", "[Core] second change",
                                                                 "[Core] first change"]
    assert git(into, "rev-parse", "kvforge/base/t").strip() == base.commit
    git(into, "fsck", "--strict")  # every object is in the tree's own repository


def test_new_into_gives_a_new_tree_after_the_first_is_deleted(project, base_v0202, tmp_path):
    cache, base = base_v0202
    two_patches(project, base)
    first, second = tmp_path / "first", tmp_path / "second"
    assert kvforge("apply", "-t", "t", "--into", str(first)).exit_code == 0
    shutil.rmtree(first)
    res = kvforge("apply", "-t", "t", "--into", str(second), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["mode"] == "created"
    assert "# second" in (second / UTILS).read_text()


def clone_of_base(base, clone: Path) -> Path:
    """A user's clone: a repository of its own whose branch main (checked out) is the base commit."""
    clone.mkdir()
    git(clone, "init", "-q")
    git(clone, "fetch", "-q", str(base.repo), f"{base.commit}:refs/heads/main")
    git(clone, "checkout", "-q", "main")
    return clone


def test_repo_dir_adds_the_branch_and_leaves_the_checkout_alone(project, base_v0202, tmp_path):
    cache, base = base_v0202
    two_patches(project, base)
    clone = clone_of_base(base, tmp_path / "clone")
    (clone / POOL).write_text("uncommitted edit\n")  # a tracked file changed
    (clone / "untracked.txt").write_text("new\n")
    git(clone, "add", "untracked.txt")  # staged
    before = (git(clone, "status", "--porcelain"), git(clone, "diff"), git(clone, "diff", "--cached"),
              git(clone, "rev-parse", "HEAD"), git(clone, "symbolic-ref", "HEAD"))
    res = kvforge("apply", "-t", "t", "--into-clone", str(clone), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["mode"] == "added"
    after = (git(clone, "status", "--porcelain"), git(clone, "diff"), git(clone, "diff", "--cached"),
             git(clone, "rev-parse", "HEAD"), git(clone, "symbolic-ref", "HEAD"))
    assert after == before
    assert (clone / POOL).read_text() == "uncommitted edit\n"
    assert git(clone, "rev-parse", "kvforge/t").strip() == data["head"]
    assert git(clone, "log", "--format=%s", "-2", "kvforge/t").splitlines() == ["[Core] second change",
                                                                              "[Core] first change"]
    # Again: a no-op. A repo-dir that is not a repository: one line, exit 2.
    assert "nothing to do" in kvforge("apply", "-t", "t", "--into-clone", str(clone)).output
    res = kvforge("apply", "-t", "t", "--into-clone", str(tmp_path))
    assert res.exit_code == 2 and "not a git repository" in res.output


def test_repo_dir_keeps_a_base_tag_the_user_moved(project, base_v0202, tmp_path):
    """kvforge/base/<t> in the user's clone pointing elsewhere than the base is the user's: refused (exit 2, one
    line, nothing changed, no deletion suggested), never silently reset. One that names the base is kept as it is."""
    cache, base = base_v0202
    two_patches(project, base)
    clone = clone_of_base(base, tmp_path / "clone")
    git(clone, "commit", "-q", "--allow-empty", "-m", "my own base")
    mine = git(clone, "rev-parse", "HEAD").strip()
    git(clone, "tag", "kvforge/base/t", mine)  # the user moved (or made) the base tag
    refs = git(clone, "for-each-ref")
    res = kvforge("apply", "-t", "t", "--into-clone", str(clone))
    assert res.exit_code == 2, res.output
    [line] = [ln for ln in res.stderr.splitlines() if ln.startswith("kvforge: error:")]
    assert "kvforge/base/t" in line and mine[:12] in line and base.commit[:12] in line and "nothing was changed" in line
    assert "tag -d" not in line and "delete" not in line and "--into" in line
    assert git(clone, "for-each-ref") == refs  # no branch added, the tag where the user put it
    # The user takes the suggestion: a copy of their tag, then theirs pointed at the base (annotated).
    git(clone, "tag", "kvforge/base/t-mine", "kvforge/base/t")
    git(clone, "tag", "-f", "-a", "-m", "the base, by hand", "kvforge/base/t", base.commit)
    tag_object = git(clone, "rev-parse", "kvforge/base/t").strip()
    res = kvforge("apply", "-t", "t", "--into-clone", str(clone), "--json")
    assert res.exit_code == 0, res.output
    assert git(clone, "rev-parse", "kvforge/base/t").strip() == tag_object  # the user's tag object, kept
    assert git(clone, "rev-parse", "kvforge/base/t-mine^{commit}").strip() == mine
    assert git(clone, "rev-parse", "kvforge/t").strip() == json.loads(res.stdout)["head"]


def test_conflicting_patch_leaves_nothing_behind(project, base_v0202, tmp_path):
    cache, base = base_v0202
    d = project / "patches" / "t"
    make_patch(base.repo, base.commit, {POOL: ("class BlockPool:", "class BlockPool:  # ok")},
               "[Core] fine", "fine-fix", d / "0001-fine-fix.patch")
    # A patch made against a different preimage: its hunk cannot apply, and 3-way cannot merge it.
    _, diverged = make_patch(base.repo, base.commit, {POOL: ("class BlockPool:", "class BlockPool:  # upstream moved on")},
                             "upstream moved on", "diverge", tmp_path / "diverge.patch")
    make_patch(base.repo, diverged, {POOL: ("class BlockPool:  # upstream moved on", "class BlockPool:  # ours")},
               "[Core] conflicting", "conflict-fix", d / "0002-conflict-fix.patch")
    write_series(project, "0001-fine-fix.patch", "0002-conflict-fix.patch")
    before = state(base.repo)
    into = tmp_path / "tree"
    res = kvforge("apply", "-t", "t", "--into", str(into))
    assert res.exit_code == 3, res.output
    line = next(ln for ln in res.output.splitlines() if ln.startswith("kvforge: error:"))
    assert line.startswith("kvforge: error: 0002-conflict-fix.patch: hunk 1 of vllm/v1/core/block_pool.py "
                           "does not apply at line 127"), line
    assert state(base.repo) == before  # no branch, no worktree, no ref
    assert not into.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["diverge.patch", "project"]  # nothing hidden
    # --keep-conflict: left at the failing patch, with conflict markers, on the branch.
    res = kvforge("apply", "-t", "t", "--into", str(into), "--keep-conflict")
    assert res.exit_code == 3, res.output
    assert "<<<<<<<" in (into / POOL).read_text()
    assert git(into, "log", "-1", "--format=%s").strip() == "[Core] fine"
    assert git(into, "rev-parse", "--abbrev-ref", "HEAD").strip() == "kvforge/t"
    git(into, "fsck", "--no-dangling")  # self-contained: the borrowed preimages were copied in


def test_patch_already_in_base_is_reported_and_skipped(project, base_v0202, tmp_path):
    cache, base = base_v0202
    d = project / "patches" / "t"
    # Reverse of the real base: the patch's result *is* the base, so the base contains it.
    _, c = make_patch(base.repo, base.commit, {POOL: ("class BlockPool:", "class BlockPool:  # tmp")},
                      "[Core] tmp", "tmp-fix", tmp_path / "tmp.patch")
    make_patch(base.repo, c, {POOL: ("class BlockPool:  # tmp", "class BlockPool:")},
               "[Core] already upstream", "upstreamed-fix", d / "0001-upstreamed-fix.patch")
    # Apply it on top of a base that already has it: make the base the patch's postimage.
    make_patch(base.repo, base.commit, {UTILS: ("class FreeKVCacheBlockQueue:", "class FreeKVCacheBlockQueue:  # 2")},
               "[Core] real", "real-fix", d / "0002-real-fix.patch")
    write_series(project, "0001-upstreamed-fix.patch", "0002-real-fix.patch")
    res = kvforge("apply", "-t", "t", "--into", str(tmp_path / "tree"), "--json")
    assert res.exit_code == 0, res.output
    outcomes = json.loads(res.stdout)["patches"]
    assert [o["status"] for o in outcomes] == ["in base", "applied"]
    assert outcomes[0]["commit"] is None


def test_lint_errors_stop_apply_before_touching_anything(project, base_v0202, tmp_path):
    cache, base = base_v0202
    d = project / "patches" / "t"
    make_patch(base.repo, base.commit, {POOL: ("class BlockPool:", "class BlockPool:  # x")},
               "[Core] x", "x-fix", d / "0001-x-fix.patch")
    text = (d / "0001-x-fix.patch").read_text().replace("Upstream-Status: Pending", "Upstream-Status: Backport")
    (d / "0001-x-fix.patch").write_text(text)
    write_series(project, "0001-x-fix.patch")
    before = state(base.repo)
    res = kvforge("apply", "-t", "t", "--into", str(tmp_path / "tree"))
    assert res.exit_code == 2
    assert "0001-x-fix.patch:" in res.output and "needs [the upstream PR or commit]" in res.output
    assert "Traceback" not in res.output
    assert state(base.repo) == before


def test_unknown_target_lists_known_ones(project):
    res = kvforge("apply", "--target", "v9")
    assert res.exit_code == 2
    assert res.output.strip().splitlines()[-1] == "kvforge: error: unknown target 'v9'; known targets: t"


def test_write_through_a_symlink_of_the_base_is_refused(tmp_path):
    """A tree whose `docs` is a link to outside: a patch writing docs/x must not be applied."""
    from kvforge.git.engine import ApplyFailure, am_series
    from kvforge.project.series import parse_patch

    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "a.txt").write_text("a\n")
    (repo / "docs").symlink_to(tmp_path)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base with a link")
    base_commit = git(repo, "rev-parse", "HEAD").strip()
    # Made in a clone where docs is a real directory, so the diff itself looks harmless.
    other = tmp_path / "other"
    other.mkdir()
    git(other, "init", "-q")
    (other / "a.txt").write_text("a\n")
    git(other, "add", "-A")
    git(other, "commit", "-qm", "base")
    (other / "docs").mkdir()
    (other / "docs" / "x").write_text("owned\n")
    git(other, "add", "-A")
    git(other, "commit", "-qm", f"[Core] write docs/x\n\nBody.\n\n{trailers_block()}")
    patch = tmp_path / "0001-x.patch"
    from kvforge.git.engine import format_patch

    patch.write_bytes(format_patch(other, "HEAD"))
    parsed = parse_patch(patch)
    assert parsed.problems == []  # the diff alone is fine: only the base shows the link
    try:
        am_series(repo, [parsed], base_commit)
    except ApplyFailure as exc:
        assert "docs is a symbolic link in the base" in str(exc)
    else:
        raise AssertionError("a write through a symlink was applied")
    assert not (tmp_path / "x").exists()


def trailers_block() -> str:
    from helpers import trailers

    return trailers("x-fix")


def test_patch_in_base_after_applied_ones_keeps_their_commits(project, base_v0202, tmp_path):
    """A patch git am stops at and that is already in the tree must not undo the patches before it."""
    cache, base = base_v0202
    d = project / "patches" / "t"
    _, c1 = make_patch(base.repo, base.commit, {POOL: ("class BlockPool:", "class BlockPool:  # first")},
                       "[Core] first", "first-fix", d / "0001-first-fix.patch")
    # Its preimage differs from the tree (so am stops) but its postimage is already there (reverse applies).
    _, moved = make_patch(base.repo, c1, {UTILS: ("class FreeKVCacheBlockQueue:", "class FreeKVCacheBlockQueue:  # x")},
                          "scratch", "scratch", tmp_path / "scratch.patch")
    upstreamed, _ = make_patch(base.repo, moved,
                               {UTILS: ("class FreeKVCacheBlockQueue:  # x", "class FreeKVCacheBlockQueue:")},
                               "[Core] upstreamed", "upstreamed-fix", d / "0002-upstreamed-fix.patch")
    # Preimage blob unknown to the base repository: no 3-way fallback, only the reverse check can tell.
    text = upstreamed.read_text()
    old_blob = re.search(r"^index ([0-9a-f]{40})\.\.", text, re.M).group(1)
    upstreamed.write_text(text.replace(old_blob, "1" * 40))
    make_patch(base.repo, c1, {UTILS: ("class KVCacheBlock:", "class KVCacheBlock:  # third")},
               "[Core] third", "third-fix", d / "0003-third-fix.patch")
    write_series(project, "0001-first-fix.patch", "0002-upstreamed-fix.patch", "0003-third-fix.patch")
    into = tmp_path / "tree"
    res = kvforge("apply", "-t", "t", "--into", str(into), "--json")
    assert res.exit_code == 0, res.output
    outcomes = json.loads(res.stdout)["patches"]
    assert [o["status"] for o in outcomes] == ["applied", "in base", "applied"]
    assert git(into, "log", "--format=%s", f"{base.commit}..HEAD").splitlines() == ["[Core] third", "[Core] first"]
    assert "# first" in (into / POOL).read_text()


CRASH_STEPS = ["stack:applied", "stack:recorded", "apply:initialized", "apply:fetched", "apply:checked-out",
               "apply:renamed"]


def run_kvforge(*args: str, crash_at: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVFORGE_CRASH_AT"}
    if crash_at:
        env["KVFORGE_CRASH_AT"] = crash_at
    return subprocess.run([sys.executable, "-m", "kvforge.cli", *args], env=env, capture_output=True, text=True)


@pytest.mark.parametrize("step", CRASH_STEPS)
def test_apply_killed_at_every_step_leaves_nothing_half_made(project, base_v0202, tmp_path, step):
    """SIGKILL at each step boundary; then: the next run succeeds, no hidden tree, no extra worktree or
    ref in the cache repository, the series files unchanged, and the tree is complete or absent."""
    cache, base = base_v0202
    two_patches(project, base)
    # Forget stacks built by earlier tests, so this run really builds one (and can be killed doing it).
    for ref in git(base.repo, "for-each-ref", "--format=%(refname)", "refs/kvforge/stacks").split():
        git(base.repo, "update-ref", "-d", ref)
    patches_before = {p.name: p.read_bytes() for p in (project / "patches" / "t").iterdir()}
    worktrees_before = state(base.repo)
    users = tmp_path / "user"
    users.mkdir()
    into = users / "tree"
    killed = run_kvforge("apply", "-t", "t", "--into", str(into), crash_at=step)
    assert killed.returncode == -9, killed.stderr
    if into.exists():  # only past the final rename: then it is complete
        assert step == "apply:renamed"
        assert git(into, "status", "--porcelain") == ""
    res = run_kvforge("apply", "-t", "t", "--into", str(into), "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["noop"] == (step == "apply:renamed")
    assert sorted(p.name for p in users.iterdir()) == ["tree"]  # no .tree.kvforge-PID left
    assert git(into, "log", "--format=%s", "-2").splitlines() == ["[Core] second change", "[Core] first change"]
    assert state(base.repo) == worktrees_before
    assert {p.name: p.read_bytes() for p in (project / "patches" / "t").iterdir()} == patches_before


def test_two_concurrent_applies_into_one_place(project, base_v0202, tmp_path):
    """Both finish cleanly: one makes the tree, the other finds it and has nothing to do."""
    cache, base = base_v0202
    two_patches(project, base)
    into = tmp_path / "tree"
    env = {k: v for k, v in os.environ.items() if k != "KVFORGE_CRASH_AT"}
    procs = [subprocess.Popen([sys.executable, "-m", "kvforge.cli", "apply", "-t", "t", "--into", str(into), "--json"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate() for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted(json.loads(o)["noop"] for o, _ in outs) == [False, True]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project", "tree"]
