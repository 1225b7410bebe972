"""The `kvforge` command line: parse options, build one Context, call one library function and
`finish` its outcome (kvforge.core.outcome): the one place that prints a result or an error and exits.

One module per group of commands (series, proof, wheels, upstream, adopt, help), each command thin; `options`
holds the options they share and the decorators that give every command --cache-dir (a global option that works
before or after the subcommand); `finish` owns how a command ends. This module makes the root group and is the
console script's entry point (`main`).

Imports: the root group loads its commands lazily (click's "Lazily Loading Subcommands"): `LAZY` names each
command's module, attribute and one-line help, so `kvforge --help` and the completion of command names import
no command module, and `kvforge rebase` imports kvforge.cli.upstream (whose commands import their library module
when they run: `from kvforge.flow import rebase` inside the command) and nothing of the other groups. A test
checks `LAZY` against the commands themselves (tests/test_cli.py).

Errors: a KvforgeError goes through `finish` too: one line on stderr (with --json also {"error",
"exit", **data} on stdout) and its exit code; a click usage error exits 2 the same way; anything
else is a bug in kvforge: one line, the traceback saved to a file, exit 70.
"""

from __future__ import annotations

import importlib

import click
from click.shell_completion import CompletionItem

from kvforge import __version__
from kvforge.core.cache import Cache
from kvforge.core.errors import EXIT_CODES
from kvforge.cli.finish import VERBOSITY, finish, progress, run_cli
from kvforge.cli.options import Group, cache_option

__all__ = ["LAZY", "cli", "finish", "main", "progress"]

# Every command: its module in kvforge.cli, the attribute holding it there, and its one-line help (the first
# sentence of its docstring, what `kvforge --help` lists).
LAZY: dict[str, tuple[str, str, str]] = {
    "targets": ("series", "targets_cmd", "List the release targets and their components."),
    "target": ("series", "target_group", "Make targets: `kvforge target add VERSION` (see `kvforge help targets`)."),
    "base": ("series", "base_cmd", "Materialise a target's base (upstream release) as a commit in the cache."),
    "apply": ("series", "apply_cmd",
              "Apply a target's series to its base: one commit per patch, on a branch in a tree you own."),
    "lint": ("series", "lint_cmd",
             "Check every series: files listed once, headers valid, diffs parse, no path escapes the tree, and no "
             "risky change (a decorator moved or lost, a definition removed while referenced, a public signature "
             "changed, a module-level call added) that its patch's header does not acknowledge (`Acknowledges:`)."),
    "audit": ("series", "audit_cmd",
              "What each patch changes in the program, per definition: added, removed, renamed, moved; decorators; "
              "signatures; base classes; module-level statements; removed names still referenced."),
    "status": ("series", "status_cmd",
               "Fixes x targets: what each target carries, with its upstream status, or why it needs no patch, and "
               "the patches `kvforge rebase` dropped (with the signals that said upstream has them)."),
    "report": ("series", "report_cmd",
               "What carrying each fix costs, per fix and target: since when and in which releases it is carried, "
               "its Upstream-Status and PR, whether its Drop-When is met on the newest release a target follows (the "
               "newest target per component), whether its verify evidence is current or stale, and its churn "
               "(commits that changed the patch file, rebase drops)."),
    "export": ("series", "export_cmd",
               "Write a tree's commits back as the series: one patch per commit since the base, and `series`."),
    "env": ("proof", "env_cmd", "Build (once) the Python environment that runs the target's vLLM CPU tests."),
    "test": ("proof", "test_cmd",
             "Run the target's test selection plus every Checks test of its series with vLLM's own tests."),
    "verify": ("proof", "verify_cmd",
               "Prove every patch: its Checks fail before it and pass after it; the suite passes at the end."),
    "bench": ("proof", "bench_group",
              "Measure a target's base and patched trees by replaying workloads through vLLM's own code."),
    "build": ("wheels", "build_cmd", "Build the target's patched wheels from the release wheels, and verify them."),
    "matrix": ("wheels", "matrix_cmd", "The CI jobs of every target: build, cpu, cuda and npu, each a kvforge command."),
    "rebase": ("upstream", "rebase_cmd",
               "Move a target's series onto a new upstream release, dropping the patches it already has."),
    "watch": ("upstream", "watch_cmd",
              "New vLLM / vllm-ascend releases against every maintained target: what a rebase onto each would do."),
    "port": ("upstream", "port_cmd",
             "Start a variant of one fix for another target: a tree of yours with the target's series and the fix "
             "applied three-way on top (header and Fix-Id carried over), conflicts left to resolve."),
    "pick": ("upstream", "pick_cmd",
             "Pick one upstream change into every target's series, with a verdict per target."),
    "pr": ("upstream", "pr_cmd", "Describe one fix as an upstream pull request: a title, a blank line, the body."),
    "notes": ("upstream", "notes_cmd",
              "Release notes for a patched build: base and series identity, one entry per fix."),
    "init": ("upstream", "init_cmd",
             "Make DIR (default: the current directory) a new patch repository run by this (installed) kvforge: "
             "targets/, patches/, a README with the two commands (install kvforge, run the checks and CPU jobs), "
             ".gitignore, the CI files (.github/workflows/kvforge.yml and kvforge-watch.yml, .buildkite/pipeline.yml) "
             "and a git repository with a first commit."),
    "import": ("adopt", "import_cmd",
               "Import a team's existing patches into a target's series, all or nothing."),
    "help": ("help", "help_cmd",
             "Print a documentation topic (the docs kvforge ships): `kvforge help` lists them, `kvforge help targets` "
             "prints docs/targets.md."),
}


class RootGroup(Group):
    """The root group: its commands come from `LAZY`, each module imported when its command is wanted; the
    listing in --help and the completion of command names read `LAZY` only."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        run_cli(self, args, prog_name, **extra)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(LAZY)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in LAZY:
            return None
        module, attr, _help = LAZY[cmd_name]
        command = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
        assert isinstance(command, click.Command)
        return command

    def resolve_command(self, ctx: click.Context, args: list[str]):
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            # click (8.4 on) names close commands from the group's registered ones; here they are LAZY's.
            if getattr(exc, "possibilities", True) or not args:
                raise
            raise type(exc)(args[0], possibilities=sorted(LAZY), ctx=ctx) from None  # type: ignore[call-arg]

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        limit = formatter.width - 6 - max(map(len, LAZY))
        rows = [(name, click.Command(name, help=LAZY[name][2]).get_short_help_str(limit))
                for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def shell_complete(self, ctx: click.Context, incomplete: str) -> list[CompletionItem]:
        names = [CompletionItem(name, help=click.Command(name, help=LAZY[name][2]).get_short_help_str())
                 for name in self.list_commands(ctx) if name.startswith(incomplete)]
        return names + click.Command.shell_complete(self, ctx, incomplete)


def exit_code_help() -> str:
    return "\n".join(f"  {code:>2}  {what}" for code, what in EXIT_CODES.items())


@click.group(cls=RootGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog="\b\nExit codes:\n" + exit_code_help())
@click.version_option(__version__, "-V", "--version", prog_name="kvforge")
@click.option("-q", "--quiet", is_flag=True, help="No progress lines on stderr (warnings and errors still).")
@click.option("-v", "--verbose", is_flag=True, help="An internal error's traceback on stderr too (it is always saved "
                                                    "to a file).")
@cache_option
@click.pass_context
def cli(ctx: click.Context, quiet: bool, verbose: bool) -> None:
    """Carry, prove and measure downstream patch series for vLLM's hybrid KV-cache manager.

    \b
    Typical day:
      kvforge status                           fixes x targets, with upstream status
      kvforge apply -t v0.20.2rc --into DIR    base + series as commits in a repository of your own
      (edit, commit in DIR)
      kvforge verify -t v0.20.2rc --from DIR   prove each of your commits with vLLM's own tests
      kvforge export -t v0.20.2rc --from DIR   write your commits back as the series (all or nothing)

    Documentation: `kvforge help` (the docs ship with kvforge); a command's options: `kvforge COMMAND --help`.
    """
    VERBOSITY["level"] = -1 if quiet else 1 if verbose else 0
    if ctx.obj is None:
        ctx.obj = Cache(None)


main = cli  # the console script and tests call main(): RootGroup.main runs run_cli
