"""The models' hybrid KV cache layouts, as the scheduler sees them: one dict per KV cache group,
in group order.

    kind: full | mla | swa | swa_mla; block_size; head_size; num_kv_heads (default 1); dtype
    (a torch dtype name); window (swa kinds); layers (how many layers share the group);
    draft (the group exists only with the speculative-decoding draft model); MLA extras
    (cache_dtype_str, alignment, model_version, tokens_per_state) where the model has them.

The lists are data: workloads hand them to the driver, which never edits them. kv_cache_spec()
is the one place a group becomes a vLLM KVCacheSpec (vLLM passed in, not imported here).
"""

from __future__ import annotations

import math

from .compat import Features, accepts, kw

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


def kv_cache_spec(g: dict, torch, kvi, feats: Features):
    """Group dict -> this tree's KVCacheSpec (kvi: vllm.v1.kv_cache_interface)."""
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
            name = "tokens_per_state" if accepts(cls, "tokens_per_state") else "compress_ratio"
            extra[name] = g["tokens_per_state"]
            feats["mla_compression_field"] = name
        return cls(**common, **kw(cls, **extra))
    if kind == "swa_mla":
        cls = kvi.SlidingWindowMLASpec
        return cls(**common, sliding_window=g["window"], **kw(cls, **extra))
    raise ValueError(kind)
