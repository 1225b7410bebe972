"""The commands that bring a team's existing work into kvforge: `import` (a series, an mbox or a fork branch into
a target, all or nothing; kvforge.flow.importer)."""

from __future__ import annotations

from pathlib import Path

import click

from kvforge.core.cache import Cache
from kvforge.cli.finish import finish
from kvforge.cli.options import (command, component_option, dry_run_option, json_option, make_ctx, target_option,
                                 with_cache)


@command("import")
@target_option
@click.argument("source", required=False, metavar="[SOURCE]")
@component_option
@click.option("--order", type=click.Path(dir_okay=False, exists=True, path_type=Path), metavar="FILE",
              help="The order of SOURCE's patch files, one name a line [default: its `series` file, else name "
                   "order].")
@click.option("--repo", "repo", nargs=2, metavar="CLONE BASE..BRANCH",
              help="Import a fork branch: the commits BASE..BRANCH of the clone CLONE, oldest first (no SOURCE).")
@dry_run_option("Propose the headers and apply the patches; write nothing.")
@json_option
@with_cache
def import_cmd(cache: Cache, target_name: str, source: str | None, component: str | None, order: Path | None,
               repo: tuple[str, str] | None, dry_run: bool, as_json: bool) -> None:
    """Import a team's existing patches into a target's series, all or nothing.

    SOURCE: a directory of patch files (plain diffs, `git format-patch` messages, DEP-3 or Yocto quilt
    patches), a `git format-patch` mbox, or a single patch file; or --repo CLONE BASE..BRANCH. Each patch keeps
    its header; kvforge proposes what is missing (Fix-Id, Kind, Upstream-Status, Why, Drop-When, sign-off) and
    names every proposed field in a `Review:` trailer (`kvforge lint` warns until it is reviewed; see
    docs/import.md). The patches apply as `kvforge apply` applies them (one that does not: its file, hunk and
    line, nothing written), on the target's current series.
    """
    from kvforge.flow import importer

    ctx = make_ctx(cache, target_name, component)
    clone = (Path(repo[0]), repo[1]) if repo else None
    finish(importer.import_command(ctx, source, order=order, repo=clone, dry_run=dry_run), as_json)


COMMANDS = [import_cmd]
