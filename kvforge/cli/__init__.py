"""The `kvforge` command line: parse options, build one Context, call one library function and
`finish` its outcome (kvforge.core.outcome): the one place that prints a result or an error and exits.

One module per group of commands (series, proof, wheels, upstream), each command thin; `options` holds the
options they share and the decorators that give every command --cache-dir (a global option that works before
or after the subcommand); `finish` owns how a command ends. This module makes the root group, adds every
command to it and is the console script's entry point (`main`).

Imports: each command imports its library module when it runs (`from kvforge.flow import rebase` inside the
command), so that `kvforge --help` and shell completion load click and kvforge's small core only; nothing
imports cli, so these imports close no cycle (tests/test_layout.py).

Errors: a KvforgeError goes through `finish` too: one line on stderr (with --json also {"error",
"exit", **data} on stdout) and its exit code; a click usage error exits 2 the same way; anything
else is a bug in kvforge: one line, the traceback saved to a file, exit 70.
"""

from __future__ import annotations

import click

from kvforge import __version__
from kvforge.core.cache import Cache
from kvforge.core.errors import EXIT_CODES
from kvforge.cli import adopt, help, proof, series, upstream, wheels
from kvforge.cli.finish import VERBOSITY, finish, progress, run_cli
from kvforge.cli.options import Group, cache_option

__all__ = ["cli", "finish", "main", "progress"]


class RootGroup(Group):
    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        run_cli(self, args, prog_name, **extra)


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


for _module in (series, proof, wheels, upstream, adopt, help):
    for _command in _module.COMMANDS:
        cli.add_command(_command)

main = cli  # the console script and tests call main(): RootGroup.main runs run_cli
