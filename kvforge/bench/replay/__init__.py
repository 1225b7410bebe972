"""The prefix-cache replay: bug-report workloads through a vLLM tree's real scheduler.

Runs in two places, from these same files:

- in the target's test environment, as a subprocess started by kvforge.bench.prefix_cache with
  `python <this directory> ARGS` and cwd = the root of a vLLM source tree, so `import vllm` is that
  tree (base or patched). __main__.py loads this directory as the private package
  `kvforge_replay`, and kvforge cannot be imported there;
- in kvforge's own process, as `kvforge.bench.replay`, for the parts that need no vLLM
  (scenario names, workloads, ceilings).

Rules every module here keeps: import only the standard library, vLLM and torch; vLLM and torch
only inside functions; each other only by relative imports. A module that needs vLLM says so.

    topologies  the models' hybrid KV cache groups, and their vLLM specs
    workloads   the scenarios: seeded request streams and the scheduler config each asks for
    ceilings    what an unbounded prefix cache could serve each request (chained block keys)
    compat      keyword filtering and feature records across vLLM versions
    scheduler   vLLM's Scheduler and request block hasher, built as the engine core does   [vLLM]
    connector   the KV connector modelling an external KV tier (external-hit scenarios)   [vLLM]
    sampler     the synthetic model runner: planned tokens, drafts, acceptance
    stats       vLLM's own prefix-cache counters: run totals and per-request deltas
    invariants  the block-table checker (violations are results, never crashes)
    probe       the external-allocation probe (does issue #33775's trigger hold?)
    driver      steps one scenario to completion and assembles its result                 [vLLM]
    cli         the command line and the JSON document the parent reads
"""
