"""The options commands share, `--cache-dir` on every command, and the decorators that make a command.

`command(name)` and `group(name)` make a subcommand or a nested group (of `Group`, whose commands get
--cache-dir too); kvforge.cli adds them to the root group. `make_ctx` builds the one Context a command
passes to its library function; it imports kvforge.git.context only when a command runs.
"""

from __future__ import annotations

from pathlib import Path

import click

from kvforge.core.cache import Cache
from kvforge.cli.finish import progress


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


def command(name: str, **kwargs):
    """A subcommand with --cache-dir (kvforge.cli adds it to the root group)."""
    decorator = click.command(name, **kwargs)
    return lambda fn: decorator(cache_option(fn))


def group(name: str, **kwargs):
    """A nested group whose commands get --cache-dir."""
    kwargs.setdefault("cls", Group)
    return click.group(name, **kwargs)
