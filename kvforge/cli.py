"""The `kvforge` command line: parse options, build one Context, call one library function and
`finish` its outcome (kvforge.outcome): the one place that prints a result or an error and exits.

Imports: each command imports its library module when it runs (`from . import <module>`), so that
`kvforge --help` and shell completion stay fast (0.07 s, against 0.35-0.41 s with every module loaded);
nothing imports cli, so these imports close no cycle (tests/test_layout.py).

Errors: a KvforgeError goes through `finish` too: one line on stderr (with --json also {"error",
"exit", **data} on stdout) and its exit code; a click usage error exits 2 the same way; anything
else is a bug in kvforge: one line, the traceback saved to a file, exit 70. Global options
(--cache-dir) work before or after the subcommand.
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

import click

from kvforge import __version__
from kvforge.bench import DEFAULT_SCALE as BENCH_DEFAULT_SCALE
from kvforge.core.cache import Cache
from kvforge.core.errors import EXIT_CODES, EXIT_INTERNAL, EXIT_USAGE, KvforgeError
from kvforge.core.outcome import Outcome
from kvforge.project.platforms import DEVICES, JOB_KINDS, PLATFORMS
from kvforge.core.render import json_text

GLOBAL_OPTIONS = ("--cache-dir",)


def progress(msg: str) -> None:
    click.echo(f"kvforge: {msg}", err=True)


def finish(result: Outcome | KvforgeError, as_json: bool) -> NoReturn:
    """Print how a command ended and exit with its code: the one place that does.

    An Outcome: with --json its to_json() (plus "error" and "exit" when it failed; keys the document
    has itself win) on stdout, else its render() on stdout and its `aside` on stderr; its `notes`
    as warnings first. A KvforgeError: {"error": its first line, "exit", **data} with --json, else
    its `text` on stdout; its `notes` first. Failing: "kvforge: error: <error>" on stderr (with --json
    the first line of the document's "error")."""
    error: str | None
    doc: Any
    if isinstance(result, KvforgeError):
        code, error, notes, aside = result.exit_code, str(result), result.notes, ""
        doc, text = dict(result.data), result.text
    else:
        code, error, aside = result.exit_code, result.error, getattr(result, "aside", "")
        notes = getattr(result, "notes", [])
        doc, text = (result.to_json(), "") if as_json else (None, result.render())
    for note in notes:
        click.echo(f"kvforge: warning: {note}", err=True)
    if as_json:
        if error is not None:
            doc = {"error": first_line(error), "exit": code, **doc}
            error = str(doc["error"])
        click.echo(json_text(doc))
    else:
        if text:
            click.echo(text, nl=not text.endswith("\n"))
        if aside:
            click.echo(aside, err=True)
    if error is not None:
        click.echo(f"kvforge: error: {first_line(error) if as_json else error}", err=True)
    sys.exit(code)


def first_line(text: str) -> str:
    return (text.splitlines() or [""])[0]


def wants_json(kwargs: dict) -> bool:
    """--json, or matrix's --format json."""
    return bool(kwargs.get("as_json")) or kwargs.get("fmt") == "json"


def handle_errors(fn):
    """KvforgeError -> finish (one line and its exit code, a JSON error object with --json)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KvforgeError as exc:
            finish(exc, wants_json(kwargs))
        except KeyboardInterrupt as exc:
            interrupted(exc)

    return wrapper


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a CI timeout, a closed terminal), raised where the process is, so every cleanup
    that ends a child on KeyboardInterrupt (testrun's pytest process group, subprocess.run's child, the
    transactions' rollbacks) runs before kvforge exits 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _terminate(signum, _frame) -> None:
    signal.signal(signum, signal.SIG_DFL)  # a second one ends kvforge at once
    raise Terminated(signum)


def handle_signals() -> dict:
    """SIGTERM and SIGHUP end kvforge like Ctrl-C does: its children are ended first (see Terminated).
    Returns the handlers it replaced (run_cli puts them back: a caller such as a test process keeps its own)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _terminate) for sig in (signal.SIGTERM, signal.SIGHUP)}


def interrupted(exc: BaseException) -> NoReturn:
    if isinstance(exc, Terminated):
        click.echo(f"kvforge: terminated ({signal.Signals(exc.signum).name}); its child processes were ended",
                   err=True)
        sys.exit(128 + exc.signum)
    click.echo("kvforge: interrupted", err=True)
    sys.exit(130)


def make_ctx(cache: Cache, target_name: str, component: str | None = None, **kw):
    from kvforge.git.context import Context

    return Context.load(cache, target_name, component, progress=progress, **kw)


target_option = click.option("--target", "-t", "target_name", required=True, metavar="NAME",
                             help="Release target (a file in targets/, e.g. v0.20.2rc).")
json_option = click.option("--json", "as_json", is_flag=True,
                           help="Print machine-readable JSON on stdout (errors too: {\"error\", \"exit\"}).")
source_option = click.option("--source", type=click.Choice(["auto", "git", "sdist"]), default="auto",
                             show_default=True,
                             help="Where the base comes from: auto uses a cached base, else --repo or a reachable "
                                  "upstream, else the PyPI sdist (offline-capable).")
repo_option = click.option("--repo", "repo_url", metavar="URL|DIR",
                           help="Git remote or local clone to take the base ref from (implies --source git).")
component_option = click.option("--component", metavar="NAME", help="Component of the target (default: the first).")
from_option = click.option("--from", "from_rev", metavar="REV|DIR|DIR:REV",
                           help="Use the commits base..REV of a tree as the series instead of the series files: "
                                "REV in the current directory's repository, a tree DIR (its HEAD), or DIR:REV.")
python_option = click.option("--python", "python", type=click.Path(dir_okay=False, path_type=Path),
                             help="Run with this interpreter (an existing env with torch); missing packages go into "
                                  "an overlay in the cache, never into it [env KVFORGE_PYTHON].")
torch_index_option = click.option("--torch-index", metavar="URL",
                                  help="Package index to take the CPU torch wheel from [env KVFORGE_TORCH_INDEX; "
                                       "default: PyTorch's CPU index, then pip's find-links].")


def tree_options(fn):
    """The options of every command that tests or builds a tree: --from, --python, --torch-index,
    --source, --repo, --json."""
    for option in (json_option, repo_option, source_option, torch_index_option, python_option, from_option):
        fn = option(fn)
    return fn


def cache_option(fn):
    """--cache-dir on the group and on every subcommand, so it works before or after the subcommand."""

    def store(ctx: click.Context, _param, value):
        if value is not None:
            # The subcommand's context already copied the root's obj: set both.
            ctx.obj = ctx.find_root().obj = Cache(value)
        return value

    return click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), expose_value=False,
                        callback=store, is_eager=True,
                        help="Cache for bases, trees and environments [env KVFORGE_CACHE; "
                             "default ~/.cache/kvforge].")(fn)


class Group(click.Group):
    """Subcommands get --cache-dir too; nested groups are of this class."""

    def command(self, *args, **kwargs):
        decorator = super().command(*args, **kwargs)
        return lambda fn: decorator(cache_option(fn))

    def group(self, *args, **kwargs):
        kwargs.setdefault("cls", Group)
        return super().group(*args, **kwargs)


class RootGroup(Group):
    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        run_cli(self, args, prog_name, **extra)


def exit_code_help() -> str:
    return "\n".join(f"  {code:>2}  {what}" for code, what in EXIT_CODES.items())


@click.group(cls=RootGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog="\b\nExit codes:\n" + exit_code_help())
@click.version_option(__version__, prog_name="kvforge")
@cache_option
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Carry, prove and measure downstream patch series for vLLM's hybrid KV-cache manager.

    \b
    Typical day:
      kvforge status                           fixes x targets, with upstream status
      kvforge apply -t v0.20.2rc --into DIR    base + series as commits in a repository of your own
      (edit, commit in DIR)
      kvforge verify -t v0.20.2rc --from DIR   prove each of your commits with vLLM's own tests
      kvforge export -t v0.20.2rc --from DIR   write your commits back as the series (all or nothing)
    """
    if ctx.obj is None:
        ctx.obj = Cache(None)


@cli.command("targets")
@json_option
@click.pass_obj
@handle_errors
def targets_cmd(cache: Cache, as_json: bool) -> None:
    """List the release targets and their components."""
    from kvforge.project import targets

    finish(targets.targets_command(), as_json)


@cli.group("target")
def target_group() -> None:
    """Make targets: `kvforge target add VERSION` (see docs/targets.md)."""


@target_group.command("add")
@click.argument("version", required=False, metavar="VERSION")
@click.option("--from", "from_target", metavar="TARGET",
              help="Seed the series from this target [default: the newest maintained target whose vLLM base is "
                   "older than VERSION].")
@click.option("--as", "as_name", metavar="NAME", help="The new target's name [default: vVERSION]; with --continue or "
                                                      "--abort: which target add.")
@click.option("--dry-run", is_flag=True, help="Print the plan (pins, each patch's verdict, selections); write nothing.")
@click.option("--try", "try_cpu", is_flag=True,
              help="Also run the test modules the rescan finds new in the release on CPU (as `kvforge test --scan "
                   "--try`) and add those that run (slow: the release's CPU test environment, then pytest).")
@click.option("--continue", "do_continue", is_flag=True,
              help="Resume after resolving a conflict in the worktree named (or after a kill).")
@click.option("--skip", "do_skip", is_flag=True,
              help="Drop the patch it stopped at (recorded as skipped in the new series' ledger) and go on.")
@click.option("--abort", "do_abort", is_flag=True, help="Stop; targets/ and patches/ stay as they were.")
@json_option
@click.pass_obj
@handle_errors
def target_add_cmd(cache: Cache, version: str | None, from_target: str | None, as_name: str | None, dry_run: bool,
                   try_cpu: bool, do_continue: bool, do_skip: bool, do_abort: bool, as_json: bool) -> None:
    """A complete new target for vLLM release VERSION, in one step (all files or none).

    \b
    - vLLM's PyPI sdist pinned by sha256, its upstream commit (from _version.py), its
      release wheels per architecture (the first upload: the one built from the sdist's commit) as [[components.wheels]];
    - each further component (vllm-ascend) follows its release built on VERSION: the
      newest whose sdist's Dockerfile says ARG VLLM_TAG=vVERSION (0.22.1 -> vllm_ascend
      0.22.1rc1, branch releases/v0.22.1rc), pinned the same way, or is left out with
      the reason (0.21.0: vllm_ascend 0.21.0rc1 is built on vLLM v0.22.1);
    - each component's series seeded by rebasing the --from target's series onto the
      new base (verdicts and signals per patch, as kvforge rebase); a conflict stops
      (exit 3) with the worktree named: resolve, `git add`, then --continue (or
      --skip the patch, --abort);
    - selections checked against the new base (missing paths dropped, said), the CPU
      selection rescanned statically (--try: the modules new in the release run on
      CPU, those that run added); lifecycle = "maintained".
    Nothing is written to targets/ or patches/ until every patch is decided; then
    patches/NAME[-COMPONENT]/ and targets/NAME.toml in one step. An existing NAME is
    refused (exit 2, never overwritten); no package index (offline) is exit 6.
    """
    from kvforge.flow import targetadd

    actions = [a for a, on in (("continue", do_continue), ("skip", do_skip), ("abort", do_abort)) if on]
    if len(actions) > 1:
        raise KvforgeError("--continue, --skip and --abort exclude each other", EXIT_USAGE)
    finish(targetadd.run(cache, actions[0] if actions else "start", version, from_target=from_target,
                         as_name=as_name, dry_run=dry_run, try_cpu=try_cpu, progress=progress), as_json)


@cli.command("base")
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
    from kvforge.git import bases

    finish(bases.base_command(make_ctx(cache, target_name, component, source=source, repo_url=repo_url)), as_json)


@cli.command("apply")
@target_option
@component_option
@click.option("--into", type=click.Path(file_okay=False, path_type=Path),
              help="Make a standalone git repository here [default: ./<component>-<target>; a target with several "
                   "components and no --component: each component into its own].")
@click.option("--repo-dir", type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="Instead: add the branch to this existing clone (its checkout, index and changes are untouched).")
@click.option("--branch", help="Branch to create [default: kvforge/<target>; kvforge/<target>-<component> for a "
                                "target's second component].")
@click.option("--keep-conflict", is_flag=True,
              help="On failure, leave the tree at the failing patch with conflict markers (git am in progress).")
@source_option
@repo_option
@json_option
@click.pass_obj
@handle_errors
def apply_cmd(cache: Cache, target_name: str, component: str | None, into: Path | None, repo_dir: Path | None,
              branch: str | None, keep_conflict: bool, source: str, repo_url: str | None, as_json: bool) -> None:
    """Apply a target's series to its base: one commit per patch, on a branch in a tree you own.

    \b
    --into DIR      a standalone repository (objects copied, no link to the cache): the base is
                    tagged kvforge/base/<target>, the branch checked out. Deleting the cache
                    never affects it.
    --repo-dir DIR  the branch (and base tag) fetched into your existing clone.

    A target with several components (v0.20.2rc: vllm, then vllm-ascend) without --component
    applies each into ./<component>-<target>, every series prepared before any tree is made.

    Transactional: the series is applied in kvforge's own worktree and your tree or branch appears
    only when every patch is in. If a patch fails, nothing is left and the error names the patch,
    file, hunk and line. Re-running is a no-op when the branch already holds exactly this series;
    a branch that differs (your work) is never touched: the refusal says how to keep it.
    """
    from kvforge.flow import apply

    ctx = make_ctx(cache, target_name, component, source=source, repo_url=repo_url)
    finish(apply.apply_command(ctx, component, into, repo_dir, branch, keep_conflict), as_json)


@cli.command("lint")
@click.option("--target", "-t", "target_names", multiple=True, metavar="NAME",
              help="Lint only these targets' series (repeatable) [default: all].")
@click.option("--component", metavar="NAME", help="Lint only this component's series [default: every component].")
@click.option("--selections", is_flag=True,
              help="Also check that every test path of every platform selection (cpu, cuda, npu) exists in its "
                   "base (materialises the bases into the cache).")
@click.option("--collect", is_flag=True,
              help="With --selections: also collect the cuda selections on CPU (pytest --collect-only) in the base "
                   "and the patched tree; modules that do not import on CPU are checked by path, and said so.")
@json_option
@click.pass_obj
@handle_errors
def lint_cmd(cache: Cache, target_names: tuple[str, ...], component: str | None, selections: bool, collect: bool,
             as_json: bool) -> None:
    """Check every series: files listed once, headers valid, diffs parse, no path escapes the tree.

    With --selections, also every test selection against its base (exit 1 when a path is missing)."""
    from kvforge.proof import selection

    finish(selection.lint_command(cache, target_names, component, selections, collect, progress), as_json)


@cli.command("status")
@click.option("--check", is_flag=True,
              help="Evaluate every patch's Drop-When against its target's base: which could be dropped now "
                   "(materialises the bases into the cache).")
@json_option
@click.pass_obj
@handle_errors
def status_cmd(cache: Cache, check: bool, as_json: bool) -> None:
    """Fixes x targets: what each target carries, with its upstream status, or why it needs no patch,
    and the patches `kvforge rebase` dropped (with the signals that said upstream has them).

    --check: each patch's Drop-When (version >= X, base-contains C, upstream-pr-merged URL, never)
    against its target's base: drop now, keep, or cannot tell here (an sdist base has no history;
    a PR's state needs the network).
    """
    from kvforge.flow import status

    finish(status.status_command(cache, check, progress), as_json)


@cli.command("report")
@click.option("--target", "-t", "target_names", multiple=True, metavar="NAME",
              help="Only this target (repeatable) [default: every target].")
@click.option("--format", "fmt", type=click.Choice(["table", "markdown", "trend"]), default="table",
              show_default=True,
              help="table: for a terminal; markdown: for an issue or a job summary; trend: one JSON line of "
                   "totals to append to a file (a trend over runs).")
@json_option
@click.pass_obj
@handle_errors
def report_cmd(cache: Cache, target_names: tuple[str, ...], fmt: str, as_json: bool) -> None:
    """What carrying each fix costs, per fix and target: since when and in which releases it is carried,
    its Upstream-Status and PR, whether its Drop-When is met on the newest release, whether its verify
    evidence is current or stale, and its churn (commits that changed the patch file, rebase drops).

    \b
    Totals by Upstream-Status as Yocto's patchreview counts them and by forwarding as Debian's UDD
    does. --json: every row and the totals (schema in docs/report.md); --format trend: one line,
    e.g. `kvforge report --format trend >> carrying.jsonl` in a scheduled job.
    Materialises the bases into the cache, as `kvforge status --check` does.
    """
    from kvforge.flow import carrying

    finish(carrying.report_command(cache, target_names, fmt, progress), as_json)


@cli.command("init")
@click.argument("dest", metavar="DIR", type=click.Path(path_type=Path))
@click.option("--upstream", type=click.Choice(["vllm", "vllm-ascend"]), default="vllm", show_default=True,
              help="What the series patch: vLLM, or vllm-ascend (on the vLLM release it is built on).")
@click.option("--release", metavar="VERSION",
              help="Write a first target for this release (vllm 0.20.2, vllm-ascend 0.20.2rc1): its PyPI sdist pinned "
                   "by sha256 (read from the package index), an empty series, vLLM's KV-cache manager CPU tests.")
@click.option("--name", metavar="NAME", help="The first target's name [default: v<VERSION>].")
@click.option("--install", metavar="REQUIREMENT",
              help="The pip requirement CI installs kvforge from (e.g. 'kvforge @ git+https://host/org/kvforge@v0.1.0') "
                   "[default: where this kvforge was installed from: its git source, else its path, else kvforge==VERSION].")
@json_option
@click.pass_obj
@handle_errors
def init_cmd(cache: Cache, dest: Path, upstream: str, release: str | None, name: str | None, install: str | None,
             as_json: bool) -> None:
    """Make DIR a new patch repository run by this (installed) kvforge: targets/, patches/, a README with
    the two commands (install kvforge, run the checks and CPU jobs), .gitignore, the CI files
    (.github/workflows/kvforge.yml, .buildkite/pipeline.yml) and a git repository with a first commit.

    All or nothing: DIR must not exist or be empty; everything is made beside it and renamed into place
    in one step. kvforge finds the project from the current directory (or $KVFORGE_ROOT) afterwards.
    """
    from kvforge.ci import scaffold

    finish(scaffold.init_command(dest, upstream, release, name, install, cache, progress), as_json)


@cli.command("export")
@target_option
@component_option
@from_option
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Series directory to write [default: the target's series].")
@click.option("--renumber", is_flag=True,
              help="Name every file NNNN-<Fix-Id>.patch by its position (default: keep existing names).")
@source_option
@repo_option
@json_option
@click.pass_obj
@handle_errors
def export_cmd(cache: Cache, target_name: str, component: str | None, from_rev: str | None, out: Path | None,
               renumber: bool, source: str, repo_url: str | None, as_json: bool) -> None:
    """Write a tree's commits back as the series: one patch per commit since the base, and `series`.

    All or nothing: every file is computed into a temporary directory and linted there, then the
    series directory is replaced in one step; on any problem nothing in it changes. Unchanged
    commits re-export byte for byte; existing file names are kept unless --renumber. Default
    --from: branch kvforge/<target> of the repository at the current directory, else of
    ./<component>-<target>. On a target with several components, --component defaults to the one
    `kvforge apply` recorded in that tree (git config kvforge.component).
    """
    from kvforge.env import components
    from kvforge.flow import export
    from kvforge.project import targets

    if component is None:
        component = components.component_of_tree(targets.load_target(target_name), from_rev)
    ctx = make_ctx(cache, target_name, component, source=source, repo_url=repo_url, from_rev=from_rev)
    finish(export.export_command(ctx, out=out, renumber=renumber), as_json)


@cli.command("env")
@target_option
@component_option
@click.option("--rebuild", is_flag=True, help="Remove and rebuild the target's environment (or overlay).")
@click.option("--platform", "platform_name", type=click.Choice(list(PLATFORMS)), default="cpu",
              show_default=True, help="The platform whose environment to set up (cuda/npu need --python).")
@python_option
@torch_index_option
@source_option
@repo_option
@json_option
@click.pass_obj
@handle_errors
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


@cli.command("test")
@target_option
@component_option
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
@click.pass_obj
@handle_errors
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

    ctx = make_ctx(cache, target_name, component, source=source, repo_url=repo_url, from_rev=from_rev,
                   python=python, torch_index=torch_index)
    finish(selection.scan_target(ctx, try_cpu) if scan or try_cpu
           else testrun.run_command(ctx, component, platform_name, on_base, keyword), as_json)


@cli.command("verify")
@target_option
@component_option
@tree_options
@click.pass_obj
@handle_errors
def verify_cmd(cache: Cache, target_name: str, component: str | None, from_rev: str | None, python: Path | None,
               torch_index: str | None, source: str, repo_url: str | None, as_json: bool) -> None:
    """Prove every patch: its Checks fail before it and pass after it; the suite passes at the end.

    With --from, each commit base..REV of your tree is proven instead of the series files. A fix
    whose Checks already pass before it (or that has none) is unproven. refactor and test patches
    are held to the regression suite only. The report is saved as JSON in the cache. Exit 0 only
    when everything is proven. Without --component, every component of the target, in order.
    """
    from kvforge.proof import verify

    ctx = make_ctx(cache, target_name, component, source=source, repo_url=repo_url, from_rev=from_rev,
                   python=python, torch_index=torch_index)
    finish(verify.verify_command(ctx, component), as_json)


# ---------------------------------------------------------------- build, matrix (kvforge/wheels/build.py, kvforge/ci/matrix.py)

def _shard_value(_ctx, _param, value):
    if value is None:
        return (1, 1)
    try:
        k, n = (int(x) for x in value.split("/", 1))
    except ValueError:
        raise click.BadParameter("expected K/N, e.g. 1/2") from None
    if not 1 <= k <= n:
        raise click.BadParameter("expected K/N with 1 <= K <= N")
    return (k, n)


@cli.command("build")
@target_option
@component_option
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("dist"), show_default=True,
              help="Directory the verified wheel is written to (a wheel that fails verification is not left there).")
@click.option("--mode", type=click.Choice(["overlay", "source"]), default="overlay", show_default=True,
              help="overlay: the release wheel with the series' files replaced; source: print vLLM's own build "
                   "of the patched tree (VLLM_USE_PRECOMPILED=1 with the release wheel), not run here (exit 7).")
@click.option("--wheel", "wheel_path", type=click.Path(exists=True, path_type=Path), metavar="FILE|DIR",
              help="Do not build: verify this patched wheel (or the target's wheel in DIR), e.g. on a GPU runner.")
@click.option("--platform", "platform_name", type=click.Choice(list(PLATFORMS)), default="cpu", show_default=True,
              help="Where the verification tests run (cuda/npu need --python and the hardware, else exit 7).")
@click.option("--tests", "tests_mode", type=click.Choice(["checks", "all"]), default="checks", show_default=True,
              help="Verify with the series' Checks, or with the platform's selection plus the Checks.")
@click.option("--shard", callback=_shard_value, metavar="K/N", help="Run only the K-th of N parts of the tests.")
@click.option("--arch", type=click.Choice(["x86_64", "aarch64", "all"]),
              help="Which release wheels to overlay: an architecture's pins, or all [default: the x86_64 ones]. "
                   "A wheel this machine cannot import is checked by RECORD, files and metadata; its import is "
                   "labelled not run.")
@click.option("--device", type=click.Choice(list(DEVICES)),
              help="Instead of an overlay: vLLM's own build of the patched tree for this device (empty: "
                   "VLLM_TARGET_DEVICE=empty, pure Python, the vLLM an Ascend deployment installs under vllm-ascend).")
@tree_options
@click.pass_obj
@handle_errors
def build_cmd(cache: Cache, target_name: str, component: str | None, out: Path, mode: str, wheel_path: Path | None,
              platform_name: str, tests_mode: str, shard: tuple[int, int], arch: str | None, device: str | None,
              from_rev: str | None, python: Path | None,
              torch_index: str | None, source: str, repo_url: str | None, as_json: bool) -> None:
    """Build the target's patched wheels from the release wheels, and verify them.

    \b
    The release wheels (pinned in the target file, [[components.wheels]], one per platform tag)
    are downloaded once; the files the series changes are replaced with the patched tree's,
    everything else is copied as stored (compiled .so files, data), RECORD is rewritten. The
    version gets kvforge's local label (0.20.2+kvforge.<target>.<digest>: pip freeze/show say it);
    vllm.__version__ stays the release's (vllm-ascend checks it exactly); a build tag and
    <dist-info>/kvforge.json name the series. Same base and series: the same bytes.
    --component vllm-ascend overlays vllm-ascend's release wheels (its .so files untouched).
    Every build is verified before it gets its name in --out: installed with --no-deps, RECORD
    checked, the patched files compared with the tree, then the series' Checks run with vllm
    imported from the installed wheel. A series that changes compiled inputs or packaging
    (csrc/, setup.py, requirements, ...) is refused: --mode source prints vLLM's own build.
    """
    from kvforge.wheels import build

    ctx = make_ctx(cache, target_name, component, source=source, repo_url=repo_url, from_rev=from_rev,
                   python=python, torch_index=torch_index)
    finish(build.build_command(ctx, out, mode, tests_mode, platform_name, wheel_path, shard, arch, device), as_json)


@cli.command("matrix")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "github", "buildkite", "buildkite-vllm",
                                                    "commands", "targets"]),
              default="table", show_default=True,
              help="github: lines for $GITHUB_OUTPUT; buildkite: a pipeline for `buildkite-agent pipeline upload`; "
                   "buildkite-vllm: steps in vLLM's .buildkite/test_areas format; commands/targets: one per line.")
@click.option("--changed-since", metavar="REV",
              help="Only the targets whose target file or series changed since REV (all when kvforge changed).")
@click.option("--kind", "kinds", multiple=True, type=click.Choice(list(JOB_KINDS)),
              help="Only these kinds of job (repeatable) [default: all].")
@click.option("--target", "-t", "target_names", multiple=True, metavar="NAME", help="Only these targets (repeatable).")
@click.option("--cuda-shards", type=int, default=1, show_default=True, help="Split each cuda job's tests N ways.")
@click.option("--runs-on", "runs_on", multiple=True, metavar="PLATFORM=LABEL[,LABEL]",
              help="GitHub runner labels for a platform instead of kvforge/project/platforms.py's defaults.")
@json_option
@handle_errors
def matrix_cmd(fmt: str, changed_since: str | None, kinds: tuple[str, ...], target_names: tuple[str, ...],
               cuda_shards: int, runs_on: tuple[str, ...], as_json: bool) -> None:
    """The CI jobs of every target: build, cpu, cuda and npu, each a kvforge command.

    Generated only: nothing is run, and cuda/npu jobs (runs_here: false) are never reported as
    passed. With --json (or --format json) errors are a JSON object too.
    """
    from kvforge.ci import matrix

    as_json = as_json or fmt == "json"
    finish(matrix.matrix_command("json" if as_json else fmt, changed_since, kinds, target_names, cuda_shards,
                                 runs_on), as_json)


@cli.group("bench")
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
@tree_options
@click.pass_obj
@handle_errors
def bench_prefix_cache_cmd(cache: Cache, target_name: str, component: str | None, scenario_spec: str, scale: float,
                           seed: int, plot_path: Path | None, from_rev: str | None, python: Path | None,
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

    if plot_path is not None:
        prefix_cache.check_plot_available()
    ctx = make_ctx(cache, target_name, component, source=source, repo_url=repo_url, from_rev=from_rev,
                   python=python, torch_index=torch_index)
    finish(prefix_cache.bench_command(ctx, scenario_spec, scale, seed, plot_path), as_json)


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
@click.pass_obj
@handle_errors
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

    ctx = make_ctx(cache, target_name, component, source=source, repo_url=repo_url, from_rev=from_rev,
                   python=python, torch_index=torch_index)
    finish(overhead.bench_scheduler_overhead(ctx, topologies, kinds, pools, scale, steps, reps, seed, mask=not no_mask),
           as_json)


# ---------------------------------------------------------------- rebase, port (kvforge/rebase.py, port.py)


@cli.command("rebase")
@target_option
@component_option
@click.option("--onto", metavar="VERSION|REF",
              help="The release to move onto (its PyPI sdist, sha256 from PyPI), or a git ref with --repo.")
@click.option("--as", "as_target", metavar="NEWTARGET",
              help="Write a new target (targets/NEWTARGET.toml, patches/NEWTARGET/) instead of moving this one.")
@click.option("--dry-run", is_flag=True, help="Print the plan (verdict and signals per patch); write nothing.")
@click.option("--checks", is_flag=True,
              help="Also run each patch's Checks on the new base without the patch (slow: the new base's test env).")
@click.option("--continue", "do_continue", is_flag=True, help="Resume after resolving a conflict (carry the patch).")
@click.option("--skip", "do_skip", is_flag=True, help="Drop the patch the rebase stopped at (recorded in the ledger).")
@click.option("--abort", "do_abort", is_flag=True, help="Stop the rebase; patches/ and targets/ stay as they were.")
@source_option
@repo_option
@json_option
@click.pass_obj
@handle_errors
def rebase_cmd(cache: Cache, target_name: str, component: str | None, onto: str | None, as_target: str | None,
               dry_run: bool, checks: bool, do_continue: bool, do_skip: bool, do_abort: bool, source: str,
               repo_url: str | None, as_json: bool) -> None:
    """Move a target's series onto a new upstream release, dropping the patches it already has.

    \b
    Per patch, in order: upstream (dropped, with the signals that say so, into the ledger
    patches/<target>/dropped.toml), carried (applied three-way), conflict (stop: resolve in the
    worktree printed, `git add`, --continue; or --skip / --abort), disagree (stop: --continue
    carries, --skip drops). Nothing in patches/ or targets/ changes until every patch is
    decided; then the series, the target's ref/version/sha256 and the ledger change in one step.
    Exit 3 when the rebase stopped at a patch.
    """
    from kvforge.flow import rebase

    actions = [a for a, on in (("continue", do_continue), ("skip", do_skip), ("abort", do_abort)) if on]
    if len(actions) > 1:
        raise KvforgeError("--continue, --skip and --abort exclude each other", EXIT_USAGE)
    ctx = make_ctx(cache, target_name, component, source=source, repo_url=repo_url)
    finish(rebase.run(ctx, actions[0] if actions else "start", onto, as_target, dry_run, checks), as_json)


# ---------------------------------------------------------------- watch (kvforge/flow/watch.py)


@cli.command("watch")
@click.option("--since", metavar="VERSION", help="Only releases newer than this one [default: newer than each "
                                                 "target's base].")
@click.option("--target", "-t", "target_names", multiple=True, metavar="NAME",
              help="Watch only these targets (repeatable) [default: every target whose lifecycle is maintained].")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "markdown"]), default="table",
              show_default=True, help="The report: a table, JSON, or markdown (one section per release).")
@click.option("--source", type=click.Choice(["auto", "git", "sdist"]), default="sdist", show_default=True,
              help="Where each new base comes from: the release's PyPI sdist (cached), or git (auto: a cached or "
                   "reachable upstream clone first).")
@click.option("--apply", "apply", is_flag=True,
              help="For each new vLLM release that is clean for every target moving to it and that no target has "
                   "yet: `kvforge target add VERSION` (writes targets/ and patches/; stops at the first that stops).")
@json_option
@click.pass_obj
@handle_errors
def watch_cmd(cache: Cache, since: str | None, target_names: tuple[str, ...], fmt: str, source: str, apply: bool,
              as_json: bool) -> None:
    """New vLLM / vllm-ascend releases against every maintained target: what a rebase onto each would do.

    \b
    Reads the release lists of each component's package on PyPI ($KVFORGE_PYPI_URL for another
    index). For every release newer than a target's base (pre-releases only for a component whose
    base is one, as vllm-ascend's rc's), a dry-run rebase of that component onto it (nothing is
    written; sdists are downloaded once into the cache): per patch carried / upstream (with the
    signals) / conflict / disagree, its Drop-When evaluated there, and the release's wheels per
    platform. Targets with lifecycle = "eol" are not watched.

    \b
    Exit 0: nothing new, or new releases and all clean ("status" in --json says which);
    exit 3: attention needed (a conflict, a disagreement, a wheel the target pins missing, a failed
    check; 6 when one failed on the network). --json (or --format json) gives every release with its
    markdown body and issue title, for the scheduled workflow (ci/github/kvforge-watch.yml).
    """
    from kvforge.flow import watch

    finish(watch.watch(cache, target_names, since, "json" if as_json else fmt, source, progress, apply),
           as_json or fmt == "json")


@cli.command("port")
@click.argument("fix_id", metavar="FIX")
@click.option("--to", "to_target", required=True, metavar="TARGET", help="The target to make a variant for.")
@click.option("--from-target", metavar="TARGET", help="Start from this target's variant [default: the newest other].")
@click.option("--into", type=click.Path(file_okay=False, path_type=Path),
              help="The tree to make [default: ./<component>-<target>-<fix>].")
@component_option
@source_option
@repo_option
@json_option
@click.pass_obj
@handle_errors
def port_cmd(cache: Cache, fix_id: str, to_target: str, from_target: str | None, into: Path | None,
             component: str | None, source: str, repo_url: str | None, as_json: bool) -> None:
    """Start a variant of one fix for another target: a tree of yours with the target's series and the
    fix applied three-way on top (header and Fix-Id carried over), conflicts left to resolve.

    Then: resolve, `git am --continue`, `kvforge verify -t TARGET --from DIR`, `kvforge export -t
    TARGET --from DIR`. Exit 3 when it conflicts (the tree is left at the conflict).
    """
    from kvforge.flow import port

    ctx = make_ctx(cache, to_target, component, source=source, repo_url=repo_url)
    finish(port.port(ctx, fix_id, from_target, into), as_json)


@cli.command("pick", epilog="""\b
Exit codes:
   0  every target present, carried or picked (and proven, with --verify); the series written
   2  bad input: SOURCE, an option, a tree in the way, a pick already in progress
   3  a target conflicts, needs a prerequisite or its signals disagree: nothing written, the
      state kept for --continue (trees left at the conflict)
   4  --verify: a picked patch is not proven: nothing written
   6  a PR could not be fetched (offline: download pull/N.patch and pick the file)""")
@click.argument("source", required=False, metavar="SOURCE")
@click.option("--repo", "repo_dir", type=click.Path(file_okay=False, path_type=Path), metavar="DIR",
              help="SOURCE is a commit (or A..B, picked as one change) of this local clone.")
@click.option("--target", "-t", "targets", multiple=True, metavar="NAME",
              help="Pick into this target (repeatable) [default: every target with the change's component].")
@click.option("--component", metavar="NAME", help="The change's component [default: from the repository: vllm].")
@click.option("--fix-id", metavar="ID", help="The Fix-Id [default: a slug of the subject].")
@click.option("--signoff", metavar="'NAME <EMAIL>'", help="The carrier's Signed-off-by [default: git's user].")
@click.option("--into", "tree_dir", type=click.Path(file_okay=False, path_type=Path), metavar="DIR",
              help="Where conflict trees are made [default: the current directory].")
@click.option("--exclude", multiple=True, metavar="TARGET", help="Leave this target out (with --continue too).")
@click.option("--after", metavar="FIX", help="Place the patch right after the patch with this Fix-Id in each series "
                                             "(the later ones re-applied over it, or the pick is refused, exit 3) "
                                             "[default: appended].")
@click.option("--dry-run", is_flag=True, help="Print the verdicts; write nothing, leave no tree.")
@click.option("--verify", is_flag=True, help="Prove the picked patch on each target where it applies (kvforge "
                                              "verify); nothing is written unless every one is proven.")
@click.option("--continue", "do_continue", is_flag=True, help="Take the resolved trees into the series and write.")
@click.option("--abort", "do_abort", is_flag=True, help="Forget a stopped pick (patches/, targets/ and your trees "
                                                        "stay as they are).")
@click.option("--source", "source_policy", type=click.Choice(["auto", "git", "sdist"]), default="auto",
              show_default=True, help="Where the targets' bases come from (as for the other commands).")
@json_option
@click.pass_obj
@handle_errors
def pick_cmd(cache: Cache, source: str | None, repo_dir: Path | None, targets: tuple[str, ...],
             component: str | None, fix_id: str | None, signoff: str | None, tree_dir: Path | None,
             exclude: tuple[str, ...], after: str | None, dry_run: bool, verify: bool, do_continue: bool,
             do_abort: bool, source_policy: str, as_json: bool) -> None:
    """Pick one upstream change into every target's series, with a verdict per target.

    \b
    SOURCE: a commit or range A..B of a clone (--repo DIR REV), a git format-patch /
    mbox file of one message (GitHub's pull/N.patch), or a vLLM / vllm-ascend PR
    number or URL (online only).
    Verdicts: present (the base has it: reverse-apply, Drop-When from the first
    release containing it, ancestry; never on one weak signal), carried (same
    Fix-Id or patch-id), applies, applies (3-way), conflict, needs prerequisite,
    disagree. A conflict leaves a tree of yours at it (./<component>-<target>-pick-<fix>);
    resolve, `git add`, `kvforge pick --continue`. Nothing in patches/ or targets/
    changes until every target is decided; then all of them change in one step
    (present targets get an in_base entry). See docs/pick.md.
    """
    from kvforge.flow import pick

    if do_continue and do_abort:
        raise KvforgeError("--continue and --abort exclude each other", EXIT_USAGE)
    if (do_continue or do_abort) and source:
        raise KvforgeError("--continue / --abort take no SOURCE", EXIT_USAGE)
    if after and (do_continue or do_abort):
        raise KvforgeError("--after goes with a new pick, not with --continue / --abort", EXIT_USAGE)
    action = "continue" if do_continue else "abort" if do_abort else "start"
    finish(pick.pick(cache, source, repo_dir=repo_dir, targets=list(targets) or None, component=component,
                     fix_id=fix_id, dry_run=dry_run, verify=verify, exclude=list(exclude), action=action,
                     signoff=signoff, tree_dir=tree_dir, base_source=source_policy, after=after,
                     progress=progress), as_json)


# ---------------------------------------------------------------- pr, notes (kvforge/flow/pr.py)

TEXT_EXIT_HELP = """\b
Exit codes:
   0  written (evidence that does not exist is stated in the text and warned about)
   2  bad input: an unknown fix, a fix the target has in its base, a commit without
      Signed-off-by, a template error (file:line)
   3  a patch does not apply, so the series cannot be stacked
   4  stale evidence refused: the newest verify/bench record is of another series
      or base (--allow-stale uses it and says so in the text)
   5  environment: --open without gh installed, gh pr create failed, --out not writable"""

text_template_option = click.option(
    "--template", "template_path", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
    help="Render the body with your own jinja2 template (sandboxed, StrictUndefined; `{% set title = ... %}` "
         "in it sets the title). See docs/pr.md for the data it gets.")
text_out_option = click.option("--out", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
                               help="Write the text to FILE instead of stdout.")
text_allow_stale_option = click.option(
    "--allow-stale", is_flag=True,
    help="Use evidence recorded for another series or base, and say so in the text [default: refuse, exit 4].")


@cli.command("pr", epilog=TEXT_EXIT_HELP)
@target_option
@component_option
@click.option("--fix", "fix_id", required=True, metavar="FIX-ID", help="The Fix-Id of the patch to describe.")
@click.option("--style", type=click.Choice(["vllm", "vllm-ascend"]), default=None,
              help="Only a check: the style follows the component's upstream (vllm: [Tag] title and the base's own "
                   "PR template; vllm-ascend: [Branch][Module][Action] title, its three-section template); a "
                   "different --style is exit 2.")
@text_template_option
@text_out_option
@text_allow_stale_option
@click.option("--open", "open_in_gh", is_flag=True,
              help="Open the PR: re-apply the fix onto the upstream branch of your clone (--repo CLONE, git am -3; "
                   "conflicts are exit 3), push it to --push-to as fix/<FIX-ID>, check the pushed branch, then "
                   "`gh pr create --draft --base BRANCH --head ...` (exit 5 without gh).")
@click.option("--push-to", "push_to", metavar="REMOTE|URL",
              help="With --open: your fork, as a remote name of the --repo clone or a URL; the branch is pushed there.")
@from_option
@source_option
@repo_option
@json_option
@click.pass_obj
@handle_errors
def pr_cmd(cache: Cache, target_name: str, component: str | None, fix_id: str, style: str | None,
           template_path: Path | None, out: Path | None, allow_stale: bool, open_in_gh: bool, push_to: str | None,
           from_rev: str | None,
           source: str, repo_url: str | None, as_json: bool) -> None:
    """Describe one fix as an upstream pull request: a title, a blank line, the body.

    Filled from the patch header (Why, upstream links, Bug, Depends-On), its diffstat, the newest
    `kvforge verify` record of exactly this series (each Checks test failing before the patch and
    passing after it, the regression suite, the platform) and, where the fix has a scenario, the
    newest `kvforge bench prefix-cache` record. Evidence that does not exist is stated, never
    invented; evidence of another series is refused. Every commit the PR carries (the fix and its
    Depends-On) must have Signed-off-by. With --from, the commits of your tree are the series.
    Where it goes follows each upstream's policy (kvforge/data/upstream-policy.toml): vLLM takes new
    fixes on main (from the main target's variant) and no backports of merged PRs into a released
    version; vllm-ascend takes fixes onto main and its maintained releases/* branches. A fix with no
    upstream PR (Inappropriate, already merged, already on the branch) is refused with the reason
    (exit 2). Repository, --base branch and style come from the component. On a target with several
    components, --component defaults to the one whose patch for the fix has a PR route.
    """
    from kvforge.flow import pr
    from kvforge.flow import prpolicy
    from kvforge.project import targets

    gh = pr.find_gh() if open_in_gh else None
    if component is None:
        component = prpolicy.component_for_pr(targets.load_target(target_name), fix_id)
    ctx = make_ctx(cache, target_name, component, source=source, repo_url=repo_url, from_rev=from_rev)
    finish(pr.pr_command(ctx, fix_id, style, template_path, allow_stale, out, gh, push_to), as_json)


@cli.command("notes", epilog=TEXT_EXIT_HELP)
@target_option
@component_option
@text_template_option
@text_out_option
@text_allow_stale_option
@from_option
@source_option
@repo_option
@json_option
@click.pass_obj
@handle_errors
def notes_cmd(cache: Cache, target_name: str, component: str | None, template_path: Path | None, out: Path | None,
              allow_stale: bool, from_rev: str | None, source: str, repo_url: str | None, as_json: bool) -> None:
    """Release notes for a patched build: base and series identity, one entry per fix.

    Each fix with its upstream status, its verify evidence (and bench figures where it has a
    scenario) and when to drop it; the fixes the base already has; shortlog, diffstat and
    base-commit as in a b4 cover letter. Evidence rules as for `kvforge pr`.
    """
    from kvforge.flow import pr

    ctx = make_ctx(cache, target_name, component, source=source, repo_url=repo_url, from_rev=from_rev)
    finish(pr.notes_command(ctx, template_path, allow_stale, out), as_json)


def crash_report(exc: BaseException) -> Path | None:
    """Save the traceback of an unexpected exception; return the file (None if nothing is writable)."""
    text = "".join(traceback.format_exception(exc))
    for d in (os.environ.get("KVFORGE_CACHE"), tempfile.gettempdir()):
        if not d:
            continue
        try:
            Path(d).mkdir(parents=True, exist_ok=True)
            path = Path(d) / f"kvforge-crash-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.txt"
            path.write_text(f"kvforge {__version__}\nargv: {sys.argv}\n\n{text}", encoding="utf-8")
            return path
        except OSError:
            continue
    return None


def run_cli(group: click.Group, args: list[str] | None, prog_name: str | None, **extra) -> None:
    """Run the CLI; turn usage errors and bugs into one line and a documented exit code."""
    args = list(sys.argv[1:] if args is None else args)
    as_json = "--json" in args
    previous = handle_signals()
    try:
        _run(group, args, prog_name, as_json, **extra)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(group: click.Group, args: list[str], prog_name: str | None, as_json: bool, **extra) -> NoReturn:
    try:
        code = click.Group.main(group, args=args, prog_name=prog_name or "kvforge", standalone_mode=False, **extra)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort as exc:
        interrupted(exc.__context__ if isinstance(exc.__context__, Terminated) else exc)
    except click.ClickException as exc:
        if as_json:
            click.echo(json_text({"error": exc.format_message(), "exit": EXIT_USAGE}))
        exc.show()
        sys.exit(EXIT_USAGE)
    except KvforgeError as exc:  # raised outside a command (e.g. while parsing the group)
        finish(exc, as_json)
    except SystemExit:
        raise
    except KeyboardInterrupt as exc:
        interrupted(exc)
    except Exception as exc:
        where = crash_report(exc)
        msg = f"internal error: {type(exc).__name__}: {exc}".splitlines()[0]
        msg += f" (a bug in kvforge; traceback: {where})" if where else " (a bug in kvforge)"
        finish(KvforgeError(msg, EXIT_INTERNAL), as_json)
    sys.exit(code if isinstance(code, int) else 0)


main = cli  # the console script and tests call main(): RootGroup.main runs run_cli


if __name__ == "__main__":  # pragma: no cover
    main()
