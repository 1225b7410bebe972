"""docs/upstream-truth.md, issue 38's truth table, is complete and is what bench/upstream_truth.py reads.

Fast: the table parses; it has one row per (component, release, Fix-Id) for every Fix-Id of the shipped
series (patches/v0.20.2rc, v0.20.1, main for vllm; v0.20.2rc-vllm-ascend for vllm-ascend) and every
release the script covers; each cell is upstream / needed / cannot tell with a non-empty evidence note;
the summary and the counts agree with the rows. Slow: the script, re-run on the real sdists of vLLM
0.22.0 and 0.33.0 (downloaded once into the user's kvforge cache), prints exactly the doc's cells.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from kvforge.core.cache import Cache, default_cache_dir
from kvforge.git.bases import download_sdist
from kvforge.project.targets import Release

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "upstream-truth.md"
SCRIPT = ROOT / "bench" / "upstream_truth.py"
SERIES = {"vllm": ["v0.20.2rc", "v0.20.1", "main"], "vllm-ascend": ["v0.20.2rc-vllm-ascend"]}
VERDICTS = {"upstream", "needed", "cannot tell"}

_spec = importlib.util.spec_from_file_location("upstream_truth", SCRIPT)
assert _spec is not None and _spec.loader is not None
truth = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("upstream_truth", truth)
_spec.loader.exec_module(truth)


def section(title: str) -> list[str]:
    """The lines of the doc's `## title` section."""
    lines = DOC.read_text(encoding="utf-8").splitlines()
    start = lines.index(f"## {title}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def rows(lines: list[str]) -> list[list[str]]:
    """Every markdown table row of `lines`, split into cells (header and separator rows included)."""
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines if ln.startswith("|")]


def cells() -> dict[tuple[str, str, str], dict[str, str]]:
    table = rows(section("The table"))
    assert table[0] == ["component", "release", "fix", "verdict", "how", "evidence"], table[0]
    out: dict[tuple[str, str, str], dict[str, str]] = {}
    for r in table[2:]:
        assert len(r) == 6, r
        key = (r[0], r[1], r[2])
        assert key not in out, f"two rows for {key}"
        out[key] = dict(zip(table[0], r))
    return out


def shipped_fix_ids(component: str) -> set[str]:
    ids = set()
    for name in SERIES[component]:
        d = ROOT / "patches" / name
        listed = [ln.split("#", 1)[0].strip() for ln in (d / "series").read_text(encoding="utf-8").splitlines()]
        for patch in filter(None, listed):
            header = (d / patch).read_text(encoding="utf-8").split("\n---\n", 1)[0]
            ids.update(re.findall(r"^Fix-Id: (\S+)$", header, re.M))
    return ids


def test_every_shipped_fix_and_release_has_a_cell():
    got = cells()
    for component, releases in (("vllm", truth.VLLM_RELEASES), ("vllm-ascend", truth.ASCEND_RELEASES)):
        fixes = shipped_fix_ids(component)
        assert fixes and fixes == {f for (c, _, f) in got if c == component}, component
        missing = [(component, r, f) for r in releases for f in fixes if (component, r, f) not in got]
        assert not missing, f"no cell for {missing[:5]}"
    assert len(got) == len(truth.VLLM_RELEASES) * 5 + len(truth.ASCEND_RELEASES) * 8
    assert truth.VLLM_RELEASES[0] == "0.21.0" and truth.VLLM_RELEASES[-1] == "0.33.0"
    assert truth.ASCEND_RELEASES[0] == "0.21.0rc1" and len(truth.VLLM_RELEASES + truth.ASCEND_RELEASES) == 29


def test_every_cell_is_a_verdict_with_evidence():
    for key, c in cells().items():
        assert c["verdict"] in VERDICTS, f"{key}: {c['verdict']!r}"
        assert c["evidence"] and c["how"], f"{key}: no evidence or no `how`"


def test_summary_and_counts_agree_with_the_rows():
    got = cells()
    short = {"U": "upstream", "N": "needed", "?": "cannot tell"}
    seen = 0
    for r in rows(section("Summary (U upstream, N needed, ? cannot tell)")):
        if r[0].endswith("Fix-Id"):
            component, releases = r[0].removesuffix(" Fix-Id"), r[1:]
        elif not r[0].startswith("---"):
            for release, mark in zip(releases, r[1:], strict=True):
                assert got[(component, release, r[0])]["verdict"] == short[mark], (component, release, r[0])
                seen += 1
    assert seen == len(got)
    counts = Counter((k[0], c["verdict"]) for k, c in got.items())
    for r in rows(section("Counts"))[2:]:
        component, total, up, needed, unsure = r
        assert [int(total), int(up), int(needed), int(unsure)] == [
            sum(n for (c, _), n in counts.items() if c == component), counts[(component, "upstream")],
            counts[(component, "needed")], counts[(component, "cannot tell")]], component


@pytest.mark.slow
def test_script_reproduces_the_docs_cells_from_two_real_sdists():
    user = Cache(default_cache_dir())
    for version in ("0.22.0", "0.33.0"):
        if not (user.downloads / f"vllm-{version}.tar.gz").is_file():
            class Wanted:  # what download_sdist reads of a component
                release = Release("vllm", version)
            download_sdist(Wanted, user, print)  # type: ignore[arg-type]
    res = subprocess.run([sys.executable, str(SCRIPT), "--downloads", str(user.downloads), "--format", "json",
                          "--release", "vllm==0.22.0", "--release", "vllm==0.33.0"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    printed = json.loads(res.stdout)
    assert len(printed) == 10
    doc = cells()
    for c in printed:
        row = doc[(c["component"], c["release"], c["fix"])]
        assert (row["verdict"], row["evidence"]) == (c["verdict"], c["evidence"].replace("|", "/")), c
