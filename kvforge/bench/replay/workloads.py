"""The scenarios: seeded, pure-Python request streams from the bug reports, and the scheduler
configuration each one asks for.

workload(scenario, variant, scale, seed) returns {groups, config, requests, notes}, or for a sweep
{sweep: [one such dict per point, plus `point`], sweep_param, groups, notes}. A request is a dict:
id (unique, sortable in submission order), label, prompt (token ids), output (the planned tokens;
max_tokens = len(output)), after (index of a request that must finish before this one is
submitted, or None) and optionally tier_adds (token sequences that enter the external KV tier
just before it is submitted). config: num_blocks, max_num_batched_tokens, max_num_seqs,
concurrency (closed-loop client), max_model_len, spec (None or {method, k, accept}), and
connector ("tier") for the external-hit scenarios.

Invariants: the same (scenario, variant, scale, seed) gives the same workload in any process
(one random.Random per scenario and seed, consumed in a fixed order: changing the order of draws
changes every result); the workload owns its dicts and nothing downstream edits them.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

from .topologies import DSV4_GROUPS, EXTERNAL_GROUPS, GEMMA4_DFLASH_GROUPS, GPTOSS_GROUPS

SCENARIOS = {
    # name: variants (each variant is one replay and one row)
    "dsv4-resend": [""],
    "dsv4-repeat": [""],
    "gemma4-dflash": ["", "nospec"],
    "gptoss-eagle": ["", "nospec"],
    "external-hit": ["", "soak"],
}


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


def workload(scenario: str, variant: str, scale: float, seed: int = 0) -> dict:
    """Return {groups, config, requests, notes} for a scenario at a scale."""
    rng = random.Random(f"{scenario}:{seed}")
    build = _BUILDERS.get(scenario)
    if build is None:
        raise ValueError(f"unknown scenario {scenario!r}")
    wl = build(rng, variant, scale, seed)
    if "sweep" in wl:
        return wl
    for i, r in enumerate(wl["requests"]):
        r["id"] = f"{i:04d}-{r['label']}"
        r.setdefault("after", None)
    return wl


def random_tokens(rng: random.Random, n: int) -> list[int]:
    # Token ids well inside any vocabulary and away from special ids.
    return [rng.randrange(1000, 100_000) for _ in range(n)]


def scaled(n: float, scale: float, minimum: int = 1) -> int:
    return max(minimum, int(round(n * scale)))


def _chunk(tokens: int, scale: float, unit: int) -> int:
    """A scaled token budget per step, in whole `unit`s (at least one)."""
    return max(unit, unit * round(tokens * scale / unit))


def _dsv4_resend(rng: random.Random, variant: str, scale: float, seed: int) -> dict:
    # Seed 000: A, A, B, A of ~374k tokens; A and B share only the first
    # 256 tokens (the chat-template prelude). Sequential, max_tokens 3.
    shared = random_tokens(rng, 256)
    len_a, len_b = scaled(373_943, scale, 1024), scaled(378_175, scale, 1024)
    a = shared + random_tokens(rng, len_a - 256)
    b = shared + random_tokens(rng, len_b - 256)
    outs = [random_tokens(rng, 3) for _ in range(4)]
    reqs = [
        dict(label="A.1", prompt=a, output=outs[0]),
        dict(label="A.2", prompt=a, output=outs[1]),
        dict(label="B", prompt=b, output=outs[2]),
        dict(label="A.3", prompt=a, output=outs[3]),
    ]
    cfg = dict(num_blocks=scaled(54_774, scale, 64), max_num_batched_tokens=_chunk(4096, scale, 256),
               max_num_seqs=512, concurrency=1, max_model_len=1_048_576, spec=None)
    notes = ["sequential like the seed's client (each request after the previous finished)"]
    return dict(groups=DSV4_GROUPS, config=cfg, requests=reqs, notes=notes)


def _dsv4_repeat(rng: random.Random, variant: str, scale: float, seed: int) -> dict:
    # Seed 001's workload: 8K input x 1K output, 32 in flight, 90% of the
    # requests re-send an earlier prompt.
    conc, n = 32, 512
    in_len, out_len = scaled(8192, scale, 512), scaled(1024, scale, 8)
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
            reqs.append(dict(label=f"r{i}=p{p}", prompt=prompts[p], output=random_tokens(rng, out_len)))
        else:
            prompts.append(random_tokens(rng, in_len))
            first_sent.append(i)
            reqs.append(dict(label=f"r{i}:p{len(prompts) - 1}", prompt=prompts[-1],
                             output=random_tokens(rng, out_len)))
    cfg = dict(num_blocks=scaled(54_774, scale, 64), max_num_batched_tokens=_chunk(4096, scale, 256),
               max_num_seqs=512, concurrency=conc, max_model_len=1_048_576, spec=None)
    notes = [f"{n} requests, {len(prompts)} distinct prompts, "
             f"{sum(1 for r in reqs if '=' in r['label'])} re-sends"]
    return dict(groups=DSV4_GROUPS, config=cfg, requests=reqs, notes=notes)


def _gemma4_dflash(rng: random.Random, variant: str, scale: float, seed: int) -> dict:
    # Seed 002: gsm8k-style eval, every request shares a ~1.5k-token
    # few-shot prefix, then its own question; DFlash speculative decoding.
    n, conc = scaled(256, scale, 16), scaled(32, scale, 4)
    fewshot = random_tokens(rng, 1487)
    reqs = []
    for i in range(n):
        q = random_tokens(rng, rng.randint(40, 160))
        reqs.append(dict(label=f"q{i}", prompt=fewshot + q, output=random_tokens(rng, rng.randint(80, 256))))
    spec = None if variant == "nospec" else dict(method="dflash", k=8, accept=0.7)
    cfg = dict(num_blocks=scaled(16_384, scale, 2048), max_num_batched_tokens=8192,
               max_num_seqs=256, concurrency=conc, max_model_len=40_000, spec=spec)
    groups = GEMMA4_DFLASH_GROUPS if spec else [g for g in GEMMA4_DFLASH_GROUPS if not g.get("draft")]
    notes = ["spec decode off: no DFlash draft group, 2 KV groups" if not spec
             else "DFlash k=8, per-token acceptance 0.7"]
    return dict(groups=groups, config=cfg, requests=reqs, notes=notes)


def _gptoss_eagle(rng: random.Random, variant: str, scale: float, seed: int) -> dict:
    # Control: gpt-oss (full + SWA 128) with EAGLE3, multi-turn chats that
    # share a system prompt; each turn re-sends the whole conversation.
    convs, turns, conc = scaled(48, scale, 4), 4, scaled(32, scale, 4)
    system = random_tokens(rng, 1200)
    history = [list(system) for _ in range(convs)]
    reqs = []
    last_of: dict[int, int] = {}
    for t in range(turns):
        for c in range(convs):
            prompt = history[c] + random_tokens(rng, rng.randint(50, 300))
            out = random_tokens(rng, rng.randint(100, 400))
            reqs.append(dict(label=f"c{c}t{t}", prompt=prompt, output=out, after=last_of.get(c)))
            last_of[c] = len(reqs) - 1
            history[c] = prompt + out
    # nospec: the same requests without speculative decoding (the rate EAGLE3 should reach).
    spec = None if variant == "nospec" else dict(method="eagle3", k=3, accept=0.7)
    cfg = dict(num_blocks=scaled(16_384, scale, 2048), max_num_batched_tokens=8192,
               max_num_seqs=256, concurrency=conc, max_model_len=131_072, spec=spec)
    notes = [("spec decode off" if spec is None else "EAGLE3 k=3, per-token acceptance 0.7")
             + "; turn t+1 re-sends turn t's prompt and answer"]
    return dict(groups=GPTOSS_GROUPS, config=cfg, requests=reqs, notes=notes)


def _external_hit(rng: random.Random, variant: str, scale: float, seed: int) -> dict:
    if variant == "":
        return _external_hit_sweep(rng, scale, seed)
    if variant == "soak":
        return _external_hit_soak(rng, scale)
    raise ValueError("unknown scenario 'external-hit'")


def _external_hit_sweep(rng: random.Random, scale: float, seed: int) -> dict:
    # Seed 003 / issue #43884 (fixed upstream by #44409): a local prefix hit
    # plus external (connector) tokens on 1 full + 2 SWA groups, with the
    # local-hit blocks near the head of the free queue. In a steady soak that
    # state is rare (see the "soak" variant), so this sweeps it: turn 1 of a
    # chat runs and finishes; then a concurrent request of growing size takes
    # blocks from the head of the free queue (the KV pressure of the moment)
    # while turn 3 arrives, finding turn 1 locally and turn 2 (served by
    # another instance) in the shared KV tier. One fresh scheduler per point.
    system = random_tokens(rng, 1000)
    user1, out1 = random_tokens(rng, 200), random_tokens(rng, 100)
    user2, out2 = random_tokens(rng, 150), random_tokens(rng, 200)
    user3, out3 = random_tokens(rng, 100), random_tokens(rng, 32)
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
        filler = random_tokens(random.Random(f"filler:{seed}:{size}"), size)
        reqs: list[dict[str, Any]] = [
            dict(label="turn1", prompt=turn1, output=out1),
            dict(label="load", prompt=filler, output=random_tokens(rng, 16), after=0),
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


def _external_hit_soak(rng: random.Random, scale: float) -> dict:
    # Seed 003 / issue #43884: a local prefix hit plus external (connector)
    # tokens on 1 full + 2 SWA groups (Gemma-style window 1024), MTP k=3.
    # Two instances behind a round-robin router share a KV tier (an
    # offload/LMCache-style store that keeps every block once computed);
    # multi-turn chats alternate between them. We replay instance B: its
    # turn t+2 finds turn t in its local prefix cache and turn t+1, served
    # by instance A, in the shared tier (external tokens).
    convs, turns, conc = scaled(96, scale, 8), 8, scaled(32, scale, 4)
    system = random_tokens(rng, 1000)
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
        prompt = history[c] + random_tokens(rng, rng.randint(50, 300))
        out = random_tokens(rng, rng.randint(64, 256))
        history[c] = prompt + out
        if (c + t) % 2 == 0:  # served by instance A: its KV lands in the shared tier
            pending_tier[c].append(prompt + out[:-1])
            continue
        reqs.append(dict(label=f"c{c}t{t}", prompt=prompt, output=out, after=last_of.get(c),
                         tier_adds=pending_tier.pop(c, [])))
        last_of[c] = len(reqs) - 1
    cfg = dict(num_blocks=scaled(12_288, scale, 1536), max_num_batched_tokens=4096,
               max_num_seqs=256, concurrency=conc, max_model_len=32_768,
               spec=dict(method="mtp", k=3, accept=0.7), connector="tier")
    notes = ["instance B of two sharing a KV tier; connector: synchronous loads from the tier, "
             "which stores each block once computed; MTP k=3, per-token acceptance 0.7"]
    return dict(groups=EXTERNAL_GROUPS, config=cfg, requests=reqs, notes=notes)


_BUILDERS = {
    "dsv4-resend": _dsv4_resend,
    "dsv4-repeat": _dsv4_repeat,
    "gemma4-dflash": _gemma4_dflash,
    "gptoss-eagle": _gptoss_eagle,
    "external-hit": _external_hit,
}
