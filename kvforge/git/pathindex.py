"""A temporary git index holding only the entries of a commit's tree that a set of patches names.

`git apply --cached [--check]` reads and writes only the index entries of the paths a patch names, so against
such an index it gives the answer it gives against the commit's full index (vLLM's: 4,700 entries, 585 KB
read and written by every git call) at a fraction of the cost. The claim holds for a patch whose every named
path was looked up in the commit: each is a file there or absent, and none of its parent directories is a file
(apply replaces such entries in a full index; a partial one cannot know them). `PathIndex.usable` says, per
patch, whether it holds; a caller asks a full index for the patches it does not.

Owns only its own index file; writes objects to no repository.
"""

from __future__ import annotations

from pathlib import Path

from git.index.fun import read_cache

from kvforge.git import gitutil

# Lines of a git diff that name a path (after the prefix), in a file's header or a rename/copy.
_NAMING = (b"--- a/", b"+++ b/", b"rename from ", b"rename to ", b"copy from ", b"copy to ")


def named_paths(raw: bytes) -> set[str] | None:
    """Every path the diffs of a patch file name (either side), or None when one cannot be read plainly: a
    quoted name (git quotes names with unusual bytes) or a `diff --git` section naming no path it can read."""
    start = raw.find(b"\ndiff --git ")
    if start < 0:
        return set()
    out: set[str] = set()
    for section in raw[start + 1:].split(b"\ndiff --git "):
        names: set[str] = set()
        lines = section.split(b"\n")
        first = lines[0].removeprefix(b"diff --git ")
        half = (len(first) - 1) // 2
        if first[:2] == b"a/" and first[half:half + 3] == b" b/" and first[2:half] == first[half + 3:]:
            names.add(first[2:half].decode("utf-8", "surrogateescape"))
        for line in lines[1:]:
            for prefix in _NAMING:
                if line.startswith(prefix):
                    name = line[len(prefix):]
                    if name.startswith(b'"'):
                        return None
                    names.add(name.decode("utf-8", "surrogateescape"))
        if not names:
            return None
        out |= names
    return out


class PathIndex:
    """The entries of `commit` for the paths `raws` (patch files' bytes) name, in the index file `index`
    (created; the caller owns its directory). `usable[k]`: the index answers `git apply --cached` of patch k
    exactly as the commit's full index does (see the module docstring)."""

    def __init__(self, repo: Path, commit: str, raws: "list[bytes]", index: Path):
        self.repo, self.index = repo, index
        named = [named_paths(raw) for raw in raws]
        paths = set().union(*(n for n in named if n))
        parents = {d for p in paths for d in _parents(p)}
        kinds: dict[str, bytes] = {}
        info: list[bytes] = []
        if paths:
            listing = gitutil.run(repo, "ls-tree", "-z", "--full-tree", commit, "--", *sorted(paths | parents),
                                  env=self.env, binary=True).stdout
            for record in filter(None, listing.split(b"\0")):
                meta, name = record.split(b"\t", 1)
                mode, kind, oid = meta.split()
                kinds[name.decode("utf-8", "surrogateescape")] = kind
                if kind in (b"blob", b"commit"):  # files, links, submodules: what an index holds
                    info.append(b"%s %s\t%s" % (mode, oid, name))
        gitutil.run(repo, "update-index", "--add", "--index-info", stdin=b"".join(i + b"\n" for i in info),
                    env=self.env)
        self.usable = [n is not None and all(kinds.get(p, b"blob") != b"tree" for p in n)
                       and all(kinds.get(d, b"tree") == b"tree" for p in n for d in _parents(p)) for n in named]

    @property
    def env(self) -> dict[str, str]:
        """The environment that points git at this index (GIT_WORK_TREE: the index's directory, never read)."""
        return {"GIT_INDEX_FILE": str(self.index), "GIT_WORK_TREE": str(self.index.parent),
                "GIT_DIR": str(self.repo)}

    def entries(self) -> dict[bytes, tuple[int, str]]:
        """The index as it is now: path -> (mode, object id), stage 0 (read with GitPython)."""
        with open(self.index, "rb") as stream:
            _, found, _, _ = read_cache(stream)
        return {str(e.path).encode("utf-8", "surrogateescape"): (e.mode, e.hexsha)
                for (_, stage), e in found.items() if stage == 0}


def _parents(path: str) -> list[str]:
    return [path.rsplit("/", k)[0] for k in range(1, path.count("/") + 1)]
