"""Every reader of a series directory recovers an interrupted swap (issue 21).

An export killed by SIGKILL inside the two-rename fallback swap (KVFORGE_EXPORT_SWAP=rename, crash step
`export:swap-aside`, the path taken where renameat2's exchange is missing) leaves patches/<t> absent with
both complete versions beside it. lint, status, apply and matrix must finish that swap themselves (the
series is then the exported one), or, when they cannot write there, refuse in one line with the exact
command that finishes it, writing nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import git

from kvforge.cli import main


def kvforge(*args: str):
    return CliRunner().invoke(main, list(args))


def leftovers(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d.parent) if n.startswith(f".{d.name}.kvforge"))


def files_of(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def killed_fallback_export(fake, tmp_path: Path) -> tuple[Path, dict[str, bytes], dict[str, bytes]]:
    """patches/fake with two patches; a tree with the second one's subject changed; an export of it killed
    (SIGKILL) between the fallback's two renames. Returns (series dir, old files, new files)."""
    first = fake.patch("0001-first-fix", {"vllm_like/core.py": ("return 2 * x", "return x + x")}, kind="refactor")
    fake.patch("0002-second-fix", {"vllm_like/core.py": ("return max(lo, x)", "return min(max(lo, x), hi)")},
               kind="refactor", start=first)
    fake.series("0001-first-fix", "0002-second-fix")
    d = fake.root / "patches" / "fake"
    old = files_of(d)
    tree = tmp_path / "tree"
    res = kvforge("apply", "-t", "fake", "--into", str(tree))
    assert res.exit_code == 0, res.output
    message = git(tree, "log", "-1", "--format=%B").replace("[Core] second-fix", "[Core] clamp to hi as well", 1)
    git(tree, "commit", "-q", "--amend", "-m", message)
    env = {**os.environ, "KVFORGE_CRASH_AT": "export:swap-aside", "KVFORGE_EXPORT_SWAP": "rename"}
    proc = subprocess.run([sys.executable, "-c", "from kvforge.cli import main; main()", "export", "-t", "fake",
                           "--from", str(tree)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr  # a real SIGKILL at the step boundary
    assert not d.exists() and leftovers(d) == [".fake.kvforge-new", ".fake.kvforge-old"]
    new = files_of(d.parent / ".fake.kvforge-new")
    assert new != old and b"clamp to hi as well" in new["0002-second-fix.patch"]
    return d, old, new


@contextmanager
def unwritable(directory: Path):
    """`directory` refuses renames in it, even to root: immutable (chattr +i) where the file system has it,
    else read-only for a user who is not root."""
    immutable = subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode == 0 \
        if shutil.which("chattr") else False
    if not immutable:
        os.chmod(directory, 0o555)
    try:
        probe = directory / ".kvforge-probe"
        try:
            probe.mkdir()
        except OSError:
            pass
        else:
            probe.rmdir()
            pytest.skip("cannot make a directory unwritable here (root without chattr)")  # never a pass
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
        else:
            os.chmod(directory, 0o755)


@pytest.mark.parametrize("reader", ["lint", "status", "apply", "matrix"])
def test_each_reader_finishes_a_swap_killed_between_the_fallbacks_renames(fake, tmp_path, reader):
    d, _old, new = killed_fallback_export(fake, tmp_path)
    args = {"lint": ["lint", "--json"], "status": ["status", "--json"],
            "apply": ["apply", "-t", "fake", "--into", str(tmp_path / "again"), "--json"],
            "matrix": ["matrix", "--format", "json"]}[reader]
    res = kvforge(*args)
    assert res.exit_code == 0, res.output
    json.loads(res.stdout)
    # Rolled forward: the series is the exported one, complete, and nothing is left beside it.
    assert files_of(d) == new and leftovers(d) == []
    if reader == "apply":
        assert "clamp to hi as well" in git(tmp_path / "again", "log", "-1", "--format=%s")


def test_a_reader_that_cannot_write_there_names_the_command_that_finishes_it(fake, tmp_path):
    d, old, new = killed_fallback_export(fake, tmp_path)
    patches = d.parent
    with unwritable(patches):
        res = kvforge("lint")
        state = sorted(os.listdir(patches))
    assert res.exit_code == 5, res.output
    [line] = res.stderr.strip().splitlines()
    assert "patches/fake" in line and "interrupted" in line
    assert state == [".fake.kvforge-new", ".fake.kvforge-old"]  # nothing written, nothing deleted
    command = line.split("finish it with: ", 1)[1]
    assert command.startswith("mv ") and "rm" not in command
    subprocess.run(command, shell=True, check=True, cwd=fake.root)  # the command as printed, from the project
    assert files_of(d) == new
    res = kvforge("lint")
    assert res.exit_code == 0, res.output
    # The old version is left whole beside it (garbage the next export or rebase of the series deletes).
    assert leftovers(d) == [".fake.kvforge-old"] and files_of(patches / ".fake.kvforge-old") == old
