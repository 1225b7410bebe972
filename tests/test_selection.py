"""The CPU test selection: which of vLLM's tests a series can break (static scan), and verify's
base-vs-patched comparison that keeps the base's own failures from being blamed on the series.

The scanner runs on a tiny tree here and, statically, on the three real release trees (their
sdists); the comparison runs real pytest on the `fake` vLLM-like upstream.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import CORE, TESTS, git

from kvforge.cli import main
from kvforge.proof.selection import DirSource, SdistSource, covered, imports_of, scan, series_touched, touched_modules

REPO_ROOT = Path(__file__).resolve().parent.parent


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_scanner_finds_direct_and_local_helper_imports_only(tmp_path):
    write(tmp_path, {
        "pkg/__init__.py": "", "pkg/core/__init__.py": "", "pkg/core/pool.py": "", "pkg/core/other.py": "",
        "pkg/envs.py": "",
        "tests/__init__.py": "", "tests/core/__init__.py": "",
        "tests/core/test_direct.py": "from pkg.core.pool import Pool\n",
        "tests/core/test_module_from_package.py": "from pkg.core import pool, other\n",
        "tests/core/test_in_function.py": "def test_x():\n    import pkg.core.pool as p\n",
        "tests/core/test_relative_helper.py": "from .utils import make\n",
        "tests/core/utils.py": "from .deeper import thing\n",
        "tests/core/deeper.py": "from pkg.core.pool import Pool\n",
        "tests/core/test_unrelated.py": "from pkg.core.other import x\nimport pkg.core\n",
        "tests/core/test_package_reexport.py": "from pkg.core import Pool\n",  # through pkg/core/__init__.py
        "tests/utils.py": "import pkg.envs\nfrom pkg.core.pool import Pool\n",
        "tests/test_top.py": "from tests.utils import x\n",  # same directory as tests/utils.py: followed
        "tests/core/test_far_helper.py": "from tests.utils import x\n",  # another directory's helper: not
        "tests/core/conftest.py": "from pkg.core.pool import Pool\n",
        "tests/core/test_broken.py": "def (:\n",
        "tests/core/pool_test.py": "from pkg.core import pool\n",
    })
    touched = touched_modules(["pkg/core/pool.py", "pkg/README.md", "tests/core/test_new.py"], package="pkg")
    assert touched == ["pkg.core.pool"]
    hits = {h.module: h for h in scan(DirSource(tmp_path), touched)}
    assert sorted(hits) == ["tests/core/pool_test.py", "tests/core/test_direct.py", "tests/core/test_in_function.py",
                            "tests/core/test_module_from_package.py", "tests/core/test_relative_helper.py",
                            "tests/test_top.py"]
    assert hits["tests/core/test_relative_helper.py"].via == ["tests/core/utils.py", "tests/core/deeper.py"]
    direct = hits["tests/core/test_direct.py"]
    assert direct.reaches == ["pkg.core.pool"] and direct.via == []
    assert imports_of("from ..a import b\nfrom . import c\n", "tests/x/y/test_z.py") == {
        "tests.x.a", "tests.x.a.b", "tests.x.y", "tests.x.y.c"}
    assert covered("tests/core/test_direct.py", ["tests/core"]) and covered("tests/a.py", ["tests/a.py"])
    assert not covered("tests/core/test_direct.py", ["tests/core/test_direct.py::test_one", "tests/cor"])


# ---------------------------------------------------------------- base vs patched on the fake upstream

BROKEN_UPSTREAM = "\n\ndef test_broken_upstream():\n    assert double(3) == 7\n"
FIX = {  # a real fix with its Checks, so verify has something to prove
    CORE: ("return max(lo, x)", "return min(hi, max(lo, x))"),
    "tests/test_kvforge_clamp.py": ("", "from vllm_like.core import clamp\n\n\ndef test_clamp_upper():\n"
                                        "    assert clamp(5, 0, 3) == 3\n"),
}
CHECK = "tests/test_kvforge_clamp.py::test_clamp_upper"


def kvforge(*args: str):
    return CliRunner().invoke(main, list(args))


def break_the_base(fake) -> None:
    """Give the fake upstream's release a test that fails on it (as vLLM 0.20.2's offloading tests do on CPU)."""
    (fake.upstream / TESTS).write_text((fake.upstream / TESTS).read_text() + BROKEN_UPSTREAM)
    git(fake.upstream, "commit", "-qam", "v1 with a broken test")
    git(fake.upstream, "tag", "-f", "v1")
    fake.base = git(fake.upstream, "rev-parse", "HEAD").strip()


def test_a_failure_the_base_has_is_not_blamed_and_a_new_one_is(fake):
    break_the_base(fake)
    c1 = fake.patch("0001-clamp-upper", FIX, checks=(CHECK,))
    fake.series("0001-clamp-upper")
    res = kvforge("verify", "-t", "fake", "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    reg = report["regression"]
    cmp = reg["compare"]
    assert reg["ok"] and reg["failed"] == 1  # the broken test fails on the patched tree too...
    assert cmp["pre_existing"] == ["tests/test_core.py::test_broken_upstream"]  # ...and is the base's state
    assert cmp["new"] == [] and cmp["base_source"] == "run" and cmp["base"]["failed"] == 1
    record = json.loads(Path(cmp["base_record"]).read_text())["data"]
    assert record["asked"] == ["tests/test_core.py::test_broken_upstream"]  # only what fails patched ran on the base
    human = kvforge("verify", "-t", "fake")  # again: the base's answer is recorded, not asked again
    assert human.exit_code == 0, human.output
    out = human.stdout
    assert "0 new failures, 1 pre-existing" in out and "pre-existing tests/test_core.py::test_broken_upstream" in out
    assert "(1 pre-existing on the base)" in out and "recorded earlier" in out
    test = kvforge("test", "-t", "fake")  # `kvforge test` judges the same way
    assert test.exit_code == 0 and "1 failed" in test.stdout and "0 new failures, 1 pre-existing" in test.stdout

    # A second patch breaks a test that passes on the base: a new failure, blamed; the base's is still not.
    fake.patch("0002-double-one", {CORE: ("return 2 * x", "return 2 * x if x else 1")}, kind="refactor", start=c1)
    fake.series("0001-clamp-upper", "0002-double-one")
    res = kvforge("verify", "-t", "fake", "--json")
    assert res.exit_code == 4, res.output
    report = json.loads(res.stdout)
    cmp = report["regression"]["compare"]
    assert [(f["node"], f["base"], f["patched"]) for f in cmp["new"]] == [
        ("tests/test_core.py::test_double_zero", "passed", "failed")]
    assert cmp["pre_existing"] == ["tests/test_core.py::test_broken_upstream"]
    # Only the newly failing test was asked of the base; the earlier answer was reused.
    assert cmp["base_source"] == "run" and (cmp["base"]["failed"], cmp["base"]["passed"]) == (1, 1)
    record = json.loads(Path(cmp["base_record"]).read_text())["data"]
    assert record["asked"] == ["tests/test_core.py::test_broken_upstream", "tests/test_core.py::test_double_zero"]
    assert all("tests/test_core.py" not in r["selectors"] for r in report["runs"] if r["state"] == 0)
    assert "1 new failures" in report["error"] or "regression suite fails" in report["error"]
    assert "test_double_zero" in report["regression"]["reason"]
    human = kvforge("verify", "-t", "fake")
    assert "NEW tests/test_core.py::test_double_zero: failed (on the base: passed)" in human.stdout
    test = kvforge("test", "-t", "fake", "--json")
    assert test.exit_code == 4 and "1 new (not failing on the base)" in json.loads(test.stdout)["error"]


def test_a_patch_that_fixes_a_base_failure_is_shown_fixed_and_a_broken_collection_is_new(fake):
    break_the_base(fake)
    c1 = fake.patch("0001-clamp-upper", FIX, checks=(CHECK,))
    fake.series("0001-clamp-upper")
    assert kvforge("verify", "-t", "fake").exit_code == 0  # records the base's failure
    fake.patch("0002-double-seven", {TESTS: ("assert double(3) == 7", "assert double(3) == 6")}, kind="test",
               start=c1)
    fake.series("0001-clamp-upper", "0002-double-seven")
    res = kvforge("verify", "-t", "fake", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["regression"]["compare"]["fixed"] == ["tests/test_core.py::test_broken_upstream"]
    # A patch that makes the selected module fail to import: a collection error the base does not have.
    (fake.root / "patches" / "fake" / "0002-double-seven.patch").unlink()
    fake.patch("0002-syntax", {TESTS: ("def test_double():", "def test_double(:")}, kind="test", start=c1)
    fake.series("0001-clamp-upper", "0002-syntax")
    res = kvforge("verify", "-t", "fake", "--json")
    assert res.exit_code == 4, res.output
    new = json.loads(res.stdout)["regression"]["compare"]["new"]
    assert [(f["node"], f["base"], f["patched"]) for f in new] == [("tests/test_core.py", "collected", "error")]


# ---------------------------------------------------------------- the real targets' selections

TARGETS = {"v0.20.1": "vllm-0.20.1.tar.gz", "v0.20.2rc": "vllm-0.20.2.tar.gz", "main": "vllm-0.33.0.tar.gz"}
# Modules the static scan finds in a release that do not run on CPU in kvforge's env, each with why:
# tried with `kvforge test --scan --try` on the base tree (no test passes there, or the module does not
# finish in 120 s). v0.20.1 and v0.20.2 have the same modules and answers.
V020_NOT_ON_CPU = {
    "tests/compile/h100/test_startup.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'anthropic'",
    "tests/compile/passes/distributed/test_async_tp.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'depyf'",
    "tests/compile/passes/distributed/test_fusion_all_reduce.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'depyf'",
    "tests/compile/passes/distributed/test_sequence_parallelism.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'depyf'",
    "tests/compile/passes/test_silu_mul_quant_fusion.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'depyf'",
    "tests/compile/test_aot_compile.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'anthropic'",
    "tests/compile/test_rotary_embedding_compile.py": 'all 1 tests skip on CPU',
    "tests/config/test_mp_reducer.py":
        'no test passes on CPU (1 failed): RuntimeError: Engine core initialization failed. See root cause above. F...',
    "tests/distributed/test_multiproc_executor.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'anthropic'",
    "tests/distributed/test_nccl_symm_mem_allreduce.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'anthropic'",
    "tests/distributed/test_ray_v2_executor.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'ray'",
    "tests/distributed/test_ray_v2_executor_e2e.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'ray'",
    "tests/distributed/test_symm_mem_allreduce.py": 'all 2 tests skip on CPU',
    "tests/distributed/test_utils.py": "does not import in the CPU env: ModuleNotFoundError: No module named 'ray'",
    "tests/entrypoints/openai/chat_completion/test_chat.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'jsonschema'",
    "tests/entrypoints/openai/completion/test_tensorizer_entrypoint.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'pytest_asyncio'",
    "tests/entrypoints/openai/responses/test_serving_responses.py":
        "its conftest does not import in the CPU env (No module named 'pytest_asyncio'): it would stop the whole run",
    "tests/kernels/moe/test_grouped_topk.py": 'all 480 tests skip on CPU',
    "tests/lora/test_add_lora.py": "does not import in the CPU env: ModuleNotFoundError: No module named 'uvicorn'",
    "tests/lora/test_lora_functions.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'uvicorn'",
    "tests/model_executor/model_loader/runai_streamer_loader/test_runai_model_streamer_s3.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'runai_model_streamer'",
    "tests/model_executor/model_loader/tensorizer_loader/test_tensorizer.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'anthropic'",
    "tests/models/language/generation/test_hybrid.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'anthropic'",
    "tests/models/multimodal/generation/test_voxtral_realtime.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'pytest_asyncio'",
    "tests/models/multimodal/processing/test_tensor_schema.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'anthropic'",
    "tests/models/test_initialization.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'anthropic'",
    "tests/plugins_tests/test_scheduler_plugins.py":
        "no test passes on CPU (1 failed): AssertionError: assert 'WorkerProc i...r root cause.' == 'Exception ra.....",
    "tests/plugins_tests/test_stats_logger_plugins.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'dummy_stat_logger'",
    "tests/test_config.py": 'does not finish in 120 s on CPU (34 pass, 95 fail on the base: model configs not offline)',
    "tests/test_regression.py": "does not import in the CPU env: ModuleNotFoundError: No module named 'anthropic'",
    "tests/v1/attention/test_mla_backends.py": 'does not finish in 120 s on CPU (every test errors)',
    "tests/v1/attention/test_rocm_attention_backends_selection.py": 'all 20 tests skip on CPU',
    "tests/v1/attention/test_sparse_mla_backends.py": 'skipped on CPU (module-level skip)',
    "tests/v1/core/test_priority_scheduler_random.py":
        'no test passes on CPU (12 failed): ValidationError: 1 validation error for ModelConfig',
    "tests/v1/determinism/test_batch_invariance.py": 'all 9 tests skip on CPU',
    "tests/v1/distributed/test_async_llm_dp.py":
        'no test passes on CPU (23 failed): Failed: async def functions are not natively supported.',
    "tests/v1/distributed/test_eagle_dp.py":
        'no test passes on CPU (1 failed): Failed: async def functions are not natively supported.',
    "tests/v1/e2e/general/test_mamba_prefix_cache.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'datasets'",
    "tests/v1/e2e/general/test_streaming_input.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'pytest_asyncio'",
    "tests/v1/e2e/spec_decode/test_spec_decode.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'anthropic'",
    "tests/v1/engine/test_abort_final_step.py": 'all 1 tests skip on CPU',
    "tests/v1/engine/test_async_llm.py": 'all 1 tests skip on CPU',
    "tests/v1/engine/test_engine_core.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'anthropic'",
    "tests/v1/engine/test_engine_core_client.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'anthropic'",
    "tests/v1/engine/test_output_processor.py":
        "no test passes on CPU (32 errors, 2 failed): OSError: couldn't connect to huggingface.co (offline)",
    "tests/v1/engine/test_preprocess_error_handling.py":
        'no test passes on CPU (1 failed): LocalEntryNotFoundError: no cached snapshot (offline)',
    "tests/v1/executor/test_executor.py": 'does not finish in 120 s on CPU (starts engines)',
    "tests/v1/kv_connector/unit/test_mooncake_connector.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'httpx'",
    "tests/v1/kv_connector/unit/test_mooncake_connector_hma.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'httpx'",
    "tests/v1/kv_connector/unit/test_moriio_connector.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'msgpack'",
    "tests/v1/kv_connector/unit/test_nixl_connector.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'ray'",
    "tests/v1/shutdown/test_delete.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'anthropic'",
    "tests/v1/shutdown/test_processor_error.py":
        'no test passes on CPU (1 failed): async def functions are not natively supported',
    "tests/v1/shutdown/test_startup_error.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'anthropic'",
    "tests/v1/streaming_input/test_scheduler_streaming.py":
        'no test passes on CPU (8 failed): AssertionError: Encoder-decoder models are expected to implement the mul...',
    "tests/v1/structured_output/test_backend_guidance.py":
        "no test passes on CPU (4 failed, 2 errors): OSError: couldn't connect to huggingface.co (offline)",
    "tests/v1/test_oracle.py":
        'no test passes on CPU (1 failed): LocalEntryNotFoundError: Cannot find an appropriate cached snapshot fold...',
    "tests/v1/worker/test_worker_memory_snapshot.py":
        'all 1 tests skip on CPU: Need at least 2 GPUs for tensor parallelism',
}
# main (0.33.0), tried on an idle machine on 2026-11-24 (`kvforge test -t main --scan --try`).
MAIN_NOT_ON_CPU = {
    "tests/v1/core/test_priority_scheduler_random.py":
        "no test passes on CPU (12 failed): ValidationError for ModelConfig: invalid repository ID (offline)",
    "tests/v1/kv_connector/unit/offloading_connector/test_scheduler.py":
        "does not finish on CPU: 225 passed, 8 failed, then waits (killed at 900 s; v0.20.x runs it)",
    "tests/v1/kv_connector/unit/test_moriio_hma_scheduler.py":
        "does not import in the CPU env: ModuleNotFoundError: No module named 'msgpack'",
    "tests/v1/kv_connector/unit/test_umbp_events.py":
        "all 24 tests skip on CPU: UMBP is only available on ROCm with the mori package installed",
    "tests/v1/kv_connector/unit/test_umbp_hybrid.py":
        "all 54 tests skip on CPU: UMBP is only available on ROCm with the mori package installed",
}
NOT_ON_CPU: dict[str, dict[str, str]] = {"v0.20.1": V020_NOT_ON_CPU, "v0.20.2rc": V020_NOT_ON_CPU,
                                         "main": MAIN_NOT_ON_CPU}


@pytest.fixture(scope="module")
def sdists():
    from kvforge.git.bases import download_sdist
    from kvforge.core.cache import Cache, default_cache_dir
    from kvforge.project.targets import load_target

    out = {}
    for name, file in TARGETS.items():
        path = default_cache_dir() / "downloads" / file
        if not path.is_file():
            download_sdist(load_target(name, REPO_ROOT).component(), Cache(default_cache_dir()), print)
        out[name] = path
    return out


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_each_targets_cpu_selection_covers_every_module_its_series_can_break(name, sdists):
    """A module of the release that imports a file the target's series touches is in the CPU selection,
    unless it is recorded as not running on CPU (with why)."""
    from kvforge.project.series import read_series
    from kvforge.project.targets import load_target

    comp = load_target(name, REPO_ROOT).component()
    series = read_series(comp.series_dir)
    touched = touched_modules(series_touched(series))
    source = SdistSource(sdists[name])
    hits = scan(source, touched)
    cpu = comp.tests["cpu"]
    unlisted = [h.module for h in hits if not covered(h.module, cpu)
                and h.module not in NOT_ON_CPU[name]]
    assert unlisted == [], f"{name}: add to [components.tests] cpu (or record why they cannot run on CPU)"
    if series.patches:
        assert "tests/v1/simple_kv_offload/test_scheduler.py" in {h.module for h in hits}  # 0002/0004 touch it
    # Every listed module exists in the release (a typo would only show as "not in this tree" at run time).
    present = set(source.paths())
    assert [s for s in cpu if s.split("::", 1)[0] not in present] == []
    # ...and an entry of NOT_ON_CPU that the scan no longer finds is stale.
    assert sorted(set(NOT_ON_CPU[name]) - {h.module for h in hits}) == []


# ---------------------------------------------------------------- kvforge lint --selections [--collect]

def private_cache(tmp_path: Path) -> Path:
    """A cache of this test's own (bases, stacks, worktrees), sharing the user cache's downloads and test
    environments (sha256-checked, keyed by content), so no other kvforge run's worktree lock is waited for."""
    from kvforge.core.cache import default_cache_dir

    cache = tmp_path / "cache"
    cache.mkdir()
    for name in ("downloads", "envs"):
        (default_cache_dir() / name).mkdir(parents=True, exist_ok=True)
        (cache / name).symlink_to(default_cache_dir() / name, target_is_directory=True)
    return cache


@pytest.mark.slow
def test_every_selection_path_of_every_target_exists_in_its_base(tmp_path, monkeypatch):
    """Every cpu, cuda and npu selector of every target and component is a file or directory of its base
    (the real release trees: vLLM 0.20.1, 0.20.2, 0.33.0, vllm-ascend 0.20.2rc1)."""
    from kvforge.project.targets import load_all

    monkeypatch.setenv("KVFORGE_ROOT", str(REPO_ROOT))
    monkeypatch.delenv("KVFORGE_OFFLINE", raising=False)
    res = CliRunner().invoke(main, ["--cache-dir", str(private_cache(tmp_path)), "lint", "--selections", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    want = {(t.name, c.name, p, s) for t in load_all(REPO_ROOT) for c in t.components
            for p, sel in c.tests.items() for s in sel}
    got = {(e["target"], e["component"], e["platform"], e["selector"]) for e in doc["selections"]}
    assert got == want and len(want) > 80
    assert all(e["exists"] for e in doc["selections"]) and doc["problems"] == []
    assert {s for (_t, _c, p, s) in want if p == "cuda"} >= {"tests/v1/e2e/spec_decode/test_spec_decode.py",
                                                            "tests/v1/e2e/spec_decode/eagle/test_eagle_correctness.py"}


def test_a_selection_path_the_base_lacks_is_a_lint_problem(project):
    """The cuda path every target named before (tests/v1/e2e/test_spec_decode.py, in no release): exit 1,
    the target file and the base named."""
    text = (project / "targets" / "t.toml").read_text()
    assert "[components.tests]" in text
    text = text.replace("[components.tests]\n", '[components.tests]\ncuda = ["tests/v1/core", '
                                                '"tests/v1/e2e/test_spec_decode.py"]\n', 1)
    (project / "targets" / "t.toml").write_text(text)
    assert CliRunner().invoke(main, ["lint"]).exit_code == 0  # without --selections: the series only
    res = CliRunner().invoke(main, ["lint", "--selections", "--json"])
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    bad = [e for e in doc["selections"] if not e["exists"]]
    assert [e["selector"] for e in bad] == ["tests/v1/e2e/test_spec_decode.py"]
    assert "targets/t.toml" in bad[0]["problem"] and "does not exist in its base" in bad[0]["problem"]
    assert "vllm v0.20.2" in bad[0]["problem"]
    assert any("test_spec_decode.py" in p["message"] for p in doc["problems"])


def test_collect_output_is_read_per_selector():
    from kvforge.proof.selection import parse_collect_output

    out = """tests/v1/core/test_a.py::test_one
tests/v1/core/test_a.py::test_two[x]
tests/v1/core/sub/test_b.py::test_three

==================================== ERRORS ====================================
__________ ERROR collecting tests/v1/e2e/spec_decode/test_spec_decode.py __________
tests/utils.py:26: in <module>
    import anthropic
E   ModuleNotFoundError: No module named 'anthropic'
3 tests collected, 1 error in 3.92s
"""
    counts, why = parse_collect_output(out, ["tests/v1/core", "tests/v1/e2e/spec_decode/test_spec_decode.py",
                                             "tests/v1/core/sub"])
    assert counts == {"tests/v1/core": 3, "tests/v1/e2e/spec_decode/test_spec_decode.py": 0, "tests/v1/core/sub": 1}
    assert why == {"tests/v1/e2e/spec_decode/test_spec_decode.py": "ModuleNotFoundError: No module named 'anthropic'"}


@pytest.mark.slow
def test_cuda_selection_collects_on_cpu_in_base_and_patched_trees(tmp_path, monkeypatch):
    """v0.20.2rc's cuda selection, collected with pytest --collect-only in the target's CPU env on the base and
    the patched tree: the KV-cache manager tests collect (more after the series: its Checks); vLLM's e2e
    modules, which import tests/utils.py (anthropic, only in vLLM's GPU test image), are checked by path
    and say why."""
    monkeypatch.setenv("KVFORGE_ROOT", str(REPO_ROOT))
    monkeypatch.delenv("KVFORGE_OFFLINE", raising=False)
    monkeypatch.delenv("KVFORGE_TEST_PYTHON", raising=False)
    res = CliRunner().invoke(main, ["--cache-dir", str(private_cache(tmp_path)), "lint", "-t", "v0.20.2rc",
                                    "--component", "vllm", "--selections", "--collect", "--json"])
    assert res.exit_code == 0, res.output
    cuda = {e["selector"]: e for e in json.loads(res.stdout)["selections"] if e["platform"] == "cuda"}
    core = cuda["tests/v1/core"]
    assert core["collected"]["base"] > 200 and core["collected"]["patched"] > core["collected"]["base"]
    assert not core["by_path"] and not core["problem"]
    e2e = [e for s, e in cuda.items() if s.startswith("tests/v1/e2e/")]
    assert len(e2e) == 3 and all(e["exists"] and "checked by path" in e["by_path"] for e in e2e)
    assert all("No module named" in e["by_path"] for e in e2e)
