"""`--repo` naming a directory that does not exist (kvforge.git.bases, for base, apply, port and every command that
fetches a git base): one line naming it and saying it does not exist, exit 2, nothing made in the cache; not
git's "Please make sure you have the correct access rights and the repository exists." (issue 21)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvforge.cli import main


def kvforge(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("command", [["base", "-t", "fake"], ["apply", "-t", "fake", "--into", "TREE"],
                                     ["test", "-t", "fake", "--base"]])
@pytest.mark.parametrize("missing", ["/nonexistent", "ABS/gone", "file://ABS/gone", "relative/gone"])
def test_repo_naming_a_missing_directory_is_one_line_exit_2(fake, tmp_path, monkeypatch, command, missing):
    monkeypatch.chdir(tmp_path)
    missing = missing.replace("ABS", str(tmp_path))
    args = [a.replace("TREE", str(tmp_path / "tree")) for a in command]
    res = kvforge(*args, "--repo", missing)
    assert res.exit_code == 2, res.output
    [line] = [ln for ln in res.stderr.splitlines() if ln.startswith("kvforge: error:")]
    assert line == (f"kvforge: error: {missing}: no such directory (the repository vllm v1 is fetched from: --repo, "
                    f"$KVFORGE_VLLM_REPO or the target's repo; a git clone or a URL)")
    assert "repository exists" not in res.output and "fetching" not in res.output
    assert not (fake.cache / "repos" / "vllm-git.git").exists() and not (tmp_path / "tree").exists()
    res = kvforge(*args, "--repo", missing, "--json")
    assert res.exit_code == 2 and json.loads(res.stdout)["exit"] == 2


def test_repo_naming_a_clone_still_fetches(fake, tmp_path):
    res = kvforge("base", "-t", "fake", "--repo", str(fake.upstream), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["commit"] == fake.base
