"""Hit rates from vLLM's own counters: PrefixCacheStats (what the "Prefix cache hit rate" log
line and the prefix_cache_hits/queries metrics show). Standard library only; works on vLLM objects.

Run totals are summed from the scheduler stats of each step's engine-core outputs, plus a final
make_stats(). Per-request numbers are deltas of kv_cache_manager.prefix_cache_stats around the
calls that record into it, attributed to the call's request; the driver checks that they add up
to the totals (stats_attribution_mismatch otherwise).
"""

from __future__ import annotations

from collections import Counter, defaultdict

RECORDING_CALLS = ("get_computed_blocks", "record_prefix_cache_stats")


def attribute_per_request(kvm) -> dict[str, dict]:
    """Wrap kvm's recording calls; return {request id: counters}, filled as the replay runs.

    Counters: lookups, queries, hits, preempted_queries, preempted_hits (summed over every
    lookup), and last_queries/last_hits (the latest lookup: the one that admitted the request).
    """
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

    for name in RECORDING_CALLS:
        attribute(name)
    return per_req


def add_step_stats(outputs, totals: Counter, conn_totals: Counter) -> None:
    """Add the prefix-cache (and connector prefix-cache) stats of one step's outputs."""
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


def add_final_stats(scheduler, totals: Counter) -> None:
    """Anything recorded after the last update (scheduler.make_stats(), where the tree has it)."""
    tail = scheduler.make_stats() if hasattr(scheduler, "make_stats") else None
    if tail is not None and tail.prefix_cache_stats is not None:
        totals["requests"] += tail.prefix_cache_stats.requests
        totals["queries"] += tail.prefix_cache_stats.queries
        totals["hits"] += tail.prefix_cache_stats.hits
