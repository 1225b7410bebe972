"""vLLM's Scheduler for a workload, built the way the engine core builds it. Needs vLLM.

VllmConfig from the workload's config (an offline model config; speculative decoding switched to
the workload's method as vLLM's own scheduler tests do; the tier connector when the workload has
one), a hand-built hybrid KVCacheConfig from the topology as the GPU worker would report it,
block sizes resolved by vLLM's own helpers, and the engine core's request block hasher. Whatever
differs between vLLM versions is detected by feature and recorded in `feats`.
"""

from __future__ import annotations

import inspect
import math
import os
import time

from . import connector
from .compat import Features, kw
from .topologies import hit_alignment, kv_cache_spec


def build(wl: dict, feats: Features):
    """Build vLLM's Scheduler for the workload, as the engine core does."""
    import torch
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
        vcfg.ModelConfig, model=os.environ.get("KVFORGE_REPLAY_MODEL", "Qwen/Qwen3-0.6B"),
        dtype="float16", seed=0, skip_tokenizer_init=True, max_model_len=cfg["max_model_len"]))
    scheduler_config = vcfg.SchedulerConfig(**kw(
        vcfg.SchedulerConfig, max_num_seqs=min(cfg["max_num_seqs"], cfg["max_num_batched_tokens"]),
        max_num_batched_tokens=cfg["max_num_batched_tokens"], max_model_len=cfg["max_model_len"],
        enable_chunked_prefill=True, async_scheduling=False,
        is_encoder_decoder=model_config.is_encoder_decoder))
    cache_config = vcfg.CacheConfig(**kw(vcfg.CacheConfig, block_size=16, gpu_memory_utilization=0.9,
                                         cache_dtype="auto", enable_prefix_caching=True))
    spec_config = None
    spec = cfg.get("spec")
    if spec:
        spec_config = vcfg.SpeculativeConfig(model="ngram", num_speculative_tokens=spec["k"])
        # No draft checkpoint offline: build the config as vLLM's own scheduler
        # tests do and switch the method, which is all the scheduler reads
        # (use_eagle(): eagle, eagle3, mtp, dflash).
        object.__setattr__(spec_config, "method", spec["method"])
        feats["spec_use_eagle"] = bool(spec_config.use_eagle())
    kv_transfer_config = connector.transfer_config(vcfg) if cfg.get("connector") else None
    vllm_config = vcfg.VllmConfig(**kw(
        vcfg.VllmConfig, model_config=model_config, cache_config=cache_config,
        scheduler_config=scheduler_config, parallel_config=vcfg.ParallelConfig(),
        speculative_config=spec_config, kv_transfer_config=kv_transfer_config))

    groups = []
    for i, g in enumerate(wl["groups"]):
        spec_obj = kv_cache_spec(g, torch, kvi, feats)
        layers = [f"model.layers.{i}.{j}.attn" for j in range(g.get("layers", 1))]
        groups.append(kvi.KVCacheGroupSpec(layers, spec_obj))
    kv_cache_config = kvi.KVCacheConfig(num_blocks=cfg["num_blocks"], kv_cache_tensors=[],
                                        kv_cache_groups=groups)

    # What EngineCore._initialize_kv_caches does with the workers' config.
    cache_config.num_gpu_blocks = cfg["num_blocks"]
    cache_config.block_size = min(g["block_size"] for g in wl["groups"])
    try:
        from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
        register_all_kvcache_specs(vllm_config)
        feats["kvcache_spec_registry"] = True
    except ImportError:
        feats["kvcache_spec_registry"] = False
    if hasattr(kcu, "resolve_kv_cache_block_sizes"):
        sched_bs, hash_bs = kcu.resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    else:  # older trees: LCM for the scheduler, GCD for hashing
        sizes = [g["block_size"] for g in wl["groups"]]
        sched_bs, hash_bs = math.lcm(*sizes), math.gcd(*sizes)
    feats["scheduler_block_size"], feats["hash_block_size"] = sched_bs, hash_bs
    if hasattr(kcu, "resolve_cache_hit_alignment_tokens"):
        align = kcu.resolve_cache_hit_alignment_tokens(kv_cache_config, vllm_config, sched_bs, hash_bs)
        for key, value in (("hash_block_size", hash_bs), ("cache_hit_alignment_tokens", align)):
            if hasattr(kv_cache_config, key):
                setattr(kv_cache_config, key, value)
        feats["cache_hit_alignment_tokens"] = align

    connector.STATE.reset(hit_alignment(wl["groups"]))

    scheduler = Scheduler(**kw(
        Scheduler, vllm_config=vllm_config, kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        include_finished_set=False, log_stats=True, block_size=sched_bs, hash_block_size=hash_bs))

    # The engine core's request block hasher.
    try:
        from vllm.utils.hashing import get_hash_fn_by_name
    except ImportError:  # pragma: no cover - older layout
        from vllm.utils import get_hash_fn_by_name
    hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
    kcu.init_none_hash(hash_fn)
    lookahead = getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0
    hasher_args = [hash_bs, hash_fn]
    if len(inspect.signature(kcu.get_request_block_hasher).parameters) >= 3:
        hasher_args.append(lookahead)
        feats["num_hash_lookahead_tokens"] = lookahead
    block_hasher = kcu.get_request_block_hasher(*hasher_args)

    coord = scheduler.kv_cache_manager.coordinator
    feats["coordinator"] = type(coord).__name__
    feats["managers"] = [type(m).__name__ for m in coord.single_type_managers]
    if hasattr(coord, "attention_groups"):
        feats["attention_groups"] = [list(ag[1]) for ag in coord.attention_groups]
    for name in ("lcm_block_size", "scheduler_block_size"):
        if hasattr(coord, name):
            feats[f"coordinator.{name}"] = getattr(coord, name)
    feats["use_eagle"] = bool(getattr(scheduler, "use_eagle", False))
    feats["num_lookahead_tokens"] = getattr(scheduler, "num_lookahead_tokens", 0)
    return scheduler, block_hasher, vllm_config


def make_request(r: dict, block_hasher, eos: int):
    """A workload request as a vLLM Request: greedy, ignore_eos, max_tokens = planned output."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=len(r["output"]), ignore_eos=True, temperature=0.0)
    if hasattr(sp, "update_from_generation_config"):
        sp.update_from_generation_config({}, eos)
    return Request(**kw(Request, request_id=r["id"], prompt_token_ids=list(r["prompt"]),
                        sampling_params=sp, pooling_params=None, block_hasher=block_hasher,
                        arrival_time=time.time()))
