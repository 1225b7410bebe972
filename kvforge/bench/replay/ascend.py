"""vllm-ascend's DeepSeek-V4 prefix-cache replay: seed 001 through vLLM's scheduler with Ascend's
coordinator and managers. Needs vLLM and vllm_ascend.

    cd <vllm-ascend tree> && PYTHONPATH=<vLLM tree>[:stand-ins] \\
        python <kvforge>/bench/replay ascend [--block-sizes 128,64,32] [--workloads repeat,shared-prefix]
            [--partial-hits] [--num-blocks N[,N...]] [--retention-interval T] [--scale F] [--seed N]
            [--out FILE]

cwd is a vllm-ascend tree (base or patched), the vLLM tree comes from PYTHONPATH. With
VLLM_ASCEND_APPLY_DSV4_PATCH=1 (set here), importing vllm_ascend.patch.platform installs Ascend's
KV cache specs and AscendHybridKVCacheCoordinator with the managers of
vllm_ascend/core/single_type_kv_cache_manager.py, as on an NPU. The DeepSeek-V4 geometry is the
tree's own: for each requested --block-size, the tree's refresh_block_size resolves the block
size (the base forces 128) and the tree's layers build their KV cache specs (DSAAttention C4 and
C128, the C4 indexer cache, the SWA cache, the three compressor state caches), one KV cache group
each. vLLM's Scheduler then replays seed 001's workload (8,192-token prompts, 90% re-sends of an
earlier prompt, 32 in flight) with the driver's step loop; the second workload (shared-prefix)
re-sends only a prefix of 4,096 to 8,191 tokens of an earlier prompt, then new tokens. Hits can
only be multiples of the coordinator's lcm_block_size (lcm of block_size x compress_ratio); with
--partial-hits (VLLM_ASCEND_ENABLE_PARTIAL_HASH_HITS=1, vllm-ascend's
ascend-dsv4-partial-hash-hits) the compressed groups also hit part of a block and hits are
multiples of the block size: the ceiling uses the tree's alignment. Each request's result also
records the tokens of its hit that the worker copies (the partial tail, largest over the
compressed groups) and the tokens it recomputes. Writes the replay document (cli.py's schema): one
result per workload and block size, labelled scenario "ascend-dsv4-repeat" or
"ascend-dsv4-shared-prefix", variant "bs<N>" ("bs<N>+partial" with --partial-hits); a run that
raises is an error entry. The third workload (seed) is seed 001's own run: 32 requests in one wave
sharing the first 90% of their 8,192-token prompts. --num-blocks bounds the pool (one run per size;
0, the default, is unbounded) and --retention-interval sets CacheConfig's
prefix_cache_retention_interval; each result's "pool" counts the blocks cached per request, the
evictions and the peak use, and with --partial-hits the document's "copy_cost" times the worker's
copy on CPU tensors of each compressed group's layout.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import random
import socket
import sys
import time
from types import SimpleNamespace
from typing import Any

from . import driver
from .cli import run_case, write_doc
from .compat import Features, kw
from .driver import SCHEMA

SCENARIO = "ascend-dsv4-repeat"
SCENARIOS = {"repeat": SCENARIO, "shared-prefix": "ascend-dsv4-shared-prefix", "seed": "ascend-dsv4-seed"}
PARTIAL_HITS_ENV = "VLLM_ASCEND_ENABLE_PARTIAL_HASH_HITS"
BLOCK_SIZES = (128, 64, 32)
PROMPT_TOKENS = 8192  # not scaled: the prompt against the hit granularity is the bug
# Seed 001's own run (vllm-ascend #10193): QPS x E2E = 0.6023 x 53.13 = 32 requests, one wave of
# concurrency 32, repeat ratio 0.9: each prompt shares its first 90% with the others.
SEED_REQUESTS, SEED_SHARED = 32, round(0.9 * PROMPT_TOKENS)
# DeepSeek-V4-Flash: head_dim 512, indexer head_dim 128 (int8 + fp16 scale), sliding window 128.
HEAD_DIM, INDEX_HEAD_DIM, WINDOW = 512, 128, 128


def workload(scale: float, seed: int, kind: str = "repeat") -> dict:
    """Seed 001: 8K-token prompts x concurrency 32, 90% re-send a prompt first sent >= 32 requests earlier.

    kind "shared-prefix": a re-send keeps only the first 4,096 to 8,191 tokens (uniform) of the earlier
    prompt and continues with new tokens (whole-block caching reuses 4,096 of them at block size 32).
    The request count and output length scale; the prompt length does not."""
    rng = random.Random(f"{SCENARIOS[kind]}:{seed}")
    conc = 32
    if kind == "seed":
        return seed_workload(rng, scale)
    n = max(64, round(512 * scale))
    out_len = max(8, round(1024 * scale))
    repeat_at = set(rng.sample(range(conc, n), min(round(0.9 * n), n - conc)))
    prompts: list[list[int]] = []
    first_sent: list[int] = []
    reqs: list[dict[str, Any]] = []
    for i in range(n):
        eligible = [p for p, j in enumerate(first_sent) if j <= i - conc]
        if i in repeat_at and eligible:
            p = rng.choice(eligible)
            if kind == "shared-prefix":
                keep = rng.randrange(PROMPT_TOKENS // 2, PROMPT_TOKENS)
                tail = [rng.randrange(1000, 100_000) for _ in range(PROMPT_TOKENS - keep)]
                reqs.append(dict(label=f"r{i}=p{p}[:{keep}]", prompt=prompts[p][:keep] + tail))
            else:
                reqs.append(dict(label=f"r{i}=p{p}", prompt=prompts[p]))
        else:
            prompts.append([rng.randrange(1000, 100_000) for _ in range(PROMPT_TOKENS)])
            first_sent.append(i)
            reqs.append(dict(label=f"r{i}:p{len(prompts) - 1}", prompt=prompts[-1]))
        reqs[-1]["output"] = [rng.randrange(1000, 100_000) for _ in range(out_len)]
    for i, r in enumerate(reqs):
        r["id"], r["after"] = f"{i:04d}-{r['label']}", None
    cfg = dict(num_blocks=0, max_num_batched_tokens=8192, max_num_seqs=256, concurrency=conc,
               max_model_len=32_768, spec=None)
    what = "re-sends of a 4,096-8,191-token prefix" if kind == "shared-prefix" else "re-sends"
    notes = [f"{n} requests of {PROMPT_TOKENS} prompt tokens, {len(prompts)} distinct prompts, "
             f"{n - len(prompts)} {what}; {out_len} output tokens; concurrency {conc}"]
    return dict(config=cfg, requests=reqs, notes=notes)


def seed_workload(rng: random.Random, scale: float) -> dict:
    """Seed 001's own run: 32 requests in one wave (concurrency 32), each prompt of 8,192 tokens whose
    first 7,373 (90%) are the same for all, then its own; 1,024 x scale output tokens. Not scaled in
    count: the seed ran 32."""
    out_len = max(8, round(1024 * scale))
    shared = [rng.randrange(1000, 100_000) for _ in range(SEED_SHARED)]
    reqs: list[dict[str, Any]] = []
    for i in range(SEED_REQUESTS):
        own = [rng.randrange(1000, 100_000) for _ in range(PROMPT_TOKENS - SEED_SHARED)]
        reqs.append(dict(id=f"{i:04d}-s{i}", label=f"s{i}", prompt=shared + own, after=None,
                         output=[rng.randrange(1000, 100_000) for _ in range(out_len)]))
    cfg = dict(num_blocks=0, max_num_batched_tokens=8192, max_num_seqs=256, concurrency=SEED_REQUESTS,
               max_model_len=32_768, spec=None)
    notes = [f"{SEED_REQUESTS} requests in one wave of {PROMPT_TOKENS} prompt tokens sharing the first "
             f"{SEED_SHARED}; {out_len} output tokens; concurrency {SEED_REQUESTS}"]
    return dict(config=cfg, requests=reqs, notes=notes)


# ---------------------------------------------------------------- the tree's own DeepSeek-V4 geometry

def _load_worker_patch(name: str):
    """Import one module of vllm_ascend.patch.worker without that package's __init__, which applies
    every worker patch (some import vision models that need torchvision)."""
    if name in sys.modules:
        return sys.modules[name]
    import vllm_ascend

    path = os.path.join(os.path.dirname(vllm_ascend.__file__), *name.split(".")[1:]) + ".py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, f"{path}: a .py file always gives a spec with a loader"
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _init_single_process_group() -> None:
    """The compressor's linear layers ask for the tensor-parallel rank: a one-process gloo group."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        initialize_model_parallel(1, 1)


def dsv4_specs(requested: int, feats: Features) -> tuple[int, list[tuple[str, Any]]]:
    """(effective block size, [(group, KV cache spec)]) as this vllm-ascend tree builds them."""
    import torch
    from vllm.config import CacheConfig, SchedulerConfig, VllmConfig, set_current_vllm_config

    import vllm_ascend.patch.platform  # noqa: F401  the global patches (specs, coordinator), as at start-up
    from vllm_ascend.ascend_config import init_ascend_config
    from vllm_ascend.utils import refresh_block_size

    pdc = _load_worker_patch("vllm_ascend.patch.worker.patch_deepseek_compressor")
    from vllm_ascend.models import deepseek_v4
    from vllm_ascend.models.layer.attention.layer import DSAAttention

    vllm_config = VllmConfig(cache_config=CacheConfig(block_size=requested, enable_prefix_caching=True),
                             scheduler_config=SchedulerConfig(max_model_len=8192, is_encoder_decoder=False))
    init_ascend_config(vllm_config)
    model_config = SimpleNamespace(hf_config=SimpleNamespace(model_type="deepseek_v4"), is_hybrid=False,
                                   dtype=torch.bfloat16)
    refresh_block_size(SimpleNamespace(cache_config=vllm_config.cache_config, model_config=model_config,
                                       scheduler_config=vllm_config.scheduler_config))
    effective = vllm_config.cache_config.block_size
    vllm_config.model_config = model_config
    cache_config = vllm_config.cache_config
    _init_single_process_group()
    hf = SimpleNamespace(hidden_size=64, qk_rope_head_dim=64, rms_norm_eps=1e-6)  # sizes the specs do not read
    specs = []
    with set_current_vllm_config(vllm_config):
        for ratio in (4, 128):
            layer = SimpleNamespace(compress_ratio=ratio, kv_cache_dtype="auto", head_size=HEAD_DIM)
            specs.append((f"c{ratio}_attn", DSAAttention.get_kv_cache_spec(layer, vllm_config)))
        specs.append(("c4_indexer", pdc.AscendDeepseekV4IndexerCache(
            head_dim=INDEX_HEAD_DIM, dtype=torch.int8, prefix=f"bs{requested}.k_cache", cache_config=cache_config,
            compress_ratio=4).get_kv_cache_spec(vllm_config)))
        specs.append(("swa", pdc.AscendDeepseekV4SWACache(
            head_dim=HEAD_DIM, window_size=WINDOW, dtype=torch.bfloat16, prefix=f"bs{requested}.swa",
            cache_config=cache_config).get_kv_cache_spec(vllm_config)))
        for name, ratio, head_dim, rotate in (("c4_attn_state", 4, HEAD_DIM, False),
                                              ("c4_indexer_state", 4, INDEX_HEAD_DIM, True),
                                              ("c128_attn_state", 128, HEAD_DIM, False)):
            comp = deepseek_v4.Compressor(vllm_config, hf, ratio, head_dim=head_dim, rotate=rotate,
                                          cache_config=cache_config, prefix=f"bs{requested}.{name}")
            specs.append((name, comp.state_cache.get_kv_cache_spec(vllm_config)))
    feats["requested_block_size"], feats["effective_block_size"] = requested, effective
    return effective, specs


def group_record(name: str, spec) -> dict:
    """A spec as the result's topology records it (tokens_per_block: what one block spans)."""
    ratio = max(getattr(spec, "compress_ratio", 1) or 1, 1)
    rec = dict(group=name, spec=type(spec).__name__, block_size=spec.block_size, compress_ratio=ratio,
               tokens_per_block=spec.block_size * ratio, page_size_bytes=spec.page_size_bytes,
               head_size=spec.head_size, dtype=str(spec.dtype).removeprefix("torch."))
    if getattr(spec, "sliding_window", None):
        rec["window"] = spec.sliding_window
    return rec


# ---------------------------------------------------------------- the scheduler, as the engine core builds it

def build(specs: list[tuple[str, Any]], wl: dict, feats: Features):
    """vLLM's Scheduler over the given KV cache groups (vllm-ascend's coordinator once patched)."""
    import vllm
    from vllm import config as vcfg
    from vllm.v1 import kv_cache_interface as kvi
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    feats["vllm_version"] = getattr(vllm, "__version__", "?")
    feats["vllm_file"] = vllm.__file__
    cfg = wl["config"]
    model_config = vcfg.ModelConfig(**kw(
        vcfg.ModelConfig, model=os.environ.get("KVFORGE_REPLAY_MODEL", "Qwen/Qwen3-0.6B"), dtype="float16",
        seed=0, skip_tokenizer_init=True, max_model_len=cfg["max_model_len"]))
    scheduler_config = vcfg.SchedulerConfig(**kw(
        vcfg.SchedulerConfig, max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
        max_model_len=cfg["max_model_len"], enable_chunked_prefill=True, async_scheduling=False,
        is_encoder_decoder=False))
    cache_config = vcfg.CacheConfig(**kw(vcfg.CacheConfig, block_size=16, gpu_memory_utilization=0.9,
                                         cache_dtype="auto", enable_prefix_caching=True,
                                         prefix_cache_retention_interval=cfg.get("retention_interval")))
    if cfg.get("retention_interval") is not None and \
            getattr(cache_config, "prefix_cache_retention_interval", None) != cfg["retention_interval"]:
        raise RuntimeError("--retention-interval: this vLLM tree has no prefix_cache_retention_interval "
                           "(needs swa-retention-queue-split)")
    vllm_config = vcfg.VllmConfig(**kw(vcfg.VllmConfig, model_config=model_config, cache_config=cache_config,
                                       scheduler_config=scheduler_config, parallel_config=vcfg.ParallelConfig()))
    groups = [kvi.KVCacheGroupSpec([f"model.layers.{i}.{name}"], spec) for i, (name, spec) in enumerate(specs)]
    kv_cache_config = kvi.KVCacheConfig(num_blocks=cfg["num_blocks"], kv_cache_tensors=[], kv_cache_groups=groups)
    # What EngineCore._initialize_kv_caches does with the workers' config.
    cache_config.num_gpu_blocks = cfg["num_blocks"]
    cache_config.block_size = min(spec.block_size for _, spec in specs)
    sched_bs, hash_bs = kcu.resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    feats["scheduler_block_size"], feats["hash_block_size"] = sched_bs, hash_bs
    scheduler = Scheduler(**kw(
        Scheduler, vllm_config=vllm_config, kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config), include_finished_set=False,
        log_stats=True, block_size=sched_bs, hash_block_size=hash_bs))
    try:
        from vllm.utils.hashing import get_hash_fn_by_name
    except ImportError:  # pragma: no cover - older layout
        from vllm.utils import get_hash_fn_by_name
    hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
    kcu.init_none_hash(hash_fn)
    block_hasher = kcu.get_request_block_hasher(hash_bs, hash_fn)
    coord = scheduler.kv_cache_manager.coordinator
    feats["coordinator"] = f"{type(coord).__module__}.{type(coord).__name__}"
    feats["managers"] = [type(m).__name__ for m in coord.single_type_managers]
    feats["coordinator.lcm_block_size"] = getattr(coord, "lcm_block_size", None)
    return scheduler, block_hasher, vllm_config


def hit_alignment(specs: list[tuple[str, Any]], partial: bool = False) -> int:
    """The granularity of a hit in AscendHybridKVCacheCoordinator: lcm of block_size x compress_ratio;
    with partial hits a compressed group (compress_ratio > 1) counts with its block size alone."""
    def unit(spec) -> int:
        ratio = max(getattr(spec, "compress_ratio", 1) or 1, 1)
        return spec.block_size if partial and ratio > 1 else spec.block_size * ratio
    return math.lcm(*(unit(spec) for _, spec in specs))


def record_copies(scheduler, copied: dict[str, int]) -> None:
    """Count, per request, the hit tokens a partial hit copies: wrap each compressed manager's
    add_local_computed_blocks and read the partial tail it records (largest over the groups)."""
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        pending = getattr(manager, "_partial_hit_reqs", None)
        if pending is None:
            continue
        add = manager.add_local_computed_blocks
        logical = manager.block_size * manager.compress_ratio

        def wrapped(request_id, new_computed_blocks, num_local, num_external, _add=add, _p=pending, _l=logical):
            is_new = _add(request_id, new_computed_blocks, num_local, num_external)
            if request_id in _p:
                copied[request_id] = max(copied.get(request_id, 0), num_local % _l)
            return is_new

        manager.add_local_computed_blocks = wrapped


def count_pool(scheduler, pool: dict) -> None:
    """Count in `pool` what the block pool does: blocks entering the prefix cache (`cached`),
    cached blocks evicted to be handed out again (`evictions`), and the most blocks in use at once
    after a step's schedule (`peak_used`). Wraps the pool's own methods; changes nothing."""
    bp = scheduler.kv_cache_manager.block_pool
    pool.update(cached=0, evictions=0, peak_used=0)
    index = bp.cached_block_hash_to_block
    insert, evict, schedule = index.insert, bp._maybe_evict_cached_block, scheduler.schedule

    def counted_insert(key, block, _insert=insert):
        pool["cached"] += 1
        return _insert(key, block)

    def counted_evict(block, _evict=evict):
        evicted = _evict(block)
        pool["evictions"] += bool(evicted)
        return evicted

    def counted_schedule(*a, _schedule=schedule, **k):
        out = _schedule(*a, **k)
        pool["peak_used"] = max(pool["peak_used"], bp.num_gpu_blocks - bp.get_num_free_blocks())
        return out

    index.insert, bp._maybe_evict_cached_block, scheduler.schedule = counted_insert, counted_evict, counted_schedule


def unbounded_pool(wl: dict) -> int:
    """A pool no run can fill: every block any request allocates in any group, plus 1,024."""
    return 1024 + sum(
        sum(-(-(len(r["prompt"]) + len(r["output"])) // g["tokens_per_block"]) + 1 for g in wl["groups"])
        for r in wl["requests"])


def run(requested: int, scale: float, seed: int, kind: str = "repeat", partial: bool = False,
        num_blocks: int = 0, retention_interval: int | None = None) -> dict:
    """One block size: the tree's geometry, then the workload through the scheduler (driver.run_one).

    num_blocks 0 (the default): an unbounded pool, as the ceiling assumes; else a pool of that many
    blocks shared by every group, as on a device. retention_interval: CacheConfig's
    prefix_cache_retention_interval (None: unset)."""
    feats = Features()
    effective, specs = dsv4_specs(requested, feats)
    align = hit_alignment(specs, partial)
    wl = workload(scale, seed, kind)
    wl["groups"] = [group_record(name, spec) for name, spec in specs]
    wl["config"]["num_blocks"] = num_blocks or unbounded_pool(wl)
    wl["config"]["bounded"] = bool(num_blocks)
    wl["config"]["retention_interval"] = retention_interval
    pool: dict[str, int] = {}
    # driver.run_one builds the scheduler with scheduler.build (group dicts -> vLLM's specs) and sizes
    # the ceiling with topologies.hit_alignment; here both come from the tree's own specs.
    saved = driver.build, driver.hit_alignment
    tree_feats = feats
    copied: dict[str, int] = {}

    def tree_build(wl: dict, feats: Features):  # driver.build's signature; run_one passes this `wl`
        feats.update(tree_feats)
        built = build(specs, wl, feats)
        coord = built[0].kv_cache_manager.coordinator
        feats["enable_partial_hash_hits"] = getattr(coord, "enable_partial_hash_hits", None)
        feats["cache_hit_alignment_tokens"] = getattr(coord, "cache_hit_alignment_tokens", None)
        if partial and not feats["enable_partial_hash_hits"]:
            raise RuntimeError(f"{PARTIAL_HITS_ENV}=1 but this vllm-ascend tree's coordinator has no partial "
                               "hits (needs ascend-dsv4-partial-hash-hits)")
        record_copies(built[0], copied)
        count_pool(built[0], pool)
        return built

    def tree_alignment(groups: list[dict]) -> int:  # topologies.hit_alignment's signature
        return align

    driver.build, driver.hit_alignment = tree_build, tree_alignment
    variant = f"bs{requested}" + ("+partial" if partial else "") + (
        f"+retention{retention_interval}" if retention_interval is not None else "") + (
        f"@{num_blocks}" if num_blocks else "")
    try:
        res = driver.run_one(wl, SCENARIOS[kind], variant, scale, seed)
    finally:
        driver.build, driver.hit_alignment = saved
    n = len(res["requests"])
    res["pool"] = dict(pool, num_blocks=wl["config"]["num_blocks"], bounded=bool(num_blocks),
                       cached_per_request=round(pool.get("cached", 0) / n, 1) if n else 0.0,
                       step_ms=round(1000 * res["seconds"]["replay"] / max(res["steps"], 1), 3))
    for row in res["requests"]:
        row["copied_tokens"] = copied.get(row["id"], 0)
        row["recomputed_tokens"] = row["prompt_tokens"] - row["hit_tokens"]
    if partial:
        if res["features"].get("cache_hit_alignment_tokens") != align:
            raise RuntimeError(f"coordinator cache_hit_alignment_tokens {res['features']['cache_hit_alignment_tokens']}"
                               f" != {align} computed from the specs")
    elif res["features"].get("coordinator.lcm_block_size") not in (None, align):
        raise RuntimeError(f"coordinator lcm_block_size {res['features']['coordinator.lcm_block_size']} "
                           f"!= {align} computed from the specs")
    res["notes"] = list(res["notes"]) + [f"--block-size {requested}: the tree uses {effective}; hits are "
                                         f"multiples of {align} tokens"]
    return res


def copy_cost(specs: list[tuple[str, Any]], num_blocks: int = 256, copies: int = 32, repeats: int = 20) -> dict:
    """The worker's copy (vllm_ascend/worker/kv_cache_block_copy.py) timed on CPU tensors of each
    compressed group's real layout: the spec's dtype and head size in views whose block stride is the
    spec's padded page, as NPUModelRunner._adjust_kv_layout makes them. `copies` blocks of half a
    block's entries each, one call per layer: microseconds per layer and per block copied (median of
    `repeats`). {} on a tree without partial hits."""
    import torch

    try:
        from vllm_ascend.core.partial_prefix_cache import KVCacheBlockCopy
        from vllm_ascend.worker.kv_cache_block_copy import copy_kv_cache_blocks
    except ImportError:
        return {}
    out: dict[str, Any] = {}
    for name, spec in specs:
        if max(getattr(spec, "compress_ratio", 1) or 1, 1) == 1:
            continue
        dtype = spec.dtype if isinstance(spec.dtype, torch.dtype) else torch.bfloat16
        esize = torch.empty((), dtype=dtype).element_size()
        shape = (num_blocks, spec.block_size, 1, spec.head_size)
        raw = torch.zeros(num_blocks * spec.page_size_bytes, dtype=torch.uint8)
        view = torch.as_strided(raw.view(dtype), shape,
                                (spec.page_size_bytes // esize, *torch.empty(shape).stride()[1:]))
        batch = [KVCacheBlockCopy(0, i, copies + i, spec.block_size // 2) for i in range(copies)]
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            copy_kv_cache_blocks({0: [view]}, batch)
            times.append(time.perf_counter() - t)
        call = sorted(times)[len(times) // 2]
        out[name] = dict(page_bytes=spec.page_size_bytes, entries=spec.block_size // 2, blocks=copies,
                         us_per_layer_call=round(call * 1e6, 1), us_per_layer_block=round(call * 1e6 / copies, 2))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block-sizes", default=",".join(map(str, BLOCK_SIZES)))
    ap.add_argument("--workloads", default="repeat", help="comma-separated: " + ", ".join(SCENARIOS))
    ap.add_argument("--partial-hits", action="store_true", help=f"run with {PARTIAL_HITS_ENV}=1")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-blocks", default="0",
                    help="comma-separated pool sizes in blocks, one run each; 0: unbounded (default)")
    ap.add_argument("--retention-interval", type=int, default=None,
                    help="CacheConfig.prefix_cache_retention_interval in tokens (default: unset)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    try:
        pools = [int(x) for x in args.num_blocks.split(",") if x.strip()]
    except ValueError:
        ap.error("--num-blocks: comma-separated integers")
    if not pools or any(p < 0 for p in pools):
        ap.error("--num-blocks: block counts >= 0 (0: unbounded)")
    if args.retention_interval is not None and args.retention_interval < 0:
        ap.error("--retention-interval must be >= 0")
    try:
        sizes = [int(x) for x in args.block_sizes.split(",") if x.strip()]
    except ValueError:
        ap.error("--block-sizes: comma-separated integers")
    if not args.scale > 0:
        ap.error("--scale must be > 0")
    kinds = [k.strip() for k in args.workloads.split(",") if k.strip()]
    if not kinds or any(k not in SCENARIOS for k in kinds):
        ap.error(f"--workloads: comma-separated names of {', '.join(SCENARIOS)}")
    os.environ[PARTIAL_HITS_ENV] = "1" if args.partial_hits else "0"
    os.environ["VLLM_ASCEND_APPLY_DSV4_PATCH"] = "1"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    os.environ.setdefault("VLLM_USAGE_STATS_DISABLED", "1")
    sys.path.insert(0, os.getcwd())  # the vllm-ascend tree
    real_stdout, sys.stdout = sys.stdout, sys.stderr
    doc = dict(schema=SCHEMA, cwd=os.getcwd(), scale=args.scale, seed=args.seed, results=[], errors=[])
    t0 = time.perf_counter()
    try:
        suffix = ("+partial" if args.partial_hits else "") + (
            f"+retention{args.retention_interval}" if args.retention_interval is not None else "")
        for kind in kinds:
            for bs in sizes:
                for blocks in pools:
                    run_case(doc, SCENARIOS[kind], f"bs{bs}{suffix}" + (f"@{blocks}" if blocks else ""),
                             lambda: run(bs, args.scale, args.seed, kind, args.partial_hits, blocks,
                                         args.retention_interval))
        if args.partial_hits:
            for bs in sizes:
                doc.setdefault("copy_cost", {})[f"bs{bs}"] = copy_cost(dsv4_specs(bs, Features())[1])
    finally:
        sys.stdout = real_stdout
    return write_doc(doc, args.out, real_stdout, t0)
