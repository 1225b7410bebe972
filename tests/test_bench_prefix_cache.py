"""Fast tests of `kvforge bench prefix-cache`: workloads, ceilings, aggregation, goals, table, CLI.

No vLLM here: replay.py's top level is standard library only, and the aggregation works on the
JSON documents the replay writes (built by hand below).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvforge.bench import prefix_cache as pc
from kvforge.cli import main
from kvforge.errors import KvforgeError

replay = pc.replay_module()


def req(prompt, output=(9, 9), label="r"):
    return {"prompt": list(prompt), "output": list(output), "label": label}


# ---------------------------------------------------------------- ceilings

def test_ceiling_resend_pattern():
    shared = list(range(8))
    a = shared + list(range(100, 124))  # 32 tokens
    b = shared + list(range(200, 232))  # shares one 8-token block with a
    got = replay.ceilings([req(a), req(a), req(b), req(a)], align=8)
    # A.1 cold; A.2 all but the last token, in whole blocks; B only the shared block; A.3 like A.2.
    assert got == [0, 24, 8, 24]


def test_ceiling_counts_earlier_outputs_but_not_the_last_token():
    turn1 = req(list(range(16)), output=list(range(1000, 1010)))  # computes 16 + 9 tokens
    turn2 = req(turn1["prompt"] + turn1["output"] + list(range(2000, 2030)))
    got = replay.ceilings([turn1, turn2], align=4)
    assert got == [0, 24]  # 25 computed tokens -> 6 whole blocks of 4


def test_ceiling_is_capped_below_the_prompt_and_aligned():
    p = list(range(20))
    assert replay.ceilings([req(p), req(p)], align=8) == [0, 16]  # 19 tokens at most -> 16
    assert replay.ceilings([req(p), req(p)], align=32) == [0, 0]


def test_ceiling_needs_a_contiguous_prefix():
    a = list(range(32))
    b = [999] + a[1:]  # differs in the first token only
    assert replay.ceilings([req(a), req(b)], align=8) == [0, 0]


def test_hit_alignment_is_the_lcm_of_block_sizes():
    assert replay.hit_alignment(replay.DSV4_GROUPS) == 256
    assert replay.hit_alignment(replay.GEMMA4_DFLASH_GROUPS) == 64
    assert replay.hit_alignment(replay.EXTERNAL_GROUPS) == 16


# ---------------------------------------------------------------- workloads

def test_dsv4_resend_workload_matches_the_seed():
    wl = replay.workload("dsv4-resend", "", 1.0)
    a1, a2, b, a3 = wl["requests"]
    assert [r["label"] for r in wl["requests"]] == ["A.1", "A.2", "B", "A.3"]
    assert len(a1["prompt"]) == 373_943 and len(b["prompt"]) == 378_175
    assert a1["prompt"] == a2["prompt"] == a3["prompt"]
    assert a1["prompt"][:256] == b["prompt"][:256] and a1["prompt"][256] != b["prompt"][256]
    cfg = wl["config"]
    assert (cfg["num_blocks"], cfg["max_num_batched_tokens"], cfg["concurrency"]) == (54_774, 4096, 1)
    sizes = [(g["block_size"], g.get("window")) for g in wl["groups"]]
    assert sizes == [(256, None), (64, 128), (64, 128), (4, 8), (8, 128)]


@pytest.mark.parametrize("scale", [0.05, 0.25, 1.0])
def test_scale_keeps_the_dsv4_churn(scale):
    """One request pushes more blocks through the 4-token group than the pool holds."""
    wl = replay.workload("dsv4-resend", "", scale)
    a = wl["requests"][0]
    assert len(a["prompt"]) // 4 > wl["config"]["num_blocks"]
    assert wl["config"]["max_num_batched_tokens"] % 256 == 0


def test_dsv4_repeat_resends_ninety_percent():
    wl = replay.workload("dsv4-repeat", "", 0.25)
    reqs = wl["requests"]
    resent = [r for r in reqs if "=" in r["label"]]
    assert len(reqs) == 512 and len(resent) == round(0.9 * 512)
    assert all(len(r["prompt"]) == 2048 for r in reqs)
    first = {}
    for i, r in enumerate(reqs):  # a re-send names a prompt first sent at least 32 requests earlier
        key = tuple(r["prompt"][:8])
        if "=" in r["label"]:
            assert first[key] <= i - 32
        first.setdefault(key, i)


def test_workloads_are_deterministic():
    assert replay.workload("gptoss-eagle", "", 0.1) == replay.workload("gptoss-eagle", "", 0.1)
    assert replay.workload("gptoss-eagle", "", 0.1, seed=1) != replay.workload("gptoss-eagle", "", 0.1)


def test_gemma_spec_off_drops_the_draft_group():
    on, off = (replay.workload("gemma4-dflash", v, 0.1) for v in ("", "nospec"))
    assert len(on["groups"]) == 3 and on["config"]["spec"]["method"] == "dflash"
    assert len(off["groups"]) == 2 and off["config"]["spec"] is None
    assert on["requests"] == off["requests"]


def test_external_hit_sweep_points():
    wl = replay.workload("external-hit", "", 0.05)
    points = wl["sweep"]
    assert len(points) == 37 and [p["point"] for p in points] == sorted(p["point"] for p in points)
    turn1, load, turn3 = points[0]["requests"]
    assert turn3["prompt"][:len(turn1["prompt"])] == turn1["prompt"]
    assert turn3["tier_adds"] and turn3["after"] == 0 and load["after"] == 0
    assert [g["kind"] for g in points[0]["groups"]] == ["full", "swa", "swa"]


def test_parse_runs():
    assert replay.parse_runs("all") == [(n, v) for n, vs in replay.SCENARIOS.items() for v in vs]
    assert replay.parse_runs("gemma4-dflash") == [("gemma4-dflash", ""), ("gemma4-dflash", "nospec")]
    assert replay.parse_runs("gemma4-dflash/nospec,dsv4-resend") == [("gemma4-dflash", "nospec"),
                                                                    ("dsv4-resend", "")]
    assert replay.parse_runs("dsv4-resend,dsv4-resend") == [("dsv4-resend", "")]
    with pytest.raises(ValueError, match="unknown scenario"):
        replay.parse_runs("nope")
    with pytest.raises(ValueError, match="no variant"):
        replay.parse_runs("dsv4-resend/x")
    with pytest.raises(KvforgeError, match="--scenario"):
        pc.parse_scenarios("nope")


# ---------------------------------------------------------------- aggregation

def result(scenario, rows, variant="", hits=None, queries=None, violations=None, two_groups=0, external=None,
           seconds=1.0):
    """A replay result as replay.py writes it; rows: (label, hit, prompt, ceiling)."""
    reqs = [{"label": lab, "hit_tokens": h, "prompt_tokens": p, "ceiling_tokens": c} for lab, h, p, c in rows]
    return {
        "scenario": scenario, "variant": variant, "features": {"vllm_version": "0.20.1"},
        "requests": reqs, "steps": 10,
        "overall": {"hits": sum(r[1] for r in rows) if hits is None else hits,
                    "queries": sum(r[2] for r in rows) if queries is None else queries},
        "ceiling": {"hits": sum(r[3] for r in rows), "queries": sum(r[2] for r in rows)},
        "violations": {"counts": violations or {}, "block_ids_in_two_groups": two_groups, "examples": {}},
        "external": external, "seconds": {"replay": seconds, "setup": 5.0, "total": 6.0},
    }


RESEND_BASE = result("dsv4-resend", [("A.1", 0, 1000, 0), ("A.2", 992, 1000, 992), ("B", 0, 1000, 256),
                                     ("A.3", 0, 1000, 992)])
RESEND_FIXED = result("dsv4-resend", [("A.1", 0, 1000, 0), ("A.2", 992, 1000, 992), ("B", 256, 1000, 256),
                                      ("A.3", 992, 1000, 992)])


def test_summarize_rates():
    s = pc.summarize(result("x", [("a", 50, 100, 80), ("b", 0, 100, 0)], hits=50, queries=400))
    assert s["hit_rate"] == 50 / 400  # vLLM's counters, retried lookups included
    assert s["admitted_rate"] == 50 / 200 and s["ceiling_rate"] == 80 / 200 and s["of_ceiling"] == 50 / 80
    assert s["per_request"][0] == {"label": "a", "hit": 50, "prompt": 100, "ceiling": 80}


def test_summarize_without_ceiling():
    s = pc.summarize(result("x", [("a", 0, 100, 0)]))
    assert s["of_ceiling"] is None and s["ceiling_rate"] == 0


def test_aggregate_pairs_states_and_keeps_errors():
    docs = {"base": {"results": [RESEND_BASE], "errors": [{"scenario": "gptoss-eagle", "variant": "",
                                                            "error": "Boom: x"}]},
            "patched": {"results": [RESEND_FIXED, result("gptoss-eagle", [("c0t0", 10, 100, 10)])], "errors": []}}
    rows = pc.aggregate(docs)
    assert [r["label"] for r in rows] == ["dsv4-resend", "gptoss-eagle"]
    assert rows[0]["base"]["admitted_hits"] == 992 and rows[0]["patched"]["admitted_hits"] == 2240
    assert rows[1]["base"] is None and rows[1]["base_error"] == "Boom: x"
    text = pc.render(rows, ["base", "patched"])
    assert "Boom: x" in text and "error" in text


def test_goals_judge_the_patched_tree():
    ext_bad = result("external-hit", [("turn3", 10, 100, 10)], violations={"block_in_two_groups": 5},
                     two_groups=5, external={"trigger_held": 3, "allocations_with_external_tokens": 37})
    ext_ok = result("external-hit", [("turn3", 10, 100, 10)],
                    external={"trigger_held": 3, "allocations_with_external_tokens": 37})
    rep_close = result("dsv4-repeat", [("r0", 0, 1000, 0), ("r1", 990, 1000, 992)])
    rep_far = result("dsv4-repeat", [("r0", 0, 1000, 0), ("r1", 900, 1000, 992)])
    ctl_base = result("gptoss-eagle", [("c", 900, 1000, 990)])
    ctl_worse = result("gptoss-eagle", [("c", 890, 1000, 990)])
    docs = {"base": {"results": [RESEND_BASE, ext_bad, rep_far, ctl_base]},
            "patched": {"results": [RESEND_FIXED, ext_ok, rep_close, ctl_worse]}}
    judged = {(g["scenario"], g["goal"]): g["ok"] for g in pc.goals(pc.aggregate(docs))}
    assert judged[("dsv4-resend", "A.3 hit rate >= 99%")]
    assert judged[("external-hit", "no block id in two groups")]
    assert judged[("dsv4-repeat", "within 0.5 points of the ceiling")]  # 0.1 points below
    assert not judged[("gptoss-eagle", "no regression against base")]
    assert all(ok for (s, g), ok in judged.items() if g == "no invariant violations")
    on_base = {(g["scenario"], g["goal"]): g["ok"] for g in pc.goals(pc.aggregate(docs), "base")}
    assert not on_base[("dsv4-resend", "A.3 hit rate >= 99%")]
    assert not on_base[("external-hit", "no block id in two groups")]
    assert not on_base[("external-hit", "no invariant violations")]
    assert not on_base[("dsv4-repeat", "within 0.5 points of the ceiling")]


def test_render_table_and_per_request_detail():
    ext = result("external-hit", [("turn3", 10, 100, 10)], violations={"block_in_two_groups": 33},
                 two_groups=33, external={"trigger_held": 3, "allocations_with_external_tokens": 37})
    rows = pc.aggregate({"base": {"results": [RESEND_BASE, ext]}, "patched": {"results": [RESEND_FIXED]}})
    text = pc.render(rows, ["base", "patched"])
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["scenario", "tree", "hit"]
    resend = [ln for ln in lines if ln.startswith("dsv4-resend ")][0]
    assert "24.80%" in resend and "56.00%" in resend  # base per-request 992/4000; ceiling 2240/4000
    assert "33 ids in 2 groups (trigger 3/37)" in text
    assert "A.3      1,000   0 (0.00%)     992 (99.20%)  992 (99.20%)" in text


def test_print_bench_lists_goals_and_files():
    tree = lambda state, doc: pc.TreeRun(state, "abc" * 10, doc, 12.0, pc.Path(f"/x/{state}.json"))  # noqa: E731
    res = pc.BenchResult("v0.20.1", "vllm", 0.25, 0, ["dsv4-resend"], "envkey")
    res.trees = [tree("base", {"results": [RESEND_BASE]}), tree("patched", {"results": [RESEND_FIXED]})]
    res.rows = pc.aggregate({t.state: t.doc for t in res.trees})
    res.goals = pc.goals(res.rows)
    res.files = ["/x/base.json", "/x/patched.json"]
    out: list[str] = []
    pc.print_bench(res, out.append)
    text = "\n".join(out)
    assert "ok   dsv4-resend (patched): A.3 hit rate >= 99%: 99.20%" in text
    assert "results: /x/base.json, /x/patched.json" in text
    doc = res.to_json()
    assert doc["trees"]["patched"]["commit"] == "abc" * 10 and doc["rows"][0]["label"] == "dsv4-resend"
    json.dumps(doc)


def test_plot_writes_a_png_or_says_how_to_get_matplotlib(tmp_path):
    rows = pc.aggregate({"base": {"results": [RESEND_BASE]}, "patched": {"results": [RESEND_FIXED]}})
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(KvforgeError, match=r"kvforge\[plot\]"):
            pc.check_plot_available()
        return
    out = tmp_path / "hits.png"
    pc.write_plot(rows, ["base", "patched"], out, "test")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- CLI

def test_cli_help_and_bad_scenario(tmp_path):
    res = CliRunner().invoke(main, ["bench", "prefix-cache", "--help"])
    assert res.exit_code == 0 and "--scenario" in res.output and "--plot" in res.output
    res = CliRunner().invoke(main, ["--cache-dir", str(tmp_path), "bench", "prefix-cache", "--target", "v0.20.1",
                                    "--scenario", "nope"])
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [
        "kvforge: error: --scenario: unknown scenario 'nope'; known: " + ", ".join(replay.SCENARIOS)]


def test_cli_rejects_a_bad_scale(tmp_path):
    res = CliRunner().invoke(main, ["--cache-dir", str(tmp_path), "bench", "prefix-cache", "--target", "v0.20.1",
                                    "--scale", "0"])
    assert res.exit_code == 2 and "--scale must be > 0" in res.output


def test_bench_result_lists_scenarios_that_could_not_run():
    res = pc.BenchResult("v0.20.1", "vllm", 0.25, 0, ["dsv4-resend", "gptoss-eagle"], "envkey")
    docs = {"base": {"results": [RESEND_BASE], "errors": [{"scenario": "gptoss-eagle", "variant": "",
                                                            "error": "AssertionError: x"}]},
            "patched": {"results": [RESEND_FIXED, result("gptoss-eagle", [("c", 1, 10, 1)])]}}
    res.trees = [pc.TreeRun(s, "c" * 40, d, 1.0, pc.Path(f"/x/{s}.json")) for s, d in docs.items()]
    res.rows = pc.aggregate(docs)
    assert res.errors == [("gptoss-eagle", "base", "AssertionError: x")]
    assert res.to_json()["errors"] == [{"scenario": "gptoss-eagle", "tree": "base", "error": "AssertionError: x"}]
    out: list[str] = []
    pc.print_bench(res, out.append)
    assert "error gptoss-eagle (base): AssertionError: x" in out
