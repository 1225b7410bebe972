"""The `kvforge` command line: parse options, call one module, print its result. No logic lives here."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import click

from . import __version__
from .bench import DEFAULT_SCALE as BENCH_DEFAULT_SCALE
from .cache import Cache
from .errors import EXIT_TESTS, KvforgeError
from .report import emit_json, table


def progress(msg: str) -> None:
    click.echo(f"kvforge: {msg}", err=True)


def handle_errors(fn):
    """Turn KvforgeError into one line on stderr and its exit code: no tracebacks for user errors."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KvforgeError as exc:
            click.echo(f"kvforge: error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("kvforge: interrupted", err=True)
            sys.exit(130)

    return wrapper


target_option = click.option("--target", "-t", "target_name", required=True, metavar="NAME",
                             help="Release target (a file in targets/, e.g. v0.20.2rc).")
json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON on stdout.")
source_option = click.option("--source", type=click.Choice(["auto", "git", "sdist"]), default="auto",
                             show_default=True,
                             help="Where the base comes from: auto uses a cached base, else --repo or a reachable "
                                  "upstream, else the PyPI sdist (offline-capable).")
repo_option = click.option("--repo", "repo_url", metavar="URL|DIR",
                           help="Git remote or local clone to take the base ref from (implies --source git).")
component_option = click.option("--component", metavar="NAME", help="Component of the target (default: the first).")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvforge")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), envvar="KVFORGE_CACHE",
              help="Cache for bases, trees and environments [env KVFORGE_CACHE; default ~/.cache/kvforge].")
@click.pass_context
def main(ctx: click.Context, cache_dir: Path | None) -> None:
    """Carry, prove and measure downstream patch series for vLLM's hybrid KV-cache manager.

    \b
    Typical day:
      kvforge status                      fixes x targets, with upstream status
      kvforge lint                        check every series and patch header
      kvforge apply --target v0.20.2rc    base + series as commits in a worktree
      kvforge verify --target v0.20.2rc   prove each patch with vLLM's own tests

    Exit codes: 0 ok, 1 lint problems, 2 bad input, 3 a patch does not apply,
    4 tests/verify failed, 5 environment problem, 6 network/download problem.
    """
    ctx.obj = Cache(cache_dir)


@main.command("targets")
@json_option
@click.pass_obj
@handle_errors
def targets_cmd(cache: Cache, as_json: bool) -> None:
    """List the release targets and their components."""
    from .targets import load_all

    rows = []
    for t in load_all():
        for c in t.components:
            rows.append({"target": t.name, "component": c.name, "ref": c.ref,
                         "release": f"{c.release.package}=={c.release.version}",
                         "series": str(c.series_dir.relative_to(t.path.parent.parent)),
                         "platforms": list(c.platforms), "description": t.description})
    if as_json:
        emit_json(rows)
        return
    click.echo(table(["target", "component", "upstream ref", "offline source", "series", "platforms"],
                     [[r["target"], r["component"], r["ref"], r["release"], r["series"], ",".join(r["platforms"])]
                      for r in rows]))


@main.command("base")
@target_option
@component_option
@source_option
@repo_option
@json_option
@click.pass_obj
@handle_errors
def base_cmd(cache: Cache, target_name: str, component: str | None, source: str, repo_url: str | None,
             as_json: bool) -> None:
    """Materialise a target's base (upstream release) as a commit in the cache.

    From a git remote or clone when given or reachable; otherwise the PyPI sdist, verified against
    the sha256 pinned in the target file and imported with a fixed author and date, so the commit
    id is the same on every machine. A cached base costs no network.
    """
    from .bases import ensure_base
    from .targets import load_target

    target = load_target(target_name)
    base = ensure_base(target.component(component), cache, source, repo_url, progress)
    data = {"target": target.name, "component": base.component, "ref": base.ref, "commit": base.commit,
            "source": base.source, "origin": base.origin, "repo": str(base.repo), "cached": base.cached,
            "seconds": round(base.seconds, 3)}
    if as_json:
        emit_json(data)
    else:
        how = "cached" if base.cached else f"imported in {base.seconds:.1f}s"
        click.echo(f"{target.name}/{base.component}: {base.ref} = {base.commit} ({base.source}: {base.origin}; {how})")
        click.echo(f"repository: {base.repo}")


@main.command("apply")
@target_option
@component_option
@click.option("--into", type=click.Path(file_okay=False, path_type=Path),
              help="Directory for the worktree [default: <cache>/trees/<target>].")
@click.option("--branch", help="Branch to create [default: kvforge/<target>].")
@click.option("--keep-conflict", is_flag=True,
              help="On failure, leave the worktree at the failing patch with conflict markers.")
@source_option
@repo_option
@json_option
@click.pass_obj
@handle_errors
def apply_cmd(cache: Cache, target_name: str, component: str | None, into: Path | None, branch: str | None,
              keep_conflict: bool, source: str, repo_url: str | None, as_json: bool) -> None:
    """Apply a target's series to its base: one commit per patch, on a new branch in a worktree.

    Transactional: the series is applied in a hidden worktree and the branch is created only when
    every patch is in. If a patch fails, nothing visible is left and the error names the patch, the
    file, the hunk and the line. Re-running on an existing branch is a no-op when it already holds
    exactly this series, and refuses otherwise; it never rewrites a branch.
    """
    from .apply import ApplyFailure, apply_target
    from .targets import load_target

    target = load_target(target_name)
    try:
        result = apply_target(target, cache, into, branch, keep_conflict, source, repo_url, component, progress)
    except ApplyFailure as failure:
        if as_json:
            emit_json({"target": target.name, "ok": False, "error": str(failure),
                       "patches": [o.__dict__ for o in failure.outcomes]})
        else:
            _print_outcomes(failure.outcomes)
        raise
    if as_json:
        emit_json({**result.to_json(), "ok": True})
        return
    _print_outcomes(result.patches)
    if result.noop:
        click.echo(f"\n{result.branch} already holds this series at {result.head[:12]}: nothing to do"
                   + (f" (worktree {result.worktree})" if result.worktree else ""))
    else:
        click.echo(f"\n{result.branch} at {result.head[:12]} on {target.component(component).ref} "
                   f"({result.base[:12]}), worktree {result.worktree} ({result.seconds:.1f}s)")


def _print_outcomes(outcomes) -> None:
    click.echo(table(["#", "patch", "fix-id", "result", "commit", "detail"],
                     [[i, o.name, o.fix_id, o.status, (o.commit or "")[:12], o.detail]
                      for i, o in enumerate(outcomes, 1)]))


@main.command("lint")
@click.option("--target", "-t", "target_names", multiple=True, metavar="NAME",
              help="Lint only these targets' series (repeatable) [default: all].")
@json_option
@handle_errors
def lint_cmd(target_names: tuple[str, ...], as_json: bool) -> None:
    """Check every series: files listed once, headers valid, diffs parse, no path escapes the tree."""
    from .series import read_series
    from .targets import load_all, load_target

    targets = [load_target(n) for n in target_names] if target_names else load_all()
    problems, checked = [], 0
    for t in targets:
        for c in t.components:
            s = read_series(c.series_dir)
            checked += len(s.patches)
            problems.extend(s.all_problems())
    if as_json:
        emit_json({"patches": checked, "problems": [{"file": str(p.path), "line": p.line, "message": p.message}
                                                   for p in problems]})
    else:
        for p in problems:
            click.echo(str(p))
        click.echo(f"{checked} patches in {len(targets)} targets: "
                   + (f"{len(problems)} problems" if problems else "clean"), err=bool(problems))
    if problems:
        sys.exit(1)


@main.command("status")
@json_option
@handle_errors
def status_cmd(as_json: bool) -> None:
    """Fixes x targets: what each target carries, with its upstream status, or why it needs no patch."""
    from .status import status_matrix
    from .targets import load_all

    targets = load_all()
    order, cells = status_matrix(targets)
    if as_json:
        emit_json({fid: {t: c.__dict__ for t, c in row.items()} for fid, row in cells.items()})
        return
    names = [t.name for t in targets]
    notes: list[str] = []

    def cell(fid, t):
        c = cells[fid].get(t)
        if c is None:
            return "-"
        if c.state == "carried":
            return c.detail
        text = f"{fid}: {c.detail}"
        if text not in notes:
            notes.append(text)
        return f"in base [{notes.index(text) + 1}]"

    rows = [[fid, *[cell(fid, t) for t in names]] for fid in order]
    click.echo(table(["fix-id", *names], rows))
    click.echo("\n'-': not carried on that target; 'NNNN Status': patch number and Upstream-Status.")
    for i, n in enumerate(notes, 1):
        click.echo(f"[{i}] {n}")


@main.command("export")
@target_option
@component_option
@click.option("--from", "rev", metavar="REV", help="Branch or commit to export [default: kvforge/<target>].")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Series directory to write [default: the target's series].")
@source_option
@repo_option
@json_option
@click.pass_obj
@handle_errors
def export_cmd(cache: Cache, target_name: str, component: str | None, rev: str | None, out: Path | None,
               source: str, repo_url: str | None, as_json: bool) -> None:
    """Refresh a series from a branch: one patch per commit since the base, plus the series file.

    Unchanged commits re-export to byte-identical files, so `git diff` on patches/ shows only
    real changes.
    """
    from .bases import ensure_base
    from .export import export_range
    from .targets import load_target

    target = load_target(target_name)
    comp = target.component(component)
    base = ensure_base(comp, cache, source, repo_url, progress)
    rev = rev or f"kvforge/{target.name}"
    written = export_range(base.repo, base.commit, rev, out or comp.series_dir)
    if as_json:
        emit_json([e.__dict__ for e in written])
        return
    click.echo(table(["patch", "fix-id", "file"], [[e.name, e.fix_id, "rewritten" if e.changed else "unchanged"]
                                                 for e in written]))


@main.command("env")
@target_option
@component_option
@click.option("--rebuild", is_flag=True, help="Remove and rebuild the target's environment.")
@source_option
@repo_option
@json_option
@click.pass_obj
@handle_errors
def env_cmd(cache: Cache, target_name: str, component: str | None, rebuild: bool, source: str,
            repo_url: str | None, as_json: bool) -> None:
    """Build (once) the Python environment that runs the target's vLLM CPU tests.

    torch from a local CPU wheel, vLLM's import-time requirements with the base tree's own version
    specifiers, pytest, a CPU platform plugin and an offline HF cache; nothing is installed into
    your Python. Targets whose requirements agree share one environment. $KVFORGE_TEST_PYTHON
    names an interpreter to use instead.
    """
    from .env import target_env
    from .targets import load_target

    env = target_env(load_target(target_name), cache, component, source, repo_url, rebuild, progress)
    if as_json:
        emit_json(env.to_json())
    else:
        how = "external" if env.external else ("reused" if env.reused else f"built in {env.seconds:.0f}s")
        click.echo(f"{target_name}: env {env.key} ({how}): {env.python}")


@main.command("test")
@target_option
@component_option
@click.option("--platform", "platform_name", type=click.Choice(["cpu", "cuda", "npu"]), default="cpu",
              show_default=True, help="Test selection to run (targets/*.toml components.tests).")
@click.option("--base/--patched", "on_base", default=False,
              help="Run on the base tree, or on the fully patched tree [default: --patched].")
@click.option("-k", "keyword", metavar="EXPR", help="Only tests matching this pytest -k expression.")
@source_option
@repo_option
@json_option
@click.pass_obj
@handle_errors
def test_cmd(cache: Cache, target_name: str, component: str | None, platform_name: str, on_base: bool,
             keyword: str | None, source: str, repo_url: str | None, as_json: bool) -> None:
    """Run the target's test selection plus every Checks test of its series with vLLM's own tests.

    pytest runs from the root of the base or patched tree in kvforge's test environment and
    writes JUnit XML (target, base commit, series hash and platform on every testcase) into the
    cache. Exit 4 when a test fails or none ran. cuda and npu print the command a runner with
    that hardware would run: they cannot run here.
    """
    from .targets import load_target
    from .testrun import print_test_result, test_target

    result = test_target(load_target(target_name), cache, component, platform_name, on_base, keyword, source,
                         repo_url, progress)
    print_test_result(result, as_json)


@main.command("verify")
@target_option
@component_option
@source_option
@repo_option
@json_option
@click.pass_obj
@handle_errors
def verify_cmd(cache: Cache, target_name: str, component: str | None, source: str, repo_url: str | None,
               as_json: bool) -> None:
    """Prove every patch: its Checks fail before it and pass after it; the suite passes at the end.

    A fix whose Checks already pass before it (or that has none) is unproven. refactor and test
    patches are held to the regression suite only. The report is also saved as JSON in the cache.
    Exit 0 only when everything is proven.
    """
    from .targets import load_target
    from .verify import print_verify_report, verify_target

    report = verify_target(load_target(target_name), cache, component, source, repo_url, progress)
    print_verify_report(report, as_json)


@main.group("bench")
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
@source_option
@repo_option
@json_option
@click.pass_obj
@handle_errors
def bench_prefix_cache_cmd(cache: Cache, target_name: str, component: str | None, scenario_spec: str, scale: float,
                           seed: int, plot_path: Path | None, source: str, repo_url: str | None,
                           as_json: bool) -> None:
    """Prefix-cache hit rates of the base and the patched tree, from vLLM's own counters.

    Each tree's real scheduler (built as vLLM's engine core builds it, with a hand-built hybrid
    KV cache config) replays the workloads of the bug reports with synthetic model outputs; the
    table shows vLLM's prefix-cache hit rate, the ceiling the workload allows, block-table
    invariant violations and wall time. Results are kept in the cache as JSON. The goals of the
    bug reports are checked on the patched tree and printed; they do not change the exit status.
    Exit 4 when a scenario could not run on a tree (its error is in the table).
    """
    from .bench.prefix_cache import bench_prefix_cache, check_plot_available, print_bench, write_plot
    from .targets import load_target

    if plot_path is not None:
        check_plot_available()
    result = bench_prefix_cache(load_target(target_name), cache, scenario_spec, scale, seed, component, source,
                                repo_url, progress)
    if plot_path is not None:
        write_plot(result.rows, result.states, plot_path,
                   f"{result.target}: prefix-cache hit rate per request (scale {result.scale:g})")
        result.files.append(str(plot_path))
    if as_json:
        emit_json(result.to_json())
    else:
        print_bench(result, click.echo)
    if result.errors:
        sys.exit(EXIT_TESTS)


if __name__ == "__main__":  # pragma: no cover
    main()
