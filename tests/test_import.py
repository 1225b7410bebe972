"""`kvforge import`: a team's existing series into a target, on the real vLLM 0.20.2 base (PyPI sdist).

One test per source: plain diffs (`git diff` and bare `diff -u`) with --order, a quilt series with DEP-3 and
Yocto headers, a `git format-patch` mbox, and a fork branch (--repo CLONE BASE..BRANCH). Each: import -> lint
(warnings only: the proposed fields to review) -> apply; the headers the patches had are in the written series
byte for byte. The slow lane goes on: verify, then `rebase --onto 0.21.0` (exit 0, or 3 at a real conflict).
The edits are small, real changes to vLLM 0.20.2's v1 core (comments and a docstring), made here.
"""

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

from helpers import git

from kvforge.cli import main
from kvforge.core.cache import default_cache_dir

# The user cache's (read at import, before a fixture points KVFORGE_CACHE at the test cache), as
# tests/test_verify_slow.py does: the test env is built once, the 0.21.0 sdist downloaded once.
TEST_ENVS = Path(os.environ.get("KVFORGE_TEST_ENVS") or default_cache_dir() / "envs")
USER_DOWNLOADS = default_cache_dir() / "downloads"
UTILS = "vllm/v1/core/kv_cache_utils.py"
POOL = "vllm/v1/core/block_pool.py"
EDITS = {  # name -> (path, old, new): each applies to 0.20.2 alone and after the ones before it
    "queue-note": (UTILS, "class FreeKVCacheBlockQueue:", "class FreeKVCacheBlockQueue:  # team: the free list"),
    "pool-note": (POOL, "class BlockPool:", "class BlockPool:  # team: the block pool"),
    "block-note": (UTILS, "class KVCacheBlock:", "class KVCacheBlock:  # team: one block"),
}


def kvforge(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture()
def fork(project, base_v0202, tmp_path, monkeypatch):
    """A clone of the base (the team's tree) and the project as a git repository with the carrier's identity."""
    _cache, base = base_v0202
    clone = tmp_path / "fork"
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(base.repo), str(clone)], check=True)
    git(clone, "checkout", "-q", "-b", "team", base.commit)
    git(project, "init", "-q")
    git(project, "config", "user.name", "Carrier")
    git(project, "config", "user.email", "carrier@example.com")
    monkeypatch.chdir(tmp_path)
    return clone, base


def _edit(clone: Path, name: str) -> None:
    path, old, new = EDITS[name]
    f = clone / path
    text = f.read_text()
    assert old in text, (path, old)
    f.write_text(text.replace(old, new, 1))


def _diff(clone: Path, name: str, bare: bool = False) -> bytes:
    """The edit as `git diff` (or as bare `diff -u` of a/ and b/ copies); the tree is left as it was."""
    _edit(clone, name)
    out = subprocess.run(["git", "diff"], cwd=clone, check=True, capture_output=True).stdout
    git(clone, "checkout", "-q", "--", ".")
    if bare:  # what `diff -u a/x b/x` prints: no `diff --git`, no index line
        out = b"\n".join(ln for ln in out.split(b"\n") if not ln.startswith((b"diff --git ", b"index ")))
    return out


def _commit(clone: Path, name: str, message: str) -> str:
    _edit(clone, name)
    git(clone, "commit", "-qam", message)
    return git(clone, "rev-parse", "HEAD").strip()


def _series(project: Path) -> dict[str, bytes]:
    d = project / "patches" / "t"
    return {n: (d / n).read_bytes() for n in (d / "series").read_text().split()}


def _lint_apply(project: Path, tmp_path: Path, n: int) -> str:
    """lint: exit 0 with one warning per unreviewed patch; --strict exit 1; status counts; apply exit 0."""
    res = kvforge("lint")
    assert res.exit_code == 0, res.output
    assert res.stderr.count("unreviewed:") == n and "warning" in res.stderr
    assert kvforge("lint", "--strict").exit_code == 1
    st = kvforge("status", "--json")
    assert st.exit_code == 0 and json.loads(st.stdout)["reviewed"]["t/vllm"] == {"reviewed": 0, "patches": n}
    res = kvforge("apply", "-t", "t", "--into", str(tmp_path / "tree"), "--json")
    assert res.exit_code == 0, res.output
    return res.stdout


def _written(res) -> dict:
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["written"] is True
    return data


# ---------------------------------------------------------------- the four sources


def test_plain_diffs_in_the_order_file(project, fork, tmp_path):
    clone, _base = fork
    src = tmp_path / "team-patches"
    src.mkdir()
    (src / "a-pool-note.diff").write_bytes(_diff(clone, "pool-note", bare=True))
    (src / "b-queue-note.diff").write_bytes(_diff(clone, "queue-note"))
    order = tmp_path / "order.txt"
    order.write_text("b-queue-note.diff\na-pool-note.diff\n")
    dry = kvforge("import", "-t", "t", str(src), "--order", str(order), "--dry-run", "--json")
    assert dry.exit_code == 0 and json.loads(dry.stdout)["written"] is False, dry.output
    assert (project / "patches" / "t" / "series").read_text() == ""
    data = _written(kvforge("import", "-t", "t", str(src), "--order", str(order), "--json"))
    assert [p["fix_id"] for p in data["patches"]] == ["b-queue-note", "a-pool-note"]
    files = _series(project)
    assert list(files) == ["0001-b-queue-note.patch", "0002-a-pool-note.patch"]
    first = files["0001-b-queue-note.patch"].decode()
    assert "Drop-When: never [no upstream commit or PR known for it]\n" in first
    assert "From: Carrier <carrier@example.com>" in first and "Upstream-Status: Pending\n" in first
    assert "Review: Fix-Id Kind Upstream-Status Why Drop-When Signed-off-by\n" in first
    _lint_apply(project, tmp_path, 2)


DEP3 = """\
Description: Name the free list
 The team reads this class first; the comment says what it is.
Author: Jane Doe <jane@example.com>
Origin: vendor
Bug: 1234
Forwarded: not-needed
Last-Update: 2026-10-01
---
"""
YOCTO = """\
Name the block pool

The pool is where blocks come from; say so.

Upstream-Status: Inappropriate [team-specific comment]
Signed-off-by: Joe Builder <joe@example.com>
---
"""


def test_quilt_series_with_dep3_and_yocto_headers(project, fork, tmp_path):
    clone, _base = fork
    src = tmp_path / "debian-patches"
    src.mkdir()
    quilt = re.sub(r"^diff --git a/(\S+) b/\S+\nindex .*\n", r"Index: vllm/\1\n" + "=" * 67 + "\n",
                   _diff(clone, "queue-note").decode(), flags=re.M)
    quilt = quilt.replace("--- a/", "--- vllm.orig/").replace("+++ b/", "+++ vllm/")  # quilt's own names
    (src / "name-free-list.patch").write_text(DEP3 + quilt)
    (src / "0002-block-pool.patch").write_text(YOCTO + _diff(clone, "pool-note").decode())
    (src / "series").write_text("# team series\nname-free-list.patch -p1\n0002-block-pool.patch\n")
    data = _written(kvforge("import", "-t", "t", str(src), "--json"))
    assert [p["fix_id"] for p in data["patches"]] == ["name-free-list", "block-pool"]
    files = list(_series(project).values())
    one, two = (f.decode() for f in files)
    assert DEP3.removesuffix("---\n") in one  # the DEP-3 header, byte for byte
    assert "Subject: [PATCH] Name the free list\n" in one and "From: Jane Doe <jane@example.com>" in one
    assert "Why: The team reads this class first; the comment says what it is.\n" in one
    assert "From: Joe Builder <joe@example.com>" in two  # Yocto: the first sign-off is the author's
    assert "Subject: [PATCH] Name the block pool\n\nThe pool is where blocks come from; say so.\n\n" in two
    assert "Upstream-Status: Inappropriate [team-specific comment]\nSigned-off-by: Joe Builder <joe@example.com>\n" \
        in two  # the Yocto trailers, kept where they were, kvforge's added after them
    assert "Review: Fix-Id Kind Why Drop-When\n" in two
    _lint_apply(project, tmp_path, 2)


def test_format_patch_mbox(project, fork, tmp_path):
    clone, base = fork
    _commit(clone, "queue-note", "[Core] Name the free list\n\nA comment for readers.\n\n"
                                 "Upstream-PR: https://github.com/vllm-project/vllm/pull/40001\n"
                                 "Signed-off-by: kvforge <kvforge@users.noreply.github.com>")
    _commit(clone, "pool-note", "[Core] Name the pool\n\nFix-Id: pool-named\nKind: refactor\n"
                                "Signed-off-by: kvforge <kvforge@users.noreply.github.com>")
    mbox = tmp_path / "team.mbox"
    mbox.write_bytes(subprocess.run(["git", "format-patch", "--stdout", f"{base.commit}..team"], cwd=clone,
                                    check=True, capture_output=True).stdout)
    data = _written(kvforge("import", "-t", "t", str(mbox), "--json"))
    assert [p["fix_id"] for p in data["patches"]] == ["name-the-free-list", "pool-named"]
    one, two = (f.decode() for f in _series(project).values())
    assert ("A comment for readers.\n\nUpstream-PR: https://github.com/vllm-project/vllm/pull/40001\n"
            "Signed-off-by: kvforge <kvforge@users.noreply.github.com>\nFix-Id: name-the-free-list\n") in one
    assert "Upstream-Status: Submitted [https://github.com/vllm-project/vllm/pull/40001]\n" in one
    assert "Drop-When: upstream-pr-merged https://github.com/vllm-project/vllm/pull/40001\n" in one
    assert "Fix-Id: pool-named\nKind: refactor\nSigned-off-by: kvforge <kvforge@users.noreply.github.com>\n" in two
    assert "Review: Upstream-Status Why Drop-When\n" in two
    _lint_apply(project, tmp_path, 2)


def test_fork_branch(project, fork, tmp_path):
    clone, base = fork
    _commit(clone, "queue-note", "Name the free list\n\nSigned-off-by: kvforge <kvforge@users.noreply.github.com>")
    _commit(clone, "block-note", "Name the block\n\nBackport of https://github.com/vllm-project/vllm/commit/"
                                 "0123456789abcdef0123456789abcdef01234567\n\n"
                                 "Signed-off-by: kvforge <kvforge@users.noreply.github.com>")
    data = _written(kvforge("import", "-t", "t", "--repo", str(clone), f"{base.commit}..team", "--json"))
    assert [p["fix_id"] for p in data["patches"]] == ["name-the-free-list", "name-the-block"]
    two = list(_series(project).values())[1].decode()
    assert "Upstream-Status: Backport [https://github.com/vllm-project/vllm/commit/0123456789abcdef" in two
    assert "Drop-When: base-contains 0123456789ab\n" in two and "Upstream-Commit: 0123456789ab\n" in two
    _lint_apply(project, tmp_path, 2)
    # A second import stacks on the series the target has: Fix-Ids stay unique.
    again = kvforge("import", "-t", "t", "--repo", str(clone), f"{base.commit}..team", "--dry-run", "--json")
    assert again.exit_code == 3 or again.exit_code == 0, again.output


def test_a_patch_that_does_not_apply_names_file_hunk_and_line_and_writes_nothing(project, fork, tmp_path):
    clone, _base = fork
    src = tmp_path / "p"
    src.mkdir()
    (src / "0001-ok.diff").write_bytes(_diff(clone, "pool-note"))
    stale = _diff(clone, "queue-note", bare=True)  # no index line: no 3-way fallback either
    lines = stale.split(b"\n")
    k = next(i for i, ln in enumerate(lines) if ln.startswith(b"@@")) + 1
    lines[k] = b" # a line 0.20.2 does not have"  # the hunk's first context line
    (src / "0002-stale.diff").write_bytes(b"\n".join(lines))
    before = (project / "patches" / "t" / "series").read_bytes()
    res = kvforge("import", "-t", "t", str(src))
    assert res.exit_code == 3, res.output
    assert "0002-stale.diff: hunk 1 of vllm/v1/core/kv_cache_utils.py does not apply at line" in res.stderr
    assert "nothing was written" in res.stderr
    assert (project / "patches" / "t" / "series").read_bytes() == before
    assert sorted(p.name for p in (project / "patches" / "t").iterdir()) == ["series"]


def test_bad_sources_are_one_line(project, fork, tmp_path):
    assert kvforge("import", "-t", "t").exit_code == 2
    res = kvforge("import", "-t", "t", str(tmp_path / "missing"))
    assert res.exit_code == 2 and "no such file or directory" in res.stderr
    (tmp_path / "empty").mkdir()
    res = kvforge("import", "-t", "t", str(tmp_path / "empty"))
    assert res.exit_code == 2 and "no patch files" in res.stderr
    res = kvforge("import", "-t", "t", "--repo", str(tmp_path), "a..b")
    assert res.exit_code == 2 and "not a git repository" in res.stderr


# ---------------------------------------------------------------- slow: verify, and rebase onto the next release


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["plain", "quilt", "mbox", "branch"])
def test_imported_series_verifies_and_rebases_onto_0210(kind, project, fork, tmp_path, base_v0202, monkeypatch):
    clone, base = fork
    cache, _ = base_v0202
    TEST_ENVS.mkdir(parents=True, exist_ok=True)
    if not (cache.root / "envs").exists():
        (cache.root / "envs").symlink_to(TEST_ENVS, target_is_directory=True)
    user = USER_DOWNLOADS / "vllm-0.21.0.tar.gz"
    if user.is_file() and not (cache.downloads / user.name).exists():
        shutil.copy2(user, cache.downloads / user.name)
    monkeypatch.delenv("KVFORGE_TEST_PYTHON", raising=False)
    src = tmp_path / "src"
    src.mkdir()
    if kind in ("plain", "quilt"):
        (src / "0001-queue-note.patch").write_bytes((DEP3.encode() if kind == "quilt" else b"")
                                                   + _diff(clone, "queue-note"))
        (src / "0002-pool-note.patch").write_bytes((YOCTO.encode() if kind == "quilt" else b"")
                                                   + _diff(clone, "pool-note", bare=kind == "plain"))
        args = [str(src)]
    else:
        _commit(clone, "queue-note", "Name the free list\n\nSigned-off-by: kvforge <kvforge@users.noreply.github.com>")
        _commit(clone, "pool-note", "Name the pool\n\nSigned-off-by: kvforge <kvforge@users.noreply.github.com>")
        if kind == "branch":
            args = ["--repo", str(clone), f"{base.commit}..team"]
        else:
            mbox = tmp_path / "team.mbox"
            mbox.write_bytes(subprocess.run(["git", "format-patch", "--stdout", f"{base.commit}..team"], cwd=clone,
                                            check=True, capture_output=True).stdout)
            args = [str(mbox)]
    _written(kvforge("import", "-t", "t", *args, "--json"))
    _lint_apply(project, tmp_path, 2)
    res = kvforge("verify", "-t", "t", "--json")
    assert res.exit_code == 0, res.output
    assert {p["status"] for p in json.loads(res.stdout)["patches"]} == {"pass-to-pass"}
    env = {k: v for k, v in os.environ.items() if k != "KVFORGE_OFFLINE"}
    r = subprocess.run([sys.executable, "-c", "from kvforge.cli import main; main()", "rebase", "-t", "t",
                        "--onto", "0.21.0", "--json"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode in (0, 3), r.stderr
    print(f"{kind}: rebase --onto 0.21.0 exit {r.returncode}: {json.loads(r.stdout).get('state')}")
    if r.returncode == 0:
        assert kvforge("lint").exit_code == 0
