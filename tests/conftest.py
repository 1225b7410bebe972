"""Shared fixtures: a real vLLM v0.20.2 base (PyPI sdist) and throw-away kvforge projects around it.

The sdist is downloaded once into the user's kvforge cache (~34 MB) and copied into a per-session
test cache, so tests never touch a real user cache beyond that one download.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from helpers import FAKE_TARGET, FILES, Fake, git

from kvforge.core.cache import Cache, default_cache_dir

REPO_ROOT = Path(__file__).resolve().parent.parent
V0202_SHA256 = "58809377798c5335c6e2fe30092abda54d9200b5b8a717b3735a63f5daa0e383"

TARGET_TOML = """\
name = "{name}"
description = "test target on vLLM 0.20.2"

[[components]]
name = "vllm"
repo = "https://invalid.invalid/vllm.git"
ref = "v0.20.2"
series = "patches/{name}"
platforms = ["cpu", "cuda"]

[components.release]
package = "vllm"
version = "0.20.2"
sha256 = "{sha}"

[components.tests]
cpu = ["tests/v1/core/test_kv_cache_utils.py"]
"""


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> Cache:
    """A test cache holding the real vllm 0.20.2 sdist (downloaded once into the user cache)."""
    cache = Cache(tmp_path_factory.mktemp("kvforge-cache"))
    user_downloads = default_cache_dir() / "downloads"
    src = user_downloads / "vllm-0.20.2.tar.gz"
    if not src.is_file():
        from kvforge.git.bases import download_sdist
        from kvforge.project.targets import load_target

        download_sdist(load_target("v0.20.2rc", REPO_ROOT).component(), Cache(default_cache_dir()), print)
    shutil.copy2(src, cache.downloads / src.name)
    return cache


@pytest.fixture(scope="session")
def base_v0202(session_cache):
    """The imported base: (Cache, Base). Imported once per session."""
    from kvforge.git.bases import ensure_base
    from kvforge.project.targets import parse_target

    root = session_cache.root / "project-for-base"
    (root / "targets").mkdir(parents=True, exist_ok=True)
    (root / "patches" / "t").mkdir(parents=True, exist_ok=True)
    path = root / "targets" / "t.toml"
    path.write_text(TARGET_TOML.format(name="t", sha=V0202_SHA256))
    comp = parse_target(path, root).component()
    return session_cache, ensure_base(comp, session_cache, "sdist")


@pytest.fixture()
def project(tmp_path, monkeypatch, base_v0202):
    """A kvforge project (targets/ + patches/) with one target 't' on vLLM 0.20.2; env points at it."""
    cache, _base = base_v0202
    root = tmp_path / "project"
    (root / "targets").mkdir(parents=True)
    (root / "patches" / "t").mkdir(parents=True)
    (root / "targets" / "t.toml").write_text(TARGET_TOML.format(name="t", sha=V0202_SHA256))
    (root / "patches" / "t" / "series").write_text("")
    monkeypatch.setenv("KVFORGE_ROOT", str(root))
    monkeypatch.setenv("KVFORGE_CACHE", str(cache.root))
    monkeypatch.setenv("KVFORGE_OFFLINE", "1")
    yield root
    # The base repository is shared by the session: drop what this test made in it.
    from kvforge.git import gitutil

    for line in gitutil.run(_base.repo, "worktree", "list", "--porcelain").stdout.splitlines():
        if line.startswith("worktree ") and Path(line[9:]) != _base.repo:
            gitutil.run(_base.repo, "worktree", "remove", "--force", "--force", line[9:], check=False)
    gitutil.run(_base.repo, "worktree", "prune")
    for ref in gitutil.run(_base.repo, "for-each-ref", "--format=%(refname)", "refs/heads").stdout.split():
        gitutil.run(_base.repo, "update-ref", "-d", ref)


@pytest.fixture()
def fake(tmp_path, monkeypatch) -> Fake:
    """A kvforge project whose target `fake` is a tiny vLLM-like git repository; this interpreter runs its tests."""
    upstream = tmp_path / "upstream"
    for rel, text in FILES.items():
        (upstream / rel).parent.mkdir(parents=True, exist_ok=True)
        (upstream / rel).write_text(text)
    git(upstream, "init", "-q")
    git(upstream, "add", "-A")
    git(upstream, "commit", "-qm", "v1")
    git(upstream, "tag", "v1")
    root = tmp_path / "project"
    (root / "targets").mkdir(parents=True)
    (root / "patches" / "fake").mkdir(parents=True)
    (root / "targets" / "fake.toml").write_text(FAKE_TARGET)
    (root / "patches" / "fake" / "series").write_text("")
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVFORGE_ROOT", str(root))
    monkeypatch.setenv("KVFORGE_CACHE", str(cache))
    monkeypatch.setenv("KVFORGE_VLLM_REPO", str(upstream))
    monkeypatch.setenv("KVFORGE_OFFLINE", "1")
    monkeypatch.setenv("KVFORGE_TEST_PYTHON", sys.executable)
    return Fake(root, upstream, git(upstream, "rev-parse", "HEAD").strip(), cache)
