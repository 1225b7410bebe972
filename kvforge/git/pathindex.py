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

import struct
from pathlib import Path

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
        """The index as it is now: path -> (mode, object id), stage 0 (read from the file: an index of version 2
        or 3, as git writes it by default; any other version through `git ls-files --stage`)."""
        data = self.index.read_bytes()
        if data[:4] != b"DIRC":
            raise ValueError(f"{self.index}: not a git index")
        version, count = struct.unpack_from(">LL", data, 4)
        if version not in (2, 3):
            listing = gitutil.run(self.index.parent, "ls-files", "--stage", "-z", env=self.env, binary=True).stdout
            out: dict[bytes, tuple[int, str]] = {}
            for record in filter(None, listing.split(b"\0")):
                meta, name = record.split(b"\t", 1)
                mode, oid, stage = meta.split()
                if stage == b"0":
                    out[name] = (int(mode, 8), oid.decode())
            return out
        return _entries(data, count)


def _entries(data: bytes, count: int) -> dict[bytes, tuple[int, str]]:
    """The stage-0 entries of an index of version 2 or 3 (`data`, `count` entries from offset 12): each a fixed
    62-byte part (mode at 24, object id at 40, flags at 60), 2 more bytes when extended, the name (its length in
    the flags, NUL-terminated when 0xFFF or longer), NUL-padded to a multiple of 8 bytes."""
    out: dict[bytes, tuple[int, str]] = {}
    unpack, pos = struct.unpack_from, 12
    for _ in range(count):
        mode, = unpack(">L", data, pos + 24)
        flags, = unpack(">H", data, pos + 60)
        name_at = pos + (64 if flags & 0x4000 else 62)
        length = flags & 0xFFF
        end = data.index(b"\0", name_at + length) if length == 0xFFF else name_at + length
        if not flags & 0x3000:
            out[data[name_at:end]] = (mode, data[pos + 40:pos + 60].hex())
        pos += (end - pos + 8) & ~7
    return out


def _parents(path: str) -> list[str]:
    return [path.rsplit("/", k)[0] for k in range(1, path.count("/") + 1)]
