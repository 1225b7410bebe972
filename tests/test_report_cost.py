"""`kvforge report`: the carrying cost per fix and target (kvforge/flow/carrying.py), its totals and its JSON."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import git, make_patch, write_series
from test_verify import errline

from kvforge.core import evidence
from kvforge.core.cache import Cache
from kvforge.flow.carrying import classify
from kvforge.cli import main

REPO_ROOT = Path(__file__).resolve().parent.parent

LEDGER = """\
[[dropped]]
file = "0009-gone.patch"
fix_id = "{fix}"
decision = "skipped"
dropped_at = "2026-11-23T12:00:00Z"
onto_version = "0.21.0"

[[dropped]]
file = "0009-gone.patch"
fix_id = "{fix}"
decision = "upstream"
dropped_at = "2026-11-23T13:00:00Z"
onto_version = "0.22.0"
"""


def kvforge(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("value,want", [
    ("Pending", ("Pending", "not-forwarded")),
    ("Submitted [https://github.com/vllm-project/vllm/pull/1]", ("Submitted", "forwarded")),
    ("Backport [https://github.com/vllm-project/vllm/pull/1]", ("Backport", "not-needed")),
    ("Inappropriate [downstream only]", ("Inappropriate", "not-needed")),
    ("Accepted", ("Accepted", "forwarded")),
    ("Denied", ("Denied", "forwarded")),
    ("Backport", ("malformed", "invalid")),  # Backport needs [where] (docs/patch-format.md)
    ("Someday", ("malformed", "invalid")),
    ("", ("missing", "invalid")),
])
def test_upstream_status_categories(value, want):
    assert classify(value) == want


def test_report_rows_history_ledger_and_evidence(project, base_v0202):
    """One target on the real vLLM 0.20.2: git history gives first-carried and commits (through a rename), the
    ledger the drops, a verify record of exactly this base and series is current, of another series stale."""
    cache, base = base_v0202
    pdir = project / "patches" / "t"
    a, _ = make_patch(base.repo, base.commit, {"vllm/v1/core/block_pool.py": ("class BlockPool", "class BlockPoolA")},
                      "[Core] a", "fix-a", pdir / "0001-fix-a.patch")
    b, _ = make_patch(base.repo, base.commit, {"vllm/v1/core/kv_cache_utils.py": ("import ", "import  ")},
                      "[Core] b", "fix-b", pdir / "0002-fix-b.patch")
    a.write_bytes(a.read_bytes().replace(b"Drop-When: never", b"Drop-When: version >= 0.20.2"))
    b.write_bytes(b.read_bytes().replace(b"Upstream-Status: Pending",
                                         b"Upstream-Status: Submitted [https://github.com/vllm-project/vllm/pull/7]")
                  .replace(b"Drop-When: never", b"Drop-When: version >= 0.21.0"))
    write_series(project, "0001-fix-a.patch", "0002-fix-b.patch")
    git(project, "init", "-q")
    git(project, "add", "-A")
    git(project, "commit", "-qm", "series")
    # fix-b: renamed, then edited: three commits through the rename
    git(project, "mv", "patches/t/0002-fix-b.patch", "patches/t/0002-fix-b-renamed.patch")
    write_series(project, "0001-fix-a.patch", "0002-fix-b-renamed.patch")
    git(project, "commit", "-qam", "rename")
    p = pdir / "0002-fix-b-renamed.patch"
    p.write_bytes(p.read_bytes().replace(b"Body.", b"Body, edited."))
    git(project, "commit", "-qam", "edit", env={"GIT_COMMITTER_DATE": "2026-11-23T12:00:00+00:00"})
    (pdir / "dropped.toml").write_text(LEDGER.format(fix="fix-b"))

    # the session's test cache may hold other tests' records of a target named "t" on this base: not this test's
    c = Cache(Path(os.environ["KVFORGE_CACHE"]))
    shutil.rmtree(c.results / "t", ignore_errors=True)
    res = kvforge("report", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    rows = {r["fix_id"]: r for r in data["rows"]}
    assert set(rows) == {"fix-a", "fix-b"}
    assert (rows["fix-a"]["commits"], rows["fix-a"]["rewrites"], rows["fix-a"]["first_carried"]) == (1, 0, "2026-11-22")
    assert (rows["fix-b"]["commits"], rows["fix-b"]["rewrites"], rows["fix-b"]["first_carried"]) == (3, 2, "2026-11-22")
    assert (rows["fix-b"]["dropped"], rows["fix-b"]["conflicts_skipped"], rows["fix-a"]["dropped"]) == (2, 1, 0)
    assert rows["fix-a"]["drop_when_met"] is True and rows["fix-b"]["drop_when_met"] is False
    assert rows["fix-a"]["drop_when_on"] == "0.20.2 (t)"
    assert rows["fix-b"]["prs"] == ["https://github.com/vllm-project/vllm/pull/7"]
    assert (rows["fix-b"]["status"], rows["fix-b"]["udd"]) == ("Submitted", "forwarded")
    assert rows["fix-a"]["evidence"] == "missing"
    t = data["totals"]
    assert t["by_status"]["Pending"] == 1 and t["by_status"]["Submitted"] == 1 and t["udd"]["forwarded"] == 1
    assert data["trend_row"]["status_pending"] == 1 and data["trend_row"]["commits"] == 4
    assert data["trend_row"]["project_commit"] == git(project, "rev-parse", "HEAD").strip()

    # a verify record of another series: stale; one of exactly this base and series: current (with its verdict)
    from kvforge.project.series import read_series
    digest = read_series(pdir).digest
    evidence.save(c, evidence.Record("verify", evidence.Key("t", "vllm", base.commit, "0" * 12), ok=True,
                                     created="2026-11-23T10:00:00+00:00",
                                     data={"patches": [{"fix_id": "fix-a", "status": "proven"}]}))
    rows = {r["fix_id"]: r for r in json.loads(kvforge("report", "--json").stdout)["rows"]}
    assert (rows["fix-a"]["evidence"], rows["fix-a"]["evidence_verdict"]) == ("stale", "proven")
    evidence.save(c, evidence.Record("verify", evidence.Key("t", "vllm", base.commit, digest), ok=True,
                                     created="2026-11-23T11:00:00+00:00",
                                     data={"patches": [{"fix_id": "fix-a", "status": "proven"},
                                                       {"fix_id": "fix-b", "status": "not proven"}]}))
    rows = {r["fix_id"]: r for r in json.loads(kvforge("report", "--json").stdout)["rows"]}
    assert (rows["fix-a"]["evidence"], rows["fix-b"]["evidence_verdict"]) == ("current", "not proven")

    text = kvforge("report").stdout
    line = next(ln for ln in text.splitlines() if "fix-b" in ln)
    assert "Submitted" in line and "#7" in line and "not yet: version >= 0.21.0" in line
    assert "3 commits, dropped 2x (1 after a conflict)" in line
    md = kvforge("report", "--format", "markdown").stdout
    assert md.startswith("## Carrying cost\n\n| target | patch |") and "| Submitted | 1 |" in md
    trend = kvforge("report", "--format", "trend").stdout
    assert len(trend.strip().splitlines()) == 1 and json.loads(trend)["status_submitted"] == 1

    # COLUMNS=80 kvforge report | awk '{ if (length > 80) exit 1 }': the table wraps, JSON is never fitted
    assert max(len(ln) for ln in text.splitlines()) > 80  # the unfitted table is wider
    doc = json.loads(kvforge("report", "--json").stdout)
    fitted = CliRunner(env={"COLUMNS": "80"}).invoke(main, ["report"])
    assert fitted.exit_code == 0 and all(len(ln) <= 80 for ln in fitted.stdout.splitlines()), fitted.stdout
    assert "1 target;" in fitted.stdout.replace("\n", " ") and "1 targets" not in fitted.stdout
    again = json.loads(CliRunner(env={"COLUMNS": "80"}).invoke(main, ["report", "--json"]).stdout)
    assert again["rows"] == doc["rows"]


def test_report_bad_target_is_exit_2_one_line(project):
    res = kvforge("report", "-t", "nope", "--json")
    assert res.exit_code == 2
    assert json.loads(res.stdout) == {"error": "--target nope: no such target (known: t)", "exit": 2}


def test_report_refuses_a_series_listing_a_patch_that_does_not_exist(project, base_v0202):
    """It was counted around (exit 0, the patch missing from every figure): one line naming the series file, its
    line and the patch, exit 2."""
    cache, base = base_v0202
    pdir = project / "patches" / "t"
    make_patch(base.repo, base.commit, {"vllm/v1/core/block_pool.py": ("class BlockPool", "class BlockPoolA")},
               "[Core] a", "fix-a", pdir / "0001-fix-a.patch")
    write_series(project, "0001-fix-a.patch", "0002-not-there.patch")
    res = kvforge("report")
    assert res.exit_code == 2, res.output
    line = errline(res)
    assert f"{pdir / 'series'}:2: 0002-not-there.patch does not exist" in line and res.stdout == ""


@pytest.mark.parametrize("data", [[], {"patches": "fix-a"}], ids=["data-a-list", "patches-a-string"])
def test_report_refuses_a_malformed_verify_record_naming_it(project, base_v0202, data):
    """A verify record whose data is not what verify writes was an AttributeError (exit 70): now one line naming the
    record's file, exit 2."""
    cache, base = base_v0202
    pdir = project / "patches" / "t"
    make_patch(base.repo, base.commit, {"vllm/v1/core/block_pool.py": ("class BlockPool", "class BlockPoolA")},
               "[Core] a", "fix-a", pdir / "0001-fix-a.patch")
    write_series(project, "0001-fix-a.patch")
    shutil.rmtree(cache.results / "t", ignore_errors=True)
    path = evidence.save(cache, evidence.Record("verify", evidence.Key("t", "vllm", base.commit, "0" * 16), ok=True))
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "data": data}))
    res = kvforge("report")
    shutil.rmtree(cache.results / "t", ignore_errors=True)
    assert res.exit_code == 2, res.output
    assert errline(res).startswith(f"kvforge: error: {path}: not a kvforge ")


def _header_counts() -> tuple[Counter, int]:
    """Upstream-Status categories straight from the shipped series' headers (grep, not kvforge)."""
    counts: Counter = Counter()
    n = 0
    for series in (REPO_ROOT / "patches").glob("*/series"):
        for name in (ln.split("#")[0].strip() for ln in series.read_text().splitlines()):
            if not name:
                continue
            text = (series.parent / name).read_text()
            counts[re.search(r"^Upstream-Status: (\w[\w-]*)", text, re.M).group(1)] += 1
            n += 1
    return counts, n


@pytest.mark.slow
def test_report_on_the_shipped_targets():
    """The real series on their real bases (the shared cache: vLLM 0.20.1, 0.20.2, 0.33.0 and vllm-ascend
    0.20.2rc1 sdists): figures checked against the headers, the history and Drop-When by hand."""
    env = {k: v for k, v in os.environ.items() if k not in ("KVFORGE_ROOT",)}
    run = subprocess.run([sys.executable, "-m", "kvforge.cli", "report", "--json"], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    counts, n = _header_counts()
    assert data["totals"]["patches"] == n == len(data["rows"]) == 19
    assert {k: v for k, v in data["totals"]["by_status"].items() if v} == dict(counts)
    assert dict(counts) == {"Pending": 4, "Backport": 10, "Inappropriate": 5}
    assert data["totals"]["udd"] == {"forwarded": 0, "not-forwarded": 4, "not-needed": 15, "invalid": 0}
    assert data["newest"] == {"vllm": "0.33.0 (main)", "vllm-ascend": "0.20.2rc1 (v0.20.2rc)"}
    by = {(r["target"], r["component"], r["fix_id"]): r for r in data["rows"]}
    for r in data["rows"]:
        m = re.match(r"version >= (\S+)$", r["drop_when"])
        if r["component"] == "vllm" and m:  # every `version >= X` of ours has X <= 0.33.0
            assert r["drop_when_met"] is True, r
        elif r["drop_when"].startswith(("never", "upstream-pr-merged")):
            assert r["drop_when_met"] is None, r
        rel = f"patches/{Path(r['target'] if r['component'] == 'vllm' else r['target'] + '-' + r['component'])}"
        log = subprocess.run(["git", "log", "--follow", "--format=%H", "--", f"{rel}/{r['patch']}"], cwd=REPO_ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
        assert r["commits"] == len(log) and r["first_commit"] == log[-1]
        assert r["evidence"] in ("current", "stale", "missing")
    assert by[("main", "vllm", "kv-events-token-ids")]["releases"] == ["0.20.1", "0.20.2", "0.33.0"]
    assert by[("v0.20.1", "vllm", "two-phase-kv-alloc")]["releases"] == ["0.20.1", "0.20.2"]
    assert by[("v0.20.1", "vllm", "two-phase-kv-alloc")]["prs"] == ["https://github.com/vllm-project/vllm/pull/44409"]
    assert by[("v0.20.2rc", "vllm-ascend", "two-phase-kv-alloc")]["releases"] == ["0.20.2rc1"]
    assert data["totals"]["drop_when_met"] == 8  # 0001, 0002, 0004, 0005 of v0.20.1 and v0.20.2rc on 0.33.0
    text = subprocess.run([sys.executable, "-m", "kvforge.cli", "report", "-t", "main"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=900).stdout
    assert "main/vllm" in text and "v0.20.1/vllm" not in text and "Pending            1" in text
