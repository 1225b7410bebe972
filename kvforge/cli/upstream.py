"""The commands that move fixes between upstream and the series: rebase, watch, port, pick, pr, notes, and
init (a new patch repository). Each finishes the outcome of one library function, imported when the command
runs; --continue / --skip / --abort are checked here, before any work."""

from __future__ import annotations

from pathlib import Path

import click

from kvforge.core.cache import Cache
from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.cli.finish import finish, progress
from kvforge.cli.options import (REPO_HELP, alias, base_json_cache, command, complete_fixes, complete_targets,
                                 component_option, component_option_for, dry_run_option, from_option, json_option,
                                 make_ctx, target_option, targets_option, tree_component, with_cache)


@command("rebase")
@target_option
@component_option
@click.option("--onto", metavar="VERSION|REF",
              help="The release to move onto (its PyPI sdist, sha256 from PyPI), or a git ref with --repo.")
@click.option("--as", "as_target", metavar="NEWTARGET",
              help="Write a new target (targets/NEWTARGET.toml, patches/NEWTARGET/) instead of moving this one.")
@dry_run_option("Print the plan (verdict and signals per patch); write nothing.")
@click.option("--checks", is_flag=True,
              help="Also run each patch's Checks on the new base without the patch (slow: the new base's test env).")
@click.option("--continue", "do_continue", is_flag=True, help="Resume after resolving a conflict (carry the patch).")
@click.option("--skip", "do_skip", is_flag=True, help="Drop the patch the rebase stopped at (recorded in the ledger).")
@click.option("--abort", "do_abort", is_flag=True, help="Stop the rebase; patches/ and targets/ stay as they were.")
@base_json_cache
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
    runner = None
    if checks:  # the env and proof layers, loaded only when the Checks run
        from kvforge.flow.behaviour import checks_signal
        runner = checks_signal
    finish(rebase.run(ctx, actions[0] if actions else "start", onto, as_target, dry_run, runner), as_json)


@command("watch")
@click.option("--since", metavar="VERSION", help="Only releases newer than this one [default: newer than each "
                                                 "target's base].")
@targets_option("Watch only these targets (repeatable) [default: every target whose lifecycle is maintained].")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "markdown"]), default="table",
              show_default=True, help="The report: a table, JSON, or markdown (one section per release).")
@click.option("--source", type=click.Choice(["auto", "git", "sdist"]), default="sdist", show_default=True,
              help="Where each new base comes from: the release's PyPI sdist (cached), or git (auto: a cached or "
                   "reachable upstream clone first).")
@click.option("--apply", "apply", is_flag=True,
              help="For each new vLLM release that is clean for every target moving to it and that no target has "
                   "yet: `kvforge target add VERSION` (writes targets/ and patches/; stops at the first that stops).")
@click.option("--checks", "checks", type=click.IntRange(min=0), default=None, metavar="N",
              help="At most N Checks runs (pytest) for the conflict rows; a result cached by release, patch and "
                   "environment costs none; 0: no Checks [default: $KVFORGE_WATCH_CHECKS, else no limit].")
@json_option
@with_cache
def watch_cmd(cache: Cache, since: str | None, target_names: tuple[str, ...], fmt: str, source: str, apply: bool,
              checks: int | None, as_json: bool) -> None:
    """New vLLM / vllm-ascend releases against every maintained target: what a rebase onto each would do.

    \b
    Reads the release lists of each component's package on PyPI ($KVFORGE_PYPI_URL for another
    index). For every release newer than a target's base (pre-releases only for a component whose
    base is one, as vllm-ascend's rc's), a dry-run rebase of that component onto it (nothing is
    written; sdists are downloaded once into the cache): per patch carried / upstream (with the
    signals) / conflict / disagree, its Drop-When evaluated there, and the release's wheels per
    platform. Targets with lifecycle = "eol" are not watched.

    \b
    A conflict or disagreement is decided by behaviour: the patch's Checks run on the release
    without it (all pass: upstream (by behaviour); a behavioural failure: needed), then the nearest
    variant of the fix is ported with git am -3 and its Checks run (port proven), else the row
    needs a person and says where to start. Each row's decision and the release's cost (rows that
    need a person) are in every format (docs/watch.md).

    \b
    Exit 0: nothing new, or new releases and all clean ("status" in --json says which);
    exit 3: attention needed (a conflict, a disagreement, a wheel the target pins missing, a failed
    check; said as "kvforge: attention:", a result, not a failure; 6 when one failed on the network). --json (or --format json) gives every release with its
    markdown body and issue title, for the scheduled workflow (ci/github/kvforge-watch.yml).
    """
    from kvforge.flow import watch

    finish(watch.watch(cache, target_names, since, "json" if as_json else fmt, source, progress, apply, checks),
           as_json or fmt == "json", fit_text=fmt == "table")


@command("port")
@click.argument("fix_id", metavar="FIX", shell_complete=complete_fixes)
@click.option("--target", "-t", "to_target", metavar="TARGET", shell_complete=complete_targets,
              help="The target to make a variant for (required).")
@alias("--to", "to_target", "-t/--target", metavar="TARGET")
@click.option("--from-target", metavar="TARGET", shell_complete=complete_targets,
              help="Start from this target's variant [default: the newest other].")
@click.option("--into", type=click.Path(file_okay=False, path_type=Path),
              help="The tree to make [default: ./<component>-<target>-<fix>].")
@component_option
@base_json_cache
def port_cmd(cache: Cache, fix_id: str, to_target: str | None, from_target: str | None, into: Path | None,
             component: str | None, source: str, repo_url: str | None, as_json: bool) -> None:
    """Start a variant of one fix for another target: a tree of yours with the target's series and the
    fix applied three-way on top (header and Fix-Id carried over), conflicts left to resolve.

    Then: resolve, `git am --continue`, `kvforge verify -t TARGET --from DIR`, `kvforge export -t
    TARGET --from DIR`. Exit 3 when it conflicts (the tree is left at the conflict).
    """
    from kvforge.flow import port

    if not to_target:
        raise KvforgeError("kvforge port FIX needs -t/--target TARGET: the target to make a variant for", EXIT_USAGE)
    ctx = make_ctx(cache, to_target, component, source=source, repo_url=repo_url)
    finish(port.port(ctx, fix_id, from_target, into), as_json)


@command("pick", epilog="""\b
Exit codes:
   0  every target present, carried or picked (and proven, with --verify); the series written
   2  bad input: SOURCE, an option, a tree in the way, a pick already in progress
   3  a target conflicts, needs a prerequisite or its signals disagree: nothing written, the
      state kept for --continue (trees left at the conflict)
   4  --verify: a picked patch is not proven: nothing written
   6  a PR could not be fetched (offline: download pull/N.patch and pick the file)""")
@click.argument("source", required=False, metavar="SOURCE")
@click.option("--repo", "repo_dir", type=click.Path(file_okay=False, path_type=Path), metavar="DIR",
              help=f"{REPO_HELP}, here a local clone: SOURCE is a commit (or A..B, picked as one change) of it.")
@click.option("--target", "-t", "targets", multiple=True, metavar="NAME", shell_complete=complete_targets,
              help="Pick into this target (repeatable) [default: every target with the change's component].")
@click.option("--component", metavar="NAME", help="The change's component [default: from the repository: vllm].")
@click.option("--fix-id", metavar="ID", help="The Fix-Id [default: a slug of the subject].")
@click.option("--signoff", metavar="'NAME <EMAIL>'", help="The carrier's Signed-off-by [default: git's user].")
@click.option("--into", "tree_dir", type=click.Path(file_okay=False, path_type=Path), metavar="DIR",
              help="Where conflict trees are made [default: the current directory].")
@click.option("--exclude", multiple=True, metavar="TARGET", help="Leave this target out (with --continue too).")
@click.option("--after", metavar="FIX", shell_complete=complete_fixes, help="Place the patch right after the patch with this Fix-Id in each series "
                                             "(the later ones re-applied over it, or the pick is refused, exit 3) "
                                             "[default: appended].")
@dry_run_option("Print the verdicts; write nothing, leave no tree.")
@click.option("--verify", is_flag=True, help="Prove the picked patch on each target where it applies (kvforge "
                                              "verify); nothing is written unless every one is proven.")
@click.option("--continue", "do_continue", is_flag=True, help="Take the resolved trees into the series and write.")
@click.option("--abort", "do_abort", is_flag=True, help="Forget a stopped pick (patches/, targets/ and your trees "
                                                        "stay as they are).")
@click.option("--source", "source_policy", type=click.Choice(["auto", "git", "sdist"]), default="auto",
              show_default=True, help="Where the targets' bases come from (as for the other commands).")
@json_option
@with_cache
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
    (present targets get an in_base entry). See `kvforge help pick`.
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
         "in it sets the title). See `kvforge help pr` for the data it gets.")
text_out_option = click.option("--out", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
                               help="Write the text to FILE instead of stdout.")
text_allow_stale_option = click.option(
    "--allow-stale", is_flag=True,
    help="Use evidence recorded for another series or base, and say so in the text [default: refuse, exit 4].")


@command("pr", epilog=TEXT_EXIT_HELP)
@target_option
@component_option_for("with --from DIR, the component DIR was applied for; else the one whose patch for the fix "
                      "has a PR route")
@click.option("--fix", "fix_id", required=True, metavar="FIX-ID", shell_complete=complete_fixes,
              help="The Fix-Id of the patch to describe.")
@click.option("--style", type=click.Choice(["vllm", "vllm-ascend"]), default=None,
              help="Only a check: the style follows the component's upstream (vllm: [Tag] title and the base's own "
                   "PR template; vllm-ascend: [Branch][Module][Action] title, its three-section template); a "
                   "different --style is exit 2.")
@text_template_option
@text_out_option
@text_allow_stale_option
@click.option("--open", "open_in_gh", is_flag=True,
              help="Open the PR: re-apply the fix onto the upstream branch of your clone of the upstream repository "
                   "(--repo CLONE, git am -3; "
                   "conflicts are exit 3), push it to --push-to as fix/<FIX-ID>, check the pushed branch, then "
                   "`gh pr create --draft --base BRANCH --head ...` (exit 5 without gh).")
@click.option("--push-to", "push_to", metavar="REMOTE|URL",
              help="With --open: your fork, as a remote name of the --repo clone or a URL; the branch is pushed there.")
@from_option
@base_json_cache
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
    component = tree_component(target_name, component, from_rev)
    if component is None:
        component = prpolicy.component_for_pr(targets.load_target(target_name), fix_id)
    ctx = make_ctx(cache, target_name, component, source=source, repo_url=repo_url, from_rev=from_rev)
    finish(pr.pr_command(ctx, fix_id, style, template_path, allow_stale, out, gh, push_to), as_json)


@command("notes", epilog=TEXT_EXIT_HELP)
@target_option
@component_option
@text_template_option
@text_out_option
@text_allow_stale_option
@from_option
@base_json_cache
def notes_cmd(cache: Cache, target_name: str, component: str | None, template_path: Path | None, out: Path | None,
              allow_stale: bool, from_rev: str | None, source: str, repo_url: str | None, as_json: bool) -> None:
    """Release notes for a patched build: base and series identity, one entry per fix.

    Each fix with its upstream status, its verify evidence (and bench figures where it has a
    scenario) and when to drop it; the fixes the base already has; shortlog, diffstat and
    base-commit as in a b4 cover letter. Evidence rules as for `kvforge pr`.
    """
    from kvforge.flow import pr

    component = tree_component(target_name, component, from_rev)
    ctx = make_ctx(cache, target_name, component, source=source, repo_url=repo_url, from_rev=from_rev)
    finish(pr.notes_command(ctx, template_path, allow_stale, out), as_json)


@command("init")
@click.argument("dest", metavar="[DIR]", type=click.Path(path_type=Path), default=Path("."), required=False)
@click.option("--upstream", type=click.Choice(["vllm", "vllm-ascend"]), default="vllm", show_default=True,
              help="What the series patch: vLLM, or vllm-ascend (on the vLLM release it is built on).")
@click.option("--release", metavar="VERSION",
              help="Write a first target for this release (vllm 0.20.2, vllm-ascend 0.20.2rc1): its PyPI sdist pinned "
                   "by sha256 (read from the package index), an empty series, vLLM's KV-cache manager CPU tests.")
@click.option("--as", "name", metavar="NAME", help="The first target's name [default: v<VERSION>].")
@alias("--name", "name", "--as", metavar="NAME")
@click.option("--install", metavar="REQUIREMENT",
              help="The pip requirement CI installs kvforge from (e.g. 'kvforge @ git+https://host/org/kvforge@v0.1.0') "
                   "[default: the git remote and commit this kvforge was installed from, else a wheel of this kvforge "
                   "written into the repository's ci/; never a path of this machine].")
@json_option
@with_cache
def init_cmd(cache: Cache, dest: Path, upstream: str, release: str | None, name: str | None, install: str | None,
             as_json: bool) -> None:
    """Make DIR (default: the current directory) a new patch repository run by this (installed) kvforge:
    targets/, patches/, a README with the two commands (install kvforge, run the checks and CPU jobs),
    .gitignore, the CI files (.github/workflows/kvforge.yml and kvforge-watch.yml, .buildkite/pipeline.yml)
    and a git repository with a first commit.

    \b
    CI installs kvforge from --install, else from the git remote this kvforge came from, else from a
    wheel of this kvforge that init writes into ci/ (see `kvforge help init`).
    All or nothing: DIR must not exist or be empty. A new DIR is made beside and renamed into place
    in one step; an existing empty DIR (`.`) is written in place, never replaced. kvforge finds the
    project from the current directory (or $KVFORGE_ROOT) afterwards.
    """
    from kvforge.ci import scaffold

    finish(scaffold.init_command(dest, upstream, release, name, install, cache, progress), as_json)


COMMANDS = [rebase_cmd, watch_cmd, port_cmd, pick_cmd, pr_cmd, notes_cmd, init_cmd]
