"""Where kvforge keeps what it downloads and builds: never in the project, never in the user's env.

Default ~/.cache/kvforge (or $XDG_CACHE_HOME/kvforge); $KVFORGE_CACHE or --cache-dir override it.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    env = os.environ.get("KVFORGE_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvforge"


class Cache:
    """Layout of the cache directory; each area is created on first use."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root).expanduser().resolve() if root else default_cache_dir()

    def _dir(self, *parts: str) -> Path:
        path = self.root.joinpath(*parts)
        path.mkdir(parents=True, exist_ok=True)
        return path

    @property
    def downloads(self) -> Path:
        """Verified release archives (sdists), named as upstream names them."""
        return self._dir("downloads")

    @property
    def repos(self) -> Path:
        """Bare git repositories holding imported bases, one per component and source kind."""
        return self._dir("repos")

    @property
    def trees(self) -> Path:
        """Worktrees: user trees made by `apply`, and kvforge's own trees for tests and verify."""
        return self._dir("trees")

    @property
    def envs(self) -> Path:
        """Python environments that run a target's vLLM tests."""
        return self._dir("envs")

    @property
    def results(self) -> Path:
        return self._dir("results")
