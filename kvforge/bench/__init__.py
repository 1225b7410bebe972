"""Benchmarks that replay workloads through a target's real vLLM code (base and patched trees)."""

DEFAULT_SCALE = 0.25  # `bench prefix-cache --scale`: all scenarios, base + patched, in ~1-2 min on 2 cores
