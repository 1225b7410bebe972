"""The CLI's contract: one line per error, documented exit codes, JSON errors, global options anywhere."""

from __future__ import annotations

import json
import subprocess
import sys

from click.testing import CliRunner

from kvforge.cli import main
from kvforge.core.errors import EXIT_CODES


def kvforge(*args: str):
    return CliRunner().invoke(main, list(args))


def test_json_errors_are_an_object_on_stdout(project):
    res = kvforge("apply", "-t", "nope", "--json")
    assert res.exit_code == 2
    assert json.loads(res.stdout) == {"error": "unknown target 'nope'; known targets: t", "exit": 2}
    assert res.stderr.strip() == "kvforge: error: unknown target 'nope'; known targets: t"


def test_usage_errors_exit_2_and_speak_json_too(project):
    res = kvforge("verify", "--json")  # --target is missing
    assert res.exit_code == 2
    data = json.loads(res.stdout)
    assert data["exit"] == 2 and "--target" in data["error"]
    res = kvforge("test", "-t", "t", "--platform", "tpu")
    assert res.exit_code == 2 and "Traceback" not in res.output


def test_a_bug_is_exit_70_with_one_line_and_a_saved_traceback(project, monkeypatch, tmp_path):
    from kvforge.flow import status

    def boom(_targets):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(status, "status_matrix", boom)
    monkeypatch.setenv("KVFORGE_CACHE", str(tmp_path / "cache"))
    res = kvforge("status")
    assert res.exit_code == 70
    line = res.stderr.strip()
    assert line.startswith("kvforge: error: internal error: RuntimeError: kaboom (a bug in kvforge; traceback: ")
    saved = line.rsplit("traceback: ", 1)[1].rstrip(")")
    assert "Traceback" in open(saved).read() and "Traceback" not in res.output
    res = kvforge("status", "--json")
    assert res.exit_code == 70 and json.loads(res.stdout)["exit"] == 70


def test_cache_dir_works_before_and_after_the_subcommand(project, base_v0202, tmp_path, monkeypatch):
    cache, base = base_v0202
    # The default cache is elsewhere: only --cache-dir can lead to the base.
    monkeypatch.setenv("KVFORGE_CACHE", str(tmp_path / "other-cache"))
    for args in (["--cache-dir", str(cache.root), "base", "-t", "t", "--json"],
                 ["base", "-t", "t", "--json", "--cache-dir", str(cache.root)]):
        res = kvforge(*args)
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["repo"] == str(base.repo)


def test_help_lists_every_exit_code():
    out = subprocess.run([sys.executable, "-m", "kvforge.cli", "--help"], capture_output=True, text=True).stdout
    for code, what in EXIT_CODES.items():
        assert f"{code:>2}  {what}" in out, (code, what)


def test_loading_the_cli_loads_no_command_library():
    """`kvforge --help` and shell completion load click and kvforge's core only: each command imports its library
    module when it runs."""
    code = "import sys, kvforge.cli; print(' '.join(sorted(m for m in sys.modules if m.startswith('kvforge.'))))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    libraries = ("kvforge.flow", "kvforge.wheels", "kvforge.proof", "kvforge.env", "kvforge.ci", "kvforge.git",
                 "kvforge.bench.")
    assert [m for m in loaded if m.startswith(libraries)] == []
    assert "kvforge.cli.upstream" in loaded  # every command is registered
