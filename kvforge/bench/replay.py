#!/usr/bin/env python3
"""Replay a prefix-cache workload through a vLLM tree's real scheduler.

Standalone on purpose: it imports only the standard library and vLLM, and is
run by the target environment's python with cwd = the root of a vLLM source
tree, so `import vllm` loads that tree (base or patched). No model, no GPU.

It builds the scheduler the way vLLM's engine core does (VllmConfig, a
hand-built hybrid KVCacheConfig as the GPU worker would report it, block sizes
resolved by vLLM's own helpers, the request block hasher), then steps it with
synthetic model-runner outputs: chunked prefill, sampled tokens, and for
speculative decoding draft tokens plus acceptance. Hit rates come from vLLM's
own PrefixCacheStats (the counters behind the "Prefix cache hit rate" log line
and the prefix_cache_hits/queries metrics). Block-table invariants are checked
as it runs; a violation is a result, never a crash.

    cd <vLLM tree> && python replay.py --scenario all|NAME[/VARIANT][,...] [--scale F] [--out FILE]
    python replay.py --list

Prints one JSON document on stdout (or writes --out): every scenario's result,
or its error; progress lines ("replay: ...") on stderr.
The workload and ceiling code at the top needs no vLLM, so it can be imported
and unit-tested anywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import inspect
import json
import math
import os
import random
import sys
import time
from array import array
from collections import Counter, defaultdict

SCHEMA = 1

# --------------------------------------------------------------------------
# Topologies (scheduler side): one entry per KV cache group, in group order.
#   kind: full | mla | swa | swa_mla
# --------------------------------------------------------------------------

DSV4_GROUPS = [
    # Full-attention MLA (compressed), block 256 (--block-size 256).
    dict(kind="mla", block_size=256, head_size=512, dtype="uint8", tokens_per_state=4,
         cache_dtype_str="fp8_ds_mla", alignment=576, model_version="deepseek_v4", layers=1),
    # Sliding-window MLA, block 64, window 128: two KV groups with the same spec.
    dict(kind="swa_mla", block_size=64, window=128, head_size=512, dtype="uint8",
         cache_dtype_str="fp8_ds_mla", alignment=576, model_version="deepseek_v4", layers=1),
    dict(kind="swa_mla", block_size=64, window=128, head_size=512, dtype="uint8",
         cache_dtype_str="fp8_ds_mla", alignment=576, model_version="deepseek_v4", layers=2),
    # Compressor states: C4 (block 4, window 8) and C128 (block 8, window 128).
    dict(kind="swa_mla", block_size=4, window=8, head_size=2048, dtype="float32",
         alignment=576, layers=1),
    dict(kind="swa_mla", block_size=8, window=128, head_size=1024, dtype="float32",
         alignment=576, layers=1),
]

GEMMA4_DFLASH_GROUPS = [
    # Gemma4 full attention (global_head_dim 256), block 16 after page unification.
    dict(kind="full", block_size=16, head_size=256, num_kv_heads=4, dtype="bfloat16", layers=1),
    # Gemma4 sliding window (head_dim 128), block 32, window 1024.
    dict(kind="swa", block_size=32, window=1024, head_size=128, num_kv_heads=4, dtype="bfloat16", layers=5),
    # DFlash (Qwen3-based) draft full attention, block 64.
    dict(kind="full", block_size=64, head_size=128, num_kv_heads=2, dtype="bfloat16", layers=1, draft=True),
]

GPTOSS_GROUPS = [
    # gpt-oss: full attention + sliding window 128, same page size (block 16).
    # The EAGLE3 draft layer has the full-attention spec and shares that group.
    dict(kind="full", block_size=16, head_size=64, num_kv_heads=8, dtype="bfloat16", layers=1),
    dict(kind="swa", block_size=16, window=128, head_size=64, num_kv_heads=8, dtype="bfloat16", layers=1),
]

EXTERNAL_GROUPS = [
    # 1 full + 2 sliding-window groups (the layout of vLLM's two-phase allocation
    # tests, issue #33775 / PR #44409), Gemma-style window 1024.
    dict(kind="full", block_size=16, head_size=128, num_kv_heads=8, dtype="bfloat16", layers=1),
    dict(kind="swa", block_size=16, window=1024, head_size=128, num_kv_heads=8, dtype="bfloat16", layers=1),
    dict(kind="swa", block_size=16, window=1024, head_size=128, num_kv_heads=8, dtype="bfloat16", layers=2),
]


def hit_alignment(groups: list[dict]) -> int:
    """Granularity of a prefix hit: the LCM of every group's block size."""
    return math.lcm(*(g["block_size"] for g in groups))


# --------------------------------------------------------------------------
# Workloads (pure python, seeded): a list of request dicts in submission order.
#   id, label, prompt (list[int]), output (planned tokens; max_tokens = len),
#   after (index of a request that must finish before this one is submitted)
# --------------------------------------------------------------------------


def _tokens(rng: random.Random, n: int) -> list[int]:
    # Token ids well inside any vocabulary and away from special ids.
    return [rng.randrange(1000, 100_000) for _ in range(n)]


def _scaled(n: float, scale: float, minimum: int = 1) -> int:
    return max(minimum, int(round(n * scale)))


def _chunk(tokens: int, scale: float, unit: int) -> int:
    """A scaled token budget per step, in whole `unit`s (at least one)."""
    return max(unit, unit * round(tokens * scale / unit))


def workload(scenario: str, variant: str, scale: float, seed: int = 0) -> dict:
    """Return {groups, config, requests, notes} for a scenario at a scale."""
    rng = random.Random(f"{scenario}:{seed}")
    if scenario == "dsv4-resend":
        # Seed 000: A, A, B, A of ~374k tokens; A and B share only the first
        # 256 tokens (the chat-template prelude). Sequential, max_tokens 3.
        shared = _tokens(rng, 256)
        len_a, len_b = _scaled(373_943, scale, 1024), _scaled(378_175, scale, 1024)
        a = shared + _tokens(rng, len_a - 256)
        b = shared + _tokens(rng, len_b - 256)
        outs = [_tokens(rng, 3) for _ in range(4)]
        reqs = [
            dict(label="A.1", prompt=a, output=outs[0]),
            dict(label="A.2", prompt=a, output=outs[1]),
            dict(label="B", prompt=b, output=outs[2]),
            dict(label="A.3", prompt=a, output=outs[3]),
        ]
        cfg = dict(num_blocks=_scaled(54_774, scale, 64), max_num_batched_tokens=_chunk(4096, scale, 256),
                   max_num_seqs=512, concurrency=1, max_model_len=1_048_576, spec=None)
        groups = DSV4_GROUPS
        notes = ["sequential like the seed's client (each request after the previous finished)"]
    elif scenario == "dsv4-repeat":
        # Seed 001's workload: 8K input x 1K output, 32 in flight, 90% of the
        # requests re-send an earlier prompt.
        conc, n = 32, 512
        in_len, out_len = _scaled(8192, scale, 512), _scaled(1024, scale, 8)
        n_repeat = round(0.9 * n)
        # The first `conc` requests cannot re-send anything already served; the
        # re-sends are spread over the rest, each picking a prompt first sent at
        # least `conc` requests earlier (already served in a closed loop).
        repeat_at = set(rng.sample(range(conc, n), min(n_repeat, n - conc)))
        prompts: list[list[int]] = []
        first_sent: list[int] = []
        reqs = []
        for i in range(n):
            eligible = [p for p, j in enumerate(first_sent) if j <= i - conc]
            if i in repeat_at and eligible:
                p = rng.choice(eligible)
                reqs.append(dict(label=f"r{i}=p{p}", prompt=prompts[p], output=_tokens(rng, out_len)))
            else:
                prompts.append(_tokens(rng, in_len))
                first_sent.append(i)
                reqs.append(dict(label=f"r{i}:p{len(prompts) - 1}", prompt=prompts[-1],
                                 output=_tokens(rng, out_len)))
        cfg = dict(num_blocks=_scaled(54_774, scale, 64), max_num_batched_tokens=_chunk(4096, scale, 256),
                   max_num_seqs=512, concurrency=conc, max_model_len=1_048_576, spec=None)
        groups = DSV4_GROUPS
        notes = [f"{n} requests, {len(prompts)} distinct prompts, "
                 f"{sum(1 for r in reqs if '=' in r['label'])} re-sends"]
    elif scenario == "gemma4-dflash":
        # Seed 002: gsm8k-style eval, every request shares a ~1.5k-token
        # few-shot prefix, then its own question; DFlash speculative decoding.
        n, conc = _scaled(256, scale, 16), _scaled(32, scale, 4)
        fewshot = _tokens(rng, 1487)
        reqs = []
        for i in range(n):
            q = _tokens(rng, rng.randint(40, 160))
            reqs.append(dict(label=f"q{i}", prompt=fewshot + q, output=_tokens(rng, rng.randint(80, 256))))
        spec = None if variant == "nospec" else dict(method="dflash", k=8, accept=0.7)
        cfg = dict(num_blocks=_scaled(16_384, scale, 2048), max_num_batched_tokens=8192,
                   max_num_seqs=256, concurrency=conc, max_model_len=40_000, spec=spec)
        groups = GEMMA4_DFLASH_GROUPS if spec else [g for g in GEMMA4_DFLASH_GROUPS if not g.get("draft")]
        notes = ["spec decode off: no DFlash draft group, 2 KV groups" if not spec
                 else "DFlash k=8, per-token acceptance 0.7"]
    elif scenario == "gptoss-eagle":
        # Control: gpt-oss (full + SWA 128) with EAGLE3, multi-turn chats that
        # share a system prompt; each turn re-sends the whole conversation.
        convs, turns, conc = _scaled(48, scale, 4), 4, _scaled(32, scale, 4)
        system = _tokens(rng, 1200)
        history = [list(system) for _ in range(convs)]
        reqs = []
        last_of: dict[int, int] = {}
        for t in range(turns):
            for c in range(convs):
                prompt = history[c] + _tokens(rng, rng.randint(50, 300))
                out = _tokens(rng, rng.randint(100, 400))
                reqs.append(dict(label=f"c{c}t{t}", prompt=prompt, output=out, after=last_of.get(c)))
                last_of[c] = len(reqs) - 1
                history[c] = prompt + out
        spec = dict(method="eagle3", k=3, accept=0.7)
        cfg = dict(num_blocks=_scaled(16_384, scale, 2048), max_num_batched_tokens=8192,
                   max_num_seqs=256, concurrency=conc, max_model_len=131_072, spec=spec)
        groups = GPTOSS_GROUPS
        notes = ["EAGLE3 k=3, per-token acceptance 0.7; turn t+1 re-sends turn t's prompt and answer"]
    elif scenario == "external-hit" and variant == "":
        # Seed 003 / issue #43884 (fixed upstream by #44409): a local prefix hit
        # plus external (connector) tokens on 1 full + 2 SWA groups, with the
        # local-hit blocks near the head of the free queue. In a steady soak that
        # state is rare (see the "soak" variant), so this sweeps it: turn 1 of a
        # chat runs and finishes; then a concurrent request of growing size takes
        # blocks from the head of the free queue (the KV pressure of the moment)
        # while turn 3 arrives, finding turn 1 locally and turn 2 (served by
        # another instance) in the shared KV tier. One fresh scheduler per point.
        system = _tokens(rng, 1000)
        user1, out1 = _tokens(rng, 200), _tokens(rng, 100)
        user2, out2 = _tokens(rng, 150), _tokens(rng, 200)
        user3, out3 = _tokens(rng, 100), _tokens(rng, 32)
        turn1 = system + user1
        turn2 = turn1 + out1 + user2
        turn3 = turn2 + out2 + user3
        # From a load that leaves turn 1 deep in the free queue to one that
        # evicts it; 37 points, every 32 tokens.
        lo, hi = 800, 1952
        n_points = 37  # cheap (three short requests each): not scaled
        sizes = sorted({lo + (hi - lo) * k // (n_points - 1) // 16 * 16 for k in range(n_points)})
        sweep = []
        for size in sizes:
            filler = _tokens(random.Random(f"filler:{seed}:{size}"), size)
            reqs = [
                dict(label="turn1", prompt=turn1, output=out1),
                dict(label="load", prompt=filler, output=_tokens(rng, 16), after=0),
                dict(label="turn3", prompt=turn3, output=out3, after=0, tier_adds=[turn2 + out2[:-1]]),
            ]
            for i, r in enumerate(reqs):
                r["id"] = f"p{size}-{i}-{r['label']}"
                r.setdefault("after", None)
            sweep.append(dict(point=size, groups=EXTERNAL_GROUPS, requests=reqs, notes=[],
                              config=dict(num_blocks=512, max_num_batched_tokens=4096, max_num_seqs=256,
                                          concurrency=2, max_model_len=32_768,
                                          spec=dict(method="mtp", k=3, accept=0.7), connector="tier")))
        return dict(sweep=sweep, sweep_param="tokens of the concurrent request", groups=EXTERNAL_GROUPS,
                    notes=[f"{len(sweep)} points, concurrent request of {sizes[0]}..{sizes[-1]} tokens; "
                           "pool 512 blocks; MTP k=3; tier connector (synchronous loads)"])
    elif scenario == "external-hit" and variant == "soak":
        # Seed 003 / issue #43884: a local prefix hit plus external (connector)
        # tokens on 1 full + 2 SWA groups (Gemma-style window 1024), MTP k=3.
        # Two instances behind a round-robin router share a KV tier (an
        # offload/LMCache-style store that keeps every block once computed);
        # multi-turn chats alternate between them. We replay instance B: its
        # turn t+2 finds turn t in its local prefix cache and turn t+1, served
        # by instance A, in the shared tier (external tokens).
        convs, turns, conc = _scaled(96, scale, 8), 8, _scaled(32, scale, 4)
        system = _tokens(rng, 1000)
        history = [list(system) for _ in range(convs)]
        reqs = []
        last_of: dict[int, int] = {}
        pending_tier: dict[int, list] = defaultdict(list)
        # Users come back after varying think times: turns are interleaved at
        # random (a conversation's turns stay in order).
        order = [c for c in range(convs) for _ in range(turns)]
        rng.shuffle(order)
        turn_of = [0] * convs
        for c in order:
            t = turn_of[c]
            turn_of[c] += 1
            prompt = history[c] + _tokens(rng, rng.randint(50, 300))
            out = _tokens(rng, rng.randint(64, 256))
            history[c] = prompt + out
            if (c + t) % 2 == 0:  # served by instance A: its KV lands in the shared tier
                pending_tier[c].append(prompt + out[:-1])
                continue
            reqs.append(dict(label=f"c{c}t{t}", prompt=prompt, output=out, after=last_of.get(c),
                             tier_adds=pending_tier.pop(c, [])))
            last_of[c] = len(reqs) - 1
        cfg = dict(num_blocks=_scaled(12_288, scale, 1536), max_num_batched_tokens=4096,
                   max_num_seqs=256, concurrency=conc, max_model_len=32_768,
                   spec=dict(method="mtp", k=3, accept=0.7), connector="tier")
        groups = EXTERNAL_GROUPS
        notes = ["instance B of two sharing a KV tier; connector: synchronous loads from the tier, "
                 "which stores each block once computed; MTP k=3, per-token acceptance 0.7"]
    else:
        raise ValueError(f"unknown scenario {scenario!r}")
    for i, r in enumerate(reqs):
        r["id"] = f"{i:04d}-{r['label']}"
        r.setdefault("after", None)
    return dict(groups=groups, config=cfg, requests=reqs, notes=notes)


SCENARIOS = {
    # name: variants (each variant is one replay and one row)
    "dsv4-resend": [""],
    "dsv4-repeat": [""],
    "gemma4-dflash": ["", "nospec"],
    "gptoss-eagle": [""],
    "external-hit": ["", "soak"],
}


class _Keyer:
    """Incremental chained block keys of one growing token sequence."""

    def __init__(self, align: int):
        self.align, self.keys, self.parent = align, [], b""

    def extend_to(self, tokens, n_tokens: int) -> list[bytes]:
        new = []
        while (len(self.keys) + 1) * self.align <= n_tokens:
            start = len(self.keys) * self.align
            h = hashlib.blake2b(self.parent, digest_size=16)
            h.update(array("q", tokens[start:start + self.align]).tobytes())
            self.parent = h.digest()
            self.keys.append(self.parent)
            new.append(self.parent)
        return new


def _block_keys(tokens: list[int], align: int) -> list[bytes]:
    """Chained digests of the full `align`-token blocks of a token sequence."""
    return _Keyer(align).extend_to(tokens, len(tokens))


def ceilings(requests: list[dict], align: int) -> list[int]:
    """Per request, the most tokens any prefix cache could serve.

    The longest prefix shared with what an earlier-submitted request computed
    (its prompt and all but its last output token), in whole `align` blocks,
    capped below the prompt length (vLLM recomputes at least the last token).
    An unbounded cache that never evicts reaches exactly this.
    """
    seen: set[bytes] = set()
    out = []
    for r in requests:
        prompt = r["prompt"]
        n = 0
        for k in _block_keys(prompt, align):
            if k not in seen:
                break
            n += 1
        cap = (len(prompt) - 1) // align * align
        out.append(min(n * align, cap))
        seen.update(_block_keys(prompt + r["output"][:-1], align))
    return out


# --------------------------------------------------------------------------
# Everything below needs vLLM (imported lazily).
# --------------------------------------------------------------------------

def _say(msg: str) -> None:
    print(f"replay: {msg}", file=sys.stderr, flush=True)


def _accepts(fn_or_cls, name: str) -> bool:
    try:
        params = inspect.signature(fn_or_cls).parameters
    except (TypeError, ValueError):
        params = {}
    if name in params:
        return True
    if dataclasses.is_dataclass(fn_or_cls):
        return name in {f.name for f in dataclasses.fields(fn_or_cls)}
    return False


def _kw(fn_or_cls, **kw):
    """Keep only the keyword arguments this version accepts."""
    return {k: v for k, v in kw.items() if _accepts(fn_or_cls, k)}


class Features(dict):
    """What this vLLM tree has, detected by feature (recorded in the result)."""


def _make_spec(g: dict, torch, kvi, feats: Features):
    dtype = getattr(torch, g["dtype"])
    common = dict(block_size=g["block_size"], num_kv_heads=g.get("num_kv_heads", 1),
                  head_size=g["head_size"], dtype=dtype)
    kind = g["kind"]
    if kind == "full":
        return kvi.FullAttentionSpec(**common)
    if kind == "swa":
        return kvi.SlidingWindowSpec(**common, sliding_window=g["window"])
    extra = {}
    for key in ("cache_dtype_str", "alignment", "model_version"):
        if key in g:
            extra[key] = g[key]
    if kind == "mla":
        cls = kvi.MLAAttentionSpec
        if "tokens_per_state" in g:
            # 0.20.x: compress_ratio; later: tokens_per_state.
            name = "tokens_per_state" if _accepts(cls, "tokens_per_state") else "compress_ratio"
            extra[name] = g["tokens_per_state"]
            feats["mla_compression_field"] = name
        return cls(**common, **_kw(cls, **extra))
    if kind == "swa_mla":
        cls = kvi.SlidingWindowMLASpec
        return cls(**common, sliding_window=g["window"], **_kw(cls, **extra))
    raise ValueError(kind)


def _connector_class():
    """A scheduler-side KV connector modelling an unbounded KV offload tier:
    every block is stored once computed; a request is offered, synchronously,
    the tokens beyond its local hit that the tier holds."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import base as cbase

    bases = [cbase.KVConnectorBase_V1]
    if hasattr(cbase, "SupportsHMA"):
        bases.append(cbase.SupportsHMA)

    def __init__(self, vllm_config, role, kv_cache_config=None, *args, **kwargs):
        cbase.KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        self.align = REPLAY_STATE["ext_align"]
        self.store: set[bytes] = set()
        self.live: dict[str, tuple] = {}  # request id -> (request, keyer)
        REPLAY_STATE["connector"] = self

    def get_num_new_matched_tokens(self, request, num_computed_tokens, *args, **kwargs):
        n = 0
        for k in _block_keys(list(request.prompt_token_ids), self.align):
            if k not in self.store:
                break
            n += 1
        have = min(n * self.align, (request.num_tokens - 1) // self.align * self.align)
        ext = max(0, have - num_computed_tokens)
        REPLAY_STATE["ext_offer"][request.request_id] = (num_computed_tokens, ext)
        return ext, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens, *args, **kwargs):
        if request.request_id not in self.live:
            self.live[request.request_id] = (request, _Keyer(self.align))

    def build_connector_meta(self, scheduler_output, *args, **kwargs):
        # Store what the previous steps computed (the worker saves it after the step).
        for rid in scheduler_output.num_scheduled_tokens:
            entry = self.live.get(rid)
            if entry is not None:
                req, keyer = entry
                self.store.update(keyer.extend_to(req.all_token_ids, req.num_computed_tokens))
        return cbase.KVConnectorMetadata()

    def request_finished(self, request, block_ids, *args, **kwargs):
        entry = self.live.pop(request.request_id, None)
        if entry is not None:
            self.store.update(entry[1].extend_to(request.all_token_ids, request.num_computed_tokens))
        return False, None

    def request_finished_all_groups(self, request, block_ids, *args, **kwargs):
        return self.request_finished(request, block_ids)

    ns = dict(__init__=__init__, get_num_new_matched_tokens=get_num_new_matched_tokens,
              update_state_after_alloc=update_state_after_alloc,
              build_connector_meta=build_connector_meta, request_finished=request_finished,
              request_finished_all_groups=request_finished_all_groups, __module__=__name__)
    cls = type("ReplayTierConnector", tuple(bases), ns)
    # Worker-side abstract methods: never called on the scheduler side.
    missing = set(getattr(cls, "__abstractmethods__", ()))
    for name in missing:
        setattr(cls, name, lambda self, *a, **k: None)
    if missing:
        cls = type("ReplayTierConnector", (cls,), {"__module__": __name__})
    return cls


REPLAY_STATE: dict = {"ext_offer": {}, "ext_align": 16}


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

    model_config = vcfg.ModelConfig(**_kw(
        vcfg.ModelConfig, model=os.environ.get("KVFORGE_REPLAY_MODEL", "Qwen/Qwen3-0.6B"),
        dtype="float16", seed=0, skip_tokenizer_init=True, max_model_len=cfg["max_model_len"]))
    scheduler_config = vcfg.SchedulerConfig(**_kw(
        vcfg.SchedulerConfig, max_num_seqs=min(cfg["max_num_seqs"], cfg["max_num_batched_tokens"]),
        max_num_batched_tokens=cfg["max_num_batched_tokens"], max_model_len=cfg["max_model_len"],
        enable_chunked_prefill=True, async_scheduling=False,
        is_encoder_decoder=model_config.is_encoder_decoder))
    cache_config = vcfg.CacheConfig(**_kw(vcfg.CacheConfig, block_size=16, gpu_memory_utilization=0.9,
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
    kv_transfer_config = None
    if cfg.get("connector"):
        # Loaded by module path, as vLLM loads out-of-tree connectors; some
        # versions resolve the class while building VllmConfig.
        setattr(sys.modules[__name__], "ReplayTierConnector", _connector_class())
        kv_transfer_config = vcfg.KVTransferConfig(**_kw(
            vcfg.KVTransferConfig, kv_connector="ReplayTierConnector", kv_role="kv_both",
            kv_connector_module_path=__name__))
    vllm_config = vcfg.VllmConfig(**_kw(
        vcfg.VllmConfig, model_config=model_config, cache_config=cache_config,
        scheduler_config=scheduler_config, parallel_config=vcfg.ParallelConfig(),
        speculative_config=spec_config, kv_transfer_config=kv_transfer_config))

    groups = []
    for i, g in enumerate(wl["groups"]):
        spec_obj = _make_spec(g, torch, kvi, feats)
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

    REPLAY_STATE["ext_align"] = hit_alignment(wl["groups"])
    REPLAY_STATE["ext_offer"] = {}
    REPLAY_STATE["connector"] = None

    scheduler = Scheduler(**_kw(
        Scheduler, vllm_config=vllm_config, kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        include_finished_set=False, log_stats=True, block_size=sched_bs, hash_block_size=hash_bs))

    # The engine core's request block hasher.
    try:
        from vllm.utils.hashing import get_hash_fn_by_name
    except ImportError:  # pragma: no cover - older layout
        from vllm.utils import get_hash_fn_by_name  # type: ignore
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


def _make_request(r: dict, block_hasher, eos: int):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=len(r["output"]), ignore_eos=True, temperature=0.0)
    if hasattr(sp, "update_from_generation_config"):
        sp.update_from_generation_config({}, eos)
    return Request(**_kw(Request, request_id=r["id"], prompt_token_ids=list(r["prompt"]),
                         sampling_params=sp, pooling_params=None, block_hasher=block_hasher,
                         arrival_time=time.time()))


class Checker:
    """Block-table invariants, recorded as results."""

    MAX_EXAMPLES = 20

    def __init__(self, scheduler):
        self.kvm = scheduler.kv_cache_manager
        self.coord = self.kvm.coordinator
        self.pool = self.coord.block_pool
        self.null = self.pool.null_block
        self.managers = self.coord.single_type_managers
        self.counts: Counter = Counter()
        self.examples: dict[str, list] = defaultdict(list)
        self.cross_group_ids: set[int] = set()
        self.free_queue_ok = hasattr(getattr(self.pool, "free_block_queue", None), "fake_free_list_head")
        self.full_checks = 0

    def _bad(self, kind: str, step: int, detail: str) -> None:
        self.counts[kind] += 1
        if len(self.examples[kind]) < self.MAX_EXAMPLES:
            self.examples[kind].append(dict(step=step, detail=detail))

    def light(self, step: int) -> None:
        """Every step: no block in two groups' live tables; ref counts == references."""
        null = self.null
        owner: dict[int, int] = {}
        refs: Counter = Counter()
        for g, m in enumerate(self.managers):
            for rid, blocks in m.req_to_blocks.items():
                for b in blocks:
                    if b is null:
                        continue
                    bid = b.block_id
                    refs[bid] += 1
                    o = owner.setdefault(bid, g)
                    if o != g and bid not in self.cross_group_ids:
                        self.cross_group_ids.add(bid)
                        self._bad("block_in_two_groups", step, f"block {bid} in groups {o} and {g} (req {rid})")
        blocks = self.pool.blocks
        for bid, n in refs.items():
            rc = blocks[bid].ref_cnt
            if rc != n:
                self._bad("ref_cnt_mismatch", step, f"block {bid}: ref_cnt {rc}, referenced {n} times")
        self._live = refs

    def full(self, step: int) -> None:
        """At admissions/finishes: the free queue holds exactly the unreferenced blocks."""
        if not self.free_queue_ok:
            return
        self.full_checks += 1
        q = self.pool.free_block_queue
        node, tail = q.fake_free_list_head.next_free_block, q.fake_free_list_tail
        in_queue = set()
        while node is not None and node is not tail:
            in_queue.add(node.block_id)
            if node.ref_cnt != 0:
                self._bad("referenced_block_in_free_queue", step,
                          f"block {node.block_id} ref_cnt {node.ref_cnt} is in the free queue")
            node = node.next_free_block
        live = getattr(self, "_live", {})
        for b in self.pool.blocks:
            if b is self.null or getattr(b, "is_null", False):
                continue
            if b.ref_cnt == 0 and b.block_id not in in_queue:
                self._bad("unreferenced_block_not_free", step, f"block {b.block_id} ref_cnt 0 but not in the free queue")
            if b.ref_cnt > 0 and b.block_id not in live:
                self._bad("ref_cnt_without_owner", step,
                          f"block {b.block_id} ref_cnt {b.ref_cnt} but in no live block table")

    def result(self) -> dict:
        return dict(counts=dict(self.counts), examples=dict(self.examples),
                    block_ids_in_two_groups=len(self.cross_group_ids), full_checks=self.full_checks,
                    free_queue_checked=self.free_queue_ok)


class ExternalProbe:
    """For allocations with external tokens: did a local-hit block sit where an
    earlier group's external allocation would take it (issue #33775)?"""

    def __init__(self, scheduler, checker: Checker):
        self.kvm = scheduler.kv_cache_manager
        self.checker = checker
        self.allocations: set[str] = set()
        self.triggered: set[str] = set()
        self.examples: list[dict] = []
        self.errors: list[str] = []
        orig = self.kvm.allocate_slots
        sig = inspect.signature(orig)

        def allocate_slots(*args, **kwargs):
            try:
                bound = sig.bind(*args, **kwargs)
                a = bound.arguments
                ext = a.get("num_external_computed_tokens", 0) or 0
                ncb = a.get("new_computed_blocks")
                if ext > 0 and ncb is not None:
                    self._probe(a["request"], a.get("num_new_computed_tokens", 0) or 0, ext, ncb)
            except Exception as exc:  # the probe must never break the replay
                if len(self.errors) < 5:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
            return orig(*args, **kwargs)

        self.kvm.allocate_slots = allocate_slots

    def _probe(self, request, local: int, ext: int, ncb) -> None:
        """Replays v0.20's per-group order on a copy of the queue order: group i
        touches its own hits, then takes its external blocks from the queue
        head. A later group's untouched hit block inside that reach would be
        handed to group i while still being group j's hit (issue #33775). The
        condition depends only on the state, so it is reported for every tree,
        fixed or not."""
        self.allocations.add(request.request_id)
        managers = self.kvm.coordinator.single_type_managers
        hits_by_group = ncb.blocks if hasattr(ncb, "blocks") else ncb
        total = local + ext
        kept: list[list] = []  # the hit blocks each group would touch
        takes: list[int] = []  # blocks each group takes from the queue for external tokens
        for m, raw in zip(managers, hits_by_group):
            skipped = m.get_num_skipped_tokens(total) // m.block_size if hasattr(m, "get_num_skipped_tokens") else 0
            kept.append([b for b in list(raw)[skipped:] if not getattr(b, "is_null", False)])
            takes.append(max(0, -(-total // m.block_size) - max(len(raw), skipped)))
        q = self.kvm.block_pool.free_block_queue
        order: list[int] = []
        node, tail = q.fake_free_list_head.next_free_block, q.fake_free_list_tail
        limit = sum(takes) + sum(len(k) for k in kept) + 1
        while node is not None and node is not tail and len(order) < limit:
            order.append(node.block_id)
            node = node.next_free_block
        found = []
        for j in range(1, len(managers)):
            reach_n = sum(takes[:j])
            if reach_n == 0:
                continue
            removed = {b.block_id for k in kept[:j] for b in k}
            reach = [bid for bid in order if bid not in removed][:reach_n]
            reach_set = set(reach)
            for b in kept[j]:
                if b.ref_cnt == 0 and b.block_id in reach_set:
                    found.append((j, b.block_id))
        if found:
            first = request.request_id not in self.triggered
            self.triggered.add(request.request_id)
            if first and len(self.examples) < Checker.MAX_EXAMPLES:
                self.examples.append(dict(request=request.request_id, local=local, external=ext,
                                          group_block=found[:8]))

    def result(self) -> dict:
        return dict(allocations_with_external_tokens=len(self.allocations), trigger_held=len(self.triggered),
                    trigger_examples=self.examples, probe_errors=self.errors)


class Sampler:
    """Synthetic model runner: planned output tokens, drafts and acceptance."""

    def __init__(self, planned: dict[str, list[int]], spec: dict | None, seed: int):
        self.planned = planned
        self.spec = spec
        self.rng = random.Random(f"accept:{seed}")
        self.drafted = 0
        self.accepted = 0

    def sampled(self, req, spec_tokens: list[int]) -> list[int]:
        plan = self.planned[req.request_id]
        pos = len(req.output_token_ids)
        n = 1
        if spec_tokens:
            a = 0
            while a < len(spec_tokens) and self.rng.random() < self.spec["accept"]:
                a += 1
            self.drafted += len(spec_tokens)
            self.accepted += a
            n = a + 1
        return plan[pos:pos + n] or plan[-1:]

    def drafts(self, req) -> list[int]:
        plan = self.planned[req.request_id]
        pos = len(req.output_token_ids)
        return list(plan[pos:pos + self.spec["k"]])


def run(scenario: str, variant: str, scale: float, seed: int, check_every: int = 1) -> dict:
    """Replay a scenario; a sweep scenario replays each point on a fresh scheduler."""
    wl = workload(scenario, variant, scale, seed)
    if "sweep" not in wl:
        return run_one(wl, scenario, variant, scale, seed, check_every)
    parts = []
    for point in wl["sweep"]:
        res = run_one(point, scenario, variant, scale, seed, check_every)
        res["point"] = point["point"]
        parts.append(res)
    return merge_sweep(parts, wl)


def merge_sweep(parts: list[dict], wl: dict) -> dict:
    """One result for a sweep: sums of the counters, every request row, per-point summary."""
    first = parts[0]
    out = dict(first)
    out["notes"] = wl["notes"]
    out["config"] = dict(first["config"], sweep=wl["sweep_param"],
                         points=[p["point"] for p in parts])
    total, ceil, rows, points = Counter(), Counter(), [], []
    vcounts, vexamples, ext = Counter(), defaultdict(list), Counter()
    ext_examples, probe_errors, two_groups, steps = [], [], 0, 0
    seconds = Counter()
    for p in parts:
        total.update(p["overall"])
        ceil.update(p["ceiling"])
        steps += p["steps"]
        seconds.update(p["seconds"])
        for r in p["requests"]:
            rows.append(dict(r, point=p["point"]))
        v = p["violations"]
        vcounts.update(v["counts"])
        for k, ex in v["examples"].items():
            for e in ex:
                if len(vexamples[k]) < Checker.MAX_EXAMPLES:
                    vexamples[k].append(dict(e, point=p["point"]))
        two_groups += v["block_ids_in_two_groups"]
        e = p.get("external") or {}
        ext["allocations_with_external_tokens"] += e.get("allocations_with_external_tokens", 0)
        ext["trigger_held"] += e.get("trigger_held", 0)
        for x in e.get("trigger_examples", []):
            if len(ext_examples) < Checker.MAX_EXAMPLES:
                ext_examples.append(dict(x, point=p["point"]))
        probe_errors.extend(x for x in e.get("probe_errors", []) if x not in probe_errors)
        points.append(dict(point=p["point"], hits=p["overall"].get("hits", 0),
                           queries=p["overall"].get("queries", 0),
                           external_tokens=sum(r["external_tokens"] for r in p["requests"]),
                           trigger_held=e.get("trigger_held", 0),
                           block_ids_in_two_groups=v["block_ids_in_two_groups"]))
    out.update(overall=dict(total), ceiling=dict(ceil), requests=rows, steps=steps, points=points,
               seconds={k: round(v, 3) for k, v in seconds.items()},
               violations=dict(counts=dict(vcounts), examples=dict(vexamples),
                               block_ids_in_two_groups=two_groups,
                               full_checks=sum(p["violations"]["full_checks"] for p in parts),
                               free_queue_checked=first["violations"]["free_queue_checked"]),
               external=dict(ext, trigger_examples=ext_examples, probe_errors=probe_errors[:5]))
    return out


def run_one(wl: dict, scenario: str, variant: str, scale: float, seed: int, check_every: int = 1) -> dict:
    t_start = time.perf_counter()
    reqs = wl["requests"]
    align = hit_alignment(wl["groups"])
    ceil = ceilings(reqs, align)
    feats = Features()
    scheduler, block_hasher, vllm_config = build(wl, feats)
    from vllm.v1.outputs import ModelRunnerOutput
    try:
        from vllm.v1.outputs import DraftTokenIds
    except ImportError:  # pragma: no cover
        DraftTokenIds = None

    cfg = wl["config"]
    spec = cfg.get("spec")
    kvm = scheduler.kv_cache_manager
    checker = Checker(scheduler)
    probe = ExternalProbe(scheduler, checker) if cfg.get("connector") else None

    # Per-request attribution of vLLM's own counters: deltas around the calls
    # that record into kv_cache_manager.prefix_cache_stats.
    per_req: dict[str, dict] = defaultdict(lambda: dict(lookups=0, queries=0, hits=0,
                                                        preempted_queries=0, preempted_hits=0))

    def stats_tuple():
        s = kvm.prefix_cache_stats
        return (s.queries, s.hits, getattr(s, "preempted_queries", 0), getattr(s, "preempted_hits", 0))

    def attribute(name):
        orig = getattr(kvm, name, None)
        if orig is None:
            return
        def wrapper(request, *args, **kwargs):
            before = stats_tuple()
            result = orig(request, *args, **kwargs)
            after = stats_tuple()
            d = [y - x for x, y in zip(before, after)]
            if any(d):
                pr = per_req[request.request_id]
                if d[0] or d[1]:
                    pr["lookups"] += 1
                    pr["last_queries"], pr["last_hits"] = d[0], d[1]
                pr["queries"] += d[0]
                pr["hits"] += d[1]
                pr["preempted_queries"] += d[2]
                pr["preempted_hits"] += d[3]
            return result
        setattr(kvm, name, wrapper)

    attribute("get_computed_blocks")
    attribute("record_prefix_cache_stats")

    planned = {r["id"]: r["output"] for r in reqs}
    sampler = Sampler(planned, spec, seed)
    totals = Counter()
    conn_totals = Counter()
    eos = 2
    pending = list(range(len(reqs)))
    in_flight: set[str] = set()
    finished: dict[str, int] = {}
    submitted: dict[str, int] = {}
    admitted: dict[str, int] = {}
    ids = [r["id"] for r in reqs]
    step = 0
    t_loop = time.perf_counter()
    last_progress = t_loop
    conc = cfg["concurrency"]
    stall = 0

    while pending or in_flight:
        # Closed-loop client: keep `conc` requests outstanding, in order.
        while pending and len(in_flight) < conc:
            # The first request in order whose predecessor (same conversation) is done.
            for pos, i in enumerate(pending):
                dep = reqs[i]["after"]
                if dep is None or ids[dep] in finished:
                    break
            else:
                break
            pending.pop(pos)
            conn = REPLAY_STATE.get("connector")
            for seq in reqs[i].get("tier_adds", ()):
                if conn is not None:  # served elsewhere meanwhile: now in the shared tier
                    conn.store.update(_block_keys(seq, conn.align))
            scheduler.add_request(_make_request(reqs[i], block_hasher, eos))
            in_flight.add(ids[i])
            submitted[ids[i]] = step
        if not in_flight:
            raise RuntimeError("workload dependency deadlock")

        so = scheduler.schedule()
        step += 1
        sched_ids = list(so.num_scheduled_tokens.keys())
        if not sched_ids:
            stall += 1
            if stall > 1000:
                raise RuntimeError("scheduler made no progress for 1000 steps")
        else:
            stall = 0
        newly = [r.req_id for r in so.scheduled_new_reqs]
        for rid in newly:
            admitted.setdefault(rid, step)
        sampled = []
        spec_sched = getattr(so, "scheduled_spec_decode_tokens", {}) or {}
        for rid in sched_ids:
            req = scheduler.requests[rid]
            if req.num_computed_tokens >= req.num_tokens:
                sampled.append(sampler.sampled(req, spec_sched.get(rid, [])))
            else:
                sampled.append([])
        mro = ModelRunnerOutput(req_ids=sched_ids, req_id_to_index={r: i for i, r in enumerate(sched_ids)},
                                sampled_token_ids=sampled)
        outputs = scheduler.update_from_output(so, mro)
        for eco in (outputs or {}).values():
            st = getattr(eco, "scheduler_stats", None)
            if st is None:
                continue
            pcs = st.prefix_cache_stats
            if pcs is not None:
                totals["requests"] += pcs.requests
                totals["queries"] += pcs.queries
                totals["hits"] += pcs.hits
                totals["preempted_requests"] += getattr(pcs, "preempted_requests", 0)
                totals["preempted_queries"] += getattr(pcs, "preempted_queries", 0)
                totals["preempted_hits"] += getattr(pcs, "preempted_hits", 0)
            cpcs = getattr(st, "connector_prefix_cache_stats", None)
            if cpcs is not None:
                conn_totals["queries"] += cpcs.queries
                conn_totals["hits"] += cpcs.hits
        if spec and DraftTokenIds is not None:
            d_ids, d_tok = [], []
            for rid in sched_ids:
                req = scheduler.requests.get(rid)
                if req is None or req.is_finished():
                    continue
                d_ids.append(rid)
                d_tok.append(sampler.drafts(req))
            if d_ids:
                scheduler.update_draft_token_ids(DraftTokenIds(d_ids, d_tok))
        done_now = [rid for rid in list(in_flight) if rid not in scheduler.requests]
        for rid in done_now:
            in_flight.discard(rid)
            finished[rid] = step
        if step % check_every == 0 or newly or done_now:
            checker.light(step)
        if newly or done_now:
            checker.full(step)
        now = time.perf_counter()
        if now - last_progress > 2.0:
            last_progress = now
            _say(f"{scenario}{'/' + variant if variant else ''}: step {step}, "
                 f"{len(finished)}/{len(reqs)} requests done, {now - t_loop:.0f}s")
    # Final stats (anything recorded after the last update).
    tail = scheduler.make_stats() if hasattr(scheduler, "make_stats") else None
    if tail is not None and tail.prefix_cache_stats is not None:
        totals["requests"] += tail.prefix_cache_stats.requests
        totals["queries"] += tail.prefix_cache_stats.queries
        totals["hits"] += tail.prefix_cache_stats.hits
    checker.light(step)
    checker.full(step)
    t_end = time.perf_counter()

    rows = []
    for i, r in enumerate(reqs):
        pr = per_req.get(r["id"], {})
        offer = REPLAY_STATE["ext_offer"].get(r["id"])
        rows.append(dict(
            id=r["id"], label=r["label"], prompt_tokens=len(r["prompt"]), output_tokens=len(r["output"]),
            hit_tokens=pr.get("last_hits", 0), query_tokens=pr.get("last_queries", len(r["prompt"])),
            lookups=pr.get("lookups", 0), counted_queries=pr.get("queries", 0), counted_hits=pr.get("hits", 0),
            preempted_queries=pr.get("preempted_queries", 0), preempted_hits=pr.get("preempted_hits", 0),
            ceiling_tokens=ceil[i], external_tokens=offer[1] if offer else 0,
            submitted_step=submitted.get(r["id"]), admitted_step=admitted.get(r["id"]),
            finished_step=finished.get(r["id"]),
        ))
    attributed = Counter()
    for row in rows:
        attributed["queries"] += row["counted_queries"]
        attributed["hits"] += row["counted_hits"]
    if (attributed["queries"], attributed["hits"]) != (totals["queries"], totals["hits"]):
        checker._bad("stats_attribution_mismatch", step,
                     f"per-request {dict(attributed)} vs scheduler stats {dict(totals)}")
    result = dict(
        schema=SCHEMA, scenario=scenario, variant=variant, scale=scale, seed=seed,
        features=dict(feats), topology=wl["groups"], config={k: v for k, v in cfg.items()},
        hit_alignment=align, notes=wl["notes"],
        overall=dict(totals), connector=dict(conn_totals) if conn_totals else None,
        ceiling=dict(queries=sum(len(r["prompt"]) for r in reqs), hits=sum(ceil)),
        requests=rows, steps=step,
        spec=dict(drafted=sampler.drafted, accepted=sampler.accepted) if spec else None,
        violations=checker.result(), external=probe.result() if probe else None,
        seconds=dict(setup=round(t_loop - t_start, 3), replay=round(t_end - t_loop, 3),
                     total=round(t_end - t_start, 3)),
    )
    return result


def parse_runs(spec: str) -> list[tuple[str, str]]:
    """'all' or a comma list of NAME or NAME/VARIANT -> [(name, variant)]."""
    runs: list[tuple[str, str]] = []
    for item in [x.strip() for x in spec.split(",") if x.strip()]:
        if item == "all":
            runs.extend((n, v) for n, vs in SCENARIOS.items() for v in vs)
            continue
        name, _, variant = item.partition("/")
        if name not in SCENARIOS:
            raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
        if "/" in item:
            if variant not in SCENARIOS[name]:
                raise ValueError(f"scenario {name} has no variant {variant!r}")
            runs.append((name, variant))
        else:
            runs.extend((name, v) for v in SCENARIOS[name])
    out: list[tuple[str, str]] = []
    for r in runs:
        if r not in out:
            out.append(r)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="all", help="all, or a comma list of NAME[/VARIANT]")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-every", type=int, default=1)
    ap.add_argument("--out", help="write the JSON document here instead of stdout")
    ap.add_argument("--list", action="store_true", help="print the scenarios and their variants")
    args = ap.parse_args(argv)
    if args.list:
        print(json.dumps(SCENARIOS))
        return 0
    try:
        runs = parse_runs(args.scenario)
    except ValueError as exc:
        ap.error(str(exc))
    if not args.scale > 0:
        ap.error("--scale must be > 0")
    # vLLM logs to stdout by default: keep stdout for the JSON document only.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    os.environ.setdefault("VLLM_USAGE_STATS_DISABLED", "1")
    # Run from a vLLM tree root: that tree's `vllm/` is the one imported.
    sys.path.insert(0, os.getcwd())
    real_stdout, sys.stdout = sys.stdout, sys.stderr
    doc = dict(schema=SCHEMA, cwd=os.getcwd(), scale=args.scale, seed=args.seed, results=[], errors=[])
    t0 = time.perf_counter()
    try:
        for name, variant in runs:
            label = name + (f"/{variant}" if variant else "")
            _say(f"start {label} (scale {args.scale})")
            try:
                res = run(name, variant, args.scale, args.seed, args.check_every)
            except Exception as exc:  # report, keep going with the other scenarios
                import traceback
                doc["errors"].append(dict(scenario=name, variant=variant, error=f"{type(exc).__name__}: {exc}",
                                          traceback=traceback.format_exc(limit=8)))
                _say(f"error {label}: {type(exc).__name__}: {exc}")
                continue
            doc["results"].append(res)
            o = res["overall"]
            _say(f"done {label}: hit {o.get('hits', 0)}/{o.get('queries', 0)} tokens, "
                 f"{res['seconds']['replay']:.1f}s replay")
    finally:
        sys.stdout = real_stdout
    doc["seconds"] = round(time.perf_counter() - t0, 3)
    text = json.dumps(doc, sort_keys=True, default=str)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    else:
        real_stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
