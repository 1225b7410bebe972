"""The commands that run a tree: env (its test environment), test, verify, bench prefix-cache and bench
scheduler-overhead. Each builds the Context and finishes the outcome of one library function, imported when
the command runs."""

from __future__ import annotations

from pathlib import Path

import click

from kvforge.bench import DEFAULT_SCALE as BENCH_DEFAULT_SCALE
from kvforge.core.cache import Cache
from kvforge.project.platforms import PLATFORMS
from kvforge.cli.finish import finish
from kvforge.cli.options import (EVERY_COMPONENT, base_json_cache, command, component_option, component_option_for,
                                 group, make_ctx, python_option, target_option, torch_index_option, tree_component,
                                 tree_options, with_cache)


@command("env")
@target_option
@component_option
@click.option("--rebuild", is_flag=True, help="Remove and rebuild the target's environment (or overlay).")
@click.option("--platform", "platform_name", type=click.Choice(list(PLATFORMS)), default="cpu",
              show_default=True, help="The platform whose environment to set up (cuda/npu need --python).")
@python_option
@torch_index_option
@base_json_cache
def env_cmd(cache: Cache, target_name: str, component: str | None, rebuild: bool, platform_name: str,
            python: Path | None,
            torch_index: str | None, source: str, repo_url: str | None, as_json: bool) -> None:
    """Build (once) the Python environment that runs the target's vLLM CPU tests.

    torch CPU (from --torch-index, PyTorch's CPU index, or pip's find-links), vLLM's import-time
    requirements with the base tree's own version specifiers, pytest, a CPU platform plugin and an
    offline HF cache; nothing is installed into your Python. Targets whose requirements agree share
    one environment. With --python, your interpreter is used and only what it lacks goes into an
    overlay in the cache.
    """
    from kvforge.env import venv

    ctx = make_ctx(cache, target_name, component, source=source, repo_url=repo_url, python=python,
                   torch_index=torch_index)
    finish(venv.env_command(ctx, rebuild=rebuild, platform=platform_name), as_json)


@command("test")
@target_option
@component_option_for(EVERY_COMPONENT)
@click.option("--platform", "platform_name", type=click.Choice(list(PLATFORMS)), default="cpu",
              show_default=True, help="Test selection to run (targets/*.toml components.tests).")
@click.option("--base/--patched", "on_base", default=False,
              help="Run on the base tree, or on the fully patched tree [default: --patched].")
@click.option("-k", "keyword", metavar="EXPR", help="Only tests matching this pytest -k expression.")
@click.option("--scan", is_flag=True, help="Run nothing: list the test modules that import a file the series "
              "touches and whether the CPU selection has each.")
@click.option("--try", "try_cpu", is_flag=True, help="With --scan: run the modules the selection lacks on the base "
              "tree to see which run on CPU (one of their tests passes).")
@tree_options
@with_cache
def test_cmd(cache: Cache, target_name: str, component: str | None, platform_name: str, on_base: bool,
             keyword: str | None, scan: bool, try_cpu: bool, from_rev: str | None, python: Path | None,
             torch_index: str | None, source: str, repo_url: str | None, as_json: bool) -> None:
    """Run the target's test selection plus every Checks test of its series with vLLM's own tests.

    pytest runs from the root of the base or patched tree in kvforge's test environment and
    writes JUnit XML (target, base commit, series hash and platform on every testcase) into the
    cache. Exit 4 when a test fails or none ran. A platform this machine does not have (cuda,
    npu) prints the command its runner would run and exits 7 (not run): never reported as passed.
    Without --component, every component of the target tested on the platform, in order; a
    component built on another (vllm-ascend) runs from its own tree with that one's patched tree
    importable and its declared stand-ins, which the output lists.
    """
    from kvforge.proof import selection
    from kvforge.proof import testrun

    component = tree_component(target_name, component, from_rev)
    ctx = make_ctx(cache, target_name, component, source=source, repo_url=repo_url, from_rev=from_rev,
                   python=python, torch_index=torch_index)
    finish(selection.scan_target(ctx, try_cpu) if scan or try_cpu
           else testrun.run_command(ctx, component, platform_name, on_base, keyword), as_json)


@command("verify")
@target_option
@component_option_for(EVERY_COMPONENT)
@tree_options
@with_cache
def verify_cmd(cache: Cache, target_name: str, component: str | None, from_rev: str | None, python: Path | None,
               torch_index: str | None, source: str, repo_url: str | None, as_json: bool) -> None:
    """Prove every patch: its Checks fail before it and pass after it; the suite passes at the end.

    With --from, each commit base..REV of your tree is proven instead of the series files. A fix
    whose Checks already pass before it (or that has none) is unproven. refactor and test patches
    are held to the regression suite only. The report is saved as JSON in the cache. Exit 0 only
    when everything is proven. Without --component, every component of the target, in order.
    """
    from kvforge.proof import verify

    component = tree_component(target_name, component, from_rev)
    ctx = make_ctx(cache, target_name, component, source=source, repo_url=repo_url, from_rev=from_rev,
                   python=python, torch_index=torch_index)
    finish(verify.verify_command(ctx, component), as_json)


@group("bench")
def bench_group() -> None:
    """Measure a target's base and patched trees by replaying workloads through vLLM's own code."""


@bench_group.command("prefix-cache")
@target_option
@component_option
@click.option("--scenario", "scenario_spec", default="all", show_default=True, metavar="NAME|all",
              help="dsv4-resend, dsv4-repeat, gemma4-dflash, gptoss-eagle, external-hit (NAME/VARIANT for one "
                   "variant, commas for several), or all.")
@click.option("--scale", type=float, default=BENCH_DEFAULT_SCALE, show_default=True,
              help="Shrink tokens, pool and step budget together (1 = the sizes of the bug reports).")
@click.option("--seed", type=int, default=0, show_default=True, help="Workload seed.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write a PNG of per-request hit rates, base vs patched (needs matplotlib: kvforge[plot]).")
@click.option("--num-blocks", "num_blocks", metavar="N[,N...]", default="",
              help="vllm-ascend: bound the KV pool to N blocks (one run per size; default: a pool the workload never "
                   "fills), as a deployment's memory bounds it.")
@click.option("--retention-interval", "retention_interval", type=click.IntRange(min=0), metavar="TOKENS",
              help="vllm-ascend: keep sliding-window blocks only at multiples of TOKENS (and the prompt's tail) "
                   "[default: the series' own default].")
@click.option("--seed-workload", is_flag=True,
              help="vllm-ascend: seed 001's own workload (32 requests in one wave, ~90%% of the prompt shared, "
                   "8,192 in, 1,024 out) beside the re-send workload.")
@tree_options
@with_cache
def bench_prefix_cache_cmd(cache: Cache, target_name: str, component: str | None, scenario_spec: str, scale: float,
                           seed: int, plot_path: Path | None, num_blocks: str, retention_interval: int | None,
                           seed_workload: bool, from_rev: str | None, python: Path | None,
                           torch_index: str | None, source: str, repo_url: str | None, as_json: bool) -> None:
    """Prefix-cache hit rates of the base and the patched tree, from vLLM's own counters.

    Each tree's real scheduler (built as vLLM's engine core builds it, with a hand-built hybrid
    KV cache config) replays the workloads of the bug reports with synthetic model outputs; the
    table shows vLLM's prefix-cache hit rate, the ceiling the workload allows, block-table
    invariant violations and wall time. Results are kept in the cache as JSON. The goals of the
    bug reports are checked on the patched tree and printed; they do not change the exit status.
    Exit 4 when a scenario could not run on a tree (its error is in the table).
    """
    from kvforge.bench import prefix_cache

    try:
        pools = tuple(int(n) for n in num_blocks.split(",") if n.strip())
    except ValueError:
        raise click.BadParameter(f"a comma-separated list of block counts, got {num_blocks!r}",
                                 param_hint="--num-blocks") from None
    if any(n <= 0 for n in pools):
        raise click.BadParameter(f"block counts must be > 0, got {num_blocks!r}", param_hint="--num-blocks")
    if plot_path is not None:
        prefix_cache.check_plot_available()
    component = tree_component(target_name, component, from_rev)
    ctx = make_ctx(cache, target_name, component, source=source, repo_url=repo_url, from_rev=from_rev,
                   python=python, torch_index=torch_index)
    finish(prefix_cache.bench_command(ctx, scenario_spec, scale, seed, plot_path, pools, retention_interval,
                                      seed_workload), as_json)


@bench_group.command("scheduler-overhead")
@target_option
@component_option
@click.option("--topology", "topologies", default="dsv4,gemma4", show_default=True, metavar="NAME[,NAME]",
              help="dsv4 and/or gemma4 (their KV cache groups and step budgets).")
@click.option("--workload", "kinds", default="unique,seed", show_default=True, metavar="KIND[,KIND]",
              help="unique (no prompt shares a block: prefix caching cannot change the work) and/or seed "
                   "(the bug reports' workloads).")
@click.option("--pools", default="50k,500k", show_default=True, metavar="N[,N]", help="KV cache pool sizes in blocks.")
@click.option("--scale", type=float, default=0.1, show_default=True,
              help="Shrink prompts and request counts (1 = the sizes of the bug reports); the step budget stays.")
@click.option("--steps", type=int, default=40, show_default=True, help="Scheduler steps per case and repetition.")
@click.option("--reps", type=int, default=3, show_default=True, help="Repetitions per case (fresh schedulers).")
@click.option("--seed", type=int, default=0, show_default=True, help="Workload seed.")
@click.option("--no-mask", "no_mask", is_flag=True, help="Skip the cache-mask timing and the per-group profile.")
@tree_options
@with_cache
def bench_scheduler_overhead_cmd(cache: Cache, target_name: str, component: str | None, topologies: str, kinds: str,
                                 pools: str, scale: float, steps: int, reps: int, seed: int, no_mask: bool,
                                 from_rev: str | None, python: Path | None, torch_index: str | None, source: str,
                                 repo_url: str | None, as_json: bool) -> None:
    """The scheduler's own time per step and per admitted request, base vs patched, in one run.

    Both trees' real vLLM schedulers (one process each, in the target's test environment) step the
    same workloads with synthetic model outputs; only schedule() and update_from_output() are
    timed, in CPU time. The trees take turns every few steps and alternate who goes first, and
    each step counts at its least time over the repetitions, so machine noise falls on neither.
    Prints us/step and us/request per topology x workload x pool with the ratio patched / base
    (and the range of the plain per-repetition ratios), the goal (ratio <= 1.05 where both trees
    did the same work), the sliding-window cache mask's cost per 4096-token chunk and a per-group
    profile. Results are kept in the cache as JSON. The goal does not change the exit status.
    """
    from kvforge.bench import overhead

    component = tree_component(target_name, component, from_rev)
    ctx = make_ctx(cache, target_name, component, source=source, repo_url=repo_url, from_rev=from_rev,
                   python=python, torch_index=torch_index)
    finish(overhead.bench_scheduler_overhead(ctx, topologies, kinds, pools, scale, steps, reps, seed, mask=not no_mask),
           as_json)


COMMANDS = [env_cmd, test_cmd, verify_cmd, bench_group]
