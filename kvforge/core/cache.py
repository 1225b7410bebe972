"""Where kvforge keeps what it downloads and builds: never in the project, never in the user's env.

Default ~/.cache/kvforge (or $XDG_CACHE_HOME/kvforge); $KVFORGE_CACHE or --cache-dir override it.
Everything here can be deleted at any time: user trees are standalone repositories outside it.

Layout (each entry created by the module named; a leading dot: work in progress or a lock):
  downloads/<file>           verified release archives (sdists) and pinned wheels, named as upstream names
                             them (bases, build); .<file>.<pid>.part a download, .<file>.sha256 its
                             sha256 and stat when hashed (fsutil.remember_sha256: bases, build, rebase)
  repos/<component>-<kind>.git  bare repositories holding imported bases (kind: sdist | git) (bases);
                             .<repo>.<pid>.tmp|.old an import or a corrupt repository being removed,
                             .<repo>.lock the lock around materialising a base (leftovers of dead pids swept)
  trees/.work/<target>-<component>  kvforge's own worktree of a stack, for tests, verify and bench, with
                             <target>-<component>.lock and <target>-<component>.<digest>.outcomes.json (trees)
  trees/.work/rebase-<target>-<component>  the rebase worktree, kept between rebases (rebase)
  trees/.work/.<kind>.<pid>.*  one run's scratch worktrees and files (kind: pick, import); a dead pid's are
                             removed by the next run, their worktree registrations pruned (trees)
  trees/.requires/<target>-<component>/<commit>/  a required component's package exported for the
                             components built on it; trees/.requires/<target>-<component>.lock (components)
  rebase/<target>-<component>/  a rebase's state; rebase/.<target>-<component>.lock (rebase)
  locks/tree-<key>.lock      the lock around `kvforge apply` into a user's tree (apply)
  builds/<target>/<component>/<digest>/  build reports and the verification's JUnit (build);
                             builds/.verify-<pid>/ a wheel's verification in progress
  envs/<key>/                test environments keyed by a hash of their content, with <key>.build.log,
                             overlay-<hash>/ (a user's interpreter's overlay, userenv), hf-<hash>/ (the
                             offline Hugging Face cache, envcore) (env)
  results/                   evidence: JUnit XML, verify and bench JSON (kvforge.core.evidence)

Ref namespaces written in a cached repository (each by one module only):
  refs/tags/<ref>                                   bases (bases)
  refs/kvforge/import                               a base import in progress (bases)
  refs/kvforge/stacks/<target>/<component>/<digest>/<n>   a series applied, tree after patch n (trees)
  refs/kvforge/from/<target>/<component>/head       the user's commits taken for --from (trees)
  refs/kvforge/rebase/<target>/<component>/old      the old series' last commit, copied into the new
                                                    base's repository (rebase: REF_REBASE)
"""

from __future__ import annotations

import os
from pathlib import Path

from kvforge.core.errors import EXIT_ENV, KvforgeError

REF_IMPORT = "refs/kvforge/import"
REF_STACKS = "refs/kvforge/stacks"
REF_FROM = "refs/kvforge/from"

HINT = "set --cache-dir or $KVFORGE_CACHE"


def default_cache_dir() -> Path:
    """$KVFORGE_CACHE, else $XDG_CACHE_HOME/kvforge, else ~/.cache/kvforge.

    Refuses (EXIT_ENV) when there is no home to put it in: with HOME="" Python's home is "/", and
    the cache would silently land in /.cache/kvforge at the filesystem root.
    """
    env = os.environ.get("KVFORGE_CACHE")
    if env:
        return Path(env).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and Path(xdg).is_absolute():  # the XDG spec: a relative path is invalid and ignored
        return Path(xdg) / "kvforge"
    home = os.environ.get("HOME")
    if home is None:  # unset: the password database's entry, as Path.home() does
        try:
            home = str(Path.home())
        except (RuntimeError, KeyError, OSError):
            home = ""
    if not home or not Path(home).is_absolute() or Path(home) == Path(Path(home).anchor):
        what = "empty" if not home else f"{home!r}"
        raise KvforgeError(f"cannot place the kvforge cache: $HOME is {what} and $XDG_CACHE_HOME is not set "
                           f"(it would go to {Path(home or '/').absolute() / '.cache' / 'kvforge'}); {HINT}",
                           EXIT_ENV)
    return Path(home) / ".cache" / "kvforge"


def write_error(path: Path, exc: OSError) -> KvforgeError:
    """The one-line error for a cache that cannot be written (EXIT_ENV): where, and the system's reason."""
    if isinstance(exc, FileExistsError):
        reason = "it exists and is not a directory"
    else:
        reason = exc.strerror or str(exc)
    return KvforgeError(f"cannot write the kvforge cache at {path}: {reason}; {HINT}", EXIT_ENV)


class Cache:
    """Layout of the cache directory; each area is created on first use.

    The default location is resolved on first use, so commands that need no cache (lint, status)
    run even where no cache can be placed.
    """

    def __init__(self, root: Path | None = None):
        self._root = Path(root).expanduser().resolve() if root else None

    @property
    def root(self) -> Path:
        if self._root is None:
            self._root = default_cache_dir()
        return self._root

    def _dir(self, *parts: str) -> Path:
        path = self.root.joinpath(*parts)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            # The deepest directory that could not be made (a parent that is a file: ENOTDIR).
            where = Path(exc.filename) if exc.filename and not isinstance(exc, FileExistsError) else path
            raise write_error(where, exc) from None
        return path

    def writable(self, *parts: str) -> Path:
        """The area `parts` (made on first use), checked writable by making and removing a file in it: a
        read-only cache is one error (EXIT_ENV) here, not an OSError wherever it is first written."""
        path = self._dir(*parts)
        probe = path / f".kvforge-probe-{os.getpid()}"
        try:
            probe.touch()
            probe.unlink()
        except OSError as exc:
            raise write_error(path, exc) from None
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
        """Evidence records (kvforge.core.evidence owns the layout below this)."""
        return self._dir("results")
