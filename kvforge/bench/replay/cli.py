"""Replay a prefix-cache workload through a vLLM tree's real scheduler.

    cd <vLLM tree> && python <kvforge>/bench/replay --scenario all|NAME[/VARIANT][,...] [--scale F] [--out FILE]
    python <kvforge>/bench/replay --list

No model, no GPU: the scheduler is stepped with synthetic model-runner outputs (chunked prefill,
sampled tokens, draft tokens plus acceptance for speculative decoding). Writes one JSON document
(--out, else stdout): {schema, cwd, scale, seed, results: [one per scenario run], errors: [one per
scenario that raised, with its traceback], seconds}; keys sorted. Progress lines ("replay: ...")
go to stderr, and so does everything vLLM prints: stdout carries the document only. A scenario
that raises is an error entry, and the others still run; the exit status is 0 unless the
arguments are bad. Owned by kvforge.bench.prefix_cache.run_replay, which reads the document.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

from .driver import SCHEMA, run, say
from .workloads import SCENARIOS, parse_runs


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
            run_case(doc, name, variant, lambda: run(name, variant, args.scale, args.seed, args.check_every))
    finally:
        sys.stdout = real_stdout
    return write_doc(doc, args.out, real_stdout, t0)


def run_case(doc: dict, scenario: str, variant: str, replay) -> None:
    """One case of a replay into `doc`: its result, or its error (reported; the other cases go on)."""
    label = scenario + (f"/{variant}" if variant else "")
    say(f"start {label} (scale {doc['scale']})")
    try:
        res = replay()
    except Exception as exc:
        doc["errors"].append(dict(scenario=scenario, variant=variant, error=f"{type(exc).__name__}: {exc}",
                                  traceback=traceback.format_exc(limit=8)))
        say(f"error {label}: {type(exc).__name__}: {exc}")
        return
    doc["results"].append(res)
    o = res["overall"]
    say(f"done {label}: hit {o.get('hits', 0)}/{o.get('queries', 0)} tokens, {res['seconds']['replay']:.1f}s replay")


def write_doc(doc: dict, out: str | None, stdout, t0: float) -> int:
    """Finish a replay's result document: its duration, then JSON to `out` or to the real stdout."""
    doc["seconds"] = round(time.perf_counter() - t0, 3)
    text = json.dumps(doc, sort_keys=True, default=str)
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    else:
        stdout.write(text + "\n")
    return 0
