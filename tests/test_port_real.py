"""`kvforge port` for real (slow lane): a shipped fix moved between real releases, the tree it leaves checked.

eagle-lookahead-block-hashes is carried by v0.20.1 (vLLM 0.20.1) and v0.20.2rc (vLLM 0.20.2), as variants that
differ only in their preimages and a hunk offset. In a copy of the project whose v0.20.1 series lacks it (its last
patch, so nothing depends on it), porting v0.20.2rc's variant onto v0.20.1 applies: the tree is v0.20.1's four
patches plus one commit with the whole header, the same change as the v0.20.1 variant shipped (git patch-id),
no `git am` left running, a clean checkout, and nothing in patches/ or targets/ written until `kvforge export`,
which gives back the shipped series' fix. (The conflicting direction, v0.20.2rc's kv-events-token-ids onto
main's 0.33.0, is tests/test_port.py's.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import git

from kvforge.core.cache import Cache, default_cache_dir

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parent.parent
FIX = "eagle-lookahead-block-hashes"
SHIPPED = REPO_ROOT / "patches" / "v0.20.1" / "0005-eagle-lookahead-block-hashes.patch"


def patch_id(diff: bytes) -> str:
    out = subprocess.run(["git", "patch-id", "--stable"], input=diff, capture_output=True, check=True).stdout
    return out.split()[0].decode()


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for d in ("patches", "targets")
            for p in sorted((root / d).rglob("*")) if p.is_file()}


def run(root: Path, cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVFORGE_ROOT": str(root), "KVFORGE_CACHE": str(cache), "KVFORGE_OFFLINE": "1"}
    for k in ("KVFORGE_VLLM_REPO", "KVFORGE_CRASH_AT"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-c", "from kvforge.cli import main; main()", *args], env=env,
                          capture_output=True, text=True, timeout=600)


def test_port_a_shipped_fix_from_v0202rc_onto_v0201_applies(session_cache, tmp_path):
    for version in ("0.20.1", "0.20.2"):
        name = f"vllm-{version}.tar.gz"
        if not (session_cache.downloads / name).is_file():
            user = Cache(default_cache_dir())
            if not (user.downloads / name).is_file():
                from kvforge.git.bases import download_sdist
                from kvforge.project.targets import load_target

                download_sdist(load_target(f"v{version}" if version == "0.20.1" else "v0.20.2rc",
                                           REPO_ROOT).component(), user, print)
            shutil.copy2(user.downloads / name, session_cache.downloads / name)
    root = tmp_path / "project"
    for d in ("targets", "patches"):
        shutil.copytree(REPO_ROOT / d, root / d)
    series = root / "patches" / "v0.20.1" / "series"
    series.write_text(series.read_text().replace(f"0005-{FIX}.patch\n", ""))
    (root / "patches" / "v0.20.1" / SHIPPED.name).unlink()
    before = snapshot(root)
    tree = tmp_path / "vllm-v0.20.1-eagle"
    t0 = time.monotonic()
    r = run(root, session_cache.root, "port", FIX, "-t", "v0.20.1", "--into", str(tree), "--source", "sdist",
            "--json")
    seconds = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert (data["source_target"], data["source_patch"]) == ("v0.20.2rc", f"0005-{FIX}.patch")  # the newest other
    assert data["status"] in ("applied", "applied (3-way)") and data["conflicts"] == [], data
    print(f"port {FIX} v0.20.2rc -> v0.20.1: {data['status']} in {seconds:.1f}s")
    # The tree: branch kvforge/v0.20.1 = v0.20.1's four patches + the port, on the tagged 0.20.1 base.
    assert git(tree, "symbolic-ref", "HEAD").strip() == "refs/heads/kvforge/v0.20.1"
    head = git(tree, "rev-parse", "HEAD").strip()
    assert head == data["commit"]
    base = git(tree, "rev-parse", "kvforge/base/v0.20.1^{commit}").strip()
    subjects = git(tree, "log", "--format=%s", f"{base}..HEAD").splitlines()
    assert len(subjects) == 5
    message = git(tree, "log", "-1", "--format=%B")
    assert f"Fix-Id: {FIX}" in message and message.count("Checks: ") == 6 and "Signed-off-by: " in message
    assert not (tree / ".git" / "rebase-apply").exists()  # no git am left running
    assert git(tree, "status", "--porcelain") == ""  # a clean checkout
    assert not (tree / ".git" / "objects" / "info" / "alternates").exists()  # standalone: no link to the cache
    # The same change as the v0.20.1 variant shipped, and nothing in the project written by the port.
    ported = subprocess.run(["git", "show", "--format=", "HEAD"], cwd=tree, capture_output=True, check=True).stdout
    assert patch_id(ported) == patch_id(SHIPPED.read_bytes())
    assert snapshot(root) == before
    # Export gives the series back: five patches, lint clean, the fix the shipped one (by patch-id).
    r = run(root, session_cache.root, "export", "-t", "v0.20.1", "--from", str(tree))
    assert r.returncode == 0, r.stderr
    exported = root / "patches" / "v0.20.1" / SHIPPED.name
    assert patch_id(exported.read_bytes()) == patch_id(SHIPPED.read_bytes())
    assert series.read_text() == (REPO_ROOT / "patches" / "v0.20.1" / "series").read_text()
    assert run(root, session_cache.root, "lint", "-t", "v0.20.1").returncode == 0
