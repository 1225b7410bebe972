"""kvforge target add as a careless or unlucky user runs it (issue 37): a --as NAME that is a path, a state
directory that is not kvforge's own, a corrupt or wrong-typed state, a dry run. Each case: its exit code, one
line, and nothing changed in the project, the cache or outside them (a real directory, a real symlink)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvforge.cli import main

REPO_ROOT = Path(__file__).resolve().parent.parent


def kvforge(*args: str):
    return CliRunner().invoke(main, list(args))


def one_line(r) -> bool:
    """One error line, no traceback."""
    lines = r.stderr.strip().splitlines()
    return bool(lines) and lines[-1].startswith("kvforge: error: ") and "Traceback" not in r.stderr \
        and sum(ln.startswith("kvforge: error: ") for ln in lines) == 1


def tree(root: Path) -> dict[str, str]:
    """Every file and directory under `root` (a symlink as its target), with each file's sha256."""
    out = {}
    for p in sorted(root.rglob("*")) if root.exists() else []:
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture()
def project(tmp_path, monkeypatch) -> Path:
    """This project's targets/ and patches/ copied into tmp_path; the cache is tmp_path/cache."""
    root = tmp_path / "project"
    for d in ("targets", "patches"):
        shutil.copytree(REPO_ROOT / d, root / d)
    monkeypatch.setenv("KVFORGE_ROOT", str(root))
    monkeypatch.setenv("KVFORGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KVFORGE_OFFLINE", raising=False)
    return root


def unreadable_state(d: Path) -> None:
    """A directory holding a state.json that is not JSON (and mode 000), and a file of the user's."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "state.json").write_text("{not json")
    (d / "state.json").chmod(0)
    (d / "mine.txt").write_text("the user's\n")


def a_state(project: Path, **wrong) -> dict:
    """A target add state as kvforge writes it (state_version 1), with the fields in `wrong` replaced."""
    st = os.stat(project)
    text = (project / "targets" / "v0.20.2rc.toml").read_text().replace('name = "v0.20.2rc"', 'name = "v9.9.9"') \
        .replace('series = "patches/v0.20.2rc', 'series = "patches/v9.9.9')
    data = {"name": "v9.9.9", "version": "9.9.9", "from_target": "v0.20.2rc", "root": str(project),
            "root_id": f"{st.st_dev}:{st.st_ino}", "target_text": text,
            "components": ["vllm", "vllm-ascend"], "left_out": {}, "upstream": {}, "done": [], "phase": "running",
            "final_text": "", "series_digests": {}, "notes": [], "started": "2026-11-27T00:00:00Z", "try_cpu": False,
            "state_version": 1}
    return {**data, **wrong}


@pytest.mark.parametrize("action", ["--abort", "--continue", "--skip"])
@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_a_name_that_is_a_path_is_refused_before_any_path_is_built(project, tmp_path, action, where):
    """bb0e3ee: `--abort --as <dir>` deleted a directory outside the cache holding an unreadable state.json
    (exit 0); --continue / --skip read it. Now the name rule of a new target refuses it: exit 2, one line."""
    outside = tmp_path / "outside"
    unreadable_state(outside)
    name = "../../outside" if where == "relative" else str(outside)
    (tmp_path / "cache" / "targetadd").mkdir(parents=True)  # <cache>/targetadd/../../outside is `outside`
    before, cache_before, project_before = tree(outside), tree(tmp_path / "cache"), tree(project)
    r = kvforge("target", "add", action, "--as", name)
    assert r.exit_code == 2 and one_line(r) and "is not a target name" in r.stderr, r.output
    assert r.stderr.startswith(f"kvforge: error: --as {name if len(name) <= 40 else name[:37] + '...'!r} ")
    assert tree(outside) == before and tree(tmp_path / "cache") == cache_before and tree(project) == project_before


def test_a_state_dir_that_is_a_symlink_is_not_kvforges_to_remove(project, tmp_path):
    """<cache>/targetadd/v9.9.9 a symlink to a directory elsewhere with an unreadable state: bb0e3ee said it
    removed it (exit 0, rmtree refused the symlink silently). Now: exit 2, one line saying it is not kvforge's
    own and nothing was removed; the link and the directory it points to stay."""
    outside = tmp_path / "elsewhere"
    unreadable_state(outside)
    (tmp_path / "cache" / "targetadd").mkdir(parents=True)
    (tmp_path / "cache" / "targetadd" / "v9.9.9").symlink_to(outside)
    before, cache_before = tree(outside), tree(tmp_path / "cache")
    r = kvforge("target", "add", "--abort", "--as", "v9.9.9")
    assert r.exit_code == 2 and one_line(r) and "not kvforge's own" in r.stderr and "nothing was removed" in r.stderr
    assert tree(outside) == before and tree(tmp_path / "cache") == cache_before


DEEP = "[" * 100_000  # JSON nested deeper than the parser's recursion limit: bb0e3ee's RecursionError, exit 70

# A field of the state with the wrong type (or a state too deep to parse): each was an internal error (exit 70) on
# bb0e3ee, where the state was read without checking each field's type.
WRONG = {"root an int": {"root": 5}, "nested too deep": DEEP}
WRONG_COMMITTING = {  # --abort of a state in phase "committing" reads these before it removes anything
    **WRONG,
    "final_text an int": {"phase": "committing", "final_text": 5},
    "series_digests a list": {"phase": "committing", "series_digests": ["vllm"]},
}


def write_state(project: Path, path: Path, wrong: dict | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(wrong if isinstance(wrong, str) else json.dumps(a_state(project, **wrong)))


@pytest.mark.parametrize("action", ["--continue", "--skip"])
@pytest.mark.parametrize("wrong", list(WRONG))
def test_a_wrong_typed_state_is_one_line_exit_2_and_kept(project, tmp_path, action, wrong):
    write_state(project, tmp_path / "cache" / "targetadd" / "v9.9.9" / "state.json", WRONG[wrong])
    cache_before, project_before = tree(tmp_path / "cache"), tree(project)
    r = kvforge("target", "add", action, "--as", "v9.9.9")
    assert r.exit_code == 2 and one_line(r) and "unreadable target add state" in r.stderr, r.output
    assert tree(tmp_path / "cache") == cache_before and tree(project) == project_before


@pytest.mark.parametrize("wrong", list(WRONG_COMMITTING))
def test_abort_of_a_wrong_typed_state_removes_only_its_own_dir(project, tmp_path, wrong):
    """--abort of a wrong-typed state in kvforge's own <cache>/targetadd/NAME removes that directory only (exit 0,
    one line saying so); targets/ and patches/ are untouched."""
    own = tmp_path / "cache" / "targetadd" / "v9.9.9"
    write_state(project, own / "state.json", WRONG_COMMITTING[wrong])
    (tmp_path / "cache" / "targetadd" / "v1.0.0").mkdir()
    (tmp_path / "cache" / "targetadd" / "v1.0.0" / "state.json").write_text("{}")
    project_before = tree(project)
    r = kvforge("target", "add", "--abort", "--as", "v9.9.9")
    assert r.exit_code == 0 and "unreadable and is removed" in r.output and "Traceback" not in r.output, r.output
    assert not own.exists() and (tmp_path / "cache" / "targetadd" / "v1.0.0" / "state.json").is_file()
    assert tree(project) == project_before


def test_a_dry_run_writes_nothing_in_the_cache_or_the_project(project, tmp_path, monkeypatch):
    """`target add 9.9.9 --dry-run` (the index lists 9.9.9 with no sdist: exit 2 after the index is read) leaves
    the cache and the project file for file as they were; bb0e3ee left <cache>/targetadd/.v9.9.9.lock."""
    index = tmp_path / "index" / "pypi" / "vllm"
    index.mkdir(parents=True)
    (index / "json").write_text(json.dumps({"releases": {"9.9.9": []}}))
    monkeypatch.setenv("KVFORGE_PYPI_URL", (tmp_path / "index").as_uri())
    files = {k for k, v in tree(tmp_path / "cache").items() if v != "dir"}
    project_before = tree(project)
    r = kvforge("target", "add", "9.9.9", "--dry-run")
    assert r.exit_code == 2 and one_line(r) and "not a release with an sdist" in r.stderr, r.output
    assert {k for k, v in tree(tmp_path / "cache").items() if v != "dir"} == files
    assert tree(project) == project_before
