"""`kvforge apply` / `export` on the real vLLM v0.20.2 base: transactional, explicit, reproducible."""

from __future__ import annotations

import json
import re
from pathlib import Path

from click.testing import CliRunner
from helpers import git, make_patch, write_series

from kvforge.cli import main

POOL = "vllm/v1/core/block_pool.py"
UTILS = "vllm/v1/core/kv_cache_utils.py"


def kvforge(*args: str):
    return CliRunner().invoke(main, list(args))


def state(repo: Path) -> tuple[str, str]:
    """Everything a user could see of the cache repository: refs and worktrees."""
    return git(repo, "for-each-ref", "--format=%(refname) %(objectname)"), git(repo, "worktree", "list", "--porcelain")


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
    assert res.exit_code == 2 and "already exists" in res.output and "nothing was changed" in res.output
    assert git(into, "rev-parse", "HEAD").strip() == mine != head


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
    assert not any(p.name.startswith(".tree.kvforge") for p in tmp_path.iterdir())
    # --keep-conflict: left at the failing patch, with conflict markers, on the branch.
    res = kvforge("apply", "-t", "t", "--into", str(into), "--keep-conflict")
    assert res.exit_code == 3
    assert "<<<<<<<" in (into / POOL).read_text()
    assert git(into, "log", "-1", "--format=%s").strip() == "[Core] fine"
    assert git(into, "rev-parse", "--abbrev-ref", "HEAD").strip() == "kvforge/t"


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


def test_reexport_is_byte_identical(project, base_v0202, tmp_path):
    cache, base = base_v0202
    names = two_patches(project, base)
    assert kvforge("apply", "-t", "t", "--into", str(tmp_path / "tree")).exit_code == 0
    out = tmp_path / "exported"
    res = kvforge("export", "-t", "t", "--out", str(out))
    assert res.exit_code == 0, res.output
    for name in names:
        assert (out / name).read_bytes() == (project / "patches" / "t" / name).read_bytes(), name
    assert (out / "series").read_text().split() == names
    # Export into the series itself: nothing is rewritten.
    res = kvforge("export", "-t", "t", "--json")
    assert [e["changed"] for e in json.loads(res.stdout)] == [False, False]


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
    from kvforge.apply import ApplyFailure, am_series
    from kvforge.bases import Base
    from kvforge.series import parse_patch

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
    from kvforge.export import format_patch

    patch.write_bytes(format_patch(other, "HEAD"))
    parsed = parse_patch(patch)
    assert parsed.problems == []  # the diff alone is fine: only the base shows the link
    base = Base("c", "git", repo, "main", base_commit, "test")
    try:
        am_series(repo, [parsed], base)
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
