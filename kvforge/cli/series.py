"""The series commands: targets, target add, base, apply, lint, status, report, export. Each parses its
options, builds the Context where it needs one and finishes the outcome of one library function, imported
when the command runs."""

from __future__ import annotations

from pathlib import Path

import click

from kvforge.core.cache import Cache
from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.cli.finish import finish, progress
from kvforge.cli.options import (EVERY_COMPONENT, alias, base_json_cache, base_options, command, complete_targets, component_option,
                                 component_option_for, dry_run_option, from_option, group, json_option, make_ctx,
                                 target_option, targets_option, tree_component, with_cache)


@command("targets")
@json_option
@with_cache
def targets_cmd(cache: Cache, as_json: bool) -> None:
    """List the release targets and their components."""
    from kvforge.project import targets

    finish(targets.targets_command(), as_json, fit_text=True)


@group("target")
def target_group() -> None:
    """Make targets: `kvforge target add VERSION` (see `kvforge help targets`)."""


@target_group.command("add")
@click.argument("version", required=False, metavar="VERSION")
@click.option("--from-target", "from_target", metavar="TARGET", shell_complete=complete_targets,
              help="Seed the series from this target [default: the newest maintained target whose vLLM base is "
                   "older than VERSION].")
@alias("--from", "from_target", "--from-target", metavar="TARGET")
@click.option("--as", "as_name", metavar="NAME", help="The new target's name [default: vVERSION]; with --continue or "
                                                      "--abort: which target add.")
@dry_run_option("Print the plan (pins, each patch's verdict, selections); write nothing.")
@click.option("--try", "try_cpu", is_flag=True,
              help="Also run the test modules the rescan finds new in the release on CPU (as `kvforge test --scan "
                   "--try`) and add those that run (slow: the release's CPU test environment, then pytest).")
@click.option("--continue", "do_continue", is_flag=True,
              help="Resume after resolving a conflict in the worktree named (or after a kill).")
@click.option("--skip", "do_skip", is_flag=True,
              help="Drop the patch it stopped at (recorded as skipped in the new series' ledger) and go on.")
@click.option("--abort", "do_abort", is_flag=True, help="Stop; targets/ and patches/ stay as they were.")
@json_option
@with_cache
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
    - each component's series seeded by rebasing the --from-target's series onto the
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


@command("base")
@target_option
@component_option
@base_json_cache
def base_cmd(cache: Cache, target_name: str, component: str | None, source: str, repo_url: str | None,
             as_json: bool) -> None:
    """Materialise a target's base (upstream release) as a commit in the cache.

    From a git remote or clone when given or reachable; otherwise the PyPI sdist, verified against
    the sha256 pinned in the target file and imported with a fixed author and date, so the commit
    id is the same on every machine. A cached base costs no network.
    """
    from kvforge.git import bases

    finish(bases.base_command(make_ctx(cache, target_name, component, source=source, repo_url=repo_url)), as_json)


@command("apply")
@target_option
@component_option_for("every component of the target, each into its own ./<component>-<target>; with --into or "
                      "--into-clone (one tree), the target's first component (vllm)")
@click.option("--into", type=click.Path(file_okay=False, path_type=Path),
              help="Make a standalone git repository here [default: ./<component>-<target>; a target with several "
                   "components and no --component: each component into its own].")
@click.option("--into-clone", "repo_dir", type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="Instead: add the branch to this existing clone (its checkout, index and changes are untouched).")
@alias("--repo-dir", "repo_dir", "--into-clone", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--branch", help="Branch to create [default: kvforge/<target>; kvforge/<target>-<component> for a "
                                "target's second component].")
@click.option("--keep-conflict", is_flag=True,
              help="On failure, leave the tree at the failing patch with conflict markers (git am in progress).")
@base_json_cache
def apply_cmd(cache: Cache, target_name: str, component: str | None, into: Path | None, repo_dir: Path | None,
              branch: str | None, keep_conflict: bool, source: str, repo_url: str | None, as_json: bool) -> None:
    """Apply a target's series to its base: one commit per patch, on a branch in a tree you own.

    \b
    --into DIR      a standalone repository (objects copied, no link to the cache): the base is
                    tagged kvforge/base/<target>, the branch checked out. Deleting the cache
                    never affects it.
    --into-clone D  the branch (and base tag) fetched into your existing clone D.

    A target with several components (v0.20.2rc: vllm, then vllm-ascend) without --component
    applies each into ./<component>-<target>, every series prepared before any tree is made.

    Transactional: the series is applied in kvforge's own worktree and your tree or branch appears
    only when every patch is in. If a patch fails, nothing is left and the error names the patch,
    file, hunk and line. Re-running is a no-op when the branch already holds exactly this series;
    a branch that differs (your work) is never touched: the refusal says how to keep it.
    """
    from kvforge.flow import apply
    from kvforge.project import targets

    if component is None and (into is not None or repo_dir is not None):
        comps = targets.load_target(target_name).components
        if len(comps) > 1:  # one tree named: the target's first component, said (as every command's default)
            component = comps[0].name
            progress(f"{target_name} has {len(comps)} components ({', '.join(c.name for c in comps)}) and "
                     f"{'--into' if into is not None else '--into-clone'} names one tree: {component}, the first "
                     "(--component NAME for another)")
    ctx = make_ctx(cache, target_name, component, source=source, repo_url=repo_url)
    finish(apply.apply_command(ctx, component, into, repo_dir, branch, keep_conflict), as_json, fit_text=True)


@command("lint")
@targets_option("Lint only these targets' series (repeatable) [default: all].")
@component_option_for(EVERY_COMPONENT)
@click.option("--selections", is_flag=True,
              help="Also check that every test path of every platform selection (cpu, cuda, npu) exists in its "
                   "base (materialises the bases into the cache).")
@click.option("--collect", is_flag=True,
              help="Implies --selections: also collect the cuda selections on CPU (pytest --collect-only) in the "
                   "base and the patched tree; modules that do not import on CPU are checked by path, and said so.")
@click.option("--no-audit", "no_audit", is_flag=True,
              help="Skip the audit of each series (kvforge audit: risky changes its headers do not acknowledge), "
                   "which reads the bases from the cache or the network; headers and diffs are still checked.")
@click.option("--strict", is_flag=True, help="Fail (exit 1) on header fields still to review (a `Review:` trailer); "
                                             "default: a warning.")
@json_option
@with_cache
def lint_cmd(cache: Cache, target_names: tuple[str, ...], component: str | None, selections: bool, collect: bool,
             no_audit: bool, strict: bool, as_json: bool) -> None:
    """Check every series: files listed once, headers valid, diffs parse, no path escapes the tree, and no
    risky change (a decorator moved or lost, a definition removed while referenced, a public signature changed,
    a module-level call added) that its patch's header does not acknowledge (`Acknowledges:`). Header fields
    kvforge proposed and nobody reviewed yet (`Review:`) are warnings, errors with --strict.

    With --selections, also every test selection against its base (exit 1 when a path is missing)."""
    from kvforge.project import headers
    from kvforge.proof import selection

    finish(headers.with_review(selection.lint_command(cache, target_names, component, selections, collect, progress,
                                                     audit_series=not no_audit),
                               target_names, component, strict), as_json)


@command("audit")
@target_option
@component_option_for(EVERY_COMPONENT)
@click.option("--format", "fmt", type=click.Choice(["table", "markdown", "json"]), default="table",
              show_default=True, help="How to print the change list.")
@base_options
@from_option
@json_option
@with_cache
def audit_cmd(cache: Cache, target_name: str, component: str | None, fmt: str, source: str, repo_url: str | None,
              from_rev: str | None, as_json: bool) -> None:
    """What each patch changes in the program, per definition: added, removed, renamed, moved; decorators;
    signatures; base classes; module-level statements; removed names still referenced. Risky changes its
    header does not acknowledge (`Acknowledges:`, see the patch format) exit 1, as `kvforge lint` does."""
    from kvforge.proof import audit

    component = tree_component(target_name, component, from_rev)
    ctx = make_ctx(cache, target_name, component, source=source, repo_url=repo_url, from_rev=from_rev)
    finish(audit.audit_command(ctx, "json" if as_json else fmt, component), as_json or fmt == "json")


@command("status")
@click.option("--check", is_flag=True,
              help="Evaluate every patch's Drop-When against its target's base: which could be dropped now "
                   "(materialises the bases into the cache).")
@json_option
@with_cache
def status_cmd(cache: Cache, check: bool, as_json: bool) -> None:
    """Fixes x targets: what each target carries, with its upstream status, or why it needs no patch,
    and the patches `kvforge rebase` dropped (with the signals that said upstream has them).

    --check: each patch's Drop-When (version >= X, base-contains C, upstream-pr-merged URL, never)
    against its target's base: drop now, keep, or cannot tell here (an sdist base has no history;
    a PR's state needs the network).
    """
    from kvforge.flow import status

    finish(status.status_command(cache, check, progress), as_json, fit_text=True)


@command("report")
@targets_option("Only this target (repeatable) [default: every target].")
@click.option("--format", "fmt", type=click.Choice(["table", "markdown", "trend"]), default="table",
              show_default=True,
              help="table: for a terminal; markdown: for an issue or a job summary; trend: one JSON line of "
                   "totals to append to a file (a trend over runs).")
@json_option
@with_cache
def report_cmd(cache: Cache, target_names: tuple[str, ...], fmt: str, as_json: bool) -> None:
    """What carrying each fix costs, per fix and target: since when and in which releases it is carried,
    its Upstream-Status and PR, whether its Drop-When is met on the newest release a target follows (the newest
    target per component), whether its verify
    evidence is current or stale, and its churn (commits that changed the patch file, rebase drops).

    \b
    Totals by Upstream-Status as Yocto's patchreview counts them and by forwarding as Debian's UDD
    does. --json: every row and the totals (schema: `kvforge help report`); --format trend: one line,
    e.g. `kvforge report --format trend >> carrying.jsonl` in a scheduled job.
    Materialises the bases into the cache, as `kvforge status --check` does.
    """
    from kvforge.flow import carrying

    finish(carrying.report_command(cache, target_names, fmt, progress), as_json, fit_text=fmt == "table")


@command("export")
@target_option
@component_option_for("the one `kvforge apply` recorded in the tree (git config kvforge.component)")
@from_option
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              help="Series directory to write [default: the target's series].")
@click.option("--renumber", is_flag=True,
              help="Name every file NNNN-<Fix-Id>.patch by its position (default: keep existing names).")
@base_json_cache
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


COMMANDS = [targets_cmd, target_group, base_cmd, apply_cmd, lint_cmd, audit_cmd, status_cmd, report_cmd, export_cmd]
