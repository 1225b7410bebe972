"""`kvforge port`: a variant of one fix for another target, started from an existing variant.

Real case (issue 10): kv-events-token-ids from v0.20.2rc to main (vLLM 0.33.0), in a copy of the
project as committed (HEAD), so it does not depend on the main variant being written by hand in
patches/main. On 0.33.0 the v0.20.x variant conflicts in block_pool.py: the tree is left at the
conflict, with the header carried over, ready to be resolved, committed and exported.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import CORE, git

from kvforge.cli import main
from kvforge.project.series import read_series

REPO_ROOT = Path(__file__).resolve().parent.parent


def kvforge(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture()
def committed_project(tmp_path, monkeypatch, session_cache):
    """targets/ and patches/ as committed, in tmp_path; main's base ref is v0.33.0 (the same 0.33.0
    sdist as main's: the import is shared with the rebase tests)."""
    from kvforge.core.cache import Cache, default_cache_dir

    name = "vllm-0.33.0.tar.gz"
    if not (session_cache.downloads / name).is_file():
        user = Cache(default_cache_dir())
        if not (user.downloads / name).is_file():
            from kvforge.git.bases import download_sdist
            from kvforge.project.targets import load_target

            download_sdist(load_target("main", REPO_ROOT).component(), user, print)
        shutil.copy2(user.downloads / name, session_cache.downloads / name)
    root = tmp_path / "project"
    archive = subprocess.run(["git", "archive", "HEAD", "targets", "patches"], cwd=REPO_ROOT, check=True,
                             capture_output=True).stdout
    root.mkdir()
    subprocess.run(["tar", "x"], cwd=root, input=archive, check=True)
    main_toml = root / "targets" / "main.toml"
    main_toml.write_text(main_toml.read_text().replace('ref = "main"', 'ref = "v0.33.0"'))
    # main as it was before its variant: no patch (port must start it from v0.20.2rc's).
    for f in (root / "patches" / "main").glob("*.patch"):
        f.unlink()
    (root / "patches" / "main" / "series").write_text("")
    monkeypatch.setenv("KVFORGE_ROOT", str(root))
    monkeypatch.setenv("KVFORGE_CACHE", str(session_cache.root))
    monkeypatch.setenv("KVFORGE_OFFLINE", "1")
    monkeypatch.delenv("KVFORGE_VLLM_REPO", raising=False)
    return root


def test_port_kv_events_to_main_leaves_a_conflict_with_the_header(committed_project, tmp_path):
    tree = tmp_path / "port"
    r = kvforge("port", "kv-events-token-ids", "-t", "main", "--from-target", "v0.20.2rc", "--into", str(tree),
                "--source", "sdist", "--json")
    assert r.exit_code == 3, r.output
    data = json.loads(r.stdout)
    assert data["status"] == "conflict" and data["conflicts"] == ["vllm/v1/core/block_pool.py"], data
    assert data["source_patch"] == "0003-kv-events-token-ids.patch"
    assert any("swa-reachable-cache-mask" in n and "in_base" in n for n in data["notes"])
    # A standalone repository (no alternates into the cache), git am stopped at the fix, markers in the file.
    assert not (tree / ".git" / "objects" / "info" / "alternates").exists()
    assert "<<<<<<<" in (tree / "vllm/v1/core/block_pool.py").read_text()
    message = git(tree, "am", "--show-current-patch=raw")
    assert "Fix-Id: kv-events-token-ids" in message and "Upstream-PR: " in message
    assert "Depends-On:" not in message  # main has swa-reachable-cache-mask in its base
    for stage in git(tree, "ls-files", "-u").split("\n"):
        if stage:
            git(tree, "cat-file", "-e", stage.split()[1])  # the merge's blobs are in the tree itself
    # Resolve (here: main's side of block_pool.py, keeping the new test file), commit, export.
    git(tree, "checkout", "--ours", "--", "vllm/v1/core/block_pool.py")
    git(tree, "add", "vllm/v1/core/block_pool.py")
    git(tree, "am", "--continue")
    out = tmp_path / "main-series"
    r = kvforge("export", "-t", "main", "--from", str(tree), "--out", str(out))
    assert r.exit_code == 0, r.output
    series = read_series(out)
    assert [p.fix_id for p in series.patches] == ["kv-events-token-ids"]
    assert series.patches[0].value("Bug") == "https://github.com/vllm-project/vllm/issues/44451"
    assert not series.all_problems()


def test_port_refuses_what_the_target_has_or_nobody_carries(fake):
    fake.patch("0001-triple", {CORE: ("def clamp", "def triple(x):\n    return 3 * x\n\n\ndef clamp")},
               kind="refactor")
    fake.series("0001-triple")
    r = kvforge("port", "triple", "-t", "fake")
    assert r.exit_code == 2 and "already carries" in r.output
    r = kvforge("port", "nothing-like-it", "-t", "fake")
    assert r.exit_code == 2 and "carries a patch with Fix-Id" in r.output


def test_port_result_is_an_outcome():
    from kvforge.core.outcome import Outcome
    from kvforge.flow.port import PortResult

    r = PortResult("fix", "v1", "0001-fix.patch", "main", "/tmp/tree", "kvforge/main", "conflict",
                   detail="3-way merge conflict in a.py", conflicts=["a.py"])
    assert isinstance(r, Outcome) and r.exit_code == 3
    assert r.error == "0001-fix.patch conflicts on main: 3-way merge conflict in a.py; resolve it in /tmp/tree"
    assert r.render().splitlines()[:3] == ["fix: 0001-fix.patch from v1 onto main: conflict (3-way merge conflict "
                                           "in a.py)", "tree: /tmp/tree (branch kvforge/main)", "conflicts: a.py"]
    r.status = "applied"
    assert r.exit_code == 0 and r.error is None and "error" not in r.to_json()


@pytest.mark.parametrize("to", ["main", "v0.20.1"])
def test_port_of_a_vllm_ascend_fix_onto_a_vllm_target_is_refused(committed_project, tmp_path, to):
    """ascend-dsv4-block-size lives only in v0.20.2rc's vllm-ascend series: it is not a vLLM fix, so porting it
    onto a target's vLLM component is bad input (one line, exit 2), refused before any tree is made."""
    tree = tmp_path / "port"
    for extra in ([], ["--from-target", "v0.20.2rc"]):
        r = kvforge("port", "ascend-dsv4-block-size", "-t", to, "--into", str(tree), "--source", "sdist", *extra)
        assert r.exit_code == 2, r.output
        [line] = r.stderr.strip().splitlines()
        assert "vllm-ascend" in line and "patches/v0.20.2rc-vllm-ascend" in line and f"{to} (vllm)" in line, line
        assert not tree.exists()  # no tree, let alone one stopped inside `git am`
    r = kvforge("port", "ascend-dsv4-block-size", "-t", to, "--into", str(tree), "--json")
    assert r.exit_code == 2 and json.loads(r.stdout)["exit"] == 2
