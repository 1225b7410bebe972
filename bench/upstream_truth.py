#!/usr/bin/env python3
"""Independent truth for issue 38: does each release after the targets' bases have each shipped fix?

For every PyPI release of vLLM after 0.20.2 up to 0.33.0 and of vllm-ascend after 0.20.2rc1, and every
Fix-Id of the shipped series, one cell: `upstream` (the release has the fix), `needed` (it still has the
bug) or `cannot tell`, with the evidence. Nothing here runs kvforge's rebase or watch, nor any Check: the
cells come from the release sources (the PyPI sdists, read member by member with tarfile, never
extracted) and, for vllm-ascend, from upstream history (`--mirror`, a clone or bare git directory of
vllm-project/vllm-ascend: ancestry of the fix's commit to the release tag and patch-id).

Each fix has one stated predicate over a release's source (PROBES, justified in docs/upstream-truth.md);
a vllm-ascend release is also judged through the vLLM release its Dockerfile builds on (`VLLM_TAG`), as
the five fixes both components carry live in vLLM's scheduler code. Without `--mirror` the vllm-ascend
cells rest on the sdist predicates alone and say so.

`--compare WATCH.json` (the output of `kvforge watch --json`) reads the table in docs/upstream-truth.md instead
and prints how watch's rows agree with it: a row's answer is `upstream` (decision upstream or upstream (by
behaviour)), `needed` (the Checks fail without the fix, a port is proven, or a strong signal says upstream
lacks it), else `cannot tell` (a carried patch no signal judged, a row not checked or that needs a person for
another reason). Exit 1 when a row answers against the truth (a wrong verdict), else 0.

Usage: python bench/upstream_truth.py [--downloads DIR] [--mirror GITDIR] [--release vllm==0.22.0 ...]
                                      [--format markdown|json]
       python bench/upstream_truth.py --compare WATCH.json [--truth docs/upstream-truth.md]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

VLLM_RELEASES = ["0.21.0", "0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0",
                 "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0"]
ASCEND_RELEASES = ["0.21.0rc1", "0.22.1rc1", "0.23.0rc1", "0.23.0", "0.23.0.post1", "0.24.0rc1", "0.25.1rc1",
                   "0.26.0rc1", "0.27.1rc1", "0.28.0rc1", "0.29.0rc1", "0.30.0rc1", "0.30.0rc2"]
VLLM_FIXES = ["two-phase-kv-alloc", "swa-reachable-cache-mask", "kv-events-token-ids",
              "swa-retention-queue-split", "eagle-lookahead-block-hashes"]
ASCEND_FIXES = ["ascend-dsv4-compressed-prefix-lookup", "ascend-dsv4-block-size", "ascend-dsv4-partial-hash-hits",
                *VLLM_FIXES]
VERDICTS = ("upstream", "needed", "cannot tell")

# vllm-ascend fixes with an upstream commit: the patch header's Upstream-Commit, and the main-line commit
# of the same fix (#10297: same author, title and issue #10296 as #10298, adapted to main).
ASCEND_COMMITS = {
    "ascend-dsv4-compressed-prefix-lookup": ["d376f722e5", "eef0b36b3c"],
    "ascend-dsv4-block-size": ["bbeba20ce7"],
}
ASCEND_PENDING_PR = {"ascend-dsv4-partial-hash-hits": "#10193"}

CORE = "vllm/v1/core/"


@dataclass
class Cell:
    component: str
    release: str
    fix: str
    verdict: str
    evidence: str


class Sdist:
    """One release's sdist, read in place: text files by their path inside the package root."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tar = tarfile.open(path)
        self._members = {m.name.split("/", 1)[1]: m for m in self._tar.getmembers()
                         if m.isfile() and "/" in m.name}
        self._text: dict[str, str | None] = {}

    def names(self) -> list[str]:
        return list(self._members)

    def read(self, rel: str) -> str | None:
        if rel not in self._text:
            m = self._members.get(rel)
            f = self._tar.extractfile(m) if m is not None else None
            self._text[rel] = f.read().decode("utf-8", "replace") if f is not None else None
        return self._text[rel]

    def line(self, rel: str, pattern: str) -> int | None:
        """1-based line of the first match of `pattern` in `rel`, None when absent."""
        text = self.read(rel)
        if text is None:
            return None
        for i, ln in enumerate(text.splitlines(), 1):
            if re.search(pattern, ln):
                return i
        return None

    def function(self, rel: str, name: str) -> tuple[int, str] | None:
        """(first line, body) of the first `def name` in `rel` (up to the next def at its indent or less)."""
        text = self.read(rel)
        if text is None:
            return None
        lines = text.splitlines()
        for i, ln in enumerate(lines):
            m = re.match(rf"(\s*)def {re.escape(name)}\(", ln)
            if m:
                indent = len(m.group(1))
                end = i + 1
                while end < len(lines):
                    cur = lines[end]
                    if cur.strip() and len(cur) - len(cur.lstrip()) <= indent and not cur.lstrip().startswith(")"):
                        break
                    end += 1
                return i + 1, "\n".join(lines[i:end])
        return None


def at(rel: str, line: int | None) -> str:
    return f"`{rel.removeprefix(CORE)}:{line}`"


# ---- vLLM: one predicate per fix over the release source ----

def probe_two_phase(s: Sdist) -> tuple[str, str]:
    rel = CORE + "kv_cache_coordinator.py"
    local = s.line(rel, r"\.add_local_computed_blocks\(")
    ext = s.line(rel, r"\.allocate_external_computed_blocks\(")
    one = s.line(rel, r"manager\.allocate_new_computed_blocks\(")
    if local and ext and local < ext:
        return "upstream", (f"two-phase: {at(rel, local)} touches every group's local hits "
                            f"(add_local_computed_blocks) before {at(rel, ext)} allocates external blocks")
    if one:
        return "needed", (f"one phase per group: {at(rel, one)} calls each manager's allocate_new_computed_blocks "
                          "(touch hits + allocate external blocks) group after group")
    return "cannot tell", f"{rel} has neither the per-group call nor the two-phase calls"


def probe_swa_mask(s: Sdist) -> tuple[str, str]:
    stm = CORE + "single_type_kv_cache_manager.py"
    reach = s.line(stm, r"def reachable_block_mask\(")
    shift = s.line(stm, r"shift = 1 if use_eagle")
    old = s.line(stm, r"def _cache_block_mask\(")
    if reach and shift:
        return "upstream", (f"#42258 + #44082: {at(stm, reach)} reachable_block_mask, EAGLE lookahead block "
                            f"kept ({at(stm, shift)} `shift = 1 if use_eagle`)")
    if old:
        return "needed", (f"#42258 only: {at(stm, old)} _cache_block_mask has no EAGLE lookahead block "
                          "(no reachable_block_mask / use_eagle shift): with EAGLE/MTP the block a hit needs "
                          "is never cached")
    bp = CORE + "block_pool.py"
    if s.line(bp, r"block_mask") is None:
        return "needed", (f"no mask: {at(bp, s.line(bp, r'def cache_full_blocks'))} cache_full_blocks "
                          "caches every full sliding-window block")
    return "cannot tell", "block_pool.py takes a block_mask but no known mask builder is defined"


def probe_kv_events(s: Sdist) -> tuple[str, str]:
    bp = CORE + "block_pool.py"
    sl = s.line(bp, r"token_ids=request\.all_token_ids\[start_token_idx:end_token_idx\]")
    skip = s.line(bp, r"block_mask\[") or s.line(bp, r"if blk\.is_null|\.is_null:")
    if sl and skip:
        return "needed", (f"{at(bp, sl)} BlockStored.token_ids is the whole range's slice while block hashes "
                          f"skip masked/null blocks ({at(bp, skip)}); PR #44488 unmerged")
    return "cannot tell", f"{bp}: the BlockStored token_ids slice or the block skip is not where expected"


def probe_retention_split(s: Sdist) -> tuple[str, str]:
    bp = CORE + "block_pool.py"
    fn = s.function(bp, "free_blocks")
    retention = (s.line("vllm/envs.py", r"VLLM_PREFIX_CACHE_RETENTION_INTERVAL")
                 and "env VLLM_PREFIX_CACHE_RETENTION_INTERVAL")
    field = s.line("vllm/config/cache.py", r"prefix_cache_retention_interval")
    knob = (f"CacheConfig.prefix_cache_retention_interval (`config/cache.py:{field}`)" if field else retention)
    if fn is None:
        return "cannot tell", f"{bp} defines no free_blocks"
    start, body = fn
    split = "prepend_n" in body and "block_hash is None" in body
    if split and knob:
        return "upstream", (f"queue split #42656: {at(bp, start)} free_blocks prepends blocks without a hash, "
                            f"appends cached ones; retention #43447: {knob}")
    if split:
        return "needed", f"queue split at {at(bp, start)} but no retention interval knob"
    if "prepend" in body:
        stm = CORE + "single_type_kv_cache_manager.py"
        swa = s.line(stm, r"free_blocks\(\w+, prepend=True\)")
        return "cannot tell", (f"{at(bp, start)} free_blocks(prepend=...) only: SlidingWindowManager frees its "
                               f"uncached blocks first ({at(stm, swa)}), the other managers' free still appends "
                               f"uncached blocks behind cached ones; retention: {knob or 'none'}; whether DSv4's "
                               "re-send still loses its first-block keys takes a replay, not a reading")
    return "needed", (f"{at(bp, start)} free_blocks only append_n's (no uncached-first split); "
                      f"retention: {knob or 'none'}")


def probe_lookahead(s: Sdist) -> tuple[str, str]:
    bp = CORE + "block_pool.py"
    la = s.line(bp, r"num_hash_lookahead_tokens")
    if la:
        return "upstream", f"{at(bp, la)} BlockPool hashes lookahead tokens (num_hash_lookahead_tokens, #50897)"
    drop = (s.line("vllm/config/speculative.py", r"disable_eagle_block_drop")
            and " (0.30.0+: `disable_eagle_block_drop` opt-out, drop on by default, no lookahead hashes)")
    return "needed", f"{bp} has no num_hash_lookahead_tokens: EAGLE still drops the last matched block" + (drop or "")


VLLM_PROBES: dict[str, Callable[[Sdist], tuple[str, str]]] = {
    "two-phase-kv-alloc": probe_two_phase,
    "swa-reachable-cache-mask": probe_swa_mask,
    "kv-events-token-ids": probe_kv_events,
    "swa-retention-queue-split": probe_retention_split,
    "eagle-lookahead-block-hashes": probe_lookahead,
}


# ---- vllm-ascend: history first, then the release source ----

class Mirror:
    """A read-only git directory of vllm-project/vllm-ascend."""

    def __init__(self, gitdir: Path) -> None:
        self.gitdir = gitdir

    def git(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "--git-dir", str(self.gitdir), *args], capture_output=True, text=True,
                              timeout=120)

    def tag(self, version: str) -> str | None:
        t = f"v{version}"
        return t if self.git("rev-parse", "-q", "--verify", f"refs/tags/{t}").returncode == 0 else None

    def is_ancestor(self, commit: str, ref: str) -> bool:
        return self.git("merge-base", "--is-ancestor", commit, ref).returncode == 0

    def mentions(self, ref: str, text: str) -> bool:
        out = self.git("log", "--format=%h", "-F", f"--grep={text})", ref)
        return bool(out.stdout.strip())


ASC = "vllm_ascend/"


def vllm_base(s: Sdist) -> str | None:
    m = re.search(r"VLLM_TAG=v(\S+)", s.read("Dockerfile") or "")
    return m.group(1) if m else None


def ascend_source(fix: str, s: Sdist) -> tuple[str, str]:
    """The sdist predicate of a vllm-ascend-only fix."""
    stm = ASC + "core/single_type_kv_cache_manager.py"
    if fix == "ascend-dsv4-compressed-prefix-lookup":
        cls = s.line(stm, r"class CompressAttentionManager\(")
        logical = s.line(stm, r"BlockHashListWithBlockSize")
        if cls and logical:
            return "upstream", (f"`{stm}:{logical}` CompressAttentionManager converts hashes to "
                                "BlockHashListWithBlockSize (block_size x compress_ratio tokens)")
        if cls:
            return "needed", f"`{stm}:{cls}` CompressAttentionManager looks up physical-granularity hashes"
        kvi = ASC + "core/kv_cache_interface.py"
        spec = kvi if s.line(kvi, r"storage_block_size") else None
        if spec:
            return "upstream", ("no CompressAttentionManager (#13242): compressed specs use logical block sizes "
                                f"with upstream FullAttentionManager (`storage_block_size` in `{spec}`)")
        return "cannot tell", "no CompressAttentionManager and no logical/physical split found"
    if fix == "ascend-dsv4-block-size":
        ln = s.line(ASC + "utils.py", r"block_size not in \[32, 64, 128\]")
        if ln:
            return "upstream", f"`{ASC}utils.py:{ln}` DeepSeek-V4 --block-size accepts 32 / 64 / 128"
        return "needed", f"`{ASC}utils.py` has no 32 / 64 / 128 block-size choice"
    if fix == "ascend-dsv4-partial-hash-hits":
        coord = ASC + "patch/platform/patch_kv_cache_coordinator.py"
        env = s.line(ASC + "envs.py", r"PARTIAL_HASH_HITS|PARTIAL_PREFIX")
        index = s.read(ASC + "core/partial_prefix_cache.py") is not None or s.line(coord, r"PartialHashIndex")
        on = s.line(coord, r"self\.enable_partial_hash_hits = ")
        text = (s.read(coord) or "").splitlines()
        mamba_only = on is None or "MambaSpec" in "\n".join(text[on - 1:on + 4])
        if env is None and not index and mamba_only:
            where = (f"`{coord}:{on}` turns partial hits on for Mamba 'align' groups only" if on
                     else f"`{coord}` has no partial-hit path")
            return "needed", (f"{where}; no partial-hit switch in `{ASC}envs.py`, no partial index for "
                              "compressed groups: their hits stay whole blocks")
        return "cannot tell", f"a partial-hit switch or path exists (`envs.py:{env}`, `coordinator:{on}`): read it"
    raise KeyError(fix)


def ascend_shared(fix: str, s: Sdist, base: Sdist | None) -> tuple[str, str]:
    """A fix both components carry: the vLLM release the sdist builds on, and vllm-ascend's overrides."""
    if base is None:
        return "cannot tell", "the vLLM sdist this release builds on is not in the downloads"
    bv, bev = VLLM_PROBES[fix](base)
    on = f"on vLLM {base.path.name.removeprefix('vllm-').removesuffix('.tar.gz')}: {bv} ({bev})"
    coord = ASC + "patch/platform/patch_kv_cache_coordinator.py"
    stm = ASC + "core/single_type_kv_cache_manager.py"
    if bv != "upstream":
        return bv, on
    if fix == "two-phase-kv-alloc":
        over = s.line(coord, r"def allocate_new_computed_blocks\(")
        cls = s.line(stm, r"class CompressAttentionManager\(")
        ext = s.line(stm, r"def allocate_external_computed_blocks\(")
        if over:
            return "cannot tell", f"{on}; but `{coord}:{over}` overrides allocate_new_computed_blocks"
        if cls and not ext:
            return "needed", f"{on}; but CompressAttentionManager (`{stm}:{cls}`) has no compressed external phase"
        how = (f"CompressAttentionManager scales the external phase (`{stm}:{ext}`)" if cls
               else "no CompressAttentionManager (compressed groups use vLLM's managers)")
        return "upstream", f"{on}; the Ascend coordinator keeps vLLM's two phases; {how}"
    if fix == "swa-reachable-cache-mask":
        ln = s.line(coord, r"reachable_block_mask")
        sets = s.line(coord, r"mgr\.(scheduler_block_size|cache_hit_alignment_tokens) = self\.")
        if ln and sets:
            return "upstream", (f"{on}; the Ascend coordinator aligns vLLM's reachable_block_mask with its hits "
                                f"(`{coord}:{sets}` sets each manager's write-mask alignment)")
        return "cannot tell", f"{on}; the Ascend coordinator does not set its managers' hit alignment"
    if fix == "swa-retention-queue-split":
        ln = s.line(coord, r"retention_interval")
        if ln:
            return "upstream", f"{on}; `{coord}:{ln}` the Ascend coordinator takes the retention interval"
        return "needed", f"{on}; the Ascend coordinator drops the retention interval"
    if fix == "kv-events-token-ids":
        return "upstream", on
    if fix == "eagle-lookahead-block-hashes":
        return "upstream", on
    raise KeyError(fix)


def ascend_cell(version: str, fix: str, s: Sdist, base: Sdist | None, mirror: Mirror | None) -> Cell:
    if fix not in ASCEND_COMMITS and fix not in ASCEND_PENDING_PR:
        verdict, ev = ascend_shared(fix, s, base)
        if fix == "kv-events-token-ids" and verdict == "needed":
            own = [n for n in s.names() if n.startswith((ASC + "core/", ASC + "patch/"))
                   and "BlockStored(" in (s.read(n) or "")]
            ev += "; vllm_ascend builds no BlockStored of its own" if not own else f"; own BlockStored in {own[0]}"
        return Cell("vllm-ascend", version, fix, verdict, ev)
    verdict, ev = ascend_source(fix, s)
    if mirror is None:
        return Cell("vllm-ascend", version, fix, verdict, f"sdist: {ev}; history not read (no --mirror)")
    tag = mirror.tag(version)
    if tag is None:
        return Cell("vllm-ascend", version, fix, verdict, f"no tag v{version} in the mirror; sdist: {ev}")
    if fix in ASCEND_COMMITS:
        inside = [c for c in ASCEND_COMMITS[fix] if mirror.is_ancestor(c, tag)]
        hist = "upstream" if inside else "needed"
        hev = (f"{inside[0]} is an ancestor of {tag}" if inside
               else f"none of {', '.join(ASCEND_COMMITS[fix])} is an ancestor of {tag}")
    else:
        pr = ASCEND_PENDING_PR[fix]
        hist = "needed" if not mirror.mentions(tag, pr) else "cannot tell"
        hev = f"no commit of {tag} names {pr}" if hist == "needed" else f"a commit of {tag} names {pr}"
    if hist != verdict:
        return Cell("vllm-ascend", version, fix, "cannot tell", f"history says {hist} ({hev}), sdist says {ev}")
    return Cell("vllm-ascend", version, fix, verdict, f"{hev}; sdist: {ev}")


def downloads_dir() -> Path:
    env = os.environ.get("KVFORGE_CACHE")
    root = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvforge"
    return root / "downloads"


def table(cells: list[Cell]) -> str:
    out = ["| component | release | fix | verdict | evidence |", "|---|---|---|---|---|"]
    out += [f"| {c.component} | {c.release} | {c.fix} | {c.verdict} | {c.evidence.replace('|', '/')} |"
            for c in cells]
    return "\n".join(out)


TRUTH_ROW = re.compile(r"^\| (vllm|vllm-ascend) \| (\S+) \| (\S+) \| (upstream|needed|cannot tell) \|")


def read_truth(doc: Path) -> dict[tuple[str, str, str], str]:
    """(component, release, Fix-Id) -> upstream | needed | cannot tell, from the doc's table."""
    return {(m[1], m[2], m[3]): m[4] for m in map(TRUTH_ROW.match, doc.read_text().splitlines()) if m}


def watch_answer(row: dict) -> str:
    """What one `kvforge watch --json` patch row says about the release: upstream | needed | cannot tell."""
    if row.get("decision") in ("upstream", "upstream (by behaviour)"):
        return "upstream"
    if row.get("behaviour") == "needed" or row.get("decision") == "port proven" or \
            str(row.get("reason") or "").startswith("upstream lacks it"):
        return "needed"
    return "cannot tell"


def compare(watch_json: Path, doc: Path) -> int:
    truth = read_truth(doc)
    counts: dict[str, int] = {}
    wrong: list[str] = []
    for rel in json.loads(watch_json.read_text())["releases"]:
        for chk in rel["checks"]:
            for row in chk["patches"]:
                key = (chk["component"], rel["version"], row["fix_id"])
                said, true = watch_answer(row), truth.get(key, "no truth row")
                label = (f"agree: {said}" if said == true else f"watch cannot tell (truth: {true})"
                         if said == "cannot tell" else f"truth cannot tell (watch: {said})"
                         if true in ("cannot tell", "no truth row") else "WRONG")
                counts[label] = counts.get(label, 0) + 1
                if label == "WRONG":
                    wrong.append(f"{chk['target']} {'/'.join(key)}: watch {row['decision']} ({said}), truth {true}")
    print("| rows | watch vs truth |\n|---|---|")
    for label, n in sorted(counts.items()):
        print(f"| {n} | {label} |")
    for w in wrong:
        print(f"wrong: {w}")
    return 1 if wrong else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", type=Path, default=None, metavar="WATCH_JSON",
                    help="compare a `kvforge watch --json` output with the truth table instead")
    ap.add_argument("--truth", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "upstream-truth.md")
    ap.add_argument("--downloads", type=Path, default=None, help="the sdists (default: the kvforge cache's)")
    ap.add_argument("--mirror", type=Path, default=None, help="a git directory of vllm-project/vllm-ascend")
    ap.add_argument("--release", action="append", default=[],
                    help="vllm==X or vllm-ascend==X (repeatable; default: every release after the bases)")
    ap.add_argument("--format", choices=("markdown", "json"), default="markdown")
    a = ap.parse_args(argv)
    if a.compare:
        return compare(a.compare, a.truth)
    dl = a.downloads or downloads_dir()
    mirror = Mirror(a.mirror) if a.mirror else None
    bad = [r for r in a.release if r.count("==") != 1]
    if bad:
        sys.exit(f"--release {bad[0]}: expected vllm==VERSION or vllm-ascend==VERSION")
    wanted = [tuple(r.split("==", 1)) for r in a.release] or (
        [("vllm", v) for v in VLLM_RELEASES] + [("vllm-ascend", v) for v in ASCEND_RELEASES])
    opened: dict[Path, Sdist] = {}

    def sdist(name: str) -> Sdist | None:
        p = dl / name
        if not p.is_file():
            return None
        if p not in opened:
            opened[p] = Sdist(p)
        return opened[p]

    cells: list[Cell] = []
    for comp, ver in wanted:
        if comp == "vllm":
            s = sdist(f"vllm-{ver}.tar.gz")
            for fix in VLLM_FIXES:
                verdict, ev = VLLM_PROBES[fix](s) if s else ("cannot tell", f"vllm-{ver}.tar.gz not in downloads")
                cells.append(Cell("vllm", ver, fix, verdict, ev))
        elif comp == "vllm-ascend":
            s = sdist(f"vllm_ascend-{ver}.tar.gz")
            if s is None:
                cells += [Cell(comp, ver, f, "cannot tell", f"vllm_ascend-{ver}.tar.gz not in downloads")
                          for f in ASCEND_FIXES]
                continue
            bv = vllm_base(s)
            base = sdist(f"vllm-{bv}.tar.gz") if bv else None
            cells += [ascend_cell(ver, f, s, base, mirror) for f in ASCEND_FIXES]
        else:
            sys.exit(f"--release {comp}=={ver}: the component must be vllm or vllm-ascend")
    print(json.dumps([asdict(c) for c in cells], indent=1) if a.format == "json" else table(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
