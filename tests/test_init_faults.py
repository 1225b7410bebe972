"""`kvforge init` when the user or the machine is at fault (issue 37): a name kvforge cannot use, a read-only file
system, a full one, two inits of one directory at once. Each is one line with its documented exit code (2 bad input,
5 environment) and leaves nothing behind; no traceback, no exit 70.

The read-only and full file systems are real: a private mount namespace (`unshare -Urm`, no root needed where user
namespaces are allowed) holds a read-only bind mount and a 96 KiB tmpfs, and kvforge runs inside it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

KVFORGE = [sys.executable, "-m", "kvforge.cli"]
INSTALL = ["--install", "kvforge==0.1.0"]  # no wheel of kvforge to build: these tests are about the file system


def run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([*KVFORGE, *args], cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)


def one_line(res) -> str:
    """The error line: stderr is exactly one line, never a traceback or an internal error."""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "internal error" not in res.stderr and "Traceback" not in res.stderr
    return lines[0]


@pytest.fixture()
def here(tmp_path, monkeypatch):
    """An empty work directory outside any project, with its own cache."""
    monkeypatch.delenv("KVFORGE_ROOT", raising=False)
    monkeypatch.setenv("KVFORGE_CACHE", str(tmp_path / "cache"))
    work = tmp_path / "work"
    work.mkdir()
    return work


def namespaces_allowed() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-Urm", "true"], capture_output=True).returncode == 0


needs_mounts = pytest.mark.skipif(not namespaces_allowed(), reason="this machine allows no private mount namespace "
                                  "(unshare -Urm) for a real read-only or full file system")


def in_namespace(here: Path, mounts: str, commands: list[list[str]]) -> list[tuple[int, str, list[str]]]:
    """Run kvforge `commands` (argv tails, run in `here`) inside a private mount namespace after the shell lines
    `mounts`; returns (exit code, stderr, what `here/fs` holds afterwards, every path) per command. The mounts vanish
    with the namespace, so the listing is taken inside it."""
    out = here.parent / "ns-out"
    out.mkdir()
    lines = ["set -e", mounts, "set +e"]
    for i, argv in enumerate(commands):
        cmd = " ".join(f"'{a}'" for a in [*KVFORGE, *argv])
        lines += [f"{cmd} >/dev/null 2>{out}/{i}.err; echo $? >{out}/{i}.rc",
                  f"(cd fs && find . -mindepth 1 | sort) >{out}/{i}.ls"]
    subprocess.run(["unshare", "-Urm", "sh", "-c", "\n".join(lines)], cwd=here, check=True, timeout=300)
    return [(int((out / f"{i}.rc").read_text()), (out / f"{i}.err").read_text(),
             (out / f"{i}.ls").read_text().split()) for i in range(len(commands))]


@pytest.mark.parametrize("size,why", [(150, "is 150 characters long (at most 100)"),
                                      (300, "is 300 characters long (at most 100)")])
def test_init_refuses_a_first_target_name_kvforge_could_not_read(here, session_cache, size, why):
    """The project's own rule for target names (target_name_problem): a 150-character --name made a project whose
    every command then failed; a 300-character one was an OSError (exit 70)."""
    cache = Path(os.environ["KVFORGE_CACHE"])
    (cache / "downloads").mkdir(parents=True)
    sdist = session_cache.downloads / "vllm-0.20.2.tar.gz"
    (cache / "downloads" / sdist.name).symlink_to(sdist)
    res = run(["init", "team", "--release", "0.20.2", "--as", "a" * size, *INSTALL], here, KVFORGE_OFFLINE="1")
    assert res.returncode == 2, res.stderr
    line = one_line(res)
    assert line.startswith("kvforge: error: --as 'aaa") and why in line
    assert list(here.iterdir()) == []


def test_init_refuses_a_directory_name_too_long_to_stage(here):
    res = run(["init", "b" * 300, *INSTALL], here)
    assert res.returncode == 2, res.stderr
    assert "the directory name is 300 bytes long" in one_line(res)
    assert list(here.iterdir()) == []


@needs_mounts
def test_init_on_a_read_only_file_system_is_exit_5_and_writes_nothing(here):
    """A read-only parent (a new DIR) and a read-only empty DIR (written in place): one line naming DIR, exit 5."""
    mounts = "mkdir -p fs/empty && mount --bind fs fs && mount -o remount,bind,ro fs"
    results = in_namespace(here, mounts, [["init", "fs/new", *INSTALL], ["init", "fs/empty", *INSTALL]])
    for (code, err, listing), dest in zip(results, ("new", "empty")):
        assert code == 5, err
        line = one_line(subprocess.CompletedProcess([], code, "", err))
        assert f"fs/{dest}: cannot write the new project (Read-only file system)" in line
        assert listing == ["./empty"]


@needs_mounts
def test_init_on_a_full_file_system_is_exit_5_and_leaves_nothing(here):
    """A 96 KiB tmpfs fills while init writes its staging directory (the kvforge wheel shipped into ci/): exit 5,
    one line naming DIR, the staging directory removed, so the file system is empty again."""
    mounts = "mkdir fs && mount -t tmpfs -o size=96k tmpfs fs"
    [(code, err, listing)] = in_namespace(here, mounts, [["init", "fs/team"]])
    assert code == 5, err
    line = one_line(subprocess.CompletedProcess([], code, "", err))
    assert "fs/team: cannot write the new project (No space left on device)" in line
    assert listing == []


def test_two_inits_of_one_new_directory_at_once_make_one_whole_project(here):
    """Both start together (each finds DIR missing before either renames its project into place; the loser's rename
    was an OSError 39, exit 70): one exits 0, the other 2 with one line, and DIR is the winner's whole project (its
    one commit, a clean work tree), nothing else left beside it."""
    team = here / "team"
    for _round in range(4):  # a race: each round must end with one project and one refusal
        procs = [subprocess.Popen([*KVFORGE, "init", "team", *INSTALL, "--json"], cwd=here, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        done = [(p.wait(timeout=120), *p.communicate()) for p in procs]
        codes = sorted(d[0] for d in done)
        assert codes == [0, 2], [d[2] for d in done]
        [(_c, _o, err)] = [d for d in done if d[0] == 2]
        line = one_line(subprocess.CompletedProcess([], 2, "", err))
        assert str(team) in line and ("another process" in line or "not empty" in line)
        git = lambda *a: subprocess.run(["git", *a], cwd=team, check=True, capture_output=True,  # noqa: E731
                                        text=True).stdout
        assert git("status", "--porcelain", "--ignored") == ""
        assert len(git("log", "--format=%H").split()) == 1
        assert sorted(p.name for p in here.iterdir()) == ["team"]
        shutil.rmtree(team)
