"""`kvforge help [TOPIC]`: the documentation a pip-installed kvforge carries, so every `--help` pointer
(`kvforge help targets`) works without a checkout.

Topics: each docs/*.md of the project, shipped as package data (kvforge/data/docs), and `readme`, the README as
the package metadata's long description. Owns nothing else.
"""

from __future__ import annotations

from importlib import metadata

import click

from kvforge import DATA
from kvforge.cli.finish import finish, handle_errors
from kvforge.cli.options import command
from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.core.outcome import Done

DOCS = DATA / "docs"


def topics() -> list[str]:
    return sorted({p.stem for p in DOCS.glob("*.md")} | {"readme"})


def topic_text(topic: str) -> str:
    """The text of `topic` (a docs/*.md name without .md, or readme)."""
    name = topic.removesuffix(".md").removeprefix("docs/").lower()
    if name == "readme":
        try:  # the body of METADATA (after its headers) is the long description: README.md
            text = (metadata.distribution("kvforge").read_text("METADATA") or "").split("\n\n", 1)[-1]
        except metadata.PackageNotFoundError:
            text = None
        readme = DATA.parent.parent / "README.md"
        if not text and readme.is_file():
            text = readme.read_text(encoding="utf-8")
        if text:
            return str(text)
    elif (DOCS / f"{name}.md").is_file():
        return (DOCS / f"{name}.md").read_text(encoding="utf-8")
    raise KvforgeError(f"no help topic {topic!r}; topics: {', '.join(topics())}", EXIT_USAGE)


def _complete(_ctx, _param, incomplete: str) -> list[str]:
    return [t for t in topics() if t.startswith(incomplete)]


@command("help")
@click.argument("topic", required=False, metavar="TOPIC", shell_complete=_complete)
@handle_errors
def help_cmd(topic: str | None) -> None:
    """Print a documentation topic (the docs kvforge ships): `kvforge help` lists them, `kvforge help targets`
    prints docs/targets.md. A command's own options: `kvforge COMMAND --help`."""
    if topic is None:
        finish(Done({"topics": topics()}, "kvforge help TOPIC, with TOPIC one of:\n"
                    + "\n".join(f"  {t}" for t in topics())), False)
    finish(Done({"topic": topic}, topic_text(topic)), False)


COMMANDS = [help_cmd]
