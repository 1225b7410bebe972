"""`kvforge pr` and `kvforge notes`: texts generated from a series and its typed evidence.

A fixture series (two annotated patches on the tiny vLLM-like tree of test_verify's `fake`
fixture, whose base carries a real vLLM PR template) gets fixture evidence: verify and bench
records built with kvforge's own VerifyReport / bench aggregation and saved through
kvforge.core.evidence, so the golden texts in tests/golden/ are byte-stable. Other tests use real
evidence from real `kvforge verify` runs on the same tree. `gh` is never run: a labelled FAKE gh
script records what `--open` hands it.

Regenerate the golden files after an intended change: KVFORGE_UPDATE_GOLDEN=1 pytest tests/test_pr.py
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import IDENT, git
from test_verify import CLAMP_FIX, errline, kvforge

from kvforge import DATA
from kvforge.core import evidence
from kvforge.flow import prpolicy
from kvforge.flow.pr import conventions, facts
from kvforge.flow.pr.evidence import BENCH_SCENARIOS
from kvforge.bench.prefix_cache import aggregate, goals
from kvforge.core.cache import Cache
from kvforge.core.errors import KvforgeError
from kvforge.project.series import read_series
from kvforge.proof.verify import CheckResult, PatchVerdict, VerifyReport, fail_kind

GOLDEN = Path(__file__).resolve().parent / "golden"
UPSTREAM = DATA / "templates" / "upstream"
CREATED = "2026-11-22T12:00:00.000000+00:00"

CLAMP_MSG = """\
[Core] Clamp values to the upper bound too

clamp() applied only the lower bound, so clamp(5, 0, 3) returned 5 and
callers got values above hi. Apply both bounds.

Fix-Id: clamp-upper
Kind: fix
Upstream-Status: Backport [https://github.com/vllm-project/vllm/pull/101]
Upstream-PR: https://github.com/vllm-project/vllm/pull/101
Upstream-Commit: abc1234
Bug: https://github.com/vllm-project/vllm/issues/100
Why: clamp() ignored its upper bound, so callers got values above hi.
Drop-When: base-contains abc1234
Checks: tests/test_kvforge_clamp.py::test_clamp_upper
Checks: tests/test_core.py::test_clamp_in_core
Signed-off-by: {ident}
"""

FACTOR_MSG = """\
[Core] Read the doubling factor from VLLM_FAKE_FACTOR

double() hard-coded its factor (upstream issue #102):
- vllm/envs.py gets VLLM_FAKE_FACTOR (default 2),
  read when it is used.
- a test shows the default.

Fix-Id: fake-factor
Kind: fix
Upstream-Status: Pending
Upstream-PR: https://github.com/vllm-project/vllm/pull/103
Bug: https://github.com/vllm-project/vllm/issues/102
Why: double() could not be tuned
 without editing the code.
Drop-When: upstream-pr-merged https://github.com/vllm-project/vllm/pull/103
Depends-On: clamp-upper
Checks: tests/test_kvforge_factor.py::test_factor_from_env
Signed-off-by: {ident}
"""

FACTOR_FIX = {
    "vllm/__init__.py": ("", ""),
    "vllm/envs.py": ("", 'import os\n\nenvironment_variables = {\n'
                         '    "VLLM_FAKE_FACTOR": lambda: int(os.getenv("VLLM_FAKE_FACTOR", "2")),\n}\n'),
    "vllm_like/core.py": ("def double(x):\n    return 2 * x",
                          "def double(x):\n    from vllm.envs import environment_variables\n\n"
                          "    return environment_variables[\"VLLM_FAKE_FACTOR\"]() * x"),
    # Behavioural: on the old code double() ignores the setting (4 != 6), not just a missing import.
    "tests/test_kvforge_factor.py": ("", "from vllm_like.core import double\n\n\n"
                                         "def test_factor_from_env(monkeypatch):\n"
                                         "    monkeypatch.setenv(\"VLLM_FAKE_FACTOR\", \"3\")\n"
                                         "    assert double(2) == 6\n"),
}


# ---------------------------------------------------------------- fixture series and evidence

def commit_patch(fake, name: str, edits: dict, message: str, start: str) -> str:
    """Commit `edits` on `start` with `message` (no checkout) and export it as patches/fake/<name>.patch."""
    from kvforge.git.engine import format_patch

    repo = fake.upstream
    index = fake.root / f".index-{name}"
    env = {"GIT_INDEX_FILE": str(index)}
    try:
        git(repo, "read-tree", start, env=env)
        for rel, (old, new) in edits.items():
            text = git(repo, "show", f"{start}:{rel}") if old else ""
            blob = subprocess.run(["git", "hash-object", "-w", "--stdin"], cwd=repo, check=True, capture_output=True,
                                  input=text.replace(old, new, 1) if old else new, text=True).stdout.strip()
            git(repo, "update-index", "--add", "--cacheinfo", f"100644,{blob},{rel}", env=env)
        tree = git(repo, "write-tree", env=env).strip()
        commit = git(repo, "commit-tree", tree, "-p", start, "-m", message).strip()
    finally:
        index.unlink(missing_ok=True)
    (fake.root / "patches" / "fake" / f"{name}.patch").write_bytes(format_patch(repo, commit))
    return commit


def give_base_a_template(fake, template: str | None) -> None:
    """Add a PR template (a file of kvforge's upstream copies) to the fake upstream; tag v1 moves there."""
    if template is None:
        return
    dest = fake.upstream / ".github" / "PULL_REQUEST_TEMPLATE.md"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(UPSTREAM / template, dest)
    git(fake.upstream, "add", "-A")
    git(fake.upstream, "commit", "-qm", "PR template")
    git(fake.upstream, "tag", "-f", "v1")
    fake.base = git(fake.upstream, "rev-parse", "HEAD").strip()


# FAKE upstream policies, for the fixture target only (its component `vllm` is on ref v1): v1 is a
# maintained release branch of the upstream, so its fixes get PRs onto v1. The real policy is
# tested on the real targets (test_real_routes_*).
FAKE_POLICY = """\
# FAKE policy for kvforge's tests
[upstreams.vllm]
repo = "{repo}"
display = "upstream"
style = "{style}"
main = "main"
release_branches = "maintained"
release_prefix = "v"
"""


def use_fake_policy(fake, monkeypatch, style: str = "vllm") -> None:
    path = fake.root / f"fake-policy-{style}.toml"
    repo = "vllm-project/vllm" if style == "vllm" else "vllm-project/vllm-ascend"
    path.write_text(FAKE_POLICY.format(repo=repo, style=style))
    monkeypatch.setattr(prpolicy, "POLICY_FILE", path)


@pytest.fixture()
def series(fake, request, monkeypatch):
    """The fixture series on a base with vLLM 0.20.2's PR template (indirect param: another copy or None)."""
    use_fake_policy(fake, monkeypatch)
    give_base_a_template(fake, getattr(request, "param", "vllm-0.20.2.PULL_REQUEST_TEMPLATE.md"))
    c1 = commit_patch(fake, "0001-clamp-upper", CLAMP_FIX, CLAMP_MSG.format(ident=IDENT), fake.base)
    commit_patch(fake, "0002-fake-factor", FACTOR_FIX, FACTOR_MSG.format(ident=IDENT), c1)
    fake.series("0001-clamp-upper", "0002-fake-factor")
    # FAKE mapping for the fixture's fix: which bench scenario measures it (the real table names real fixes).
    monkeypatch.setitem(BENCH_SCENARIOS, "clamp-upper", {"external-hit": "measures"})
    return fake


def key_of(fake) -> evidence.Key:
    return evidence.Key("fake", "vllm", fake.base, read_series(fake.root / "patches" / "fake").digest)


def fixture_verify(fake, key: evidence.Key, passed: int = 7, first_before: str = "failed",
                   created: str = CREATED) -> evidence.Record:
    """A verify record as kvforge verify writes it (VerifyReport.to_json), with fixed numbers."""
    report = VerifyReport("fake", "vllm", "cpu", "v1", key.base, "git", key.series, "patches/fake", "env0123456789ab")
    report.patches = [
        PatchVerdict(1, "0001-clamp-upper.patch", "clamp-upper", "fix", "proven", checks=[
            CheckResult("tests/test_kvforge_clamp.py::test_clamp_upper", first_before, "passed", 0.01, 0.01,
                        "from the patch", "AssertionError: assert 5 == 3\nmore lines",
                        before_kind=fail_kind(first_before, "AssertionError: assert 5 == 3")),
            CheckResult("tests/test_core.py::test_clamp_in_core", "missing", "passed", 0, 0.01, "absent",
                        before_kind="absent-test")]),
        PatchVerdict(2, "0002-fake-factor.patch", "fake-factor", "fix", "proven", checks=[
            CheckResult("tests/test_kvforge_factor.py::test_factor_from_env", "failed", "passed", 0.01, 0.01,
                        "from the patch", "AssertionError: assert 4 == 6", before_kind="behaviour")]),
    ]
    report.regression = {"selection": ["tests/test_core.py"], "checks": ["a", "b", "c"], "passed": passed,
                         "failed": 0, "errors": 0, "skipped": 1, "ok": True, "reason": ""}
    report.ok = True
    rec = evidence.Record("verify", key, origin="series", platform="cpu", ok=True, created=created,
                          data=report.to_json())
    evidence.save(Cache(fake.cache), rec)
    return rec


def replay_doc(hits: int, violations: int) -> dict:
    """A minimal replay document of the external-hit scenarios, in the replay's own format."""
    def res(variant: str, h: int, v: int) -> dict:
        return {"scenario": "external-hit", "variant": variant, "features": {"vllm_version": "0.0.1"},
                "requests": [{"label": "r1", "prompt_tokens": 1000, "hit_tokens": h, "ceiling_tokens": 500}],
                "ceiling": {"hits": 500}, "overall": {"hits": h, "queries": 1000}, "steps": 10,
                "violations": {"counts": {"block_in_two_groups": v} if v else {}, "block_ids_in_two_groups": v},
                "external": {"trigger_held": 3, "allocations_with_external_tokens": 5, "probe_errors": []},
                "seconds": {"replay": 1.0}}
    return {"results": [res("", hits, violations), res("soak", hits // 2, 0)]}


def fixture_bench(fake, key: evidence.Key, base_hits: int = 200, patched_hits: int = 480,
                  created: str = CREATED) -> evidence.Record:
    """A bench record whose rows and goals come from kvforge's own aggregation of replay documents."""
    rows = aggregate({"base": replay_doc(base_hits, 33), "patched": replay_doc(patched_hits, 0)})
    data = {"target": "fake", "component": "vllm", "base": key.base, "base_ref": "v1", "series": key.series,
            "patches": 2, "origin": "series", "scale": 0.25, "seed": 0, "scenarios": ["external-hit"],
            "env": "env0123456789ab", "note": "", "rows": rows, "goals": goals(rows), "errors": []}
    rec = evidence.Record("bench-prefix-cache", key, "s0.25-seed0", "series", "cpu", True, created=created, data=data)
    evidence.save(Cache(fake.cache), rec)
    return rec


def golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("KVFORGE_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.is_file(), f"{path} missing: run with KVFORGE_UPDATE_GOLDEN=1 once"
    assert text == path.read_text(encoding="utf-8")


def no_machine_paths(text: str, fake) -> None:
    for p in (fake.root, fake.cache, fake.upstream, fake.root.parent):
        assert str(p) not in text


# ---------------------------------------------------------------- golden texts

def test_golden_vllm_v020_layout(series):
    key = key_of(series)
    fixture_verify(series, key)
    fixture_bench(series, key)
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper")
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("[Bugfix][Core] Clamp values to the upper bound too\n\n<!-- markdownlint-disable -->")
    assert "## Purpose" in res.stdout and "## Test Plan" in res.stdout and "## Test Result" in res.stdout
    assert "Essential Elements of an Effective PR Description Checklist" in res.stdout  # the base's checklist
    no_machine_paths(res.stdout, series)
    assert "evidence" not in res.stderr  # current evidence: nothing to warn about
    # The fixture's test file is test_kvforge_clamp.py: named in the text, so it is warned about.
    assert "the PR text names kvforge on" in res.stderr
    assert "kvforge verify" not in res.stdout and "series" not in res.stdout and "Drop" not in res.stdout
    golden("pr-vllm-purpose.md", res.stdout)


@pytest.mark.parametrize("series", ["vllm-0.33.0.PULL_REQUEST_TEMPLATE.md"], indirect=True)
def test_golden_vllm_main_layout_follows_the_base_template(series):
    key = key_of(series)
    fixture_verify(series, key)
    fixture_bench(series, key)
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper")
    assert res.exit_code == 0, res.output
    assert [h for h in res.stdout.splitlines() if h.startswith("## ")] == \
        ["## Overview", "## Claims", "## Validation", "## Details"]
    assert "Pull Request Checklist" in res.stdout
    golden("pr-vllm-overview.md", res.stdout)


def test_golden_vllm_ascend(series, monkeypatch):
    use_fake_policy(series, monkeypatch, "vllm-ascend")
    key = key_of(series)
    fixture_verify(series, key)
    fixture_bench(series, key)
    res = kvforge("pr", "-t", "fake", "--fix", "fake-factor")
    assert res.exit_code == 0, res.output
    title, _, body = res.stdout.partition("\n\n")
    assert title == "[v1][Core][BugFix] Read the doubling factor from VLLM_FAKE_FACTOR"
    assert [h for h in body.splitlines() if h.startswith("### ")] == [
        "### What this PR does / why we need it?", "### Does this PR introduce _any_ user-facing change?",
        "### How was this patch tested?"]
    # Posted in vllm-ascend: vLLM's issues and PRs are spelled in full, never as that repository's '#N'.
    assert "vllm-project/vllm#102" in body and "vllm-project/vllm#103" in body
    assert not re.search(r"(?<![\w/])#10[0-3]\b", body)
    assert "environment variable `VLLM_FAKE_FACTOR`" in body
    golden("pr-vllm-ascend.md", res.stdout)


def test_golden_notes(series):
    key = key_of(series)
    fixture_verify(series, key)
    fixture_bench(series, key)
    res = kvforge("notes", "-t", "fake")
    assert res.exit_code == 0, res.output
    assert f"base-commit: {series.base}" in res.stdout and f"series: fake/vllm {key.series}" in res.stdout
    no_machine_paths(res.stdout, series)
    golden("notes.md", res.stdout)


def test_notes_name_the_built_wheels_and_the_user_facing_settings(series):
    """The wheels come from `kvforge build`'s own report (BuildResult as build writes it), for exactly
    this series and base; a report of another series is not shown."""
    from kvforge.wheels.result import BuildResult

    key = key_of(series)
    res = kvforge("notes", "-t", "fake")
    assert "No wheel built and verified for this series yet" in res.stdout
    assert "- environment variable `VLLM_FAKE_FACTOR` (fake-factor)" in res.stdout
    builds = series.cache / "builds" / "fake" / "vllm"
    for digest, name in ((key.series, "vllm-0.0.1-1_kvforge_x-cp38-abi3-manylinux_2_35_x86_64.whl"),
                         ("0" * 16, "vllm-0.0.1-1_kvforge_other-cp38-abi3-manylinux_2_35_x86_64.whl")):
        result = BuildResult("fake", "vllm", "overlay", "0.0.1", base=key.base, series=digest, filename=name,
                             sha256="ab" * 32, size=123, ok=True)
        (builds / digest).mkdir(parents=True, exist_ok=True)
        (builds / digest / "build-cpu.json").write_text(json.dumps(result.to_json(), default=str))
    res = kvforge("notes", "-t", "fake", "--json")
    data = json.loads(res.stdout)
    assert "| `vllm-0.0.1-1_kvforge_x-cp38-abi3-manylinux_2_35_x86_64.whl` | manylinux_2_35_x86_64 | " \
           f"`{'ab' * 32}` | cpu |" in data["body"]
    assert "kvforge_other" not in data["body"]
    assert f"base-commit: {series.base}" in data["body"]  # a git base is the upstream commit itself


# ---------------------------------------------------------------- evidence rules

def test_a_changed_evidence_number_changes_the_text(series):
    key = key_of(series)
    fixture_verify(series, key)
    fixture_bench(series, key)
    before = kvforge("pr", "-t", "fake", "--fix", "clamp-upper").stdout
    # A newer record of the same series: one more test passed, the bench's patched hit rate moved.
    fixture_verify(series, key, passed=8, created="2026-11-22T13:00:00.000000+00:00")
    fixture_bench(series, key, patched_hits=470, created="2026-11-22T13:00:00.000000+00:00")
    after = kvforge("pr", "-t", "fake", "--fix", "clamp-upper").stdout
    assert after != before
    assert "7 passed, 1 skipped, none failed" in before and "8 passed, 1 skipped, none failed" in after
    assert "| external-hit | 20.00% | 48.00% |" in before and "| external-hit | 20.00% | 47.00% |" in after
    assert "2026-11-22 13:00 UTC" in after and "2026-11-22 12:00 UTC" not in after
    # And the before-outcome of a check comes from the record too.
    fixture_verify(series, key, first_before="error", created="2026-11-22T14:00:00.000000+00:00")
    assert "| `test_kvforge_clamp.py::test_clamp_upper` | error (new test file on the old code)" in \
        kvforge("pr", "-t", "fake", "--fix", "clamp-upper").stdout


def test_stale_evidence_is_refused_and_allow_stale_says_so_in_the_text(series):
    old = key_of(series)
    fixture_verify(series, old)
    fixture_bench(series, old)
    # The series changes (a patch is re-exported with another Why): its digest and key change.
    path = series.root / "patches" / "fake" / "0002-fake-factor.patch"
    path.write_bytes(path.read_bytes().replace(b"could not be tuned", b"could not be changed"))
    new = key_of(series)
    assert new.series != old.series
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper", "--json")
    assert res.exit_code == 4
    err = json.loads(res.stdout)
    assert err["exit"] == 4 and f"is for series {old.series} but this is series {new.series}" in err["error"]
    assert "--allow-stale" in errline(res)
    assert kvforge("notes", "-t", "fake").exit_code == 4
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper", "--allow-stale")
    assert res.exit_code == 0, res.output
    assert "> **Stale results.** These test results were recorded for an earlier version of this change" \
        in res.stdout
    assert old.series not in res.stdout and new.series not in res.stdout  # digests are not for upstream
    assert "> **Stale results.** These replay results" in res.stdout
    assert "using stale verify evidence" in res.stderr
    notes = kvforge("notes", "-t", "fake", "--allow-stale")
    assert notes.exit_code == 0 and "**STALE**" in notes.stdout and "(STALE, another series)" in notes.stdout


def test_missing_evidence_is_stated_never_invented(series):
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper")
    assert res.exit_code == 0, res.output
    assert "**No test results are recorded for this change yet**" in res.stdout
    assert "**No replay results are recorded for this change yet.**" in res.stdout
    assert "proven" not in res.stdout and "passed" not in res.stdout and "Fail-before" not in res.stdout
    assert "warning: no verify evidence" in res.stderr
    # A fix without a bench scenario does not ask for bench evidence.
    res = kvforge("pr", "-t", "fake", "--fix", "fake-factor", "--json")
    data = json.loads(res.stdout)
    assert [(e["kind"], e["state"]) for e in data["evidence"]] == [("verify", "missing")]
    notes = kvforge("notes", "-t", "fake")
    assert "- verify: **none recorded**" in notes.stdout and notes.stdout.count("- Evidence: none recorded") == 2


def test_real_verify_evidence_feeds_the_pr(series):
    """No fixture: kvforge verify runs the fixture series' real tests; pr shows what it recorded."""
    res = kvforge("verify", "-t", "fake", "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    body = data["body"]
    assert "Fail-before 2/2 (2 for a behavioural reason), pass-after 2/2: **proven**" in body  # both Checks run before
    assert "`AssertionError: assert 5 == 3`" in body or "`assert 5 == 3`" in body  # the real failure before
    reg = report["regression"]
    assert reg["failed"] == 0 and f"{reg['passed']} passed, {reg['skipped']} skipped, none failed" in body
    assert data["evidence"][0] == {**data["evidence"][0], "kind": "verify", "state": "current",
                                   "series": report["series"], "record": report["report"]}
    assert "**No replay results are recorded for this change yet.**" in body  # no bench run: said so


# ---------------------------------------------------------------- inputs and refusals

def test_dco_missing_sign_off_is_an_error(series, tmp_path):
    """--from a tree whose commits lack Signed-off-by (lint would refuse such series files)."""
    tree = tmp_path / "tree"
    assert kvforge("apply", "-t", "fake", "--into", str(tree)).exit_code == 0
    msg = git(tree, "log", "-1", "--format=%B", "HEAD~1")
    assert f"Signed-off-by: {IDENT}\n" in msg
    git(tree, "checkout", "-q", "--detach", "HEAD~1")  # rewrite commit 1 without its sign-off, keep commit 2
    git(tree, "commit", "-q", "--amend", "-m", msg.replace(f"Signed-off-by: {IDENT}\n", ""))
    git(tree, "cherry-pick", "kvforge/fake")
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper", "--from", str(tree))
    assert res.exit_code == 2
    assert "0001-clamp-upper.patch ([Core] Clamp values to the upper bound too): no Signed-off-by: trailer" \
        in errline(res)
    # The fix that depends on it is refused for the same commit: the PR needs its Depends-On too.
    res = kvforge("pr", "-t", "fake", "--fix", "fake-factor", "--from", str(tree), "--json")
    assert res.exit_code == 2 and "0001-clamp-upper.patch" in json.loads(res.stdout)["error"]


def test_from_a_tree_uses_its_commits_and_their_evidence(series, tmp_path):
    tree = tmp_path / "tree"
    assert kvforge("apply", "-t", "fake", "--into", str(tree)).exit_code == 0
    git(tree, "commit", "-q", "--amend", "-m",
        git(tree, "log", "-1", "--format=%B").replace("could not be tuned", "could not be set"))
    head = git(tree, "rev-parse", "HEAD").strip()
    assert kvforge("verify", "-t", "fake", "--from", str(tree)).exit_code == 0
    res = kvforge("pr", "-t", "fake", "--fix", "fake-factor", "--from", str(tree), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["evidence"][0]["state"] == "current" and data["origin"].endswith(f"({head[:12]})")
    assert f"(commit {head[:12]})" in data["body"] and "could not be set" in data["body"]
    no_machine_paths(data["body"], series)
    assert str(tree) not in data["body"]
    # The series files are another series: their text has no evidence (none was recorded for them).
    files = kvforge("pr", "-t", "fake", "--fix", "fake-factor")
    assert files.exit_code == 4  # the only verify record is the tree's: another series, refused


def test_a_fix_the_base_has_and_an_unknown_fix_are_one_line_errors(series):
    toml = series.root / "targets" / "fake.toml"
    toml.write_text(toml.read_text() + '\n[[components.in_base]]\nfix_id = "old-fix"\nreason = "upstream #7 (abc1234)"\n')
    res = kvforge("pr", "-t", "fake", "--fix", "old-fix")
    assert res.exit_code == 2
    assert errline(res) == ("kvforge: error: fake: old-fix is already in the base (upstream #7 (abc1234)); fake "
                            "carries no patch for it, so there is no PR to describe")
    res = kvforge("pr", "-t", "fake", "--fix", "nope", "--json")
    assert res.exit_code == 2
    assert json.loads(res.stdout)["error"] == ("fake: no patch with Fix-Id 'nope' in its series (it has: clamp-upper, "
                                               "fake-factor), and targets/fake.toml lists no in_base entry for it")
    notes = kvforge("notes", "-t", "fake")
    assert "## Already in the base (no patch carried)\n\n- old-fix: upstream #7 (abc1234)" in notes.stdout


def test_out_and_json(series, tmp_path):
    out = tmp_path / "pr.md"
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper", "--out", str(out))
    assert res.exit_code == 0 and res.stdout == "" and f"wrote {out}" in res.stderr
    text = out.read_text()
    assert text.startswith("[Bugfix][Core] Clamp values to the upper bound too\n\n")
    data = json.loads(kvforge("pr", "-t", "fake", "--fix", "clamp-upper", "--json").stdout)
    assert data["text"] == text and data["title"] + "\n\n" + data["body"] == text
    assert data["style"] == "vllm" and data["layout"] == "purpose" and data["fix_id"] == "clamp-upper"
    assert data["upstream_template"] == f".github/PULL_REQUEST_TEMPLATE.md of v1 ({series.base[:12]})"
    assert data["warnings"] and data["opened"] is None


@pytest.mark.parametrize("series", [None], indirect=True)
def test_a_base_without_a_pr_template_uses_kvforges_copy_and_says_so(series):
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["layout"] == "purpose"  # release 0.0.1 < 0.33.0
    assert data["upstream_template"] == "kvforge's copy of vLLM v0.20.2 (sdist vllm-0.20.2.tar.gz)"
    assert any("has no .github/PULL_REQUEST_TEMPLATE.md" in w for w in data["warnings"])


# ---------------------------------------------------------------- user templates

def test_user_template_renders_data_and_sets_the_title(series, tmp_path):
    fixture_verify(series, key_of(series))
    tpl = tmp_path / "mine.md.j2"
    tpl.write_text('{% set title = "[Misc] " ~ fix.subject_text %}'
                   "{{ fix.fix_id }}: {{ verify.patch.status }} ({{ verify.regression.passed }} passed)\n"
                   "{% for c in verify.patch.checks %}- {{ c.test }}: {{ c.before }} -> {{ c.after }}\n{% endfor %}")
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper", "--template", str(tpl))
    assert res.exit_code == 0, res.output
    assert res.stdout == ("[Misc] Clamp values to the upper bound too\n\nclamp-upper: proven (7 passed)\n"
                          "- test_kvforge_clamp.py::test_clamp_upper: failed -> passed\n"
                          "- test_core.py::test_clamp_in_core: missing -> passed\n")
    tpl.write_text('{% set title = "no tag" %}x')
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper", "--template", str(tpl))
    assert res.exit_code == 2 and "fails vLLM's PR title check" in errline(res)


def test_user_template_typo_is_one_line_naming_file_and_line(series, tmp_path):
    tpl = tmp_path / "typo.md.j2"
    tpl.write_text("# {{ fix.subject }}\n\nok\n{{ fix.fixid }}\n")
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper", "--template", str(tpl))
    assert res.exit_code == 2
    assert errline(res) == f"kvforge: error: template {tpl}:4: 'dict object' has no attribute 'fixid'"
    tpl.write_text("line one\n{% if fix %}\nunclosed\n")
    res = kvforge("notes", "-t", "fake", "--template", str(tpl), "--json")
    assert res.exit_code == 2
    assert json.loads(res.stdout)["error"].startswith(f"template {tpl}:3: Unexpected end of template")
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper", "--template", str(tmp_path / "absent.j2"))
    assert res.exit_code == 2 and "absent.j2: cannot read" in errline(res)


@pytest.mark.parametrize("attempt,why", [
    ("{{ ''.__class__.__mro__ }}", "access to attribute '__class__' of 'str' object is unsafe"),
    ("{{ cycler.__init__.__globals__ }}", "access to attribute '__init__' of 'type' object is unsafe"),
    ("{{ lipsum.__globals__['os'].listdir('/') }}", "access to attribute '__globals__' of 'function' object is unsafe"),
    ("{{ fix.__class__ }}", "access to attribute '__class__' of 'dict' object is unsafe"),
    ("{{ fix.why.format.__self__ }}", "has no attribute '__self__'"),
    ("{% include '/etc/passwd' %}", "no template '/etc/passwd'"),
    ("{% include '../../../../etc/passwd' %}", "no template '../../../../etc/passwd'"),
    ("{% import 'upstream/../../../pr.py' as x %}", "no template 'upstream/../../../pr.py'"),
])
def test_user_template_cannot_reach_python_internals_or_files(series, tmp_path, attempt, why):
    tpl = tmp_path / "evil.md.j2"
    tpl.write_text("before\n" + attempt + "\n")
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper", "--template", str(tpl))
    assert res.exit_code == 2, res.output
    assert errline(res).startswith(f"kvforge: error: template {tpl}:2: ") and why in errline(res)
    assert res.stdout == "" and "root:" not in res.stderr and "<class" not in res.stderr


@pytest.mark.parametrize("body,why", [
    ("{{ 1/0 }}", "ZeroDivisionError: division by zero"),
    ("{{ 1 + 'a' }}", "TypeError: unsupported operand"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursion too deep"),
    ("{{ 'x' * 10**10 }}", "the result of * would have 10000000000 items"),
    ("{{ [1] * 10**10 }}", "the result of * would have 10000000000 items"),
    ("{{ 10 ** (10 ** 10) }}", "the result of ** would have about 1e+10 digits"),
    ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "the rendered text is over 1048576 characters"),
])
def test_user_template_runtime_errors_are_one_line_file_and_line(series, tmp_path, body, why):
    """Errors raised while rendering (not only at parse time) are `template FILE:LINE: message`,
    exit 2, like a syntax error; the sandbox stops a value or an output too big before it is made."""
    tpl = tmp_path / "runtime.md.j2"
    tpl.write_text("first line\n" + body + "\n")
    out = tmp_path / "out.md"
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper", "--template", str(tpl), "--out", str(out))
    assert res.exit_code == 2, res.output
    assert errline(res).startswith(f"kvforge: error: template {tpl}:2: ") and why in errline(res), errline(res)
    assert "Traceback" not in res.output and not out.exists()
    assert sum(ln.startswith("kvforge: error:") for ln in res.stderr.splitlines()) == 1


def test_out_over_an_existing_file_keeps_its_mode(series, tmp_path):
    out = tmp_path / "pr.md"
    out.write_text("old\n")
    out.chmod(0o644)
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper", "--out", str(out))
    assert res.exit_code == 0, res.output
    assert out.read_text().startswith("[Bugfix]") and (out.stat().st_mode & 0o777) == 0o644
    out.chmod(0o640)
    assert kvforge("notes", "-t", "fake", "--out", str(out)).exit_code == 0
    assert (out.stat().st_mode & 0o777) == 0o640
    new = tmp_path / "new.md"
    old_umask = os.umask(0o022)
    try:
        assert kvforge("notes", "-t", "fake", "--out", str(new)).exit_code == 0
    finally:
        os.umask(old_umask)
    assert (new.stat().st_mode & 0o777) == 0o644
    assert not list(tmp_path.glob(".*.tmp"))


# ---------------------------------------------------------------- --open and gh

def path_with(tmp_path: Path, *tools: str) -> str:
    """A PATH holding only links to these real tools (git is needed by kvforge itself)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for tool in tools:
        (bindir / tool).symlink_to(shutil.which(tool))
    return str(bindir)


def test_open_without_gh_installed_is_exit_5_one_line(series, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", path_with(tmp_path, "git"))
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper", "--open")
    assert res.exit_code == 5
    assert "`gh`, which is not installed" in errline(res) and res.stdout == ""
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper", "--open", "--json")
    assert res.exit_code == 5 and json.loads(res.stdout)["exit"] == 5


FAKE_GH = """#!{python}
# FAKE gh, for kvforge's tests only: records its argv and the --body-file text; no network.
import json, os, sys
args = sys.argv[1:]
body = open(args[args.index("--body-file") + 1], encoding="utf-8").read()
with open(os.environ["FAKE_GH_LOG"], "w", encoding="utf-8") as fh:
    json.dump({{"argv": args, "body": body}}, fh)
if os.environ.get("FAKE_GH_FAIL"):
    sys.stderr.write("HTTP 401: Bad credentials\\n")
    sys.exit(1)
print("https://github.com/vllm-project/vllm/pull/99999")
"""


def upstream_and_fork(series, tmp_path, moved: dict[str, str]) -> tuple[Path, Path, Path, str]:
    """A local bare "upstream" repository (a clone of the fixture's, its branch v1 = the base, then one
    upstream commit with `moved` edits), an empty bare "fork", and the user's clone of upstream with
    the fork as remote `fork`. Returns (upstream, fork, clone, the upstream branch head)."""
    up, fork, clone, work = (tmp_path / "upstream.git", tmp_path / "fork.git", tmp_path / "clone",
                             tmp_path / "up-work")
    git(tmp_path, "clone", "-q", "--bare", str(series.upstream), str(up))
    git(up, "branch", "-f", "v1", series.base)
    git(tmp_path, "clone", "-q", "-b", "v1", str(up), str(work))
    for rel, (old, new) in moved.items():
        path = work / rel
        path.write_text(path.read_text().replace(old, new) if old else new)
    git(work, "add", "-A")
    git(work, "commit", "-qm", "upstream moved on")
    git(work, "push", "-q", "origin", "HEAD:refs/heads/v1")
    head = git(up, "rev-parse", "refs/heads/v1").strip()
    git(tmp_path, "init", "-q", "--bare", str(fork))
    git(tmp_path, "clone", "-q", str(up), str(clone))
    git(clone, "remote", "add", "fork", str(fork))
    return up, fork, clone, head


def fake_gh(tmp_path, monkeypatch) -> Path:
    bindir = Path(path_with(tmp_path, "git"))
    gh = bindir / "gh"
    gh.write_text(FAKE_GH.format(python=sys.executable))
    gh.chmod(0o755)
    log = tmp_path / "gh.json"
    monkeypatch.setenv("PATH", str(bindir))
    monkeypatch.setenv("FAKE_GH_LOG", str(log))
    return log


@pytest.mark.parametrize("style,repo,fix", [("vllm", "vllm-project/vllm", "clamp-upper"),
                                            ("vllm-ascend", "vllm-project/vllm-ascend", "fake-factor")])
def test_open_pushes_the_fix_onto_upstream_history_then_hands_it_to_gh(series, tmp_path, monkeypatch, style,
                                                                        repo, fix):
    """Against local bare repositories (never the network): the fix is re-applied onto the upstream
    branch head, pushed to the fork, checked there, and only then given to a FAKE gh with --base/--head."""
    use_fake_policy(series, monkeypatch, style)
    up, fork, clone, head = upstream_and_fork(series, tmp_path, {"README.upstream": ("", "moved on\n")})
    if fix == "fake-factor":  # it applies on top of clamp-upper: upstream has that one already
        git(clone, "fetch", "-q", "origin")
    log = fake_gh(tmp_path, monkeypatch)
    if fix == "fake-factor":
        # Upstream's v1 gets clamp-upper first (the fix it depends on), as a merged PR would.
        work = tmp_path / "up-work"
        (work / "vllm_like" / "core.py").write_text(git(series.upstream, "show", f"{series.base}:vllm_like/core.py")
                                                    .replace("return max(lo, x)", "return min(hi, max(lo, x))"))
        git(work, "commit", "-qam", "upstream clamp")
        git(work, "push", "-q", "origin", "HEAD:refs/heads/v1")
        head = git(up, "rev-parse", "refs/heads/v1").strip()
        git(clone, "fetch", "-q", "origin")
    want = json.loads(kvforge("pr", "-t", "fake", "--fix", fix, "--json").stdout)
    res = kvforge("pr", "-t", "fake", "--fix", fix, "--repo", str(clone), "--push-to", "fork", "--open", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["opened"] == "https://github.com/vllm-project/vllm/pull/99999"
    pushed = git(fork, "rev-parse", f"refs/heads/fix/{fix}").strip()
    assert data["pushed"]["commit"] == pushed and data["pushed"]["upstream_head"] == head
    # The fork's branch shares history with the upstream branch and holds the fix.
    assert subprocess.run(["git", "-C", str(fork), "merge-base", "--is-ancestor", head, pushed]).returncode == 0
    assert git(fork, "rev-list", "--count", f"{head}..{pushed}").strip() == "1"
    changed = git(fork, "diff", "--name-only", head, pushed).split()
    assert changed == sorted(read_series(series.root / "patches" / "fake").by_fix_id()[fix].touched_paths)
    assert git(fork, "log", "-1", "--format=%an <%ae>", pushed).strip() == IDENT
    seen = json.loads(log.read_text())
    argv = seen["argv"]
    body_file = argv[argv.index("--body-file") + 1]
    assert argv == ["pr", "create", "--repo", repo, "--draft", "--title", want["title"], "--body-file", body_file,
                    "--base", "v1", "--head", f"fix/{fix}"]
    assert seen["body"] == want["body"] and not Path(body_file).exists()
    assert git(clone, "status", "--porcelain") == "" and "fix/" not in git(clone, "branch", "-a")  # only read
    monkeypatch.setenv("FAKE_GH_FAIL", "1")
    res = kvforge("pr", "-t", "fake", "--fix", fix, "--repo", str(clone), "--push-to", "fork", "--open")
    assert res.exit_code == 5 and "gh pr create failed (exit 1)" in errline(res)


def test_open_reports_a_conflict_and_pushes_nothing(series, tmp_path, monkeypatch):
    _up, fork, clone, _head = upstream_and_fork(
        series, tmp_path, {"vllm_like/core.py": ("return max(lo, x)", "return max(lo, x)  # upstream changed it")})
    log = fake_gh(tmp_path, monkeypatch)
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper", "--repo", str(clone), "--push-to", "fork", "--open")
    assert res.exit_code == 3, res.output
    assert "0001-clamp-upper.patch does not apply onto v1" in errline(res) and "vllm_like/core.py" in errline(res)
    assert git(fork, "for-each-ref").strip() == "" and not log.exists()


@pytest.mark.parametrize("conflict", [True, False], ids=["failed-open", "opened"])
def test_open_leaves_the_cached_base_as_it_was(series, tmp_path, monkeypatch, conflict):
    """--open reads the clone's branch for its own run only: a later command without --repo gets the base it had
    before (here the one fetched from $KVFORGE_VLLM_REPO), not the clone's branch. Before, the clone's tip became
    the cached base, and a later pick judged "present" against it."""
    moved = ({"vllm_like/core.py": ("return max(lo, x)", "return max(lo, x)  # upstream changed it")} if conflict
             else {"README.upstream": ("", "moved on\n")})
    _up, _fork, clone, head = upstream_and_fork(series, tmp_path, moved)
    git(clone, "tag", "-f", "v1", head)  # the clone's v1 is upstream's newer tip
    fake_gh(tmp_path, monkeypatch)
    assert json.loads(kvforge("base", "-t", "fake", "--json").stdout)["commit"] == series.base
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper", "--repo", str(clone), "--push-to", "fork", "--open")
    assert res.exit_code == (3 if conflict else 0), res.output
    monkeypatch.delenv("KVFORGE_VLLM_REPO")
    after = json.loads(kvforge("base", "-t", "fake", "--json").stdout)
    assert (after["commit"], after["origin"]) == (series.base, str(series.upstream.resolve()))


def test_open_with_a_repo_that_is_not_a_clone_is_exit_2_naming_it(series, tmp_path, monkeypatch):
    """A directory that is no git repository was a failed fetch (exit 6, network): a bad argument, exit 2."""
    log = fake_gh(tmp_path, monkeypatch)
    plain = tmp_path / "not-a-clone"
    plain.mkdir()
    (plain / "README").write_text("hello\n")
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper", "--repo", str(plain), "--push-to", "fork", "--open")
    assert res.exit_code == 2, res.output
    assert errline(res).startswith(f"kvforge: error: --repo {plain}: not a git clone (")
    assert not log.exists() and res.stdout == ""
    assert sorted(p.name for p in plain.iterdir()) == ["README"]


def test_open_without_upstream_history_refuses_with_the_command(series, tmp_path, monkeypatch):
    log = fake_gh(tmp_path, monkeypatch)
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper", "--open")
    assert res.exit_code == 2 and res.stdout == ""
    assert "an import commit with no upstream history" in errline(res)
    assert "`kvforge pr -t fake --fix clamp-upper --repo CLONE --push-to FORK --open`" in errline(res)
    assert not log.exists()


# ---------------------------------------------------------------- where a PR goes (the real policy)

REAL_ROUTES = {
    # (target, component, fix): (action, repo, branch, what the reason says)
    ("v0.20.1", "vllm", "two-phase-kv-alloc"): ("none", "vllm-project/vllm", "", "merged upstream as #44409"),
    ("v0.20.2rc", "vllm", "swa-reachable-cache-mask"): ("none", "vllm-project/vllm", "", "#42258, #44082"),
    ("v0.20.2rc", "vllm", "kv-events-token-ids"):
        ("none", "vllm-project/vllm", "", "send the main variant (kvforge pr -t main --fix kv-events-token-ids)"),
    ("v0.20.2rc", "vllm", "eagle-lookahead-block-hashes"): ("none", "vllm-project/vllm", "", "released in vLLM 0.33.0"),
    ("v0.20.2rc", "vllm-ascend", "ascend-dsv4-compressed-prefix-lookup"):
        ("none", "vllm-project/vllm-ascend", "", "already on releases/v0.20.2rc as #10298"),
    ("v0.20.2rc", "vllm-ascend", "ascend-dsv4-block-size"):
        ("pr", "vllm-project/vllm-ascend", "releases/v0.20.2rc", ""),
    ("v0.20.2rc", "vllm-ascend", "two-phase-kv-alloc"): ("none", "vllm-project/vllm-ascend", "", "Inappropriate"),
    ("v0.20.2rc", "vllm-ascend", "kv-events-token-ids"): ("none", "vllm-project/vllm-ascend", "", "Inappropriate"),
    ("main", "vllm", "kv-events-token-ids"): ("pr", "vllm-project/vllm", "main", ""),
}


def test_real_routes_follow_each_upstreams_policy():
    """Every fix of every real target/component (the repository's own targets/ and patches/) gets a route:
    a PR for the right repository and branch, or none with the reason."""
    routes = prpolicy.plan()
    got = {(r.target, r.component, r.fix_id): r for r in routes}
    assert len(got) == len(routes) >= 18
    for key, (action, repo, branch, why) in REAL_ROUTES.items():
        r = got[key]
        assert (r.action, r.repo, r.branch) == (action, repo, branch), (key, r)
        assert why in r.reason, (key, r.reason)
    assert all(r.reason for r in routes if r.action == "none")
    assert [k for k, r in got.items() if r.action == "pr"] == [
        ("v0.20.2rc", "vllm-ascend", "ascend-dsv4-block-size"),
        ("v0.20.2rc", "vllm-ascend", "ascend-dsv4-partial-hash-hits"),  # Pending: our own vllm-ascend fix
        ("main", "vllm", "kv-events-token-ids")]
    partial = got[("v0.20.2rc", "vllm-ascend", "ascend-dsv4-partial-hash-hits")]
    assert (partial.repo, partial.branch) == ("vllm-project/vllm-ascend", "releases/v0.20.2rc")
    # No PR from a release target of vLLM, and every Inappropriate patch is refused.
    assert not [r for r in routes if r.repo == "vllm-project/vllm" and r.target != "main" and r.action == "pr"]


def test_the_real_policy_refuses_on_the_fixture_and_style_follows_the_component(series, monkeypatch):
    monkeypatch.setattr(prpolicy, "POLICY_FILE", DATA / "upstream-policy.toml")
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper", "--json")
    assert res.exit_code == 2
    assert json.loads(res.stdout)["error"] == (
        "clamp-upper (fake, vllm): no upstream PR: merged upstream as #101 (abc1234) on main; vLLM takes "
        "cherry-picks only into the release in flight (vLLM 0.0.1 is released)")
    res = kvforge("pr", "-t", "fake", "--fix", "fake-factor")
    assert res.exit_code == 2 and "vllm-project/vllm takes new fixes on main only" in errline(res)
    use_fake_policy(series, monkeypatch, "vllm")
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper", "--style", "vllm-ascend")
    assert res.exit_code == 2 and res.stdout == ""
    assert "--style vllm-ascend: vllm's fixes go to vllm-project/vllm, whose style is vllm" in errline(res)


# ---------------------------------------------------------------- units

def test_titles_follow_each_upstreams_convention():
    assert conventions.vllm_title("[Core] Fix x", "fix", "purpose") == "[Bugfix][Core] Fix x"
    assert conventions.vllm_title("[Bugfix][KV Offload] Fix x", "fix", "overview") == "[Bugfix][KV Offload] Fix x"
    assert conventions.vllm_title("Fix x", "fix", "purpose") == "[Bugfix] Fix x"
    assert conventions.vllm_title("[Core] Move x", "refactor", "purpose") == "[Misc][Core] Move x"
    assert conventions.vllm_title("[Core] Move x", "refactor", "overview") == "[Refactor][Core] Move x"
    for title in ("Fix x", "[Core]Fix x", "[] Fix x", "[Core] ", "[Co[re] x"):
        with pytest.raises(KvforgeError, match="fails vLLM's PR title check"):
            conventions.check_vllm_title(title)
    conventions.check_vllm_title("[Bugfix][Core] Fix x")
    core = ["vllm/v1/core/block_pool.py"]
    assert conventions.ascend_title("[Core] Fix x", "fix", "v0.20.2rc", core) == "[v0.20.2rc][Core][BugFix] Fix x"
    assert conventions.ascend_title("[Core] Fix x", "fix", "main", core) == "[Core][BugFix] Fix x"
    assert conventions.ascend_title("Fix x", "refactor", "main", ["vllm/envs.py"]) == "[Misc][Misc] Fix x"
    # vllm-ascend's own patches: the module from the package directory they touch; the branch from the ref.
    touched = ["vllm_ascend/attention/dsa_v1.py", "vllm_ascend/utils.py", "tests/ut/test_x.py"]
    assert conventions.ascend_title("DeepSeek-V4: fix x", "fix", "v0.20.2rc", touched) == \
        "[v0.20.2rc][Attention][BugFix] DeepSeek-V4: fix x"
    assert conventions.ascend_title("[PrefixCache] Fix x", "fix", None, touched) == "[PrefixCache][BugFix] Fix x"
    from kvforge.project.targets import load_target

    repo = Path(__file__).resolve().parent.parent
    t = load_target("v0.20.2rc", repo)
    assert conventions.ascend_branch("v0.20.2rc", t.component("vllm-ascend")) == "v0.20.2rc"  # releases/v0.20.2rc
    assert conventions.ascend_branch("v0.20.2rc", t.component("vllm")) == "v0.20.2rc"
    assert conventions.ascend_branch("main", load_target("main", repo).component()) is None


def test_upstream_templates_pick_the_layout_and_keep_the_checklist():
    purpose = conventions.parse_upstream_template((UPSTREAM / "vllm-0.20.2.PULL_REQUEST_TEMPLATE.md").read_text(), "a")
    assert purpose.layout == "purpose" and purpose.preamble == "<!-- markdownlint-disable -->"
    assert purpose.tail.startswith("---\n<details>") and purpose.tail.endswith("removed by GitHub Actions)")
    overview = conventions.parse_upstream_template((UPSTREAM / "vllm-0.33.0.PULL_REQUEST_TEMPLATE.md").read_text(),
                                                   "b")
    assert overview.layout == "overview" and "Pull Request Checklist" in overview.tail
    ascend = conventions.parse_upstream_template("<!-- hi\nthere -->\n### What this PR does / why we need it? (必填)\n\n"
                                                 "### Does this PR introduce _any_ user-facing change?\n\n"
                                                 "### How was this patch tested? (必填)\n", "c")
    assert ascend.layout == "ascend" and ascend.preamble == "" and ascend.tail == ""
    with pytest.raises(KvforgeError, match=r"x: its sections \(Summary, Tests\) match no layout"):
        conventions.parse_upstream_template("## Summary\n\n## Tests\n", "x")


def test_bench_scenarios_and_fixes_named_by_pr_exist():
    """The fix -> scenario table names real scenarios and fixes some target knows."""
    from kvforge.bench.replay.workloads import SCENARIOS
    from kvforge.project.targets import load_all

    known = set()
    for t in load_all(Path(__file__).resolve().parent.parent):
        for c in t.components:
            known |= {p.fix_id for p in read_series(c.series_dir).patches} | {e.fix_id for e in c.in_base}
    for fix_id, scenarios in BENCH_SCENARIOS.items():
        if fix_id == "clamp-upper":  # the fixture's FAKE entry, when a test put it there
            continue
        assert fix_id in known
        assert set(scenarios) <= set(SCENARIOS) and set(scenarios.values()) <= {"measures", "control"}


def test_commit_message_becomes_markdown():
    text = ("First line of a\nwrapped paragraph.\n\nThis patch:\n- one item\n  continued\n- two\n"
            "After the list.\n\n  col a   col b\n  1       2\n")
    assert facts.unwrap(text) == ("First line of a wrapped paragraph.\n\nThis patch:\n- one item continued\n- two\n\n"
                               "After the list.\n\n```text\n  col a   col b\n  1       2\n```")
    assert facts.vllm_refs("see #42948 and vllm-project/vllm#1234, not &#1234;") == \
        "see vllm-project/vllm#42948 and vllm-project/vllm#1234, not &#1234;"
    assert facts.github_ref("https://github.com/vllm-project/vllm/pull/44409", "vllm-project/vllm") == "#44409"
    assert facts.github_ref("https://github.com/vllm-project/vllm/issues/1", "vllm-project/vllm-ascend") == \
        "vllm-project/vllm#1"


# ---------------------------------------------------------------- the real series on the real base

@pytest.mark.slow
def test_every_real_v0202_fix_is_routed_and_renders_in_both_styles(project, base_v0202, monkeypatch):
    """The real v0.20.2rc patches on the real vLLM 0.20.2 base (its own PR template): the real policy
    refuses each (vLLM takes no backports into a released version), with the reason; under a FAKE
    maintained-branch policy each renders in both styles. No evidence in this test cache: said so."""
    _cache, base = base_v0202
    # The session cache is shared: evidence other tests recorded for target t is set aside here.
    results = _cache.results / "t"
    aside = _cache.results / ".t-aside-pr-test"
    if results.exists():
        results.rename(aside)
    try:
        _real_fixes_get_descriptions(project, base, monkeypatch)
    finally:
        shutil.rmtree(results, ignore_errors=True)
        if aside.exists():
            aside.rename(results)


def _real_fixes_get_descriptions(project, base, monkeypatch):
    from kvforge.git import gitutil
    from kvforge.project.targets import project_root

    # kvforge's packaged copy is the sdist's own file, byte for byte.
    sdist_template = gitutil.run(base.repo, "show", f"{base.commit}:.github/PULL_REQUEST_TEMPLATE.md", binary=True)
    assert sdist_template.stdout == (UPSTREAM / "vllm-0.20.2.PULL_REQUEST_TEMPLATE.md").read_bytes()

    real = Path(__file__).resolve().parent.parent / "patches" / "v0.20.2rc"
    for f in real.iterdir():
        shutil.copy2(f, project / "patches" / "t" / f.name)
    assert project_root() == project
    fixes = [p.fix_id for p in read_series(project / "patches" / "t").patches]
    assert fixes
    for fix_id in fixes:
        res = kvforge("pr", "-t", "t", "--fix", fix_id, "--json")
        assert res.exit_code == 2, res.output
        error = json.loads(res.stdout)["error"]
        assert error.startswith(f"{fix_id} (t, vllm): no upstream PR: "), error
        assert ("merged upstream as #" in error) or ("takes new fixes on main only" in error), error
    for style in ("vllm", "vllm-ascend"):
        policy = project / f"fake-policy-{style}.toml"  # FAKE: t's v0.20.2 as a maintained branch
        policy.write_text(FAKE_POLICY.format(repo="vllm-project/vllm" if style == "vllm" else
                                             "vllm-project/vllm-ascend", style=style))
        monkeypatch.setattr(prpolicy, "POLICY_FILE", policy)
        for fix_id in fixes:
            if style == "vllm-ascend" and read_series(project / "patches" / "t").by_fix_id()[fix_id] \
                    .upstream_status.startswith("Backport [https://github.com/vllm-project/vllm/"):
                continue  # a vLLM backport: no vllm-ascend PR (tested on the fixture)
            res = kvforge("pr", "-t", "t", "--fix", fix_id, "--json")
            assert res.exit_code == 0, res.output
            data = json.loads(res.stdout)
            if style == "vllm":
                assert conventions.VLLM_TITLE_RE.match(data["title"]) and data["layout"] == "purpose"
                assert data["upstream_template"].startswith(".github/PULL_REQUEST_TEMPLATE.md of v0.20.2")
                assert data["branch"] == "v0.20.2"
            else:
                assert data["title"].startswith("[v0.20.2][Core][BugFix] ")
            assert "No test results are recorded for this change yet" in data["body"]
            assert "kvforge verify" not in data["body"] and "Drop when" not in data["body"]
    res = kvforge("notes", "-t", "t")
    assert res.exit_code == 0 and res.stdout.count("\n### ") == len(fixes)


# ---------------------------------------------------------------- Acknowledges: in the PR text

def test_acknowledged_changes_go_beside_the_user_facing_ones(fake, monkeypatch):
    """What the header acknowledges changing on purpose is where reviewers look for interface changes
    (the user-facing line); release notes keep only the user-facing settings."""
    use_fake_policy(fake, monkeypatch)
    give_base_a_template(fake, "vllm-0.20.2.PULL_REQUEST_TEMPLATE.md")
    msg = CLAMP_MSG.format(ident=IDENT).replace(
        "Signed-off-by:", "Acknowledges: signature clamp: hi is honoured now; callers\n pass it already\n"
                          "Acknowledges: removed vllm_like/core.py::clamp_low\nSigned-off-by:")
    commit_patch(fake, "0001-clamp-upper", CLAMP_FIX, msg, fake.base)
    fake.series("0001-clamp-upper")
    patch = read_series(fake.root / "patches" / "fake").patches[0]
    assert facts.acknowledged(patch) == [
        "the signature of `clamp` changes on purpose (hi is honoured now; callers pass it already)",
        "`clamp_low` is removed in `vllm_like/core.py` on purpose"]
    res = kvforge("pr", "-t", "fake", "--fix", "clamp-upper")
    assert res.exit_code == 0, res.output
    assert ("User-facing: the signature of `clamp` changes on purpose (hi is honoured now; callers pass it "
            "already); `clamp_low` is removed in `vllm_like/core.py` on purpose.") in res.stdout
    notes = kvforge("notes", "-t", "fake")
    assert notes.exit_code == 0, notes.output
    assert "on purpose" not in notes.stdout
