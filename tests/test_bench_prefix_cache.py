"""Fast tests of `kvforge bench prefix-cache`: workloads, ceilings, the replay's isolation and its
vLLM-free parts (invariants checker, sampler), aggregation, goals, table, provenance, CLI.

No vLLM here: the replay package (kvforge/bench/replay/) imports vLLM only inside functions, and
the aggregation works on the JSON documents the replay writes (built by hand below).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from kvforge.bench import prefix_cache as pc
from kvforge.bench.replay import ceilings, topologies, workloads
from kvforge.bench.replay.invariants import Checker
from kvforge.bench.replay.sampler import Sampler
from kvforge.cli import main
from kvforge.core.errors import KvforgeError


def req(prompt, output=(9, 9), label="r"):
    return {"prompt": list(prompt), "output": list(output), "label": label}


# ---------------------------------------------------------------- ceilings

def test_ceiling_resend_pattern():
    shared = list(range(8))
    a = shared + list(range(100, 124))  # 32 tokens
    b = shared + list(range(200, 232))  # shares one 8-token block with a
    got = ceilings.ceilings([req(a), req(a), req(b), req(a)], align=8)
    # A.1 cold; A.2 all but the last token, in whole blocks; B only the shared block; A.3 like A.2.
    assert got == [0, 24, 8, 24]


def test_ceiling_counts_earlier_outputs_but_not_the_last_token():
    turn1 = req(list(range(16)), output=list(range(1000, 1010)))  # computes 16 + 9 tokens
    turn2 = req(turn1["prompt"] + turn1["output"] + list(range(2000, 2030)))
    got = ceilings.ceilings([turn1, turn2], align=4)
    assert got == [0, 24]  # 25 computed tokens -> 6 whole blocks of 4


def test_ceiling_is_capped_below_the_prompt_and_aligned():
    p = list(range(20))
    assert ceilings.ceilings([req(p), req(p)], align=8) == [0, 16]  # 19 tokens at most -> 16
    assert ceilings.ceilings([req(p), req(p)], align=32) == [0, 0]


def test_lookahead_ceiling_needs_the_token_after_each_block():
    shared = list(range(16))
    a = req(shared + [500] + list(range(600, 607)))
    same_next = req(shared + [500] + list(range(700, 707)))  # leaves a after token 16
    other_next = req(shared + [501] + list(range(800, 807)))  # leaves a exactly at the boundary
    reqs = [a, same_next, other_next]
    assert ceilings.ceilings(reqs, align=8) == [0, 16, 16]
    # The block ending at 16 is sound only with the same token 16: one block less for other_next.
    assert ceilings.lookahead_ceilings(reqs, align=8) == [0, 16, 8]


def test_lookahead_ceiling_counts_the_block_closed_by_the_last_output():
    turn1 = req(list(range(16)), output=list(range(1000, 1009)))  # computes 16 + 8 = 24 tokens
    turn2 = req(turn1["prompt"] + turn1["output"] + list(range(2000, 2030)))
    # The block ending at 24 is computed; the token after it is the last (never computed) output.
    assert ceilings.ceilings([turn1, turn2], align=8) == [0, 24]
    assert ceilings.lookahead_ceilings([turn1, turn2], align=8) == [0, 24]


def test_gptoss_eagle_lookahead_bound_is_below_the_ceiling_at_the_system_prompt_boundary():
    # Every chat leaves the 1200-token system prompt at a 16-token block boundary: with an
    # EAGLE-style drafter the last system block is sound to reuse only within the same chat.
    wl = workloads.workload("gptoss-eagle", "", 0.1)
    align = topologies.hit_alignment(wl["groups"])
    plain = ceilings.ceilings(wl["requests"], align)
    sound = ceilings.lookahead_ceilings(wl["requests"], align)
    first_turns = [i for i, r in enumerate(wl["requests"]) if r["label"].endswith("t0")][1:]
    assert all(plain[i] - sound[i] == align for i in first_turns)
    assert all(p == q for i, (p, q) in enumerate(zip(plain, sound)) if i not in first_turns)


def test_ceiling_needs_a_contiguous_prefix():
    a = list(range(32))
    b = [999] + a[1:]  # differs in the first token only
    assert ceilings.ceilings([req(a), req(b)], align=8) == [0, 0]


def test_hit_alignment_is_the_lcm_of_block_sizes():
    assert topologies.hit_alignment(topologies.DSV4_GROUPS) == 256
    assert topologies.hit_alignment(topologies.GEMMA4_DFLASH_GROUPS) == 64
    assert topologies.hit_alignment(topologies.EXTERNAL_GROUPS) == 16


# ---------------------------------------------------------------- workloads

def test_dsv4_resend_workload_matches_the_seed():
    wl = workloads.workload("dsv4-resend", "", 1.0)
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
    wl = workloads.workload("dsv4-resend", "", scale)
    a = wl["requests"][0]
    assert len(a["prompt"]) // 4 > wl["config"]["num_blocks"]
    assert wl["config"]["max_num_batched_tokens"] % 256 == 0


def test_dsv4_repeat_resends_ninety_percent():
    wl = workloads.workload("dsv4-repeat", "", 0.25)
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
    assert workloads.workload("gptoss-eagle", "", 0.1) == workloads.workload("gptoss-eagle", "", 0.1)
    assert workloads.workload("gptoss-eagle", "", 0.1, seed=1) != workloads.workload("gptoss-eagle", "", 0.1)


def test_gptoss_nospec_is_the_same_chats_without_a_drafter():
    on, off = (workloads.workload("gptoss-eagle", v, 0.1) for v in ("", "nospec"))
    assert on["config"]["spec"]["method"] == "eagle3" and off["config"]["spec"] is None
    assert on["requests"] == off["requests"] and on["groups"] == off["groups"]


def test_gemma_spec_off_drops_the_draft_group():
    on, off = (workloads.workload("gemma4-dflash", v, 0.1) for v in ("", "nospec"))
    assert len(on["groups"]) == 3 and on["config"]["spec"]["method"] == "dflash"
    assert len(off["groups"]) == 2 and off["config"]["spec"] is None
    assert on["requests"] == off["requests"]


def test_external_hit_sweep_points():
    wl = workloads.workload("external-hit", "", 0.05)
    points = wl["sweep"]
    assert len(points) == 37 and [p["point"] for p in points] == sorted(p["point"] for p in points)
    turn1, load, turn3 = points[0]["requests"]
    assert turn3["prompt"][:len(turn1["prompt"])] == turn1["prompt"]
    assert turn3["tier_adds"] and turn3["after"] == 0 and load["after"] == 0
    assert [g["kind"] for g in points[0]["groups"]] == ["full", "swa", "swa"]


def test_parse_runs():
    assert workloads.parse_runs("all") == [(n, v) for n, vs in workloads.SCENARIOS.items() for v in vs]
    assert workloads.parse_runs("gemma4-dflash") == [("gemma4-dflash", ""), ("gemma4-dflash", "nospec")]
    assert workloads.parse_runs("gemma4-dflash/nospec,dsv4-resend") == [("gemma4-dflash", "nospec"),
                                                                    ("dsv4-resend", "")]
    assert workloads.parse_runs("dsv4-resend,dsv4-resend") == [("dsv4-resend", "")]
    with pytest.raises(ValueError, match="unknown scenario"):
        workloads.parse_runs("nope")
    with pytest.raises(ValueError, match="no variant"):
        workloads.parse_runs("dsv4-resend/x")
    with pytest.raises(KvforgeError, match="--scenario"):
        pc.parse_scenarios("nope")


def test_every_scenario_and_variant_builds_a_well_formed_workload():
    for name, variant in workloads.parse_runs("all"):
        wl = workloads.workload(name, variant, 0.05)
        for w in wl.get("sweep") or [wl]:
            reqs = w["requests"]
            ids = [r["id"] for r in reqs]
            assert len(set(ids)) == len(ids), (name, variant)
            assert all(r["after"] is None or 0 <= r["after"] < i for i, r in enumerate(reqs)), (name, variant)
            assert all(len(r["output"]) >= 1 and len(r["prompt"]) >= 1 for r in reqs)
            assert w["config"]["concurrency"] >= 1 and w["groups"]
    with pytest.raises(ValueError, match="unknown scenario 'external-hit'"):
        workloads.workload("external-hit", "nope", 0.05)
    with pytest.raises(ValueError, match="unknown scenario 'nope'"):
        workloads.workload("nope", "", 0.05)


# ---------------------------------------------------------------- the replay package: isolation

REPLAY_DIR = Path(pc.REPLAY)


def test_replay_modules_import_only_the_stdlib_vllm_torch_and_each_other():
    """The replay runs in the target's env: nothing else is there. vLLM/torch only inside functions."""
    modules = sorted(REPLAY_DIR.glob("*.py"))
    assert {m.stem for m in modules} >= {"__main__", "topologies", "workloads", "ceilings", "driver", "invariants"}
    for path in modules:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top_level = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                continue  # relative: another module of the replay
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                for name in names:
                    root = name.split(".")[0]
                    where = f"{path.name}:{node.lineno}: {name}"
                    # replay/ascend.py drives vllm-ascend's coordinator (its tree is on the path there).
                    allowed = ("vllm", "torch", "vllm_ascend") if path.name == "ascend.py" else ("vllm", "torch")
                    assert root in sys.stdlib_module_names or root in allowed, where
                    assert root in sys.stdlib_module_names or id(node) not in top_level, where


def test_replay_subprocess_runs_its_own_files_and_cannot_import_kvforge(tmp_path):
    """`python <replay dir>` from a tree root: decoys in the tree or on PYTHONPATH are never loaded,
    and `import kvforge` fails even though this interpreter has kvforge installed."""
    tree, stale = tmp_path / "tree", tmp_path / "stale"
    for d in (tree / "kvforge", tree / "replay", stale / "kvforge_replay"):
        d.mkdir(parents=True)
        (d / "__init__.py").write_text("raise SystemExit('decoy imported')\n")
    for name in ("workloads", "driver", "cli"):
        (stale / f"{name}.py").write_text("raise SystemExit('decoy imported')\n")
    (tree / "torch.py").write_text("")  # the replay imports torch, then vllm: this tree's fake vllm reports
    (tree / "vllm").mkdir()
    (tree / "vllm" / "__init__.py").write_text(
        "import json, sys\n"
        "try:\n    import kvforge\n    got = 'imported ' + kvforge.__file__\n"
        "except ImportError:\n    got = 'blocked'\n"
        "mods = {n: getattr(m, '__file__', None) for n, m in sys.modules.items() if n.startswith('kvforge')}\n"
        "raise RuntimeError(json.dumps({'kvforge': got, 'mods': mods, 'path': sys.path}))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(stale)
    out = tmp_path / "doc.json"
    res = subprocess.run([sys.executable, str(REPLAY_DIR), "--scenario", "dsv4-resend", "--scale", "0.01",
                          "--out", str(out)], cwd=tree, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout == ""  # the document went to --out; stdout is for the document only
    doc = json.loads(out.read_text())
    assert doc["cwd"] == str(tree) and doc["results"] == []
    [err] = doc["errors"]
    assert err["error"].startswith("RuntimeError: ")
    seen = json.loads(err["error"][len("RuntimeError: "):])
    assert seen["kvforge"] == "blocked"
    assert seen["path"][0] == str(tree) and str(REPLAY_DIR) not in seen["path"]  # the tree first; no module shadowing
    mods = {n: f for n, f in seen["mods"].items() if f}
    assert "kvforge_replay.driver" in mods and "kvforge_replay.workloads" in mods
    assert all(Path(f).parent == REPLAY_DIR for f in mods.values()), mods
    assert "replay: error dsv4-resend: RuntimeError" in res.stderr

    listed = subprocess.run([sys.executable, str(REPLAY_DIR), "--list"], cwd=tree, env=env, capture_output=True,
                            text=True, timeout=60)
    assert json.loads(listed.stdout) == workloads.SCENARIOS
    as_module = subprocess.run([sys.executable, "-m", "kvforge.bench.replay", "--list"], cwd=tmp_path,
                               capture_output=True, text=True, timeout=60)
    assert as_module.returncode != 0 and "not with -m" in as_module.stderr


# ---------------------------------------------------------------- the replay's vLLM-free parts

class Blk:
    def __init__(self, block_id, ref_cnt=0, is_null=False):
        self.block_id, self.ref_cnt, self.is_null, self.next_free_block = block_id, ref_cnt, is_null, None


def fake_scheduler(tables: list[dict], ref_cnts: list[int], free: list[int]):
    """A KV cache manager as the checker reads it: per-group block tables, the pool, the free queue."""
    blocks = [Blk(0, is_null=True)] + [Blk(i, rc) for i, rc in enumerate(ref_cnts, 1)]
    head, tail = Blk(-1), Blk(-2)
    node = head
    for bid in free:
        node.next_free_block = blocks[bid]
        node = blocks[bid]
    node.next_free_block = tail
    queue = SimpleNamespace(fake_free_list_head=head, fake_free_list_tail=tail)
    pool = SimpleNamespace(blocks=blocks, null_block=blocks[0], free_block_queue=queue)
    managers = [SimpleNamespace(req_to_blocks={rid: [blocks[b] for b in t] for rid, t in g.items()})
                for g in tables]
    coord = SimpleNamespace(block_pool=pool, single_type_managers=managers)
    return SimpleNamespace(kv_cache_manager=SimpleNamespace(coordinator=coord))


def test_checker_passes_a_consistent_block_table():
    # group 0: r1 holds the null block and 1, 2; group 1: r1 holds 3; r2 shares 1 in group 0.
    sched = fake_scheduler([{"r1": [0, 1, 2], "r2": [1]}, {"r1": [3]}], ref_cnts=[2, 1, 1, 0, 0], free=[4, 5])
    c = Checker(sched)
    c.light(1)
    c.full(1)
    assert c.result() == dict(counts={}, examples={}, block_ids_in_two_groups=0, full_checks=1,
                              free_queue_checked=True)


def test_checker_records_every_kind_of_violation():
    # block 2 in both groups; block 3 ref_cnt 2 but one reference; block 4 referenced yet free;
    # block 5 unreferenced yet not free.
    sched = fake_scheduler([{"r1": [1, 2]}, {"r1": [2, 3]}], ref_cnts=[1, 2, 2, 1, 0], free=[4])
    c = Checker(sched)
    c.light(7)
    c.light(8)  # the same block in two groups is one id, counted once
    c.full(8)
    res = c.result()
    assert res["block_ids_in_two_groups"] == 1
    assert res["counts"] == {"block_in_two_groups": 1, "ref_cnt_mismatch": 2, "referenced_block_in_free_queue": 1,
                             "ref_cnt_without_owner": 1, "unreferenced_block_not_free": 1}
    assert res["examples"]["block_in_two_groups"] == [{"step": 7, "detail": "block 2 in groups 0 and 1 (req r1)"}]


def test_checker_without_a_readable_free_queue_skips_the_full_check():
    sched = fake_scheduler([{"r1": [1]}], ref_cnts=[1], free=[])
    del sched.kv_cache_manager.coordinator.block_pool.free_block_queue.fake_free_list_head
    c = Checker(sched)
    c.full(1)
    assert c.result()["full_checks"] == 0 and c.result()["free_queue_checked"] is False


class LinkedBlk:
    def __init__(self, block_id):
        self.block_id, self.ref_cnt, self.is_null = block_id, 0, False
        self.prev_free_block = self.next_free_block = None


class LinkedQueue:
    """vLLM's FreeKVCacheBlockQueue, reduced to its linking (the checker's incremental mode needs
    exactly these public methods)."""

    def __init__(self, blocks):
        self.fake_free_list_head, self.fake_free_list_tail = LinkedBlk(-1), LinkedBlk(-1)
        self.num_free_blocks = 0
        self.fake_free_list_head.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = self.fake_free_list_head
        self.append_n(blocks)

    def _insert_after(self, prev, b):
        nxt = prev.next_free_block
        prev.next_free_block, b.prev_free_block, b.next_free_block, nxt.prev_free_block = b, prev, nxt, b
        self.num_free_blocks += 1

    def remove(self, b):
        b.prev_free_block.next_free_block, b.next_free_block.prev_free_block = b.next_free_block, b.prev_free_block
        b.prev_free_block = b.next_free_block = None
        self.num_free_blocks -= 1

    def popleft(self):
        b = self.fake_free_list_head.next_free_block
        self.remove(b)
        return b

    def popleft_n(self, n):
        return [self.popleft() for _ in range(n)]

    def append(self, b):
        self._insert_after(self.fake_free_list_tail.prev_free_block, b)

    def append_n(self, blocks):
        for b in blocks:
            self.append(b)

    def prepend_n(self, blocks):
        prev = self.fake_free_list_head
        for b in blocks:
            self._insert_after(prev, b)
            prev = b

    def get_all_free_blocks(self):
        out, node = [], self.fake_free_list_head.next_free_block
        while node is not self.fake_free_list_tail:
            out.append(node)
            node = node.next_free_block
        return out


class LinkedPool:
    """vLLM's BlockPool as far as ref counts and the free queue go (freed blocks: odd ids to the
    front, even ids to the back, as the queue split does with uncached and cached blocks)."""

    def __init__(self, n):
        self.blocks = [LinkedBlk(i) for i in range(n)]
        self.free_block_queue = LinkedQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    def get_new_blocks(self, n):
        out = self.free_block_queue.popleft_n(n)
        for b in out:
            b.ref_cnt += 1
        return out

    def touch(self, blocks):
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, blocks):
        freed = []
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                freed.append(b)
        self.free_block_queue.prepend_n([b for b in freed if b.block_id % 2])
        self.free_block_queue.append_n([b for b in freed if not b.block_id % 2])


def replay_with_faults(seed: int, incremental: bool) -> dict:
    """A random run of allocations, hits, frees and faults made through the pool's own methods
    (a double free, a leaked table entry), checked as the driver does; the checker's result."""
    import random

    rng = random.Random(seed)
    pool = LinkedPool(400)
    tables: dict[str, list] = {}
    manager = SimpleNamespace(req_to_blocks=tables)
    coord = SimpleNamespace(block_pool=pool, single_type_managers=[manager])
    checker = Checker(SimpleNamespace(kv_cache_manager=SimpleNamespace(coordinator=coord)))
    assert checker.cost()["incremental"] is True
    if not incremental:
        checker._incremental = False  # the whole-pool walk every time: the reference
    cached: list = []
    for step in range(300):
        op = rng.random()
        if op < 0.4 or not tables:
            blocks = pool.get_new_blocks(rng.randrange(1, 6))
            hits = rng.sample(cached, min(len(cached), rng.randrange(0, 3)))
            pool.touch(hits)
            tables[f"r{step}"] = hits + blocks
        elif op < 0.8:
            rid = rng.choice(sorted(tables))
            blocks = tables.pop(rid)
            cached.extend(b for b in blocks if b.block_id % 2 == 0 and b not in cached)
            pool.free_blocks(reversed(blocks))  # an iterable, as the managers pass it
        elif op < 0.86:
            rid = rng.choice(sorted(tables))
            if tables[rid]:
                tables[rid].pop()  # leaked: referenced, in no table
        elif op < 0.9:
            rid = rng.choice(sorted(tables))
            pool.free_blocks(tables[rid][:1])  # freed while still in the table: ref_cnt off by one
        checker.light(step)
        checker.full(step)
    checker.full(300, whole=True)
    return checker.result() | {"whole_pool_checks": checker.cost()["whole_pool_checks"]}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_incremental_full_check_finds_what_the_whole_pool_walk_finds(seed):
    inc, whole = replay_with_faults(seed, True), replay_with_faults(seed, False)
    assert inc.pop("whole_pool_checks") < whole.pop("whole_pool_checks") == whole["full_checks"]
    assert inc == whole
    assert sum(inc["counts"].values()) > 0, "the faults must show"
    assert {"ref_cnt_without_owner", "ref_cnt_mismatch"} <= set(inc["counts"])


def test_sampler_follows_the_plan_and_accepts_drafts_by_seed():
    plan = {"a": list(range(100, 110))}
    req_at = lambda n: SimpleNamespace(request_id="a", output_token_ids=[0] * n)  # noqa: E731
    plain = Sampler(plan, None, seed=0)
    assert plain.sampled(req_at(0), []) == [100] and plain.sampled(req_at(10), []) == [109]
    always = Sampler(plan, {"k": 3, "accept": 1.0}, seed=0)
    assert always.drafts(req_at(2)) == [102, 103, 104]
    assert always.sampled(req_at(2), [102, 103, 104]) == [102, 103, 104, 105]
    never = Sampler(plan, {"k": 3, "accept": 0.0}, seed=0)
    assert never.sampled(req_at(2), [102, 103, 104]) == [102]
    assert (always.drafted, always.accepted, never.drafted, never.accepted) == (3, 3, 3, 0)

    def accepted(seed):
        s = Sampler(plan, {"k": 3, "accept": 0.5}, seed=seed)
        return [len(s.sampled(req_at(0), [1, 2, 3])) for _ in range(30)]

    assert accepted(1) == accepted(1) != accepted(2)


# ---------------------------------------------------------------- aggregation

def result(scenario, rows, variant="", hits=None, queries=None, violations=None, two_groups=0, external=None,
           seconds=1.0):
    """A replay result as the replay writes it; rows: (label, hit, prompt, ceiling)."""
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


def bench_result(scenarios, origin="series"):
    return pc.BenchResult("v0.20.1", "vllm", "b" * 40, "v0.20.1", "d" * 16, 4, origin, 0.25, 0, scenarios, "envkey")


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


def test_goals_compare_a_drafter_with_its_nospec_run_and_the_lookahead_bound():
    def spec(hits, bound, variant=""):
        res = result("gptoss-eagle", [("c", hits, 1000, 900)], variant=variant)
        res["ceiling_lookahead"] = {"hits": bound} if bound is not None else None
        return res

    docs = {"base": {"results": [spec(850, 880), spec(900, None, "nospec")]},
            "patched": {"results": [spec(880, 880), spec(900, None, "nospec")]}}
    judged = {(g["scenario"], g["goal"]): g for g in pc.goals(pc.aggregate(docs))}
    bound = "at the lookahead bound (a block also needs the token after it)"
    assert judged[("gptoss-eagle", bound)]["ok"]
    assert judged[("gptoss-eagle", bound)]["value"] == "880 of 880 tokens; no-spec ceiling 900"
    nospec = judged[("gptoss-eagle", "at the no-spec rate")]
    assert not nospec["ok"] and nospec["value"] == "88.00% vs 90.00% without speculative decoding"
    assert ("gptoss-eagle/nospec", "at the no-spec rate") not in judged
    assert ("gptoss-eagle/nospec", bound) not in judged
    on_base = {(g["scenario"], g["goal"]): g["ok"] for g in pc.goals(pc.aggregate(docs), "base")}
    assert not on_base[("gptoss-eagle", bound)] and not on_base[("gptoss-eagle", "at the no-spec rate")]
    docs["patched"]["results"][0] = spec(900, 880)
    judged = {(g["scenario"], g["goal"]): g["ok"] for g in pc.goals(pc.aggregate(docs))}
    assert judged[("gptoss-eagle", "at the no-spec rate")] and judged[("gptoss-eagle", bound)]


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
    res = bench_result(["dsv4-resend"])
    res.trees = [tree("base", {"results": [RESEND_BASE]}), tree("patched", {"results": [RESEND_FIXED]})]
    res.rows = pc.aggregate({t.state: t.doc for t in res.trees})
    res.goals = pc.goals(res.rows)
    res.files = ["/x/base.json", "/x/patched.json"]
    out = res.render().splitlines()
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
        "kvforge: error: --scenario: unknown scenario 'nope'; known: " + ", ".join(workloads.SCENARIOS)]


def test_cli_rejects_a_bad_scale(tmp_path):
    res = CliRunner().invoke(main, ["--cache-dir", str(tmp_path), "bench", "prefix-cache", "--target", "v0.20.1",
                                    "--scale", "0"])
    assert res.exit_code == 2 and "--scale must be > 0" in res.output


def test_bench_result_lists_scenarios_that_could_not_run():
    res = bench_result(["dsv4-resend", "gptoss-eagle"])
    docs = {"base": {"results": [RESEND_BASE], "errors": [{"scenario": "gptoss-eagle", "variant": "",
                                                            "error": "AssertionError: x"}]},
            "patched": {"results": [RESEND_FIXED, result("gptoss-eagle", [("c", 1, 10, 1)])]}}
    res.trees = [pc.TreeRun(s, "c" * 40, d, 1.0, pc.Path(f"/x/{s}.json")) for s, d in docs.items()]
    res.rows = pc.aggregate(docs)
    assert res.errors == [("gptoss-eagle", "base", "AssertionError: x")]
    assert res.to_json()["errors"] == [{"scenario": "gptoss-eagle", "tree": "base", "error": "AssertionError: x"}]
    out = res.render().splitlines()
    assert "error gptoss-eagle (base): AssertionError: x" in out


# ---------------------------------------------------------------- provenance

@pytest.mark.parametrize("origin", ["series", "--from HEAD (0123456789ab)"])
def test_bench_result_names_target_base_series_and_origin(tmp_path, monkeypatch, origin):
    """bench_prefix_cache takes the evidence's identity from the stack it measured (series files or --from)."""
    import kvforge.bench.prepare

    stack = SimpleNamespace(base=SimpleNamespace(commit="b" * 40, ref="v0.20.1"), digest="5e41e5d1", size=2,
                            origin=origin, worktree=tmp_path / "tree", commits=["b" * 40, "c" * 40, "p" * 40],
                            in_base=lambda n: False, lock=lambda say: nullcontext())
    stack.checkout = lambda n: stack.commits[n]
    from kvforge.core.evidence import Key

    stack.key = Key("v0.20.1", "vllm", "b" * 40, "5e41e5d1")
    env = SimpleNamespace(key="envkey", python=Path("python"), check=lambda: None, environ=lambda: {})
    monkeypatch.setattr(kvforge.bench.prepare, "open_stack", lambda ctx: stack)
    monkeypatch.setattr(kvforge.bench.prepare, "target_env", lambda ctx, base: env)
    docs = {"base": RESEND_BASE, "patched": RESEND_FIXED}
    monkeypatch.setattr(pc, "run_replay", lambda py, environ, tree, runs, scale, seed, out, state, say:
                        {"results": [docs[state]], "errors": []})
    from kvforge.core.cache import Cache

    ctx = SimpleNamespace(progress=lambda m: None, target=SimpleNamespace(name="v0.20.1"),
                          cache=Cache(tmp_path / "cache"),
                          component=SimpleNamespace(name="vllm", series_dir=Path("patches/v0.20.1")))
    res = pc.bench_prefix_cache(ctx, "dsv4-resend", 0.05, 3)
    want = {"target": "v0.20.1", "component": "vllm", "base": "b" * 40, "base_ref": "v0.20.1",
            "series": "5e41e5d1", "patches": 2, "origin": origin, "scale": 0.05, "seed": 3}
    doc = res.to_json()
    assert {k: doc[k] for k in want} == want
    assert doc["trees"]["base"]["commit"] == doc["base"] and doc["trees"]["patched"]["commit"] == "p" * 40
    from kvforge.core import evidence

    record = evidence.read(Path(res.files[-1]))
    assert record.kind == "bench-prefix-cache" and record.origin == origin and record.key == stack.key
    assert {k: record.data[k] for k in want} == want
    assert evidence.latest(ctx.cache, stack.key, "bench-prefix-cache", "s0.05-seed3").path == record.path
    out = res.render().splitlines()
    assert ("series: --from HEAD (0123456789ab), 2 commit(s), digest 5e41e5d1" in out) == (origin != "series")
    # A VLLM_* setting changes vLLM's behaviour: it is recorded, and the evidence gets its own name.
    monkeypatch.setenv("VLLM_PREFIX_CACHE_RETENTION_INTERVAL", "0")
    tuned = pc.bench_prefix_cache(ctx, "dsv4-resend", 0.05, 3)
    rec = evidence.read(Path(tuned.files[-1]))
    assert rec.data["vllm_settings"] == {"VLLM_PREFIX_CACHE_RETENTION_INTERVAL": "0"}
    assert rec.name.startswith("s0.05-seed3-vllm") and rec.path != record.path
