"""`kvforge rebase` under the cases issue 21 found: a first patch that conflicts (no endless loop), --dry-run
over an interrupted commit (never writes), a state started in another checkout (refused), a commit whose
files changed since the start (both kept), and bad input (one line, its exit code, nothing written).

Fast lane: the `fake` fixture (a tiny git upstream); the real releases are tests/test_rebase_real.py's.
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
from helpers import CORE, FILES, git

from kvforge.project import ledger
from kvforge.cli import main

REPO_ROOT = Path(__file__).resolve().parent.parent
SIGKILLED = -9
V2_CORE = FILES[CORE].replace("return max(lo, x)", "return min(max(lo, x), hi)").replace("return 2 * x", "return x + x")


def kvforge(*args: str):
    return CliRunner().invoke(main, list(args))


def run_kvforge(*args: str, crash_at: str | None = None, env: dict | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
    full = {**os.environ, **(env or {})}
    full.pop("KVFORGE_CRASH_AT", None)
    if crash_at:
        full["KVFORGE_CRASH_AT"] = crash_at
    return subprocess.run([sys.executable, "-c", "from kvforge.cli import main; main()", *args], env=full,
                          capture_output=True, text=True, timeout=timeout)


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for d in ("patches", "targets")
            for p in sorted((root / d).rglob("*")) if p.is_file()}


def tag_v2(fake) -> None:
    (fake.upstream / CORE).write_text(V2_CORE)
    git(fake.upstream, "commit", "-qam", "v2: clamp honours hi, double rewritten")
    git(fake.upstream, "tag", "v2")


def one_line(r) -> bool:
    """One error line (progress lines and notes aside), no traceback."""
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("kvforge: error:") or not ln.startswith("kvforge: ")]
    return len(errors) == 1 and "Traceback" not in r.output


def conflict_first(fake) -> None:
    """0001 edits the line v2 rewrote (conflicts), then two patches that carry."""
    a = fake.patch("0001-double-int", {CORE: ("return 2 * x", "return 2 * int(x)")}, kind="refactor")
    b = fake.patch("0002-triple", {CORE: ("def clamp", "def triple(x):\n    return 3 * x\n\n\ndef clamp")},
                   kind="refactor", start=a)
    fake.patch("0003-half", {CORE: ("def clamp", "def half(x):\n    return x / 2\n\n\ndef clamp")},
               kind="refactor", start=b)
    fake.series("0001-double-int", "0002-triple", "0003-half")


def two_patches(fake) -> None:
    """0001 is in v2 (dropped), 0002 carries: the rebase runs to its commit."""
    a = fake.patch("0001-clamp-hi", {CORE: ("return max(lo, x)", "return min(max(lo, x), hi)")}, kind="refactor")
    fake.patch("0002-triple", {CORE: ("def clamp", "def triple(x):\n    return 3 * x\n\n\ndef clamp")},
               kind="refactor", start=a)
    fake.series("0001-clamp-hi", "0002-triple")


# ---------------------------------------------------------------- the loop


def test_a_first_patch_that_conflicts_stops_at_once(fake):
    """Was an endless loop: a one-shot `git am` of the run 0001..0003 failed at its first patch, returned
    "progress" without moving, and the loop ran it again. Now: exit 3 at 0001, then --continue finishes."""
    conflict_first(fake)
    tag_v2(fake)
    before = snapshot(fake.root)
    r = run_kvforge("rebase", "-t", "fake", "--onto", "v2", "--repo", str(fake.upstream), timeout=60)
    assert r.returncode == 3, r.stderr
    assert "0001-double-int.patch" in r.stderr.splitlines()[-1]
    assert r.stderr.count("applying 3 patches (") <= 1
    assert snapshot(fake.root) == before
    tree = next((fake.cache / "trees" / ".work").glob("rebase-fake-vllm-*"))
    (tree / CORE).write_text(V2_CORE.replace("return x + x", "return int(x) + int(x)"))
    git(tree, "add", CORE)
    done = run_kvforge("rebase", "-t", "fake", "--continue", "--json", timeout=60)
    assert done.returncode == 0, done.stderr
    assert [p["verdict"] for p in json.loads(done.stdout)["patches"]] == ["carried"] * 3
    assert (fake.root / "patches" / "fake" / "series").read_text().split() == [
        "0001-double-int.patch", "0002-triple.patch", "0003-half.patch"]
    assert kvforge("lint").exit_code == 0


# ---------------------------------------------------------------- --dry-run, and the commit's digests


def test_dry_run_never_finishes_an_interrupted_commit_and_the_commit_keeps_a_newer_export(fake):
    """Was data loss: killed past its commit point, then the user exported their own edit; the next
    `rebase --dry-run` replaced it. Now --dry-run writes nothing and says what finishes the commit; that
    command sees the user's files changed, writes nothing there and keeps the rebase's result aside."""
    two_patches(fake)
    tag_v2(fake)
    args = ("rebase", "-t", "fake", "--onto", "v2", "--repo", str(fake.upstream))
    killed = run_kvforge(*args, crash_at="rebase:committing")  # staged, state saved, before the commit point
    assert killed.returncode == SIGKILLED, killed.stderr
    series = fake.root / "patches" / "fake" / "series"
    series.write_text(series.read_text() + "# the user's own note\n")  # their newer export
    for leftover in (fake.root / "patches").glob(".fake.kvforge-*"):  # export's recovery removes the staged copy
        shutil.rmtree(leftover)
    mine = snapshot(fake.root)
    dry = kvforge(*args, "--dry-run")
    assert dry.exit_code == 2 and one_line(dry), dry.output
    assert "--continue" in dry.stderr and "interrupted" in dry.stderr
    assert snapshot(fake.root) == mine
    kept = kvforge("rebase", "-t", "fake", "--continue")
    assert kept.exit_code == 2 and one_line(kept), kept.output
    assert snapshot(fake.root) == mine  # the user's files, untouched
    where = Path(kept.stderr.split("the rebase's result is in ")[1].split(" (")[0])
    listed = (where / "patches" / "fake" / "series").read_text().splitlines()
    assert [ln for ln in listed if not ln.startswith("#")] == ["0002-triple.patch"]
    assert 'ref = "v2"' in (where / "targets" / "fake.toml").read_text()
    assert [e.fix_id for e in ledger.load(where / "patches" / "fake")] == ["clamp-hi"]
    assert not (fake.cache / "rebase" / "fake-vllm").exists()  # over: nothing stuck
    assert kvforge(*args, "--dry-run").exit_code == 0


def test_an_edit_during_a_stopped_rebase_is_kept_and_the_result_set_aside(fake):
    conflict_first(fake)
    tag_v2(fake)
    assert kvforge("rebase", "-t", "fake", "--onto", "v2", "--repo", str(fake.upstream)).exit_code == 3
    target = fake.root / "targets" / "fake.toml"
    target.write_text(target.read_text() + "# edited meanwhile\n")
    mine = snapshot(fake.root)
    assert kvforge("rebase", "-t", "fake", "--skip").exit_code == 2
    assert snapshot(fake.root) == mine


# ---------------------------------------------------------------- the state belongs to its project


def test_a_rebase_is_refused_from_another_checkout(fake, monkeypatch, tmp_path):
    conflict_first(fake)
    tag_v2(fake)
    assert kvforge("rebase", "-t", "fake", "--onto", "v2", "--repo", str(fake.upstream)).exit_code == 3
    other = tmp_path / "other"
    shutil.copytree(fake.root, other)
    before_a, before_b = snapshot(fake.root), snapshot(other)
    monkeypatch.setenv("KVFORGE_ROOT", str(other))
    for action in ("--continue", "--skip", "--abort"):
        r = kvforge("rebase", "-t", "fake", action)
        assert r.exit_code == 2 and one_line(r) and "not this project's" in r.stderr, r.output
    r = kvforge("rebase", "-t", "fake", "--onto", "v2", "--repo", str(fake.upstream))
    assert r.exit_code == 2 and "not this project's" in r.stderr
    assert snapshot(fake.root) == before_a and snapshot(other) == before_b
    monkeypatch.setenv("KVFORGE_ROOT", str(fake.root))
    assert kvforge("rebase", "-t", "fake", "--abort").exit_code == 0


# ---------------------------------------------------------------- worktrees


def test_a_stale_worktree_registration_is_repaired(fake, tmp_path):
    """Was: after a --repo rebase, sdist rebases were stuck (the worktree registered in two repositories).
    engine.ensure_worktree now checks the worktree leads back to the repository, and repairs it."""
    from kvforge.git.engine import ensure_worktree

    a, b = tmp_path / "a.git", tmp_path / "b.git"
    for repo in (a, b):
        git(fake.upstream, "clone", "-q", "--bare", str(fake.upstream), str(repo))
    path = tmp_path / "wt"
    assert ensure_worktree(a, path, fake.base) is False
    (b / "worktrees" / "wt").mkdir(parents=True)  # b's stale registration of a's directory
    (b / "worktrees" / "wt" / "gitdir").write_text(f"{path}/.git\n")
    (b / "worktrees" / "wt" / "HEAD").write_text(fake.base + "\n")
    (b / "worktrees" / "wt" / "commondir").write_text("../..\n")
    assert ensure_worktree(b, path, fake.base) is False  # made afresh for b, not trusted
    common = git(path, "rev-parse", "--path-format=absolute", "--git-common-dir").strip()
    assert Path(common).resolve() == b.resolve()
    git(path, "reset", "--hard", "-q", fake.base)
    assert ensure_worktree(b, path, fake.base) is True


# ---------------------------------------------------------------- bad input: one line, its exit code


@pytest.mark.parametrize("onto", ["v2\n", "0.20.2\n", "\u0660.\u0662\u0660.\u0662", " 0.20.2", "0.2\x00"])
def test_onto_with_a_newline_or_non_ascii_digits_is_refused(fake, monkeypatch, onto):
    monkeypatch.delenv("KVFORGE_VLLM_REPO")
    two_patches(fake)
    before = snapshot(fake.root)
    r = kvforge("rebase", "-t", "fake", "--onto", onto)
    assert r.exit_code == 2 and one_line(r), r.output
    assert "--onto" in r.stderr and snapshot(fake.root) == before


def test_onto_a_release_that_does_not_exist_is_exit_2(fake, monkeypatch):
    from kvforge.flow.rebase import onto as onto_mod

    monkeypatch.delenv("KVFORGE_VLLM_REPO")
    monkeypatch.delenv("KVFORGE_OFFLINE")
    monkeypatch.setattr(onto_mod, "release_files", lambda package, version: ("https://pypi.org/pypi/vllm/json", []))
    two_patches(fake)
    r = kvforge("rebase", "-t", "fake", "--onto", "9.9.9")
    assert r.exit_code == 2 and one_line(r) and "9.9.9 is not a release" in r.stderr, r.output


def test_repo_that_does_not_exist(fake):
    two_patches(fake)
    r = kvforge("rebase", "-t", "fake", "--onto", "v2", "--repo", "/nonexistent")
    assert r.exit_code == 2 and one_line(r) and "no such directory" in r.stderr, r.output


@pytest.mark.parametrize("where", ["-t", "--as"])
def test_a_300_character_name_is_one_line_exit_2(fake, where):
    two_patches(fake)
    name = "x" * 300
    args = ["-t", name] if where == "-t" else ["-t", "fake", "--as", name]
    r = kvforge("rebase", *args, "--onto", "v2", "--repo", str(fake.upstream))
    assert r.exit_code == 2 and one_line(r) and "300 characters" in r.stderr, r.output


def test_as_a_name_whose_patches_entry_is_a_file(fake):
    two_patches(fake)
    tag_v2(fake)
    (fake.root / "patches" / "x").write_text("not a directory\n")
    before = snapshot(fake.root)
    r = kvforge("rebase", "-t", "fake", "--onto", "v2", "--repo", str(fake.upstream), "--as", "x")
    assert r.exit_code == 2 and one_line(r) and "not a directory" in r.stderr, r.output
    assert snapshot(fake.root) == before


def test_as_on_a_two_component_target_is_refused(fake, monkeypatch, tmp_path):
    root = tmp_path / "real"
    for d in ("targets", "patches"):
        shutil.copytree(REPO_ROOT / d, root / d)
    monkeypatch.setenv("KVFORGE_ROOT", str(root))
    before = snapshot(root)
    r = kvforge("rebase", "-t", "v0.20.2rc", "--component", "vllm", "--onto", "0.22.0", "--as", "v0.22.0rc")
    assert r.exit_code == 2 and one_line(r), r.output
    assert "more than one component" in r.stderr and "vllm-ascend" in r.stderr
    assert snapshot(root) == before


@pytest.mark.parametrize("how", ["under-a-file", "read-only"])
def test_an_unusable_cache_is_exit_5(fake, monkeypatch, tmp_path, how):
    two_patches(fake)
    if how == "under-a-file":
        (tmp_path / "afile").write_text("")
        monkeypatch.setenv("KVFORGE_CACHE", str(tmp_path / "afile" / "cache"))
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        # root writes into a read-only directory: immutable (chattr +i) refuses root too, where it exists
        immutable = os.geteuid() == 0 and shutil.which("chattr") is not None and \
            subprocess.run(["chattr", "+i", str(ro)], capture_output=True).returncode == 0
        if os.geteuid() == 0 and not immutable:
            pytest.skip("root writes into a read-only directory and chattr +i is not available")  # not counted
        monkeypatch.setenv("KVFORGE_CACHE", str(ro))
    try:
        r = kvforge("rebase", "-t", "fake", "--onto", "v2", "--repo", str(fake.upstream))
    finally:
        if how == "read-only" and os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(tmp_path / "ro")], check=True)
    assert r.exit_code == 5 and one_line(r) and "cache" in r.stderr, r.output


@pytest.mark.parametrize("text,what", [
    ("dropped = 5\n", "dropped"),
    ('[[dropped]]\nfile = "a.patch"\nfix_id = "a"\ndecision = "upstream"\nsignals = 5\n', "signals"),
    ('[[dropped]]\nfile = "a.patch"\nfix_id = "a"\ndecision = "bogus"\n', "decision"),
    ('[[dropped]]\nfile = "a.patch"\nfix_id = "a"\ndecision = "upstream"\nonto_version = 5\n', "onto_version"),
])
def test_a_ledger_of_the_wrong_types_is_one_line_exit_2(fake, text, what):
    two_patches(fake)
    (fake.root / "patches" / "fake" / "dropped.toml").write_text(text)
    r = kvforge("status")
    assert r.exit_code == 2 and one_line(r) and "dropped.toml" in r.stderr and what in r.stderr, r.output


def test_the_description_keeps_another_components_ref():
    """Was: rebasing v0.20.2rc's vllm rewrote "releases/v0.20.2rc" (vllm-ascend's ref, which stays) in the
    description."""
    from kvforge.flow.rebase.retarget import retarget_text

    text = (REPO_ROOT / "targets" / "v0.20.2rc.toml").read_text()
    out = retarget_text(text, 0, ref="v0.22.0", version="0.22.0", sha256="a" * 64, wheel=None, old_version="0.20.2")
    assert 'description = "vLLM v0.22.0, the base of vllm-ascend releases/v0.20.2rc"' in out
    assert 'ref = "releases/v0.20.2rc"' in out and 'ref = "v0.22.0"' in out
