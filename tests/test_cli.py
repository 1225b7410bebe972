"""The CLI's contract: one line per error, documented exit codes, JSON errors, global options anywhere."""

from __future__ import annotations

import json
import subprocess
import sys

import click
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


def test_the_lazy_table_is_every_command_with_its_own_help():
    """kvforge.cli.LAZY (what --help lists without importing a command module) names each group module's commands,
    each under its own name and with the first sentence of its own help."""
    from kvforge.cli import LAZY, adopt, help, proof, series, upstream, wheels

    modules = {"series": series, "proof": proof, "wheels": wheels, "upstream": upstream, "adopt": adopt, "help": help}
    real = {cmd.name: (module, cmd, cmd.get_short_help_str(10_000)) for module, m in modules.items()
            for cmd in m.COMMANDS}
    assert sorted(LAZY) == sorted(real)
    for name, (module, attr, line) in LAZY.items():
        assert (module, getattr(modules[module], attr), line) == real[name], name
    res = kvforge("nope")  # an unknown command is still told the close ones, from the table
    assert res.exit_code == 2 and "Did you mean 'notes'?" in res.stderr


def test_a_command_loads_its_own_group_only(project):
    """`kvforge rebase` imports the rebase command's module and what rebase uses: no other command group, no other
    command's library, no selection scan or audit (target add's rescan) and nothing that builds wheels."""
    code = ("import sys\nfrom kvforge.cli import main\ntry:\n    main(['rebase', '-t', 'nope'])\n"
            "except SystemExit:\n    pass\nprint(' '.join(sorted(m for m in sys.modules if m.startswith('kvforge.'))))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = res.stdout.split()
    assert "unknown target 'nope'" in res.stderr
    assert "kvforge.cli.upstream" in loaded and "kvforge.flow.rebase.command" in loaded
    unwanted = ("kvforge.cli.adopt", "kvforge.cli.help", "kvforge.cli.proof", "kvforge.cli.series", "kvforge.cli.wheels",
                "kvforge.proof.selection", "kvforge.proof.audit", "kvforge.proof.semantic", "kvforge.wheels.build",
                "kvforge.flow.rebase.retarget", "kvforge.flow.targetadd", "kvforge.flow.pick", "kvforge.flow.pr",
                "kvforge.flow.watch", "kvforge.bench", "kvforge.flow.behaviour", "kvforge.env.venv",
                "kvforge.proof.testrun", "kvforge.proof.verify")
    assert [m for m in loaded if m.startswith(unwanted)] == []


def test_apply_fits_the_terminal(project, base_v0202, tmp_path):
    """COLUMNS=80 kvforge apply | awk '{ if (length > 80) exit 1 }' (its table of patches wraps)."""
    from helpers import make_patch, write_series

    _cache, base = base_v0202
    pdir = project / "patches" / "t"
    name = "0001-a-fix-whose-file-name-is-long-enough-to-push-the-table-past-eighty-columns.patch"
    make_patch(base.repo, base.commit, {"vllm/v1/core/block_pool.py": ("class BlockPool", "class BlockPoolA")},
               "[Core] a", "a-fix-whose-fix-id-is-long-as-well", pdir / name)
    write_series(project, name)
    res = CliRunner(env={"COLUMNS": "80"}).invoke(main, ["apply", "-t", "t", "--into", str(tmp_path / "tree")])
    assert res.exit_code == 0, res.output
    assert max(len(ln) for ln in res.stdout.splitlines()) <= 80, res.stdout
    assert "0001-a-fix-whose" in res.stdout


def test_version_quiet_verbose_and_help_topics(project):
    for flag in ("-V", "--version"):
        res = kvforge(flag)
        assert res.exit_code == 0 and res.stdout.startswith("kvforge, version ")
    loud = kvforge("base", "-t", "t")
    quiet = kvforge("-q", "base", "-t", "t")
    assert quiet.exit_code == loud.exit_code == 0 and quiet.stdout == loud.stdout
    assert not [ln for ln in quiet.stderr.splitlines() if ln.startswith("kvforge: ") and "warning" not in ln]
    listed = kvforge("help")
    assert listed.exit_code == 0 and "targets" in listed.stdout.split() and "readme" in listed.stdout.split()
    from pathlib import Path

    docs = Path(__file__).resolve().parent.parent / "docs"
    assert kvforge("help", "targets").stdout == (docs / "targets.md").read_text()
    res = kvforge("help", "nope")
    assert res.exit_code == 2 and "topics:" in res.stderr
    # every `kvforge help X` a --help names is a topic
    import re

    from kvforge.cli import LAZY, cli

    named: set[str] = set()
    for name in LAZY:
        cmd = cli.get_command(click.Context(cli), name)
        for sub in getattr(cmd, "commands", {}).values() or [cmd]:
            named |= set(re.findall(r"kvforge help (\w+)", (sub.help or "") + " ".join(
                p.help or "" for p in sub.params if isinstance(p, click.Option))))
    assert named and named <= set(kvforge("help").stdout.split()), named


def test_old_spellings_are_hidden_aliases(project, tmp_path):
    from kvforge.cli import cli

    helps = {name: kvforge(*name.split(), "--help").stdout for name in ("init", "port", "apply", "target add")}
    assert "--name" not in helps["init"] and "--as" in helps["init"]
    assert "--to " not in helps["port"] and "--target" in helps["port"]
    assert "--repo-dir" not in helps["apply"] and "--into-clone" in helps["apply"]
    assert "--from-target" in helps["target add"] and "--from " not in helps["target add"]
    # the old spelling still works, with a warning that names the new one
    res = kvforge("init", str(tmp_path / "p"), "--name", "a/b")
    assert res.exit_code == 2 and "--name" in res.stderr and "--as" in res.stderr
    res = kvforge("port", "somefix", "--to", "nope")
    assert res.exit_code == 2 and "unknown target 'nope'" in res.stderr and "-t/--target" in res.stderr
    res = kvforge("port", "somefix")
    assert res.exit_code == 2 and "-t/--target" in res.stderr
    assert {c for c in cli.list_commands(click.Context(cli)) if "--json" not in kvforge(*c.split(), "--help").stdout} <= {"target", "bench",
                                                                                                 "help"}


def test_completion_of_targets_and_fixes(project):
    from kvforge.cli.options import complete_fixes, complete_targets

    (project / "patches" / "t" / "0001-my-fix.patch").write_text("Subject: x\nFix-Id: my-fix\n")
    assert complete_targets(None, None, "") == ["t"]
    assert complete_fixes(None, None, "my") == ["my-fix"]
    env = {**__import__("os").environ, "_KVFORGE_COMPLETE": "bash_complete", "COMP_WORDS": "kvforge verify -t ",
           "COMP_CWORD": "3"}
    out = subprocess.run([sys.executable, "-m", "kvforge.cli"], env=env, capture_output=True, text=True).stdout
    assert "plain,t" in out.split()
