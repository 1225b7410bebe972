"""Where kvforge keeps what it downloads and builds: never in the project, never in the user's env.

Default ~/.cache/kvforge (or $XDG_CACHE_HOME/kvforge); $KVFORGE_CACHE or --cache-dir override it.
Everything here can be deleted at any time: user trees are standalone repositories outside it.

Layout:
  downloads/                 verified release archives (sdists), named as upstream names them
  repos/<component>-<kind>.git  bare repositories holding imported bases (kind: sdist | git)
  trees/.work/               kvforge's own worktrees (stacks for tests, verify and bench)
  envs/                      test environments, keyed by a hash of their content
  results/                   evidence: JUnit XML, verify and bench JSON (kvforge.evidence)

Ref namespaces written in a cached repository (each by one module only):
  refs/tags/<ref>                                   bases (bases)
  refs/kvforge/import                               a base import in progress (bases)
  refs/kvforge/stacks/<target>/<component>/<digest>/<n>   a series applied, tree after patch n (trees)
  refs/kvforge/from/<target>/<component>/<n>       commits taken from a user's tree for --from (trees)
"""

from __future__ import annotations

import os
from pathlib import Path

REF_IMPORT = "refs/kvforge/import"
REF_STACKS = "refs/kvforge/stacks"
REF_FROM = "refs/kvforge/from"


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
        """kvforge's own worktrees (under .work/); user trees never live here."""
        return self._dir("trees")

    @property
    def envs(self) -> Path:
        """Python environments that run a target's vLLM tests."""
        return self._dir("envs")

    @property
    def results(self) -> Path:
        """Evidence records (kvforge.evidence owns the layout below this)."""
        return self._dir("results")
