"""`kvforge export` on the real vLLM v0.20.2 base: stable bytes, kept names, all or nothing, crash-safe.

Trees are standalone git repositories (git init) holding the base and commits on branch kvforge/t, as
`kvforge apply --into` makes them. So that a test does not copy 34 MB, most of them borrow the cache
repository's objects (objects/info/alternates) and make commits without a checkout; the round-trip
tests check a tree out and apply patches back with the same `git am` options `kvforge apply` uses.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import git, trailers

from kvforge.cli import main
from kvforge.git.engine import format_patch
from kvforge.project.series import read_series
from kvforge.project.seriesdir import Listing, exchange, listing_text, read_listing, recover
from kvforge.project.transaction import CRASH_STEPS

REPO_ROOT = Path(__file__).resolve().parent.parent
POOL = "vllm/v1/core/block_pool.py"
UTILS = "vllm/v1/core/kv_cache_utils.py"
MANAGER = "vllm/v1/core/kv_cache_manager.py"
AM = ("am", "-3", "--keep-non-patch", "--committer-date-is-author-date")


def kvforge(*args: str):
    return CliRunner().invoke(main, list(args))


# ---------------------------------------------------------------- trees and commits


def new_tree(path: Path, base, checkout: bool = False) -> Path:
    """A standalone repository with the base tagged kvforge/base/t (objects borrowed from the cache)."""
    git(path.parent, "init", "-q", str(path))
    (path / ".git" / "objects" / "info" / "alternates").write_text(str(base.repo / "objects") + "\n")
    git(path, "update-ref", "refs/tags/kvforge/base/t", base.commit)
    if checkout:
        git(path, "-c", "advice.detachedHead=false", "checkout", "-q", "-b", "kvforge/t", base.commit)
    return path


def commit(repo: Path, parent: str, subject: str, fix_id: str | None, edit: dict | None = None,
           write: dict | None = None, rename: dict | None = None, message: str | None = None) -> str:
    """A commit on `parent` made without a checkout: edit {path: (old, new)}, write {path: text},
    rename {old: new} (content kept, then `edit` applies to the new name)."""
    index = repo / ".git" / "kvforge-test-index"
    env = {"GIT_INDEX_FILE": str(index)}
    try:
        git(repo, "read-tree", parent, env=env)
        for old, new in (rename or {}).items():
            mode_blob = git(repo, "ls-files", "-s", "--", old, env=env).split()
            git(repo, "update-index", "--force-remove", "--", old, env=env)
            git(repo, "update-index", "--add", "--cacheinfo", f"{mode_blob[0]},{mode_blob[1]},{new}", env=env)
        files = dict(write or {})
        for rel, (old, new) in (edit or {}).items():
            text = git(repo, "show", f"{parent}:{rel}") if rel not in (rename or {}).values() else \
                git(repo, "cat-file", "blob", git(repo, "ls-files", "-s", "--", rel, env=env).split()[1])
            assert old in text, f"{old!r} not in {rel}"
            files[rel] = text.replace(old, new, 1)
        for rel, text in files.items():
            blob = subprocess.run(["git", "hash-object", "-w", "--stdin"], cwd=repo, check=True, capture_output=True,
                                  input=text.encode()).stdout.decode().strip()
            git(repo, "update-index", "--add", "--cacheinfo", f"100644,{blob},{rel}", env=env)
        tree = git(repo, "write-tree", env=env).strip()
        if message is None:
            message = f"{subject}\n\nBody.\n\n{trailers(fix_id)}" if fix_id else f"{subject}\n\nNo header block.\n"
        return git(repo, "commit-tree", tree, "-p", parent, "-m", message).strip()
    finally:
        index.unlink(missing_ok=True)


def set_branch(repo: Path, head: str) -> None:
    git(repo, "update-ref", "refs/heads/kvforge/t", head)
    git(repo, "symbolic-ref", "HEAD", "refs/heads/kvforge/t")


def first_two(tree: Path, base) -> tuple[str, str]:
    c1 = commit(tree, base.commit, "[Core] first change", "first-fix",
                edit={POOL: ("class BlockPool:", "class BlockPool:  # first")})
    c2 = commit(tree, c1, "[Core] second change", "second-fix",
                edit={UTILS: ("class FreeKVCacheBlockQueue:", "class FreeKVCacheBlockQueue:  # second")})
    return c1, c2


def old_series(project: Path, tree: Path, commits: dict[str, str], header: str = "") -> Path:
    """patches/t holding these commits as files (name -> commit), a series file and a README."""
    d = project / "patches" / "t"
    for name, c in commits.items():
        (d / name).write_bytes(format_patch(tree, c))
    (d / "series").write_text(header + "".join(f"{n}\n" for n in commits))
    (d / "README.md").write_text("Notes on this series.\n")
    return d


def snapshot(d: Path) -> dict[str, tuple[bytes, int]] | None:
    """Every file under d: bytes and mode (None when d does not exist)."""
    if not d.exists():
        return None
    out = {}
    for p in sorted(d.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(d))] = (p.read_bytes(), p.stat().st_mode)
    out["."] = (b"", d.stat().st_mode)
    return out


def leftovers(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d.parent) if n.startswith(f".{d.name}.kvforge"))


def export(*args: str):
    res = kvforge("export", "-t", "t", *args, "--json")
    return res, (json.loads(res.stdout) if res.exit_code == 0 else None)


def statuses(data) -> list[tuple[str, str]]:
    return [(f["name"], f["status"]) for f in data["files"]]


# ---------------------------------------------------------------- bytes


def test_reexport_is_byte_identical(project, base_v0202, tmp_path):
    """Patch files -> git am (as apply does) -> export: the same bytes, and re-exporting writes nothing."""
    cache, base = base_v0202
    src = new_tree(tmp_path / "src", base)
    c1, c2 = first_two(src, base)
    d = old_series(project, src, {"0001-first-fix.patch": c1, "0002-second-fix.patch": c2})
    tree = new_tree(tmp_path / "tree", base, checkout=True)
    git(tree, *AM, str(d / "0001-first-fix.patch"), str(d / "0002-second-fix.patch"))
    out = tmp_path / "exported"
    res, data = export("--from", str(tree), "--out", str(out))
    assert res.exit_code == 0, res.output
    for name in ("0001-first-fix.patch", "0002-second-fix.patch"):
        assert (out / name).read_bytes() == (d / name).read_bytes(), name
    assert (out / "series").read_text().split() == ["0001-first-fix.patch", "0002-second-fix.patch"]
    assert statuses(data) == [("0001-first-fix.patch", "unchanged"), ("0002-second-fix.patch", "unchanged")]
    # Into the series itself: nothing is written, not even an mtime.
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in d.iterdir()}
    res, data = export("--from", str(tree))
    assert res.exit_code == 0, res.output
    assert data["written"] is False and {f["status"] for f in data["files"]} == {"unchanged"}
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in d.iterdir()} == before
    assert "nothing written" in kvforge("export", "-t", "t", "--from", str(tree)).output


def test_real_series_reexports_byte_identically(project, base_v0202, tmp_path):
    """The project's own v0.20.2rc series (made by the older exporter): git am, export, same bytes."""
    cache, base = base_v0202
    real = REPO_ROOT / "patches" / "v0.20.2rc"
    d = project / "patches" / "t"
    shutil.copy2(real / "series", d / "series")
    names = [n for n in (real / "series").read_text().split() if not n.startswith("#")]
    for n in names:
        shutil.copy2(real / n, d / n)
    tree = new_tree(tmp_path / "tree", base, checkout=True)
    git(tree, *AM, *(str(d / n) for n in names))
    res, data = export("--from", str(tree), "--out", str(tmp_path / "out"))
    assert res.exit_code == 0, res.output
    for n in names:
        assert (tmp_path / "out" / n).read_bytes() == (real / n).read_bytes(), n
    assert (tmp_path / "out" / "series").read_bytes() == (real / "series").read_bytes()
    res, data = export("--from", str(tree))
    assert res.exit_code == 0, res.output
    assert data["written"] is False and [f["status"] for f in data["files"]] == ["unchanged"] * len(names)


def test_user_git_config_does_not_change_the_bytes(project, base_v0202, tmp_path, monkeypatch):
    """Settings people have (noprefix, subject prefix, sign-off, notes, python funcname attributes)."""
    cache, base = base_v0202
    tree = new_tree(tmp_path / "tree", base)
    c1 = commit(tree, base.commit, "[Core] in a method", "method-fix",
                edit={POOL: ("        self.num_gpu_blocks = num_gpu_blocks",
                             "        self.num_gpu_blocks = int(num_gpu_blocks)")})
    set_branch(tree, c1)
    d = old_series(project, tree, {"0001-method-fix.patch": c1})
    conf = tmp_path / "gitconfig"
    conf.write_text("[format]\n\tsubjectPrefix = MINE\n\tnumbered = true\n\tsignOff = true\n\tnotes = true\n"
                    "\theaders = \"X-Mine: 1\\n\"\n\tthread = shallow\n\tto = a@example.com\n"
                    "[diff]\n\tnoprefix = true\n\tmnemonicPrefix = true\n\tcontext = 1\n\tinterHunkContext = 9\n"
                    "\tsuppressBlankEmpty = true\n\tindentHeuristic = false\n\trenames = copies\n"
                    f"[core]\n\tattributesFile = {tmp_path / 'attributes'}\n")
    (tmp_path / "attributes").write_text("*.py diff=python\n")
    git(tree, "notes", "add", "-m", "a note", c1)
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(conf))
    res, data = export("--from", str(tree))
    assert res.exit_code == 0, res.output
    assert data["written"] is False, (d / "0001-method-fix.patch").read_text()[:400]


# ---------------------------------------------------------------- all or nothing


def test_commit_without_fix_id_changes_no_file(project, base_v0202, tmp_path):
    cache, base = base_v0202
    tree = new_tree(tmp_path / "tree", base)
    c1, c2 = first_two(tree, base)
    d = old_series(project, tree, {"0001-first-fix.patch": c1, "0002-second-fix.patch": c2}, "# header\n")
    # The first commit changed (it would be rewritten), then a commit with no header block.
    n1 = commit(tree, base.commit, "[Core] first change, v2", "first-fix",
                edit={POOL: ("class BlockPool:", "class BlockPool:  # first, v2")})
    n2 = commit(tree, n1, "[Core] forgot the header", None, edit={UTILS: ("import ", "import  ")})
    set_branch(tree, n2)
    before = snapshot(d)
    res = kvforge("export", "-t", "t", "--from", str(tree))
    assert res.exit_code == 2, res.output
    err = res.output.strip().splitlines()
    assert len(err) == 1 and f"commit {n2[:12]} ([Core] forgot the header)" in err[0]
    assert "no 'Fix-Id:' trailer" in err[0] and "Traceback" not in res.output
    assert snapshot(d) == before and leftovers(d) == []


def test_what_is_written_is_linted(project, base_v0202, tmp_path):
    """A commit whose header block breaks lint (Kind fix without Checks) is refused; nothing is written."""
    cache, base = base_v0202
    tree = new_tree(tmp_path / "tree", base)
    c1, c2 = first_two(tree, base)
    d = old_series(project, tree, {"0001-first-fix.patch": c1, "0002-second-fix.patch": c2})
    msg = f"[Core] a fix with no proof\n\nBody.\n\n{trailers('third-fix', kind='fix')}"
    c3 = commit(tree, c2, "", None, edit={POOL: ("import ", "import  ")}, message=msg)
    set_branch(tree, c3)
    before = snapshot(d)
    res = kvforge("export", "-t", "t", "--from", str(tree))
    assert res.exit_code == 2, res.output
    err = res.output.strip().splitlines()[-1]
    assert "export refused, nothing written" in err and "0003-third-fix.patch" in err
    assert "Kind fix needs at least one 'Checks:'" in err and f"commit {c3[:12]}" in err
    assert snapshot(d) == before and leftovers(d) == []
    # Same for a new --out directory: it is not even created.
    out = tmp_path / "deep" / "new"
    assert kvforge("export", "-t", "t", "--from", str(tree), "--out", str(out)).exit_code == 2
    assert not (tmp_path / "deep").exists()


@pytest.mark.parametrize("case", ["duplicate-fix-id", "no-commits", "merge", "not-a-series-dir", "stray-patch"])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(project, base_v0202, tmp_path, case):
    cache, base = base_v0202
    tree = new_tree(tmp_path / "tree", base)
    c1, c2 = first_two(tree, base)
    d = old_series(project, tree, {"0001-first-fix.patch": c1, "0002-second-fix.patch": c2})
    args = ["--from", str(tree)]
    head = commit(tree, c2, "[Core] second again", "second-fix", edit={POOL: ("import ", "import  ")})
    expect = "both have Fix-Id 'second-fix'"
    if case == "no-commits":
        head, expect = base.commit, "no commits on top of the base"
    elif case == "merge":
        side = commit(tree, base.commit, "[Core] side", "side-fix", edit={UTILS: ("import ", "import  ")})
        tree_id = git(tree, "rev-parse", f"{side}^{{tree}}").strip()
        head = git(tree, "commit-tree", tree_id, "-p", c2, "-p", side, "-m", "merge").strip()
        expect = "is a merge commit"
    elif case == "not-a-series-dir":
        head = c2
        (tmp_path / "stuff").mkdir()
        (tmp_path / "stuff" / "mine.txt").write_text("mine\n")
        args += ["--out", str(tmp_path / "stuff")]
        expect = "has no `series` file"
    elif case == "stray-patch":  # a patch file of the user's, not in the series: kept, so lint refuses
        head = commit(tree, c2, "[Core] third change", "third-fix", edit={POOL: ("import ", "import  ")})
        (d / "wip.patch").write_text("work in progress\n")
        expect = "wip.patch: patch file is not listed in the series file"
    set_branch(tree, head)
    before, stuff = snapshot(d), snapshot(tmp_path / "stuff")
    res = kvforge("export", "-t", "t", *args)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0], res.output
    assert snapshot(d) == before and snapshot(tmp_path / "stuff") == stuff and leftovers(d) == []


# ---------------------------------------------------------------- names, series file, --out


def renamed_and_reordered(project: Path, base, tmp_path: Path):
    """Old series: a user-named file, a comment, a README. New tree: first rewritten, second dropped,
    third new, fourth (a fix the series had) unchanged."""
    tree = new_tree(tmp_path / "tree", base)
    c1, c2 = first_two(tree, base)
    fourth = {MANAGER: ("import itertools", "import itertools  # 4")}
    c4 = commit(tree, c2, "[Core] fourth change", "fourth-fix", edit=fourth)
    d = old_series(project, tree, {"0001-my-name-for-first.patch": c1, "0002-second-fix.patch": c2,
                                   "0004-fourth-fix.patch": c4})
    (d / "series").write_text("# v0.20.2 series: keep this header\n\n0001-my-name-for-first.patch  # reviewed\n"
                              "# second is going away\n0002-second-fix.patch\n# about fourth\n"
                              "0004-fourth-fix.patch\n# end\n")
    n1 = commit(tree, base.commit, "[Core] first change, v2", "first-fix",
                edit={POOL: ("class BlockPool:", "class BlockPool:  # first, v2")})
    n3 = commit(tree, n1, "[Core] third change", "third-fix", edit={UTILS: ("import ", "import  ")})
    # c4 on top of n3: a file no other commit touches, so the same patch bytes.
    n4 = commit(tree, n3, "[Core] fourth change", "fourth-fix", edit=fourth)
    set_branch(tree, n4)
    return tree, d


def test_user_file_names_are_kept_and_new_ones_numbered_after_them(project, base_v0202, tmp_path):
    cache, base = base_v0202
    tree, d = renamed_and_reordered(project, base, tmp_path)
    os.chmod(d, 0o750)
    fourth = (d / "0004-fourth-fix.patch").stat().st_ino
    res, data = export("--from", str(tree))
    assert res.exit_code == 0, res.output
    assert statuses(data) == [("0001-my-name-for-first.patch", "rewritten"), ("0005-third-fix.patch", "new"),
                              ("0004-fourth-fix.patch", "unchanged"), ("0002-second-fix.patch", "removed")]
    assert (d / "series").read_text() == ("# v0.20.2 series: keep this header\n\n"
                                          "0001-my-name-for-first.patch  # reviewed\n0005-third-fix.patch\n"
                                          "# second is going away\n# about fourth\n0004-fourth-fix.patch\n# end\n")
    assert sorted(p.name for p in d.iterdir()) == ["0001-my-name-for-first.patch", "0004-fourth-fix.patch",
                                                   "0005-third-fix.patch", "README.md", "series"]
    assert (d / "README.md").read_text() == "Notes on this series.\n"
    assert "# first, v2" in (d / "0001-my-name-for-first.patch").read_text()
    assert (d / "0004-fourth-fix.patch").stat().st_ino == fourth  # unchanged: the very same file
    assert d.stat().st_mode & 0o777 == 0o750
    assert read_series(d).all_problems() == [] and leftovers(d) == []
    summary = kvforge("export", "-t", "t", "--from", str(tree)).output.strip().splitlines()[-1]
    assert summary.endswith("3 patches, 3 unchanged (nothing written: the series already says this)")


def test_renumber_names_every_file_by_position(project, base_v0202, tmp_path):
    cache, base = base_v0202
    tree, d = renamed_and_reordered(project, base, tmp_path)
    res = kvforge("export", "-t", "t", "--from", str(tree), "--renumber")
    assert res.exit_code == 0, res.output
    res, data = export("--from", str(tree), "--renumber")  # again: now nothing to do
    assert data["written"] is False
    assert sorted(p.name for p in d.iterdir()) == ["0001-first-fix.patch", "0002-third-fix.patch",
                                                   "0003-fourth-fix.patch", "README.md", "series"]
    assert (d / "series").read_text() == ("# v0.20.2 series: keep this header\n\n0001-first-fix.patch  # reviewed\n"
                                          "0002-third-fix.patch\n# second is going away\n# about fourth\n"
                                          "0003-fourth-fix.patch\n# end\n")
    assert read_series(d).all_problems() == []


def test_renumber_reports_renames(project, base_v0202, tmp_path):
    cache, base = base_v0202
    tree, d = renamed_and_reordered(project, base, tmp_path)
    res, data = export("--from", str(tree), "--renumber")
    assert res.exit_code == 0, res.output
    assert [(f["name"], f["status"], f["old_name"]) for f in data["files"]] == [
        ("0001-first-fix.patch", "rewritten", "0001-my-name-for-first.patch"),
        ("0002-third-fix.patch", "new", None),
        ("0003-fourth-fix.patch", "rewritten", "0004-fourth-fix.patch"),
        ("0002-second-fix.patch", "removed", None)]
    assert data["summary"].endswith("patches/t: 3 patches, 2 rewritten, 1 new, 1 removed")


def test_out_new_dir_is_a_complete_series(project, base_v0202, tmp_path):
    cache, base = base_v0202
    tree, d = renamed_and_reordered(project, base, tmp_path)
    before = snapshot(d)
    out = tmp_path / "a" / "b" / "series-copy"
    res, data = export("--from", str(tree), "--out", str(out))
    assert res.exit_code == 0, res.output
    assert snapshot(d) == before  # the target's series is only read
    # Names and comments come from the target's series; statuses are against it.
    assert (out / "series").read_text().startswith("# v0.20.2 series: keep this header\n")
    assert sorted(p.name for p in out.iterdir()) == ["0001-my-name-for-first.patch", "0004-fourth-fix.patch",
                                                     "0005-third-fix.patch", "series"]
    assert data["compared_with"] == str(d) and data["series_file"] == "new"
    assert read_series(out).all_problems() == [] and leftovers(out) == []


# ---------------------------------------------------------------- renames, non-ASCII paths: round trips


def round_trip(tree: Path, base, head: str, patch: Path, tmp_path: Path) -> None:
    """git am (kvforge apply's options) of the exported patch gives the commit's tree again."""
    back = new_tree(tmp_path / "back", base, checkout=True)
    git(back, *AM, str(patch))
    assert git(back, "rev-parse", "HEAD^{tree}") == git(tree, "rev-parse", f"{head}^{{tree}}")


def test_rename_round_trips_as_a_small_diff(project, base_v0202, tmp_path):
    cache, base = base_v0202
    tree = new_tree(tmp_path / "tree", base)
    moved = "vllm/v1/core/kv_cache_utils_hybrid.py"
    head = commit(tree, base.commit, "[Core] move kv_cache_utils", "move-utils", rename={UTILS: moved},
                  edit={moved: ("class FreeKVCacheBlockQueue:", "class FreeKVCacheBlockQueue:  # moved")})
    set_branch(tree, head)
    res, data = export("--from", str(tree))
    assert res.exit_code == 0, res.output
    patch = project / "patches" / "t" / "0001-move-utils.patch"
    text = patch.read_text()
    assert f"rename from {UTILS}\nrename to {moved}\n" in text and len(text.splitlines()) < 40, text
    assert read_series(patch.parent).all_problems() == []
    round_trip(tree, base, head, patch, tmp_path)


def test_non_ascii_path_round_trips_and_lints_clean(project, base_v0202, tmp_path):
    cache, base = base_v0202
    tree = new_tree(tmp_path / "tree", base)
    name = "docs/kvforge/größe-ü.md"
    head = commit(tree, base.commit, "[Docs] a note with a non-ASCII name", "non-ascii-note",
                  write={name: "Größe\n"}, edit={POOL: ("class BlockPool:", "class BlockPool:  # ü")})
    set_branch(tree, head)
    res, data = export("--from", str(tree))
    assert res.exit_code == 0, res.output
    patch = project / "patches" / "t" / "0001-non-ascii-note.patch"
    text = patch.read_bytes().decode("utf-8")
    assert f"diff --git a/{name} b/{name}\n" in text and "\\303" not in text  # not git's quoted form
    assert read_series(patch.parent).all_problems() == []
    round_trip(tree, base, head, patch, tmp_path)


# ---------------------------------------------------------------- default tree


def test_default_tree_is_the_branch_here_or_in_component_dash_target(project, base_v0202, tmp_path, monkeypatch):
    cache, base = base_v0202
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    res = kvforge("export", "-t", "t")
    assert res.exit_code == 2
    assert "--from DIR" in res.output and "./vllm-t does not exist" in res.output
    tree = new_tree(work / "vllm-t", base)
    c1, c2 = first_two(tree, base)
    res = kvforge("export", "-t", "t")
    assert res.exit_code == 2 and "has no branch kvforge/t" in res.output
    set_branch(tree, c2)
    res, data = export()
    assert res.exit_code == 0, res.output
    assert data["source"] == "branch kvforge/t of vllm-t" and len(data["commits"]) == 2
    monkeypatch.chdir(tree)  # inside the tree: its branch, whatever is checked out
    git(tree, "update-ref", "refs/heads/other", c1)
    git(tree, "symbolic-ref", "HEAD", "refs/heads/other")
    res, data = export()
    assert res.exit_code == 0 and data["written"] is False and len(data["commits"]) == 2


# ---------------------------------------------------------------- crash safety


# swap-aside is a step of the two-rename fallback only: the exchange has no such boundary.
@pytest.mark.parametrize("step,swap", [(step, swap) for swap in ("exchange", "rename") for step in CRASH_STEPS
                                       if not (swap == "exchange" and step == "swap-aside")])
def test_sigkill_at_every_step_leaves_old_or_new_and_next_run_recovers(project, base_v0202, tmp_path, step, swap):
    cache, base = base_v0202
    tree, d = renamed_and_reordered(project, base, tmp_path)
    old = snapshot(d)
    expected = tmp_path / "expected"
    shutil.copytree(d, expected)
    res = kvforge("export", "-t", "t", "--from", str(tree), "--out", str(expected))
    assert res.exit_code == 0, res.output
    new = snapshot(expected)
    assert new != old
    env = {**os.environ, "KVFORGE_CRASH_AT": f"export:{step}", "KVFORGE_EXPORT_SWAP": swap}
    proc = subprocess.run([sys.executable, "-c", "from kvforge.cli import main; main()", "export", "-t", "t",
                           "--from", str(tree)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    after = snapshot(d)
    if swap == "rename" and step == "swap-aside":
        # The fallback's one window: the series directory is absent, both versions are complete beside it.
        assert after is None and leftovers(d) == [".t.kvforge-new", ".t.kvforge-old"]
        assert snapshot(d.parent / ".t.kvforge-old") == old and snapshot(d.parent / ".t.kvforge-new") == new
    else:
        assert after in (old, new), step
        assert after == (old if CRASH_STEPS.index(step) < CRASH_STEPS.index("swapped") else new)
    if step == "swapped":  # which swap ran: the exchange leaves the old contents under the staging name
        exchanged = swap == "exchange" and exchange_works(tmp_path)
        assert leftovers(d) == [".t.kvforge-new" if exchanged else ".t.kvforge-old"]
    res = kvforge("export", "-t", "t", "--from", str(tree))
    assert res.exit_code == 0, res.output
    assert snapshot(d) == new and leftovers(d) == []


@pytest.mark.parametrize("step", ["staging", "ready", "swapped"])
def test_sigkill_into_a_new_out_dir_leaves_nothing_or_all(project, base_v0202, tmp_path, step):
    cache, base = base_v0202
    tree, d = renamed_and_reordered(project, base, tmp_path)
    out = tmp_path / "new-out"
    env = {**os.environ, "KVFORGE_CRASH_AT": f"export:{step}"}
    proc = subprocess.run([sys.executable, "-c", "from kvforge.cli import main; main()", "export", "-t", "t",
                           "--from", str(tree), "--out", str(out)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    assert not out.exists() if step != "swapped" else read_series(out).all_problems() == []
    # A reader's recovery: a staged series whose rename was cut off is moved into place (roll forward).
    recover(out)
    assert leftovers(out) == [] and (out.exists() == (step != "staging"))
    res = kvforge("export", "-t", "t", "--from", str(tree), "--out", str(out))
    assert res.exit_code == 0, res.output
    assert read_series(out).all_problems() == [] and leftovers(out) == []
    assert len(read_series(out).patches) == 3


def exchange_works(where: Path) -> bool:
    a, b = where / "probe-a", where / "probe-b"
    a.mkdir(), b.mkdir()
    (a / "a").touch()
    try:
        return exchange(a, b) and (b / "a").exists()
    finally:
        shutil.rmtree(a), shutil.rmtree(b)


def test_recover_series_dir_for_readers(tmp_path):
    """What a reader of a series calls: finishes an interrupted fallback swap, deletes leftovers."""
    d = tmp_path / "s"
    (tmp_path / ".s.kvforge-new").mkdir()
    (tmp_path / ".s.kvforge-new" / "series").write_text("new\n")
    (tmp_path / ".s.kvforge-old").mkdir()
    (tmp_path / ".s.kvforge-old" / "series").write_text("old\n")
    (tmp_path / ".s.kvforge-tmp-1-abc").mkdir()
    recover(d)
    assert (d / "series").read_text() == "new\n" and leftovers(d) == []
    recover(d)  # nothing to do
    assert (d / "series").read_text() == "new\n"
    # Only the old one beside a missing directory (a swap that failed and could not be undone): put it back.
    shutil.rmtree(d)
    (tmp_path / ".s.kvforge-old").mkdir()
    (tmp_path / ".s.kvforge-old" / "series").write_text("old\n")
    (tmp_path / ".s.kvforge-trash-1-abc").mkdir()
    recover(d)
    assert (d / "series").read_text() == "old\n" and leftovers(d) == []


# ---------------------------------------------------------------- series file (fast units, no git)


def test_series_text_keeps_header_and_entry_comments(tmp_path):
    (tmp_path / "series").write_text("# top\n\na.patch # on a\n# before b\nb.patch\n# before c\nc.patch\n# tail\n")
    ref = read_listing(tmp_path)
    assert isinstance(ref, Listing) and ref.names == ["a.patch", "b.patch", "c.patch"]
    # b removed (its comment moves to c), c renamed, d new.
    text = listing_text(ref, ["a.patch", "0004-d.patch", "0003-c.patch"],
                        {"a.patch": "a.patch", "0003-c.patch": "c.patch"})
    assert text == "# top\n\na.patch # on a\n0004-d.patch\n# before b\n# before c\n0003-c.patch\n# tail\n"
    assert listing_text(None, ["x.patch"], {}) == "x.patch\n"
