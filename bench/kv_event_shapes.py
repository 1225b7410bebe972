#!/usr/bin/env python3
"""Benchmark: BlockStored event shapes for hybrid models, as KV-aware routers decode them.

Drives vLLM's real Scheduler (KVCacheManager, BlockPool, the series' cache mask and retention)
from the tree given with --tree, built by kvforge's own replay (kvforge/bench/replay: the hybrid
KV cache groups of DeepSeek-V4, Gemma4 and gpt-oss, block sizes resolved by vLLM's helpers, the
engine core's request block hasher), with one long prompt per model, and compares three shapes of
the same stored blocks:

- per-run:  one BlockStored per run of consecutive stored blocks (kvforge's kv-events-token-ids,
            the tree's own events: the tree must carry that patch);
- base:     one BlockStored per cache_full_blocks call, block_hashes of the stored blocks only,
            token_ids over every block of the call (unpatched vLLM: issue #44451);
- offsets:  upstream PR #44488 (open): `base` plus `block_offsets` (block_offsets[i] = the chunk of
            token_ids that block_hashes[i] covers; None when the call stored every block), appended
            as the last BlockStored field (on v0.20 right after group_idx).

`base` and `offsets` are built per cache_full_blocks call from the same call's real per-run events
(their hashes, extra_keys and other fields), the call's block range and the request's tokens. A
call that stores nothing gives `base` an event with no hash (as unpatched vLLM does); `offsets`
is assumed to keep it (block_offsets=[]): the PR's text does not say otherwise.

Each shape's stream (one KVEventBatch per scheduler step, encoded with msgspec's msgpack Encoder
as vLLM's ZMQ publisher does) is decoded by three consumers, and what each learns is checked
against the request's true block hashes (stored blocks only):

- without block_offsets: decodes the raw msgpack as NVIDIA Dynamo's and llm-d's vLLM decoders do
  (by position for vLLM before #42892, e.g. 0.20.x; by field name after it, e.g. 0.33.0; unknown
  fields ignored), pairs block_hashes[i] with token_ids[i*bs:(i+1)*bs] and chains block i to
  block i-1 (the first to parent_block_hash);
- strict: the same, but drops an event whose token_ids are not len(block_hashes)*bs long (the
  check smg-project/smg#2495 added for issue #44451);
- block_offsets-aware: a typed msgspec decoder of this tree's schema plus block_offsets, pairing
  through block_offsets when present (a block whose previous chunk has no hash gets no parent
  link). On a positional wire format it is told the field's position.

Usage (from anywhere; the tree must be a patched vLLM tree, e.g. `kvforge apply -t v0.20.2rc
--component vllm --into DIR`, run with that target's environment, `kvforge env -t v0.20.2rc`;
`--models dsv4` is the smallest run, ~30 s, as tests/test_bench_scripts.py runs it):

    HF_HOME=HF HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu PY bench/kv_event_shapes.py --tree DIR

(PY and HF: `python` and `hf_home` of `kvforge env -t TARGET --json`.) The tree's own prefix-cache
retention setting applies; the v0.20 series reads a retention interval of 0 from
VLLM_PREFIX_CACHE_RETENTION_INTERVAL=0 (upstream's CacheConfig default), which masks far more.
"""

import argparse
import importlib
import importlib.util
import os
import random
import sys
import time
from pathlib import Path
from typing import Union

ROOT = Path(__file__).resolve().parent.parent
REPLAY = ROOT / "kvforge" / "bench" / "replay"

MODELS = {
    # name: (topology name, prompt tokens, max_num_batched_tokens); configs of workloads.py
    "dsv4": ("DSV4_GROUPS", 32_768, 4096),
    "gemma4": ("GEMMA4_DFLASH_GROUPS", 32_768, 8192),
    "gptoss": ("GPTOSS_GROUPS", 32_768, 8192),
}
UNKNOWN = object()  # a parent link a consumer cannot make


def load_replay():
    """kvforge's replay package under its private name, as kvforge runs it (no kvforge import)."""
    spec = importlib.util.spec_from_file_location("kvforge_replay", REPLAY / "__init__.py",
                                                  submodule_search_locations=[str(REPLAY)])
    pkg = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = pkg
    spec.loader.exec_module(pkg)
    return (importlib.import_module("kvforge_replay.scheduler"),
            importlib.import_module("kvforge_replay.topologies"),
            importlib.import_module("kvforge_replay.compat"))


def tree_schema_with_offsets():
    """This tree's BlockStored with #44488's block_offsets appended (same wire tag)."""
    import msgspec
    from vllm.distributed import kv_events as ke

    class BlockStoredOffsets(ke.BlockStored, tag="BlockStored"):
        block_offsets: Union[list[int], None] = None

        def __hash__(self) -> int:  # the aggregator hashes events
            return hash((super().__hash__(), tuple(self.block_offsets or ())))

    class Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Union[BlockStoredOffsets, ke.BlockRemoved, ke.AllBlocksCleared]]
        data_parallel_rank: Union[int, None] = None

    return BlockStoredOffsets, Batch


class Recorder:
    """Stands in for the scheduler's KV event publisher: keeps each step's batch."""

    def __init__(self):
        self.batches = []
        self.step = 0

    def publish(self, batch) -> None:
        self.batches.append((self.step, batch))

    def shutdown(self) -> None:
        pass


def run_model(name: str, sched_mod, topo, compat, seed: int) -> dict:
    """One prompt through the tree's Scheduler; the calls to cache_full_blocks and the events."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.outputs import ModelRunnerOutput

    topo_name, n_tokens, chunk = MODELS[name]
    groups = getattr(topo, topo_name)
    groups = [g for g in groups if not g.get("draft")]
    wl = dict(groups=groups, config=dict(num_blocks=200_000, max_num_batched_tokens=chunk, max_num_seqs=8,
                                         concurrency=1, max_model_len=40_000, spec=None))
    feats = compat.Features()
    sched, hasher, _ = sched_mod.build(wl, feats)
    mgr = sched.kv_cache_manager
    # The engine builds the pools with enable_kv_cache_events from KVEventsConfig; the replay's
    # build has no KV-events option, so set the same flags before the first request.
    pools = {id(m.block_pool): m.block_pool for m in mgr.coordinator.single_type_managers}
    for pool in pools.values():
        pool.enable_kv_cache_events = True
    mgr.enable_kv_cache_events = True
    sched.kv_event_publisher = rec = Recorder()

    calls = []
    step = [0]
    orig = BlockPool.cache_full_blocks

    def wrapped(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                kv_cache_group_id, *args, **kwargs):
        before = len(self.kv_event_queue)
        orig(self, request, blocks, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id,
             *args, **kwargs)
        new = self.kv_event_queue[before:]
        calls.append(dict(step=step[0], group=kv_cache_group_id, c=num_cached_blocks, f=num_full_blocks,
                          bs=block_size, request=request, events=list(new)))

    BlockPool.cache_full_blocks = wrapped
    try:
        rng = random.Random(seed)
        prompt = [rng.randrange(1000, 100_000) for _ in range(n_tokens)]
        r = dict(id=f"{name}-0", prompt=prompt, output=[7])
        sched.add_request(sched_mod.make_request(r, hasher, 2))
        req = sched.requests[r["id"]]
        while sched.requests:
            so = sched.schedule()
            ids = list(so.num_scheduled_tokens.keys())
            sampled = [[7] if sched.requests[i].num_computed_tokens >= sched.requests[i].num_tokens else []
                       for i in ids]
            mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={i: k for k, i in enumerate(ids)},
                                    sampled_token_ids=sampled)
            sched.update_from_output(so, mro)
            step[0] += 1
            rec.step = step[0]
    finally:
        BlockPool.cache_full_blocks = orig
    return dict(name=name, groups=groups, feats=feats, calls=calls, batches=rec.batches, request=req,
                hash_block_size=feats.get("hash_block_size"), steps=step[0])


def truth_hashes(req, hash_bs: int, bs: int) -> list:
    """The request's true block hashes at block size bs, as events carry them."""
    from vllm.v1.core import kv_cache_utils as kcu

    hashes = req.block_hashes if bs == hash_bs else kcu.BlockHashListWithBlockSize(req.block_hashes, hash_bs, bs)
    return [kcu.maybe_convert_block_hash(hashes[i]) for i in range(len(hashes))]


def build_shapes(run: dict, offsets_cls, truth) -> dict[str, list[tuple[int, list]]]:
    """Per shape, [(step, [events])]: per-run (the tree's own stream), base and offsets (each
    cache_full_blocks call's events replaced by the call's emulated event; other events, e.g. the
    partial prefix entries of vLLM 0.33, kept as they are)."""
    import msgspec

    req = run["request"]
    toks = list(req.all_token_ids)
    template = {}
    owner = {}
    for k, call in enumerate(run["calls"]):
        for ev in call["events"]:
            if len(ev.token_ids) != len(ev.block_hashes) * ev.block_size:
                raise SystemExit("this tree emits sparse BlockStored events: run on a tree with "
                                 "kvforge's kv-events-token-ids patch")
            template.setdefault(call["group"], ev)
            owner[id(ev)] = k
    any_template = next(iter(template.values()))
    emulated = {"base": [], "offsets": []}
    for call in run["calls"]:
        g, c, f, bs = call["group"], call["c"], call["f"], call["bs"]
        index = {h: i for i, h in enumerate(truth(bs))}
        evs = call["events"]
        stored = [index[h] for ev in evs for h in ev.block_hashes]
        hashes = [h for ev in evs for h in ev.block_hashes]
        extra = [k for ev in evs for k in (ev.extra_keys or [None] * len(ev.block_hashes))]
        tmpl = template.get(g, any_template)
        fields = dict(block_hashes=hashes, parent_block_hash=None if c == 0 else truth(bs)[c - 1],
                      token_ids=toks[c * bs:f * bs], block_size=bs,
                      extra_keys=extra if extra else None, group_idx=g)
        if getattr(tmpl, "lookahead_token_ids", None) is not None:
            fields["lookahead_token_ids"] = [x for ev in evs for x in (ev.lookahead_token_ids or [])]
        base = msgspec.structs.replace(tmpl, **fields)
        emulated["base"].append(base)
        dense = stored == list(range(c, f))
        emulated["offsets"].append(offsets_cls(**{k: getattr(base, k) for k in base.__struct_fields__},
                                               block_offsets=None if dense else [i - c for i in stored]))
    shapes = {"per-run": [], "base": [], "offsets": []}
    for step, batch in run["batches"]:
        real = [e for e in batch.events if hasattr(e, "token_ids")]
        shapes["per-run"].append((step, real))
        for name in ("base", "offsets"):
            out, done = [], set()
            for e in real:
                k = owner.get(id(e))
                if k is None:
                    out.append(e)
                elif k not in done:
                    done.add(k)
                    out.append(emulated[name][k])
            # Calls that stored nothing have no event in the tree's stream.
            out += [emulated[name][k] for k, call in enumerate(run["calls"])
                    if call["step"] == step and not call["events"]]
            shapes[name].append((step, out))
    return shapes


def encode(stream, batch_cls) -> list[bytes]:
    import msgspec

    enc = msgspec.msgpack.Encoder()
    return [enc.encode(batch_cls(ts=float(step), events=evs)) for step, evs in stream]


def learn_positional(payloads: list[bytes], strict: bool) -> tuple[list, int]:
    """What a consumer that does not know block_offsets learns: [(group, hash, tokens, parent)],
    and how many events it dropped."""
    import msgspec

    facts, dropped = [], 0
    for p in payloads:
        _ts, events = msgspec.msgpack.decode(p)[:2]
        for e in events:
            if isinstance(e, dict):  # named fields (vLLM >= #42892)
                if e["type"] != "BlockStored":
                    continue
                hashes, parent, tokens, bs = (e["block_hashes"], e["parent_block_hash"], e["token_ids"],
                                              e["block_size"])
                group = e.get("group_idx")
            else:  # positional array (vLLM before #42892, e.g. 0.20.x)
                if e[0] != "BlockStored":
                    continue
                hashes, parent, tokens, bs = e[1], e[2], e[3], e[4]
                group = e[9] if len(e) > 9 else None
            if strict and len(tokens) != len(hashes) * bs:
                dropped += 1
                continue
            prev = parent
            for i, h in enumerate(hashes):
                facts.append((group, h, tokens[i * bs:(i + 1) * bs], prev, bs))
                prev = h
    return facts, dropped


def learn_offsets(payloads: list[bytes], batch_cls) -> tuple[list, int]:
    """What a typed decoder that knows block_offsets learns; batches it cannot decode."""
    import msgspec

    dec = msgspec.msgpack.Decoder(type=batch_cls)
    facts, rejected = [], 0
    for p in payloads:
        try:
            batch = dec.decode(p)
        except msgspec.ValidationError:
            rejected += 1
            continue
        for e in batch.events:
            if not hasattr(e, "token_ids"):
                continue
            bs = e.block_size
            offs = e.block_offsets if e.block_offsets is not None else list(range(len(e.block_hashes)))
            at = dict(zip(offs, e.block_hashes))
            for h, k in zip(e.block_hashes, offs):
                parent = e.parent_block_hash if k == 0 else at.get(k - 1, UNKNOWN)
                facts.append((e.group_idx, h, e.token_ids[k * bs:(k + 1) * bs], parent, bs))
    return facts, rejected


def judge(facts: list, truth, toks: list, stored: set) -> dict:
    """Check learned (group, hash, tokens, parent, block size) facts against the true chain."""
    ok = wrong_tokens = wrong_parent = no_parent = 0
    seen = set()
    for group, h, tokens, parent, bs in facts:
        hashes = truth(bs)
        i = hashes.index(h)
        seen.add((group, bs, i))
        good_tokens = list(tokens) == toks[i * bs:(i + 1) * bs]
        good_parent = parent is UNKNOWN or parent == (hashes[i - 1] if i else None)
        wrong_tokens += not good_tokens
        wrong_parent += not good_parent
        no_parent += parent is UNKNOWN
        ok += good_tokens and good_parent
    return dict(ok=ok, wrong_tokens=wrong_tokens, wrong_parent=wrong_parent, no_parent=no_parent,
                missing=len(stored - seen))


def verdict(j: dict, extra: str = "") -> str:
    good = j["wrong_tokens"] == 0 and j["wrong_parent"] == 0
    s = f"{'yes' if good else 'NO'}: {j['ok']} ok"
    if j["wrong_tokens"] or j["wrong_parent"]:
        s += f", {j['wrong_tokens']} wrong tokens, {j['wrong_parent']} wrong parent"
    if j["no_parent"]:
        s += f" ({j['no_parent']} without parent link)"
    if j["missing"]:
        s += f", {j['missing']} lost"
    return s + extra


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for n, r in enumerate(rows):
        out.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
        if n == 0:
            out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=".", help="a vLLM tree with kvforge's kv-events-token-ids (default: .)")
    ap.add_argument("--models", default="dsv4,gemma4,gptoss")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tree = Path(args.tree).resolve()
    sys.path.insert(0, str(tree))
    # vLLM inspects the model config in a subprocess, which must import the same tree.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(tree)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    os.chdir(tree)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    sched_mod, topo, compat = load_replay()
    import vllm
    from vllm.distributed import kv_events as ke

    offsets_cls, offsets_batch = tree_schema_with_offsets()
    encoding = "positional arrays" if ke.BlockStored.__struct_config__.array_like else "named fields"
    print(f"vLLM {vllm.__version__} from {Path(vllm.__file__).parent.parent}")
    print(f"events are encoded as {encoding}")
    rows = [["model", "shape", "events", "msgpack bytes", "token ids", "consumer without block_offsets",
             "strict consumer (smg)", "block_offsets-aware consumer"]]
    for name in args.models.split(","):
        t0 = time.perf_counter()
        run = run_model(name, sched_mod, topo, compat, args.seed)
        cache: dict[int, list] = {}

        def truth(bs: int, run=run, cache=cache) -> list:
            if bs not in cache:
                cache[bs] = truth_hashes(run["request"], run["hash_block_size"], bs)
            return cache[bs]

        shapes = build_shapes(run, offsets_cls, truth)
        toks = list(run["request"].all_token_ids)
        real = [e for _, b in run["batches"] for e in b.events if isinstance(e, ke.BlockStored)]
        stored = {(e.group_idx, e.block_size, truth(e.block_size).index(h)) for e in real
                  for h in e.block_hashes}
        recorded = {id(e) for c in run["calls"] for e in c["events"]}
        assert recorded <= {id(e) for e in real}, "a cache_full_blocks event was not published"
        print(f"{name}: {len(toks)}-token prompt, groups (block size): "
              f"{', '.join(str(g['block_size']) for g in run['groups'])}, hash block {run['hash_block_size']}, "
              f"{run['steps']} steps, {len(run['calls'])} cache_full_blocks calls, {len(stored)} blocks stored "
              f"({len(real) - len(recorded)} events from elsewhere) "
              f"({time.perf_counter() - t0:.1f}s)")
        for shape in ("base", "per-run", "offsets"):
            stream = shapes[shape]
            batch_cls = offsets_batch if shape == "offsets" else ke.KVEventBatch
            payloads = encode(stream, batch_cls)
            events = [e for _, evs in stream for e in evs]
            pos, _ = learn_positional(payloads, strict=False)
            strict, dropped = learn_positional(payloads, strict=True)
            aware, rej = learn_offsets(payloads, offsets_batch)
            empty = sum(1 for e in events if not e.block_hashes)
            rows.append([
                name, shape + (" (ours)" if shape == "per-run" else " (#44488)" if shape == "offsets"
                               else " (unpatched)"),
                f"{len(events)}" + (f" ({empty} empty)" if empty else ""),
                f"{sum(map(len, payloads)):,}", f"{sum(len(e.token_ids) for e in events):,}",
                verdict(judge(pos, truth, toks, stored)),
                verdict(judge(strict, truth, toks, stored), f"; {dropped} events dropped" if dropped else ""),
                verdict(judge(aware, truth, toks, stored)) if not rej else f"NO: {rej} batches rejected",
            ])
    print()
    print(table(rows))
    print("\nok = stored blocks learned with their own tokens and a right (or no) parent link; "
          "lost = stored blocks the consumer never learns.")
    if encoding == "positional arrays":
        print("block_offsets on this wire format is position-only: the aware consumer above is told its "
              "position (right after the tree's last field); no upstream release defines that position.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
