"""One scenario through one tree's scheduler: the step loop, and the result it produces.

The loop is the engine core's, with a closed-loop client in front and a synthetic model runner
behind: submit (keeping `concurrency` requests outstanding), schedule, sample (sampler.py), update
from output, propose drafts (speculative decoding), check invariants. A sweep scenario replays
each point on a fresh scheduler and merges the points into one result.

Invariants: everything the result holds is a function of (workload, tree): no wall time except
under "seconds"; the same inputs step the scheduler identically. Needs vLLM (imported by
run_one and scheduler.build); merge_sweep is pure.
"""

from __future__ import annotations

import sys
import time
from collections import Counter, defaultdict

from . import connector, stats
from .ceilings import ceilings, lookahead_ceilings
from .compat import Features
from .invariants import MAX_EXAMPLES, Checker
from .probe import ExternalProbe
from .sampler import Sampler
from .scheduler import build, make_request
from .topologies import hit_alignment
from .workloads import workload

SCHEMA = 1  # of a result and of the replay's document (cli.py)
EOS = 2


def say(msg: str) -> None:
    """A progress line for the parent (prefix_cache.run_replay shows lines starting "replay: ")."""
    print(f"replay: {msg}", file=sys.stderr, flush=True)


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


class ClosedLoopClient:
    """Keeps `concurrency` requests outstanding, submitting in order the first request whose
    predecessor (`after`, same conversation) has finished; tracks submit and finish steps."""

    def __init__(self, reqs: list[dict], concurrency: int, block_hasher):
        self.reqs, self.concurrency, self.block_hasher = reqs, concurrency, block_hasher
        self.ids = [r["id"] for r in reqs]
        self.pending = list(range(len(reqs)))
        self.in_flight: set[str] = set()
        self.finished: dict[str, int] = {}
        self.submitted: dict[str, int] = {}

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.in_flight)

    def submit(self, scheduler, step: int) -> None:
        while self.pending and len(self.in_flight) < self.concurrency:
            for pos, i in enumerate(self.pending):
                dep = self.reqs[i]["after"]
                if dep is None or self.ids[dep] in self.finished:
                    break
            else:
                break
            self.pending.pop(pos)
            # Served elsewhere meanwhile: now in the shared tier.
            connector.add_to_tier(self.reqs[i].get("tier_adds", ()))
            scheduler.add_request(make_request(self.reqs[i], self.block_hasher, EOS))
            self.in_flight.add(self.ids[i])
            self.submitted[self.ids[i]] = step
        if not self.in_flight:
            raise RuntimeError("workload dependency deadlock")

    def collect(self, scheduler, step: int) -> list[str]:
        """Requests the scheduler no longer holds: finished at this step."""
        done_now = [rid for rid in list(self.in_flight) if rid not in scheduler.requests]
        for rid in done_now:
            self.in_flight.discard(rid)
            self.finished[rid] = step
        return done_now


def run_one(wl: dict, scenario: str, variant: str, scale: float, seed: int, check_every: int = 1) -> dict:
    """Replay one workload (or sweep point) on a fresh scheduler; return its result."""
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
    checker = Checker(scheduler)
    probe = ExternalProbe(scheduler) if cfg.get("connector") else None
    per_req = stats.attribute_per_request(scheduler.kv_cache_manager)
    sampler = Sampler({r["id"]: r["output"] for r in reqs}, spec, seed)
    totals: Counter[str] = Counter()
    conn_totals: Counter[str] = Counter()
    client = ClosedLoopClient(reqs, cfg["concurrency"], block_hasher)
    admitted: dict[str, int] = {}
    step = 0
    t_loop = time.perf_counter()
    last_progress = t_loop
    stall = 0

    while client.busy:
        client.submit(scheduler, step)
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
        stats.add_step_stats(scheduler.update_from_output(so, mro), totals, conn_totals)
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
        done_now = client.collect(scheduler, step)
        if step % check_every == 0 or newly or done_now:
            checker.light(step)
        if newly or done_now:
            checker.full(step)
        now = time.perf_counter()
        if now - last_progress > 2.0:
            last_progress = now
            say(f"{scenario}{'/' + variant if variant else ''}: step {step}, "
                f"{len(client.finished)}/{len(reqs)} requests done, {now - t_loop:.0f}s")
    stats.add_final_stats(scheduler, totals)
    checker.light(step)
    checker.full(step, whole=True)
    t_end = time.perf_counter()

    rows = []
    for i, r in enumerate(reqs):
        pr = per_req.get(r["id"], {})
        offer = connector.STATE.offers.get(r["id"])
        rows.append(dict(
            id=r["id"], label=r["label"], prompt_tokens=len(r["prompt"]), output_tokens=len(r["output"]),
            hit_tokens=pr.get("last_hits", 0), query_tokens=pr.get("last_queries", len(r["prompt"])),
            lookups=pr.get("lookups", 0), counted_queries=pr.get("queries", 0), counted_hits=pr.get("hits", 0),
            preempted_queries=pr.get("preempted_queries", 0), preempted_hits=pr.get("preempted_hits", 0),
            ceiling_tokens=ceil[i], external_tokens=offer[1] if offer else 0,
            submitted_step=client.submitted.get(r["id"]), admitted_step=admitted.get(r["id"]),
            finished_step=client.finished.get(r["id"]),
        ))
    attributed: Counter[str] = Counter()
    for row in rows:
        attributed["queries"] += row["counted_queries"]
        attributed["hits"] += row["counted_hits"]
    if (attributed["queries"], attributed["hits"]) != (totals["queries"], totals["hits"]):
        checker.record("stats_attribution_mismatch", step,
                       f"per-request {dict(attributed)} vs scheduler stats {dict(totals)}")
    return dict(
        schema=SCHEMA, scenario=scenario, variant=variant, scale=scale, seed=seed,
        features=dict(feats), topology=wl["groups"], config={k: v for k, v in cfg.items()},
        hit_alignment=align, notes=wl["notes"],
        overall=dict(totals), connector=dict(conn_totals) if conn_totals else None,
        ceiling=dict(queries=sum(len(r["prompt"]) for r in reqs), hits=sum(ceil)),
        # With a drafter: what the cache can serve when a block also needs the token after it.
        ceiling_lookahead=dict(hits=sum(lookahead_ceilings(reqs, align))) if spec else None,
        requests=rows, steps=step,
        spec=dict(drafted=sampler.drafted, accepted=sampler.accepted) if spec else None,
        violations=checker.result(), external=probe.result() if probe else None,
        seconds=dict(setup=round(t_loop - t_start, 3), replay=round(t_end - t_loop, 3),
                     total=round(t_end - t_start, 3)),
    )


def merge_sweep(parts: list[dict], wl: dict) -> dict:
    """One result for a sweep: sums of the counters, every request row, per-point summary."""
    first = parts[0]
    out = dict(first)
    out["notes"] = wl["notes"]
    out["config"] = dict(first["config"], sweep=wl["sweep_param"],
                         points=[p["point"] for p in parts])
    total: Counter[str] = Counter()
    ceil: Counter[str] = Counter()
    ceil_la: Counter[str] = Counter()
    rows: list[dict] = []
    points: list[dict] = []
    vcounts: Counter[str] = Counter()
    vexamples: defaultdict[str, list[dict]] = defaultdict(list)
    ext: Counter[str] = Counter()
    ext_examples: list[dict] = []
    probe_errors: list[str] = []
    two_groups = steps = 0
    seconds: Counter[str] = Counter()  # float seconds per phase
    for p in parts:
        total.update(p["overall"])
        ceil.update(p["ceiling"])
        ceil_la.update(p.get("ceiling_lookahead") or {})
        steps += p["steps"]
        seconds.update(p["seconds"])
        for r in p["requests"]:
            rows.append(dict(r, point=p["point"]))
        v = p["violations"]
        vcounts.update(v["counts"])
        for k, ex in v["examples"].items():
            for e in ex:
                if len(vexamples[k]) < MAX_EXAMPLES:
                    vexamples[k].append(dict(e, point=p["point"]))
        two_groups += v["block_ids_in_two_groups"]
        e = p.get("external") or {}
        ext["allocations_with_external_tokens"] += e.get("allocations_with_external_tokens", 0)
        ext["trigger_held"] += e.get("trigger_held", 0)
        for x in e.get("trigger_examples", []):
            if len(ext_examples) < MAX_EXAMPLES:
                ext_examples.append(dict(x, point=p["point"]))
        probe_errors.extend(x for x in e.get("probe_errors", []) if x not in probe_errors)
        points.append(dict(point=p["point"], hits=p["overall"].get("hits", 0),
                           queries=p["overall"].get("queries", 0),
                           external_tokens=sum(r["external_tokens"] for r in p["requests"]),
                           trigger_held=e.get("trigger_held", 0),
                           block_ids_in_two_groups=v["block_ids_in_two_groups"]))
    out.update(overall=dict(total), ceiling=dict(ceil), requests=rows, steps=steps, points=points,
               ceiling_lookahead=dict(ceil_la) if first.get("ceiling_lookahead") is not None else None,
               seconds={k: round(v, 3) for k, v in seconds.items()},
               violations=dict(counts=dict(vcounts), examples=dict(vexamples),
                               block_ids_in_two_groups=two_groups,
                               full_checks=sum(p["violations"]["full_checks"] for p in parts),
                               free_queue_checked=first["violations"]["free_queue_checked"]),
               external=dict(ext, trigger_examples=ext_examples, probe_errors=probe_errors[:5]))
    return out
