"""kvforge.project.transaction: N series directories, target and ledger files, all or none (fast, no git).

A real subprocess runs one transaction and is killed with SIGKILL at each of its steps ($KVFORGE_CRASH_AT);
the next writer's recovery (`settle`) leaves the project wholly old (a kill before the commit point) or wholly
new (at it or after), with nothing beside it. Then the read check, the journal's checks, and recovery's cases.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvforge.core.errors import KvforgeError
from kvforge.project import transaction
from kvforge.project.series import lint_directory
from kvforge.project.transaction import ABSENT, COMMIT_POINT, CRASH_STEPS, JOURNAL, open_transaction, settle

SCRIPT = """
import base64, json, sys
from pathlib import Path
from kvforge.project.transaction import open_transaction
spec = json.loads(Path(sys.argv[1]).read_text())
dirs = [Path(d) for d in spec["dirs"]]
with open_transaction(Path(spec["root"]), "tx", print, dirs=dirs) as tx:
    for d, files in spec["dirs"].items():
        tx.stage_dir(Path(d), {n: base64.b64decode(b) for n, b in files.items()}, keep=spec["keep"],
                     read=spec["read"][d])
    for f, data in spec["files"].items():
        tx.stage_file(Path(f), base64.b64decode(data), read=spec["read"][f])
    tx.commit()
"""

REPO_ROOT = Path(__file__).resolve().parent.parent
SERIES = REPO_ROOT / "patches" / "v0.20.2rc"
FIRST = (SERIES / "series").read_text().split()[0]  # a real, lint-clean patch file
NEW_PATCH = (SERIES / FIRST).read_bytes()


def make_project(root: Path) -> None:
    for t in ("a", "b"):
        d = root / "patches" / t
        (d / "notes").mkdir(parents=True)
        (d / "notes" / "README").write_text(f"notes of {t}\n")
        (d / "series").write_text("# the series\n")
    (root / "patches" / "c").mkdir()
    (root / "patches" / "c" / "series").write_text("")
    (root / "targets").mkdir()
    for t in ("a", "b"):
        (root / "targets" / f"{t}.toml").write_text(f'name = "{t}"\n')


def snapshot(root: Path) -> str:
    h = hashlib.sha256()
    for d in ("patches", "targets"):
        for p in sorted((root / d).rglob("*")):
            h.update(str(p.relative_to(root)).encode() + b"\0" + (p.read_bytes() if p.is_file() else b"d") + b"\0")
    return h.hexdigest()


def leftovers(root: Path) -> list[str]:
    out = [p.name for d in ("patches", "targets") for p in (root / d).iterdir() if p.name.startswith(".")]
    return out + ([JOURNAL] if (root / JOURNAL).exists() else [])


def spec_of(root: Path) -> dict:
    """Two series directories get a patch (their notes/ kept), two target files and a ledger file change."""
    dirs = {}
    for t in ("a", "b"):
        d = root / "patches" / t
        files = {FIRST: NEW_PATCH, "series": f"# the series\n{FIRST}\n".encode()}
        dirs[str(d)] = {n: base64.b64encode(b).decode() for n, b in files.items()}
    files = {str(root / "targets" / f"{t}.toml"): f'name = "{t}"\n# picked fix-it\n'.encode() for t in ("a", "b")}
    files[str(root / "patches" / "c" / "dropped.toml")] = b'[[dropped]]\nfile = "0001-x.patch"\n'
    read = {d: transaction.dir_digest(Path(d)) for d in dirs} | {f: transaction.file_digest(Path(f)) for f in files}
    return {"root": str(root), "dirs": dirs, "keep": ["notes"], "read": read,
            "files": {f: base64.b64encode(b).decode() for f, b in files.items()}}


def is_new(root: Path, spec: dict) -> bool:
    return all(transaction.dir_digest(Path(d)) != spec["read"][d] for d in spec["dirs"]) and all(
        Path(f).read_bytes() == base64.b64decode(b) for f, b in spec["files"].items())


def run(spec_path: Path, crash: str | None, swap: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVFORGE_CRASH_AT"} | {"KVFORGE_EXPORT_SWAP": swap}
    if crash:
        env["KVFORGE_CRASH_AT"] = crash
    return subprocess.run([sys.executable, "-c", SCRIPT, str(spec_path)], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("swap", ["exchange", "rename"])
def test_sigkill_at_every_step_leaves_the_project_wholly_old_or_wholly_new(tmp_path, swap):
    root = tmp_path / "project"
    make_project(root)
    spec = spec_of(root)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    old = snapshot(root)
    steps = [s for s in CRASH_STEPS if swap == "rename" or s != "swap-aside"]
    for step in [*steps, None]:
        res = run(spec_path, f"tx:{step}" if step else None, swap)
        assert res.returncode == (-9 if step else 0), (step, res.stderr[-2000:])
        settle(root)  # what the next command that writes the project runs first
        assert leftovers(root) == [], step
        killed_before = step is not None and CRASH_STEPS.index(step) < CRASH_STEPS.index(COMMIT_POINT)
        if killed_before:
            assert snapshot(root) == old, step
        else:
            assert is_new(root, spec), step
            for t in ("a", "b"):
                assert (root / "patches" / t / "notes" / "README").read_text() == f"notes of {t}\n"
                assert not lint_directory(root / "patches" / t)
            for d in ("patches", "targets"):  # back to the old project for the next kill
                shutil.rmtree(root / d)
            make_project(root)
            assert snapshot(root) == old


def test_a_file_changed_since_it_was_read_refuses_in_one_line_and_writes_nothing(tmp_path):
    root = tmp_path / "project"
    make_project(root)
    spec = spec_of(root)
    (root / "targets" / "b.toml").write_text('name = "b"\n# my edit\n')
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    before = snapshot(root)
    with pytest.raises(KvforgeError) as err:
        with open_transaction(root, "pick", lambda m: None, dirs=[root / "patches" / "a"],
                              hint=" (pick again)") as tx:
            tx.stage_dir(root / "patches" / "a", {"series": b""})
            tx.stage_file(root / "targets" / "b.toml", b"x", read=spec["read"][str(root / "targets" / "b.toml")])
            tx.commit()
    assert err.value.exit_code == 2 and "\n" not in str(err.value)
    assert str(err.value).endswith("targets/b.toml changed since the pick read it; nothing was written (pick again)")
    assert snapshot(root) == before and leftovers(root) == []


def killed_past_the_commit_point(tmp_path: Path) -> tuple[Path, dict]:
    root = tmp_path / "project"
    make_project(root)
    spec = spec_of(root)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    assert run(spec_path, "tx:committed", "exchange").returncode == -9
    assert (root / JOURNAL).is_file()
    return root, spec


def test_recovery_stages_again_from_the_journal_when_the_staged_copies_are_gone(tmp_path):
    root, spec = killed_past_the_commit_point(tmp_path)
    for p in (root / "patches").glob(".*.kvforge-*"):  # e.g. another tool cleaned them
        shutil.rmtree(p)
    said: list[str] = []
    assert settle(root, said.append)
    assert is_new(root, spec) and leftovers(root) == []
    assert any("finished a tx that was interrupted while writing" in s for s in said)
    assert (root / "patches" / "a" / "notes" / "README").is_file()


def test_recovery_leaves_a_file_someone_changed_since_and_names_it(tmp_path):
    root, spec = killed_past_the_commit_point(tmp_path)
    (root / "targets" / "a.toml").write_text("mine\n")
    said: list[str] = []
    settle(root, said.append)
    assert (root / "targets" / "a.toml").read_text() == "mine\n"
    assert any("targets/a.toml changed since the tx read it: left as it is" in s for s in said)
    assert (root / "targets" / "b.toml").read_bytes() == base64.b64decode(spec["files"][str(root / "targets" / "b.toml")])
    assert leftovers(root) == []


@pytest.mark.parametrize("forge", ["version", "unknown-key", "type", "outside", "absolute", "symlink-out", "base64"])
def test_a_journal_of_another_version_or_shape_or_outside_paths_touches_nothing(tmp_path, forge):
    root, _spec = killed_past_the_commit_point(tmp_path)
    journal = root / JOURNAL
    data = json.loads(journal.read_text())
    if forge == "version":
        data["version"] = 99
    elif forge == "unknown-key":
        data["dirs"][0]["extra"] = 1
    elif forge == "type":
        data["files"][0]["read"] = 1
    elif forge == "outside":
        data["files"][0]["path"] = "../elsewhere.toml"
    elif forge == "absolute":
        data["dirs"][0]["path"] = str(tmp_path / "x")
    elif forge == "symlink-out":
        (root / "out").symlink_to(tmp_path)
        data["files"][0]["path"] = "out/victim.toml"
    else:
        data["files"][0]["data"] = "not base64!"
    journal.write_text(json.dumps(data))
    before = snapshot(root)
    listing = sorted(os.listdir(root / "patches"))
    with pytest.raises(KvforgeError) as err:
        settle(root)
    assert err.value.exit_code == 2 and "unusable transaction journal" in str(err.value) and "\n" not in str(err.value)
    assert snapshot(root) == before and sorted(os.listdir(root / "patches")) == listing and journal.is_file()
    assert not (tmp_path / "elsewhere.toml").exists() and not (tmp_path / "victim.toml").exists()


def test_removals_take_back_only_what_is_still_the_operations_own(tmp_path):
    root = tmp_path / "project"
    make_project(root)
    a, c = root / "patches" / "a", root / "patches" / "c"
    with open_transaction(root, "tx", lambda m: None, dirs=[a, c]) as tx:
        tx.remove_dir(a, read=transaction.dir_digest(a))
        tx.remove_file(root / "targets" / "a.toml", read=transaction.file_digest(root / "targets" / "a.toml"))
        tx.commit()
    assert not a.exists() and not (root / "targets" / "a.toml").exists() and leftovers(root) == []
    with pytest.raises(KvforgeError) as err:
        with open_transaction(root, "tx", lambda m: None, dirs=[c]) as tx:
            tx.remove_dir(c, read=ABSENT)
    assert err.value.exit_code == 2 and c.is_dir()


def test_a_path_outside_the_root_is_refused_before_anything_is_staged(tmp_path):
    root = tmp_path / "project"
    make_project(root)
    before = snapshot(root)
    with pytest.raises(KvforgeError):
        with open_transaction(root, "tx", lambda m: None) as tx:
            tx.stage_file(tmp_path / "elsewhere.toml", b"x")
    assert snapshot(root) == before and not (tmp_path / "elsewhere.toml").exists()


def test_a_file_inside_a_directory_the_transaction_replaces_is_refused(tmp_path):
    root = tmp_path / "project"
    make_project(root)
    before = snapshot(root)
    a = root / "patches" / "a"
    with pytest.raises(KvforgeError) as err:
        with open_transaction(root, "tx", lambda m: None, dirs=[a]) as tx:
            tx.stage_dir(a, {"series": b""})
            tx.stage_file(a / "dropped.toml", b"")
    assert err.value.exit_code == 2 and "both written" in str(err.value)
    assert snapshot(root) == before and leftovers(root) == []
