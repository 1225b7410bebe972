"""The options commands share, `--cache-dir` on every command, and the decorators that make a command.

`command(name)` and `group(name)` make a subcommand or a nested group (of `Group`, whose commands get
--cache-dir too); kvforge.cli.LAZY names them for the root group. `make_ctx` builds the one Context a command
passes to its library function; it imports kvforge.git.context only when a command runs.

Vocabulary (README.md "Options"): one meaning per option name across commands. `-t/--target` a target;
`--from` a tree or revision (REV|DIR|DIR:REV); `--from-target` a target to start from; `--repo` the upstream git
repository (a URL or a local clone) kvforge reads from; `--into` a tree kvforge makes; `--out` files kvforge writes;
`--as` the name of what kvforge makes; `--json` the JSON document (`--format json` where a command has --format).
An old spelling is a hidden alias (`alias`) for one release, said once on stderr when used. Each option (or block
of options several commands share) is one decorator here, so its meaning and help are written once.
"""

from __future__ import annotations

import functools
from pathlib import Path

import click

from kvforge.core.cache import Cache
from kvforge.cli.finish import handle_errors, progress


def make_ctx(cache: Cache, target_name: str, component: str | None = None, **kw):
    from kvforge.git.context import Context

    return Context.load(cache, target_name, component, progress=progress, **kw)


def complete_targets(_ctx, _param, incomplete: str) -> list[str]:
    """Shell completion of target names: the files in the project's targets/ (nothing outside a project)."""
    from kvforge.project.targets import project_root

    try:
        root = project_root()
    except Exception:
        return []
    return sorted(p.stem for p in (root / "targets").glob("*.toml") if p.stem.startswith(incomplete))


def complete_fixes(_ctx, _param, incomplete: str) -> list[str]:
    """Shell completion of Fix-Ids: every series' patch file names without their NNNN- prefix and .patch, and
    the Fix-Ids in their headers."""
    import re

    from kvforge.project.targets import project_root

    try:
        root = project_root()
    except Exception:
        return []
    found: set[str] = set()
    for patch in (root / "patches").glob("*/*.patch"):
        found.add(re.sub(r"^\d+-", "", patch.stem))
        try:
            head = patch.read_text(encoding="utf-8", errors="replace").split("\ndiff --git", 1)[0]
        except OSError:
            continue
        found.update(m.group(1) for m in re.finditer(r"^Fix-Id:\s*(\S+)", head, re.M))
    return sorted(f for f in found if f.startswith(incomplete))


def alias(old: str, param: str, new: str, metavar: str | None = None, type=None):
    """`old` (an option's spelling before the one vocabulary) as a hidden alias of the parameter `param`, spelled
    `new` now, for one release: its value goes to `param` when `new` was not given, and a warning says so."""
    hidden = f"alias_{param}"

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            value = kwargs.pop(hidden, None)
            if value is not None:
                click.echo(f"kvforge: warning: {old} is the old spelling of {new} (kept for one release)", err=True)
                if kwargs.get(param) is None:
                    kwargs[param] = value
            return fn(*args, **kwargs)

        return click.option(old, hidden, hidden=True, metavar=metavar, type=type)(wrapper)

    return decorate


target_option = click.option("--target", "-t", "target_name", required=True, metavar="NAME",
                             shell_complete=complete_targets,
                             help="Release target (a file in targets/, e.g. v0.20.2rc).")
json_option = click.option("--json", "as_json", is_flag=True,
                           help="Print machine-readable JSON on stdout (errors too: {\"error\", \"exit\"}); never "
                                "fitted to the terminal.")
source_option = click.option("--source", type=click.Choice(["auto", "git", "sdist"]), default="auto",
                             show_default=True,
                             help="Where the base comes from: auto uses a cached base, else --repo or a reachable "
                                  "upstream, else the PyPI sdist (offline-capable).")
REPO_HELP = "The upstream git repository (a URL or a local clone) kvforge reads from"
repo_option = click.option("--repo", "repo_url", metavar="URL|DIR",
                           help=f"{REPO_HELP}: the base ref is taken from it (implies --source git).")


def component_option_for(default: str):
    """--component, its help saying what the command does without it on a target of several components."""
    return click.option("--component", metavar="NAME",
                        help=f"Only this component of the target (vllm, vllm-ascend) [default: {default}].")


EVERY_COMPONENT = "every component of the target, in order; with --from DIR, the component DIR was applied for"
FIRST_COMPONENT = "the target's first component (vllm); with --from DIR, the component DIR was applied for"
component_option = component_option_for(FIRST_COMPONENT)


def tree_component(target_name: str, component: str | None, from_rev: str | None) -> str | None:
    """--component for a command given one tree (--from) on a target of several components and no --component:
    the component `kvforge apply` recorded in that tree (git config kvforge.component), as export has always
    taken it; refused (exit 2) when the tree records none. Else `component` unchanged."""
    if component is not None or not from_rev:
        return component
    from kvforge.env import components
    from kvforge.project import targets

    return components.component_of_tree(targets.load_target(target_name), from_rev)
from_option = click.option("--from", "from_rev", metavar="REV|DIR|DIR:REV",
                           help="Use the commits base..REV of a tree as the series instead of the series files: "
                                "REV in the current directory's repository, a tree DIR (its HEAD), or DIR:REV.")
python_option = click.option("--python", "python", type=click.Path(dir_okay=False, path_type=Path),
                             help="Run with this interpreter (an existing env with torch); missing packages go into "
                                  "an overlay in the cache, never into it [env KVFORGE_PYTHON].")
torch_index_option = click.option("--torch-index", metavar="URL",
                                  help="Package index to take the CPU torch wheel from [env KVFORGE_TORCH_INDEX; "
                                       "default: PyTorch's CPU index, then pip's find-links].")


def stacked(*decorators):
    """One decorator for `decorators`, applied as if written one per line in this order (the first outermost)."""

    def apply(fn):
        for decorate in reversed(decorators):
            fn = decorate(fn)
        return fn

    return apply


# Where a command's base comes from: --source, --repo.
base_options = stacked(source_option, repo_option)
# The command's first parameter is the Cache (the root group's obj); a KvforgeError ends it through `finish`.
with_cache = stacked(click.pass_obj, handle_errors)
# The last lines of a command on a target's base: --source, --repo, --json; the Cache first, errors through `finish`.
base_json_cache = stacked(base_options, json_option, with_cache)
# The options of every command that tests or builds a tree: --from, --python, --torch-index, --source, --repo, --json.
tree_options = stacked(from_option, python_option, torch_index_option, base_options, json_option)


def targets_option(help: str):
    """-t/--target, repeatable: the targets a command over several targets looks at."""
    return click.option("--target", "-t", "target_names", multiple=True, metavar="NAME",
                        shell_complete=complete_targets, help=help)


def dry_run_option(help: str):
    """--dry-run: `help` says what is printed; nothing is written."""
    return click.option("--dry-run", is_flag=True, help=help)


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
    """A subcommand with --cache-dir (kvforge.cli.LAZY names it for the root group)."""
    decorator = click.command(name, **kwargs)
    return lambda fn: decorator(cache_option(fn))


def group(name: str, **kwargs):
    """A nested group whose commands get --cache-dir."""
    kwargs.setdefault("cls", Group)
    return click.group(name, **kwargs)
