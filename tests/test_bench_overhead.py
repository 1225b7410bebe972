"""`kvforge bench scheduler-overhead`: the figures (step floors, ratios, same-work, goals), the
case list and workloads, the rendering, and one real run on vLLM 0.20.2 with a patch that makes
Scheduler.schedule() spend 2 ms of CPU per call (the bench must see exactly that cost)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import make_patch, write_series

from kvforge.core import evidence
from kvforge.bench import overhead as ov
from kvforge.bench.replay import overhead as cm
from kvforge.bench.replay.ceilings import block_keys
from kvforge.bench.replay.topologies import hit_alignment
from kvforge.core.cache import default_cache_dir
from kvforge.cli import main
from kvforge.core.errors import KvforgeError

# Resolved at import, before fixtures point $KVFORGE_CACHE at a throw-away cache.
TEST_ENVS_DIR = Path(os.environ.get("KVFORGE_TEST_ENVS") or default_cache_dir() / "envs")


def rep(steps_cpu: list[int], admitted: int = 2, tokens: int = 100, hits: int = 0, done: bool = True) -> dict:
    """One tree's repetition as the replay server returns it (CPU and wall time alike here)."""
    total = sum(steps_cpu)
    return {"steps": len(steps_cpu), "admitted": admitted, "scheduled_tokens": tokens, "hits": hits, "done": done,
            "preempted": 0, "step_cpu_ns": steps_cpu, "step_ns": [2 * x for x in steps_cpu],
            "ns": {"schedule": 2 * total, "update": 0, "submit": 5000, "draft": 0, "schedule_cpu": total,
                   "update_cpu": 0}}


CASE = {"topology": "dsv4", "workload": "unique-repeat", "kind": "unique", "scenario": "dsv4-repeat",
        "variant": "", "pool": 50000}


# ---------------------------------------------------------------- figures

def test_step_floor_takes_each_steps_least_time_over_the_common_steps():
    assert ov.step_floor([[5, 1, 9], [2, 7, 3], [4, 4, 4, 0]]) == [2, 1, 3]
    assert ov.step_floor([[], [3]]) == [3]
    assert ov.step_floor([]) == []


def test_aggregate_uses_the_floors_and_reports_the_noise_as_the_plain_range():
    # base steps cost 1000 ns, patched 1100 ns; each repetition has one disturbed step.
    reps = [{"base": rep([1000, 9000, 1000]), "patched": rep([1100, 1100, 1100])},
            {"base": rep([1000, 1000, 1000]), "patched": rep([1100, 1100, 8800])}]
    row = ov.aggregate_case(CASE, reps)
    assert row["label"] == "dsv4/unique-repeat/50000" and row["reps"] == 2
    assert row["base"]["us_step"] == pytest.approx(1.0) and row["patched"]["us_step"] == pytest.approx(1.1)
    assert row["base"]["us_request"] == pytest.approx(1.5)  # 3000 ns over 2 admitted requests
    assert row["ratio_step"] == pytest.approx(1.1) and row["ratio_request"] == pytest.approx(1.1)
    assert row["wall_ratio_step"] == pytest.approx(1.1)
    # the plain per-repetition ratios: 3300/11000 and 11000/3000
    lo, hi = row["ratio_step_range"]
    assert lo == pytest.approx(0.3) and hi == pytest.approx(11000 / 3000)
    assert row["same_work"] is True and row["base"]["done"] and row["base"]["floor_steps"] == 3


def test_different_hits_or_steps_are_not_the_same_work():
    hits = [{"base": rep([1000]), "patched": rep([900], hits=64)}]
    assert ov.aggregate_case(CASE, hits)["same_work"] is False
    steps = [{"base": rep([1000, 1000]), "patched": rep([1000])}]
    assert ov.aggregate_case(CASE, steps)["same_work"] is False


def test_goals_judge_only_rows_where_both_trees_did_the_same_work():
    rows = [dict(ov.aggregate_case(CASE, [{"base": rep([1000]), "patched": rep([1040])}]), label="a"),
            dict(ov.aggregate_case(CASE, [{"base": rep([1000]), "patched": rep([1060])}]), label="b"),
            dict(ov.aggregate_case(CASE, [{"base": rep([1000]), "patched": rep([700], hits=8)}]), label="c")]
    got = {g["case"]: g for g in ov.goals(rows)}
    assert got["a"]["ok"] is True and got["b"]["ok"] is False
    assert got["c"]["ok"] is None and "not judged" in got["c"]["goal"]
    assert got["b"]["value"].startswith("1.060")


def test_mask_summary_adds_the_sliding_window_groups_and_compares_with_a_dsv4_prefill_step():
    prefill = dict(CASE, workload="unique-resend")
    row = ov.aggregate_case(prefill, [{"base": rep([2_000_000]), "patched": rep([2_000_000])}])
    decode = ov.aggregate_case(CASE, [{"base": rep([500_000]), "patched": rep([500_000])}])  # not a prefill step
    mask = {"present": True, "chunk_tokens": 4096, "groups": [
        {"group": 0, "window": None, "masked": False, "us_median": 0.1, "block_size": 256, "blocks_per_chunk": 16,
         "kept_share": 1.0},
        {"group": 3, "window": 8, "masked": True, "us_median": 120.0, "block_size": 4, "blocks_per_chunk": 1024,
         "kept_share": 0.03},
        {"group": 4, "window": 128, "masked": True, "us_median": 80.0, "block_size": 8, "blocks_per_chunk": 512,
         "kept_share": 0.5}]}
    s = ov.mask_summary(mask, [row, decode])
    assert s["us_per_chunk"] == 200.0 and s["share_of_step"] == pytest.approx(0.1)
    assert ov.mask_summary(mask, [decode])["share_of_step"] is None
    assert ov.mask_summary({"present": False, "groups": []}, [row]) is None


def test_profile_summary_is_per_group_and_tree_per_step_least_over_repetitions():
    def res(cache_ns, steps=4):
        return {"steps": steps, "profile": [{"group": 1, "manager": "SlidingWindowManager", "block_size": 64,
                                             "window": 128, "ns": {"cache_blocks": cache_ns,
                                                                   "remove_skipped_blocks": 400}}]}
    [g] = ov.profile_summary([{"base": res(8000), "patched": res(8000, steps=2)},
                              {"base": res(12000), "patched": res(6000, steps=2)}])
    assert g["base"] == {"cache_blocks": 2.0, "remove_skipped_blocks": 0.1}
    assert g["patched"]["cache_blocks"] == 3.0 and g["window"] == 128


# ---------------------------------------------------------------- cases and workloads

def test_cases_in_table_order_and_bad_names_refused():
    got = cm.cases(["gemma4", "dsv4"], ["unique"], [50_000, 500_000])
    assert [cm.case_label(c) for c in got] == [
        "gemma4/unique-dflash/50000", "gemma4/unique-dflash/500000", "dsv4/unique-resend/50000",
        "dsv4/unique-resend/500000", "dsv4/unique-repeat/50000", "dsv4/unique-repeat/500000"]
    assert len(cm.cases(["dsv4", "gemma4"], ["unique", "seed"], [50_000])) == 6
    for args in ((["llama"], ["unique"], [50_000]), (["dsv4"], ["shared"], [50_000]), (["dsv4"], ["seed"], [10])):
        with pytest.raises(ValueError):
            cm.cases(*args)


def test_option_lists_and_pool_sizes():
    assert ov.parse_list("50k, 500k,50k", "pools", ov._pool) == [50_000, 500_000]
    assert ov.parse_list("1.5k", "pools", ov._pool) == [1500]
    for spec in ("", "lots"):
        with pytest.raises(KvforgeError):
            ov.parse_list(spec, "pools", ov._pool)


@pytest.mark.parametrize("case", cm.cases(["dsv4", "gemma4"], ["unique"], [50_000]), ids=cm.case_label)
def test_unique_workloads_share_no_block_and_keep_the_seeds_shape(case):
    wl = cm.overhead_workload(case, 0.05, 0)
    seed = cm.case_requests(dict(case, kind="seed", workload=case["scenario"]), 0.05, 0)
    align = hit_alignment(wl["groups"])
    seen: set = set()
    for r in wl["requests"]:
        keys = set(block_keys(r["prompt"], align))
        assert not keys & seen, r["id"]
        seen |= keys
    assert wl["groups"] == seed["groups"]
    assert wl["config"]["num_blocks"] == 50_000
    assert wl["config"]["max_num_batched_tokens"] == cm.BUDGET[case["topology"]]
    assert wl["config"]["concurrency"] == seed["config"]["concurrency"]
    if case["workload"] != "unique-repeat":  # the others replace each seed prompt by one of its length
        assert [len(r["prompt"]) for r in wl["requests"]] == [len(r["prompt"]) for r in seed["requests"]]
    assert cm.overhead_workload(case, 0.05, 0)["requests"] == wl["requests"]  # deterministic


def test_seed_workloads_share_prefixes_and_only_pool_and_budget_change():
    case = cm.cases(["dsv4"], ["seed"], [500_000])[0]
    wl = cm.overhead_workload(case, 0.05, 0)
    scen = cm.case_requests(case, 0.05, 0)
    assert wl["requests"] == scen["requests"]
    assert wl["config"] == dict(scen["config"], num_blocks=500_000, max_num_batched_tokens=4096)
    assert wl["requests"][0]["prompt"] == wl["requests"][1]["prompt"]  # A.1, A.2 of the seed


def test_render_shows_ratios_work_and_the_mask_line():
    reps = [{"base": rep([1000, 1000]), "patched": rep([1100, 1100], done=False)}]
    res = ov.OverheadResult("t", "vllm", "b" * 40, "v0.20.2", "d" * 16, 1, "series", 0.1, 2, 1, 0, "env",
                            commits={"base": "b" * 40, "patched": "p" * 40})
    res.rows = [ov.aggregate_case(CASE, reps)]
    res.goals = ov.goals(res.rows)
    res.mask = {"us_per_chunk": 200.0, "chunk_tokens": 4096, "share_of_step": 0.09, "dsv4_base_us_step": 2200.0,
                "groups": [{"group": 3, "block_size": 4, "window": 8, "us_median": 120.0, "blocks_per_chunk": 1024,
                            "kept_share": 0.031}]}
    text = ov.render(res)
    line = next(ln for ln in text.splitlines() if ln.startswith("dsv4"))
    assert "unique-repeat" in line and "50k" in line and "1.100" in line and "same, capped" in line
    assert "200 us per 4096-token chunk = 9.0% of a DSv4 base prefill step (2,200 us)" in text
    assert "g3 (block 4, window 8): 120 us for 1024 blocks, keeps 3.1%" in text
    lines = res.render().splitlines()
    assert any("MISS" in ln and "dsv4/unique-repeat/50000" in ln for ln in lines)


# ---------------------------------------------------------------- the real thing

SPIN_MS = 2


@pytest.mark.slow
def test_real_run_sees_a_patch_that_spends_cpu_in_schedule(project, base_v0202, monkeypatch):
    """vLLM 0.20.2's real scheduler in both trees; the patch makes every schedule() call spin for
    SPIN_MS ms of CPU: the patched tree must come out that much slower per step, doing the same work."""
    cache, base = base_v0202
    TEST_ENVS_DIR.mkdir(parents=True, exist_ok=True)
    if not (cache.root / "envs").exists():
        (cache.root / "envs").symlink_to(TEST_ENVS_DIR, target_is_directory=True)
    monkeypatch.delenv("KVFORGE_TEST_PYTHON", raising=False)
    spin = ("    def schedule(self) -> SchedulerOutput:\n"
            f"        until = time.thread_time_ns() + {SPIN_MS}_000_000\n"
            "        while time.thread_time_ns() < until:\n"
            "            pass\n"
            "        return self._schedule_after_spin()\n\n"
            "    def _schedule_after_spin(self) -> SchedulerOutput:\n")
    make_patch(base.repo, base.commit,
               {"vllm/v1/core/sched/scheduler.py": ("    def schedule(self) -> SchedulerOutput:\n", spin)},
               "[Core] spin in schedule", "spin", project / "patches" / "t" / "0001-spin.patch")
    write_series(project, "0001-spin.patch")
    res = CliRunner().invoke(main, ["bench", "scheduler-overhead", "--target", "t", "--topology", "gemma4",
                                    "--workload", "unique", "--pools", "50k", "--scale", "0.05", "--steps", "12",
                                    "--reps", "2", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    [row] = doc["rows"]
    assert row["label"] == "gemma4/unique-dflash/50000" and row["same_work"]
    b, p = row["base"], row["patched"]
    assert b["steps"] == p["steps"] == [12, 12] and b["admitted"][0] > 0
    assert 0.75 * SPIN_MS * 1000 < p["us_step"] - b["us_step"] < 2 * SPIN_MS * 1000
    assert row["ratio_step"] > 2 and [g["ok"] for g in doc["goals"]] == [False]
    assert doc["mask"] is None and "no sliding-window cache mask" in doc["mask_note"]  # 0.20.2 without 0002
    assert doc["commits"]["base"] == base.commit != doc["commits"]["patched"]
    rec = evidence.read(Path(doc["files"][-1]))
    assert rec.kind == ov.KIND and rec.key.series == doc["series"] and rec.name == "s0.05-n12-r2-seed0"
    assert not list((cache.trees / ".work").glob("*.overhead.*"))  # the exported trees are gone
