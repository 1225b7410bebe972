"""`kvforge test` / `verify` / stacks on a tiny vLLM-like tree: real git, real patches, real pytest runs.

The "upstream" (the `fake` fixture, tests/conftest.py and tests/helpers.py) is a small git repository
with a package and its pytest tests; the test environment is this interpreter ($KVFORGE_TEST_PYTHON),
so nothing is built. Each verify spawns one pytest
process per tree state, as it does on vLLM.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

from click.testing import CliRunner
from helpers import CORE, TESTS, git

from kvforge.cli import main


def kvforge(*args: str):
    return CliRunner().invoke(main, list(args))


def errline(res) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("kvforge: error:")]
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.output
    return lines[0]


CLAMP_FIX = {
    CORE: ("return max(lo, x)", "return min(hi, max(lo, x))"),
    "tests/test_kvforge_clamp.py": ("", "from vllm_like.core import clamp\n\n\ndef test_clamp_upper():\n"
                                        "    assert clamp(5, 0, 3) == 3\n"),
    TESTS: ("def test_double_zero():", "def test_clamp_in_core():\n    from vllm_like.core import clamp\n\n"
                                       "    assert clamp(9, 0, 4) == 4\n\n\ndef test_double_zero():"),
}
CLAMP_CHECKS = ("tests/test_kvforge_clamp.py::test_clamp_upper", "tests/test_core.py::test_clamp_in_core")


def test_verify_proves_fix_and_records_per_patch_evidence(fake):
    fake.patch("0001-clamp-upper", CLAMP_FIX, checks=CLAMP_CHECKS)
    fake.series("0001-clamp-upper")
    res = kvforge("verify", "--target", "fake", "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    (p,) = report["patches"]
    assert p["status"] == "proven" and p["fail_before"] == [2, 2] and p["pass_after"] == [2, 2]
    # The patch's test-side changes (a test file it adds, a test it adds to an existing file) are laid over
    # the tree before it (old code, new tests): both run there and fail for a behavioural reason.
    before = {c["node"]: (c["before"], c["before_how"], c["before_kind"]) for c in p["checks"]}
    assert before == {CLAMP_CHECKS[0]: ("failed", "from the patch", "behaviour"),
                      CLAMP_CHECKS[1]: ("failed", "from the patch", "behaviour")}
    assert "assert 5 == 3" in p["checks"][0]["before_message"] and p["checks"][0]["after_message"] == ""
    assert "assert 9 == 4" in p["checks"][1]["before_message"]
    assert report["regression"]["ok"] and report["regression"]["passed"] == 4  # 2 selection + 2 Checks
    # one pytest run per tree state: the base (with the patch's two test files) and the patched tree
    assert [(r["state"], r["tests_of"]) for r in report["runs"]] == [(0, 1), (1, None)]
    assert sorted(report["runs"][0]["overlay"]) == ["tests/test_core.py", "tests/test_kvforge_clamp.py"]
    assert Path(report["report"]).is_file() and json.loads(Path(report["report"]).read_text())["ok"]
    human = kvforge("verify", "--target", "fake")
    assert human.exit_code == 0 and "proven" in human.stdout and "verify fake: OK" in human.stdout


def test_checks_that_pass_on_the_base_are_unproven(fake):
    fake.patch("0001-already-fine", {CORE: ("def double(x):", "def double(x):  # twice")},
               checks=("tests/test_core.py::test_double",))
    fake.series("0001-already-fine")
    res = kvforge("verify", "--target", "fake", "--json")
    assert res.exit_code == 4
    (p,) = json.loads(res.stdout)["patches"]
    assert p["status"] == "unproven" and "already passes before the patch" in p["reason"]
    assert p["checks"][0]["before"] == "passed" and p["checks"][0]["after"] == "passed"
    assert "1 unproven" in errline(res)


def test_new_test_that_passes_on_the_old_tree_is_unproven(fake):
    fake.patch("0001-no-trigger", {CORE: ("return max(lo, x)", "return min(hi, max(lo, x))"),
                                   "tests/test_kvforge_no_trigger.py": ("", "from vllm_like.core import clamp\n\n\n"
                                                                            "def test_in_range():\n"
                                                                            "    assert clamp(2, 0, 3) == 2\n")},
               checks=("tests/test_kvforge_no_trigger.py::test_in_range",))
    fake.series("0001-no-trigger")
    res = kvforge("verify", "--target", "fake", "--json")
    assert res.exit_code == 4
    (p,) = json.loads(res.stdout)["patches"]
    assert p["status"] == "unproven" and p["checks"][0]["before"] == "passed"
    assert p["checks"][0]["before_how"] == "from the patch"


def test_checks_that_fail_after_the_patch_are_failing(fake):
    fake.patch("0001-wrong-fix", {"tests/test_kvforge_wrong.py": ("", "from vllm_like.core import double\n\n\n"
                                                                      "def test_wrong():\n    assert double(2) == 5\n")},
               checks=("tests/test_kvforge_wrong.py::test_wrong",))
    fake.series("0001-wrong-fix")
    res = kvforge("verify", "--target", "fake", "--json")
    assert res.exit_code == 4
    report = json.loads(res.stdout)
    (p,) = report["patches"]
    assert p["status"] == "failing" and p["checks"][0]["after"] == "failed"
    assert not report["regression"]["ok"]  # the Checks run with the suite at the end too
    assert "1 failing" in errline(res)


def test_collection_error_before_is_absent_api_and_test_patches_are_pass_to_pass(fake):
    """The test exists (patch 1 adds it) and fails before patch 2 only with an ImportError: that shows
    the API is new, not that behaviour changed, so patch 2 is unproven."""
    triple_test = "from vllm_like.core import triple\n\n\ndef test_triple():\n    assert triple(2) == 6\n"
    c1 = fake.patch("0001-triple-test", {"tests/test_kvforge_triple.py": ("", triple_test)}, kind="test")
    fake.patch("0002-triple", {CORE: ("def clamp(", "def triple(x):\n    return 3 * x\n\n\ndef clamp(")},
               checks=("tests/test_kvforge_triple.py::test_triple",), start=c1)
    fake.series("0001-triple-test", "0002-triple")
    res = kvforge("verify", "--target", "fake", "--json")
    assert res.exit_code == 4, res.output
    p1, p2 = json.loads(res.stdout)["patches"]
    assert p1["status"] == "pass-to-pass" and p1["checks"] == []
    assert p2["status"] == "unproven" and p2["checks"][0]["before"] == "error"  # ImportError at collection
    assert p2["checks"][0]["before_message"].startswith("collection error: ImportError: cannot import name 'triple'")
    assert p2["checks"][0]["before_kind"] == "absent-api"


def test_empty_series_has_nothing_to_prove(fake):
    res = kvforge("verify", "--target", "fake")
    assert res.exit_code == 0, res.output
    assert "nothing to prove" in res.stdout and "2 passed" in res.stdout


def test_fix_without_checks_is_unproven():
    from kvforge.proof.testrun import RunResult
    from kvforge.proof.verify import judge

    class P:
        name, fix_id, kind, checks, bug_checks = "0001-x.patch", "x", "fix", [], []

    v = judge(1, P(), RunResult("", "", []), RunResult("", "", []), False, "c")
    assert v.status == "unproven" and not v.ok


def test_a_fix_is_proven_by_its_bug_checks():
    """With Bug-Checks, the behavioural fail-before must be one of them: a Check of the variant's own knob failing
    behaviourally while the bug's Check fails only on a missing import proves nothing about the bug."""
    from kvforge.proof.testrun import RunResult
    from kvforge.proof.testrun.pytestrun import Case
    from kvforge.proof.verify import judge

    bug, knob = "tests/t.py::test_bug", "tests/t.py::test_knob"

    class P:
        name, fix_id, kind, checks, bug_checks = "0001-x.patch", "x", "fix", [bug, knob], [bug]

    after = RunResult("after", "c", [], cases=[Case(bug, "passed", 0.1), Case(knob, "passed", 0.1)])
    api = RunResult("before", "b", [], cases=[Case(bug, "failed", 0.1, "ImportError: cannot import name 'x'"),
                                              Case(knob, "failed", 0.1, "AssertionError: assert 1 == 2")])
    v = judge(1, P(), api, after, False, "c")
    assert v.status == "unproven" and v.reason.startswith("no Bug-Checks test fails before the patch"), v.reason
    behaviour = RunResult("before", "b", [], cases=[Case(bug, "failed", 0.1, "AssertionError: assert 0 == 3"),
                                                    Case(knob, "failed", 0.1, "ImportError: cannot import name 'k'")])
    assert judge(1, P(), behaviour, after, False, "c").status == "proven"


def test_test_writes_junit_with_properties_on_every_testcase(fake):
    fake.patch("0001-clamp-upper", CLAMP_FIX, checks=CLAMP_CHECKS)
    fake.series("0001-clamp-upper")
    res = kvforge("test", "--target", "fake", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["ok"] and data["run"]["passed"] == 4 and data["state"] == "patched"
    root = ET.parse(data["run"]["junit"]).getroot()
    cases = root.findall(".//testcase")
    assert len(cases) == 4
    for tc in cases:
        props = {p.get("name"): p.get("value") for p in tc.findall("properties/property")}
        assert props["target"] == "fake" and props["platform"] == "cpu"
        assert props["base"] == fake.base and props["series"] == data["series"]
        assert props["nodeid"].startswith("tests/")
    # ...and kvforge's own parser reads the same file back.
    from kvforge.proof.testrun import parse_junit

    parsed, suite = parse_junit(Path(data["run"]["junit"]))
    assert {c.outcome for c in parsed} == {"passed"} and suite["series"] == [data["series"]]
    assert "tests/test_kvforge_clamp.py::test_clamp_upper" in {c.nodeid for c in parsed}


def test_test_on_base_skips_checks_the_base_lacks(fake):
    fake.patch("0001-clamp-upper", CLAMP_FIX, checks=CLAMP_CHECKS)
    fake.series("0001-clamp-upper")
    res = kvforge("test", "--target", "fake", "--base", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["state"] == "base" and data["run"]["passed"] == 2
    assert sorted(data["skipped_checks"]) == sorted(CLAMP_CHECKS)
    assert "not in the base tree" in res.stderr


def test_test_exits_4_on_failures_and_when_nothing_ran(fake):
    fake.patch("0001-wrong-fix", {"tests/test_kvforge_wrong.py": ("", "def test_wrong():\n    assert 1 == 2\n")},
               checks=("tests/test_kvforge_wrong.py::test_wrong",))
    fake.series("0001-wrong-fix")
    res = kvforge("test", "--target", "fake")
    assert res.exit_code == 4
    assert "FAILED tests/test_kvforge_wrong.py::test_wrong" in res.stdout and "1 failed" in errline(res)
    none = kvforge("test", "--target", "fake", "-k", "no_such_test_name")
    assert none.exit_code == 4 and "no tests ran" in errline(none)


def test_hardware_platforms_print_the_command_and_never_pass(fake):
    res = kvforge("test", "--target", "fake", "--platform", "cuda")
    assert res.exit_code == 7
    assert "kvforge apply --target fake" in res.stdout and "python -m pytest" in res.stdout
    assert "not run" in errline(res)
    npu = kvforge("test", "--target", "fake", "--platform", "npu")
    assert npu.exit_code == 2 and "no npu tests" in errline(npu)


def test_missing_env_python_is_an_environment_error(fake, monkeypatch):
    monkeypatch.setenv("KVFORGE_TEST_PYTHON", str(fake.root / "no-env" / "bin" / "python"))
    res = kvforge("verify", "--target", "fake")
    assert res.exit_code == 5 and "does not exist" in errline(res)


def test_import_failure_in_the_tree_is_an_environment_error(fake):
    fake.patch("0001-needs-module", {"tests/conftest.py": ("", "import kvforge_no_such_module  # noqa\n")},
               kind="refactor")
    fake.series("0001-needs-module")
    res = kvforge("test", "--target", "fake")
    assert res.exit_code == 5
    line = errline(res)
    assert "pytest could not run" in line and "kvforge_no_such_module" in line


def test_patch_that_does_not_apply_is_a_clear_error(fake):
    other = git(fake.upstream, "commit-tree", "-p", fake.base, "-m", "elsewhere",
                git(fake.upstream, "rev-parse", f"{fake.base}^{{tree}}").strip()).strip()
    moved = fake.patch("0000-moved", {CORE: ("return max(lo, x)", "return max(lo, x)  # moved")}, kind="refactor",
                       start=other)
    fake.patch("0001-clamp-upper", CLAMP_FIX, checks=CLAMP_CHECKS, start=moved)
    (fake.root / "patches" / "fake" / "0000-moved.patch").unlink()
    fake.series("0001-clamp-upper")
    res = kvforge("verify", "--target", "fake")
    assert res.exit_code == 3
    assert "0001-clamp-upper.patch" in errline(res) and CORE in errline(res)


def test_stack_reuses_one_worktree_and_records_each_patch(fake):
    from kvforge.core.cache import Cache
    from kvforge.git.context import Context
    from kvforge.git.trees import open_stack

    c1 = fake.patch("0001-clamp-upper", CLAMP_FIX, checks=CLAMP_CHECKS)
    fake.patch("0002-double-doc", {CORE: ("def double(x):", "def double(x):  # twice")}, kind="refactor", start=c1)
    fake.series("0001-clamp-upper", "0002-double-doc")
    stack = open_stack(Context.load(Cache(fake.cache), "fake"))
    assert stack.built and len(stack.commits) == 3 and stack.commits[0] == fake.base
    again = open_stack(Context.load(Cache(fake.cache), "fake"))
    assert not again.built and again.commits == stack.commits and again.worktree == stack.worktree
    refs = git(stack.base.repo, "for-each-ref", "--format=%(refname) %(objectname)", "refs/kvforge/stacks/")
    assert len(refs.splitlines()) == 3 and f"refs/kvforge/stacks/fake/vllm/{stack.digest}/2 {stack.commits[2]}" in refs
    stack.checkout(0)
    assert not (stack.worktree / "tests/test_kvforge_clamp.py").exists()
    (stack.worktree / "leftover.txt").write_text("x")
    stack.checkout(2)
    assert "# twice" in (stack.worktree / CORE).read_text() and not (stack.worktree / "leftover.txt").exists()
    stack.checkout(1)
    assert "# twice" not in (stack.worktree / CORE).read_text()
    assert (stack.worktree / "tests/test_kvforge_clamp.py").is_file()
    # A changed series gets a new stack and the old one's refs are dropped.
    (fake.root / "patches" / "fake" / "0002-double-doc.patch").unlink()
    fake.series("0001-clamp-upper")
    third = open_stack(Context.load(Cache(fake.cache), "fake"))
    refs = git(stack.base.repo, "for-each-ref", "--format=%(refname)", "refs/kvforge/stacks/").split()
    assert third.built and third.digest != stack.digest and len(refs) == 2


def test_verify_from_a_tree_proves_its_commits_and_catches_a_reverted_fix(fake, tmp_path):
    """--from: the commits of a user's tree are the series. Rewriting commit 1 so that its fix is
    reverted (its tests kept) makes that commit unproven, before anything is exported."""
    c1 = fake.patch("0001-clamp-upper", CLAMP_FIX, checks=CLAMP_CHECKS)
    fake.patch("0002-double-doc", {CORE: ("def double(x):", "def double(x):  # twice")}, kind="refactor", start=c1)
    fake.series("0001-clamp-upper", "0002-double-doc")
    tree = tmp_path / "tree"
    res = kvforge("apply", "-t", "fake", "--into", str(tree))
    assert res.exit_code == 0, res.output
    res = kvforge("verify", "-t", "fake", "--from", str(tree), "--json")
    assert res.exit_code == 0, res.output
    assert [p["status"] for p in json.loads(res.stdout)["patches"]] == ["proven", "pass-to-pass"]
    # The user's edit: commit 1 loses its code change (the tests stay), commit 2 is replayed on top.
    git(tree, "checkout", "-q", "-b", "edited", "kvforge/base/fake")
    git(tree, "cherry-pick", "-n", "kvforge/fake~1")
    git(tree, "checkout", "kvforge/base/fake", "--", CORE)
    git(tree, "commit", "-q", "-C", "kvforge/fake~1")
    git(tree, "cherry-pick", "kvforge/fake")
    series_before = {p.name: p.read_bytes() for p in (fake.root / "patches" / "fake").iterdir()}
    res = kvforge("verify", "-t", "fake", "--from", f"{tree}:edited", "--json")
    assert res.exit_code == 4, res.output
    report = json.loads(res.stdout)
    first = report["patches"][0]
    assert first["fix_id"] == "clamp-upper" and first["status"] != "proven"
    assert "tests/test_kvforge_clamp.py::test_clamp_upper fails with the patch" in first["reason"]
    assert report["origin"].startswith(f"--from {tree}:edited")
    # Nothing was exported or changed: the series files are as they were, the tree too.
    assert {p.name: p.read_bytes() for p in (fake.root / "patches" / "fake").iterdir()} == series_before
    assert git(tree, "status", "--porcelain") == ""
    # REV in the current directory's repository works the same way.
    import os

    cwd = os.getcwd()
    os.chdir(tree)
    try:
        res = kvforge("test", "-t", "fake", "--from", "edited")
    finally:
        os.chdir(cwd)
    assert res.exit_code == 4 and "test_clamp_upper" in res.output


def test_from_a_tree_without_the_base_is_refused(fake, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    git(other, "init", "-q")
    (other / "x").write_text("x\n")
    git(other, "add", "x")
    git(other, "commit", "-qm", "unrelated")
    res = kvforge("verify", "-t", "fake", "--from", str(other), "--json")
    assert res.exit_code == 2
    assert "does not contain the base commit" in json.loads(res.stdout)["error"]


def test_a_fix_whose_checks_fail_before_only_for_a_missing_api_is_unproven(fake):
    """An ImportError before the patch proves the API is new, not that behaviour changed."""
    fake.patch("0001-add-triple", {CORE: ("def clamp(", "def triple(x):\n    return 3 * x\n\n\ndef clamp("),
                                   "tests/test_kvforge_triple.py": ("", "from vllm_like.core import triple\n\n\n"
                                                                        "def test_triple():\n    assert triple(2) == 6\n")},
               checks=("tests/test_kvforge_triple.py::test_triple",))
    fake.series("0001-add-triple")
    res = kvforge("verify", "-t", "fake", "--json")
    assert res.exit_code == 4, res.output
    patch = json.loads(res.stdout)["patches"][0]
    assert patch["status"] == "unproven" and patch["behaviour_before"] == 0
    assert patch["checks"][0]["before_kind"] == "absent-api"
    assert "behavioural reason" in patch["reason"] and "triple" in patch["reason"]


def test_a_behavioural_fail_before_is_named_in_the_report(fake):
    fake.patch("0001-clamp-upper", CLAMP_FIX, checks=CLAMP_CHECKS)
    fake.series("0001-clamp-upper")
    res = kvforge("verify", "-t", "fake")
    assert res.exit_code == 0, res.output
    assert "2 behaviour" in res.output and "why it failed before" in res.output


def test_fail_kinds():
    from kvforge.proof.verify import fail_kind

    assert fail_kind("failed", "AssertionError: assert [3, 4] == [1, 2]") == "behaviour"
    assert fail_kind("error", "collection error: ImportError: cannot import name 'x' from 'vllm'") == "absent-api"
    assert fail_kind("failed", "TypeError: KVCacheManager.__init__() got an unexpected keyword argument 'y'") \
        == "absent-api"
    assert fail_kind("failed", "AttributeError: 'FreeKVCacheBlockQueue' object has no attribute 'prepend_n'") \
        == "absent-api"
    assert fail_kind("failed", "AttributeError: 'NoneType' object has no attribute 'block_id'") == "behaviour"
    assert fail_kind("failed", "pydantic_core._pydantic_core.ValidationError: 1 validation error for CacheConfig") \
        == "absent-api"
    assert fail_kind("failed", "SystemExit: 2") == "absent-api"
    assert fail_kind("missing", "") == "absent-test" and fail_kind("passed", "") is None


def test_a_test_added_to_an_existing_module_failing_only_to_collect_is_unproven(fake):
    """The patch's new test function in tests/test_core.py runs before the patch (its version of the module
    laid over the old tree); the module does not even collect there because the name it imports does not
    exist yet: an ImportError, not a behaviour, so the fix is unproven and the reason says why."""
    fake.patch("0001-add-triple", {CORE: ("def clamp(", "def triple(x):\n    return 3 * x\n\n\ndef clamp("),
                                   TESTS: ("from vllm_like.core import double\n",
                                           "from vllm_like.core import double, triple\n\n\n"
                                           "def test_triple():\n    assert triple(2) == 6\n")},
               checks=("tests/test_core.py::test_triple",))
    fake.series("0001-add-triple")
    res = kvforge("verify", "-t", "fake", "--json")
    assert res.exit_code == 4, res.output
    report = json.loads(res.stdout)
    (p,) = report["patches"]
    (c,) = p["checks"]
    assert (c["before"], c["before_how"], c["before_kind"], c["after"]) == ("error", "from the patch", "absent-api",
                                                                           "passed")
    assert c["before_message"].startswith("collection error: ImportError: cannot import name 'triple'")
    assert p["status"] == "unproven" and "behavioural reason" in p["reason"] and "ImportError" in p["reason"]
    assert report["regression"]["ok"]  # the patched tree is fine: only the proof is missing
    assert "1 unproven" in errline(res)


def test_the_before_run_of_a_patch_changing_a_test_module_is_its_own(fake):
    """Patch 2 changes tests/test_core.py, which holds patch 1's Checks: its version runs before patch 2
    in a pytest run of its own, so patch 1 is still judged on its own tests at the same tree state."""
    c1 = fake.patch("0001-clamp-upper", CLAMP_FIX, checks=CLAMP_CHECKS)
    fake.patch("0002-double-negative", {
        CORE: ("    return 2 * x", "    return 2 * max(x, 0)"),
        TESTS: ("    assert clamp(9, 0, 4) == 4\n", "    assert clamp(9, 0, 4) == 4\n\n\n"
                                                  "def test_double_negative():\n    from vllm_like.core import clamp\n\n"
                                                  "    assert double(-1) == 0\n    assert double(clamp(-3, 0, 4)) == 0\n"),
    }, checks=("tests/test_core.py::test_double_negative",), start=c1)
    fake.series("0001-clamp-upper", "0002-double-negative")
    res = kvforge("verify", "-t", "fake", "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert [p["status"] for p in report["patches"]] == ["proven", "proven"]
    assert [(r["state"], r["tests_of"]) for r in report["runs"]] == [(0, 1), (1, None), (1, 2), (2, None)]
    (c,) = report["patches"][1]["checks"]
    assert (c["before"], c["before_how"], c["before_kind"]) == ("failed", "from the patch", "behaviour")
    assert "assert -2 == 0" in c["before_message"]
    assert report["runs"][2]["overlay"] == [TESTS] and report["runs"][2]["passed"] + report["runs"][2]["failed"] == 1
    assert report["runs"][1]["passed"] == 2  # patch 1's Checks, on its own version of tests/test_core.py


def test_test_side_files():
    from kvforge.proof.verify import test_side

    assert test_side("tests/v1/core/utils.py") and test_side("tests/conftest.py")
    assert test_side("vllm_ascend/tests/test_x.py") and test_side("pkg/conftest.py")
    assert not test_side("vllm/v1/core/block_pool.py") and not test_side("vllm/testing.py")


def test_prove_only_some_patches_holds_the_others_to_pass_to_pass_and_records_nothing(fake):
    """verify_target(prove=[1]) (what `kvforge pick --verify --after` asks for a patch in the middle): patch 1
    is proven at its place; patch 2 is not re-proven (pass-to-pass: its Checks pass on the patched tree);
    no verify record is saved, so the series' own evidence is never shadowed by a partial run."""
    from kvforge.core.cache import Cache
    from kvforge.git.context import Context
    from kvforge.core.evidence import latest
    from kvforge.git.trees import open_stack
    from kvforge.proof.verify import verify_target

    c1 = fake.patch("0001-clamp-upper", CLAMP_FIX, checks=CLAMP_CHECKS)
    fake.patch("0002-double-negative", {CORE: ("    return 2 * x", "    return 2 * max(x, 0)"),
                                        "tests/test_kvforge_negative.py": ("", "from vllm_like.core import double\n\n\n"
                                                                               "def test_neg():\n"
                                                                               "    assert double(-1) == 0\n")},
               checks=("tests/test_kvforge_negative.py::test_neg",), start=c1)
    fake.series("0001-clamp-upper", "0002-double-negative")
    ctx = Context.load(Cache(fake.cache), "fake")
    report = verify_target(ctx, prove=[1])
    assert report.ok and [p.status for p in report.patches] == ["proven", "pass-to-pass"]
    assert "not re-proven" in report.patches[1].reason and report.patches[1].checks == []
    assert [(r["state"], r["tests_of"]) for r in report.runs] == [(0, 1), (1, None), (2, None)]
    assert "no verify record" in report.report
    assert latest(Cache(fake.cache), open_stack(ctx).key, "verify") is None
    last = verify_target(ctx, prove=[-1])  # -1: the last patch
    assert [p.status for p in last.patches] == ["pass-to-pass", "proven"]
    assert [(r["state"], r["tests_of"]) for r in last.runs] == [(1, 2), (2, None)]
