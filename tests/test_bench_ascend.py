"""`kvforge bench prefix-cache --component vllm-ascend`: seed 001 through vLLM's real scheduler with
vllm-ascend's coordinator, managers and DeepSeek-V4 specs (kvforge/bench/replay/ascend.py).

One real small run: the command's own path (both components' stacks from the project's series, the
vLLM test environment, stand-ins, the replay subprocess), narrowed to the patched trees (whole-block
hits at block sizes 128 and 32; partial hits, VLLM_ASCEND_ENABLE_PARTIAL_HASH_HITS=1, at 32 on both
workloads), at the smallest scale (64 requests of 8,192 prompt tokens). The session's cache (conftest: vLLM 0.20.2 imported once) gets the vllm-ascend
sdist from the user's kvforge downloads; the environment is ~/.cache/kvforge/envs (or
$KVFORGE_TEST_ENVS), as in test_bench_slow.py.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kvforge.bench import prefix_cache as pc
from kvforge.core.cache import Cache, default_cache_dir
from kvforge.git.context import Context

REPO_ROOT = Path(__file__).resolve().parent.parent
ASCEND_SDIST = "vllm_ascend-0.20.2rc1.tar.gz"
# Resolved at import, before fixtures point $KVFORGE_CACHE at a throw-away cache.
TEST_ENVS = Path(os.environ.get("KVFORGE_TEST_ENVS") or default_cache_dir() / "envs")
USER_DOWNLOADS = default_cache_dir() / "downloads"


@pytest.fixture(scope="module")
def ascend_bench(base_v0202) -> pc.BenchResult:
    cache, _ = base_v0202  # the session's cache: vLLM 0.20.2's base is imported there once
    src = USER_DOWNLOADS / ASCEND_SDIST
    if not src.is_file():
        from kvforge.git.bases import download_sdist
        from kvforge.project.targets import load_target

        download_sdist(load_target("v0.20.2rc", REPO_ROOT).component("vllm-ascend"), Cache(default_cache_dir()), print)
    shutil.copy2(src, cache.downloads / ASCEND_SDIST)
    TEST_ENVS.mkdir(parents=True, exist_ok=True)
    if not (cache.root / "envs").exists():  # created lazily: as test_verify_slow.py does
        (cache.root / "envs").symlink_to(TEST_ENVS, target_is_directory=True)
    mp = pytest.MonkeyPatch()
    mp.setenv("KVFORGE_ROOT", str(REPO_ROOT))
    ctx = Context.load(cache, "v0.20.2rc", "vllm-ascend", source="sdist")
    mp.setattr(pc, "ASCEND_STATES", (
        ("patched", "patched", "patched", (("--block-sizes", "128,32"),)),
        ("patched", "patched", "partial-hits", (("--block-sizes", "32", "--workloads", "repeat,shared-prefix",
                                                 "--partial-hits"),)),
    ))
    try:
        return pc.bench_ascend(ctx, "all", 0.01, 0)
    finally:
        mp.undo()


def _doc_result(bench: pc.BenchResult, variant: str) -> dict:
    tree = next(t for t in bench.trees if t.state == "patched")
    return next(r for r in tree.doc["results"] if r["variant"] == variant)


def test_replay_runs_vllm_ascend_coordinator_with_the_trees_own_geometry(ascend_bench):
    assert ascend_bench.component == "vllm-ascend" and not ascend_bench.errors
    for variant, block, align, c4_state in (("bs128", 128, 16384, 8), ("bs32", 32, 4096, 2)):
        res = _doc_result(ascend_bench, variant)
        f = res["features"]
        assert f["coordinator"].endswith("patch_kv_cache_coordinator.AscendHybridKVCacheCoordinator")
        assert "CompressAttentionManager" in f["managers"]
        assert f["effective_block_size"] == block and f["coordinator.lcm_block_size"] == align == res["hit_alignment"]
        groups = {g["group"]: g for g in res["topology"]}
        assert groups["c128_attn"]["tokens_per_block"] == block * 128
        assert groups["c4_attn_state"]["block_size"] == c4_state
        # Every group keeps the page of the tensor it shares, at any block size.
        assert {g["page_size_bytes"] for n, g in groups.items() if "indexer" not in n} == {block * 1024}
        assert {r["prompt_tokens"] for r in res["requests"]} == {8192}


def test_block_128_cannot_hit_and_block_32_hits_resent_prompts(ascend_bench):
    [row128] = [r for r in ascend_bench.rows if r["variant"] == "bs128"]
    [row32] = [r for r in ascend_bench.rows if r["variant"] == "bs32"]
    s128, s32 = row128["patched"], row32["patched"]
    # Seed 001: with block 128 a hit is a multiple of 16,384 tokens: nothing in an 8K prompt.
    assert s128["ceiling_hits"] == 0 and s128["admitted_hits"] == 0 and s128["hits"] == 0
    # Block 32: a hit is due in 4,096-token units on every re-send, and each re-send gets exactly that.
    resends = [r for r in s32["per_request"] if "=" in r["label"]]
    assert resends and all(r["ceiling"] == r["hit"] == 4096 for r in resends)
    assert all(r["hit"] == 0 for r in s32["per_request"] if "=" not in r["label"])
    assert s32["admitted_hits"] == s32["ceiling_hits"] > 0 and s32["violations"] == 0
    goals = {(g["scenario"], g["goal"]): g["ok"] for g in ascend_bench.goals}
    assert goals[(f"{row32['label']} [patched]", "hits = ceiling")]


def test_partial_hits_reuse_the_shared_part_of_the_compressed_block(ascend_bench):
    """With partial hits a re-sent 8,192-token prompt reuses 8,160 tokens (the last token is recomputed,
    hits are multiples of 32): 4,096 from the first C128 block, 4,064 copied from the second."""
    [row32] = [r for r in ascend_bench.rows if r["scenario"] == pc.ASCEND_SCENARIO and r["variant"] == "bs32"]
    p = row32["partial-hits"]
    resends = [r for r in p["per_request"] if "=" in r["label"]]
    assert resends and all(r["ceiling"] == r["hit"] == 8160 for r in resends)
    assert p["admitted_hits"] == p["ceiling_hits"] and p["violations"] == 0
    assert p["copied_per_request"] == 4064 * len(resends) / p["requests"]
    tree = next(t for t in ascend_bench.trees if t.state == "partial-hits")
    res = next(r for r in tree.doc["results"] if r["variant"] == "bs32+partial" and r["scenario"] == pc.ASCEND_SCENARIO)
    assert res["features"]["enable_partial_hash_hits"] and res["hit_alignment"] == 32
    assert all(r["copied_tokens"] == 4064 for r in res["requests"] if "=" in r["label"])
    # The second workload: a re-send shares a 4,096-8,191-token prefix; whole blocks reuse 4,096 of it.
    # Partial hits keep the sliding windows every 1,024 tokens by default (0008's
    # PARTIAL_HIT_RETENTION_TOKENS): the hit is the shared prefix down to a multiple of 1,024, never
    # less than whole blocks' 4,096 (the ceiling counts every 32-token boundary).
    [shared] = [r for r in ascend_bench.rows if r["scenario"] == pc.ASCEND_SHARED]
    s = shared["partial-hits"]
    assert 0 < s["admitted_hits"] <= s["ceiling_hits"] and s["violations"] == 0
    resent = [r for r in s["per_request"] if "=" in r["label"]]
    assert resent and all(4096 <= r["hit"] <= r["ceiling"] < r["hit"] + 1024 and r["hit"] % 1024 == 0
                          for r in resent)
    goals = {(g["scenario"], g["goal"]): g["ok"] for g in ascend_bench.goals}
    assert goals[(f"{row32['label']} [partial-hits]", "seed 001: >= 80% (reported 81.54%)")] is False  # 64 requests
    assert "partial-hits" in ascend_bench.render()


# ---------------------------------------------------------------- the seed's regime: its workload, a bounded pool

def test_seed_workload_is_one_wave_of_32_requests_sharing_90_percent():
    from kvforge.bench.replay import ascend

    wl = ascend.workload(1.0, 0, "seed")
    reqs = wl["requests"]
    assert len(reqs) == 32 and wl["config"]["concurrency"] == 32  # QPS x E2E = 0.6023 x 53.13
    assert {len(r["prompt"]) for r in reqs} == {8192} and {len(r["output"]) for r in reqs} == {1024}
    shared = reqs[0]["prompt"][:ascend.SEED_SHARED]
    assert ascend.SEED_SHARED == 7373 and all(r["prompt"][:7373] == shared for r in reqs)
    assert len({tuple(r["prompt"][7373:]) for r in reqs}) == 32, "each request has its own last 10%"
    assert ascend.workload(1.0, 0, "seed") == wl, "deterministic"
    assert "ascend-dsv4-seed" == ascend.SCENARIOS["seed"]


def test_count_pool_counts_cached_blocks_evictions_and_peak_use():
    from types import SimpleNamespace

    from kvforge.bench.replay import ascend

    free = [10]
    index = SimpleNamespace(insert=lambda key, block: None)
    bp = SimpleNamespace(cached_block_hash_to_block=index, num_gpu_blocks=16, get_num_free_blocks=lambda: free[0],
                         _maybe_evict_cached_block=lambda block: block == "cached")
    scheduler = SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=bp), schedule=lambda: "out")
    pool: dict = {}
    ascend.count_pool(scheduler, pool)
    bp.cached_block_hash_to_block.insert("h", "b")
    bp.cached_block_hash_to_block.insert("h2", "b2")
    assert bp._maybe_evict_cached_block("cached") and not bp._maybe_evict_cached_block("fresh")
    assert scheduler.schedule() == "out"
    free[0] = 12
    scheduler.schedule()
    assert pool == {"cached": 2, "evictions": 1, "peak_used": 6}


@pytest.mark.parametrize("argv,said", [(["--num-blocks", "many"], "--num-blocks"),
                                       (["--num-blocks", "-1"], "--num-blocks"),
                                       (["--retention-interval", "-32"], "--retention-interval")])
def test_replay_options_are_checked(argv, said, capsys):
    from kvforge.bench.replay import ascend

    with pytest.raises(SystemExit):
        ascend.main(argv)
    assert said in capsys.readouterr().err


def test_bench_options_reach_every_replay_run():
    assert pc.ascend_run_args(("--block-sizes", "32")) == ("--block-sizes", "32")
    assert pc.ascend_run_args(("--block-sizes", "32", "--workloads", "shared-prefix"), (15000, 45000), 4096, True) == (
        "--block-sizes", "32", "--workloads", "shared-prefix,seed", "--num-blocks", "15000,45000",
        "--retention-interval", "4096")
    assert pc.ascend_run_args(("--partial-hits",), seed_workload=True) == ("--partial-hits", "--workloads", "repeat,seed")


@pytest.mark.parametrize("argv, said", [(["--num-blocks", "0"], "block counts must be > 0"),
                                       (["--num-blocks", "12k"], "a comma-separated list of block counts"),
                                       (["--retention-interval", "-1"], "--retention-interval")])
def test_bench_command_line_refuses_bad_pool_options_before_any_work(argv, said, tmp_path):
    from click.testing import CliRunner

    from kvforge.cli import main

    out = CliRunner().invoke(main, ["--cache-dir", str(tmp_path / "c"), "bench", "prefix-cache", "-t", "v0.20.2rc",
                                    "--component", "vllm-ascend", *argv])
    assert out.exit_code == 2 and said in out.output, out.output
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir()), "nothing made in the cache"
