"""pathindex: which paths a patch names, and which patches a partial index answers for."""

from __future__ import annotations

from helpers import git

from kvforge.git import engine
from kvforge.git.pathindex import PathIndex, named_paths


def test_named_paths_reads_every_kind_of_header_and_refuses_quoted_names(tmp_path):
    repo = tmp_path / "r"
    git(tmp_path, "init", "-q", str(repo))
    (repo / "d").mkdir()
    (repo / "d" / "a.py").write_text("a\n" * 10)
    (repo / "run.sh").write_text("x\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    git(repo, "mv", "d/a.py", "d/b.py")
    (repo / "run.sh").chmod(0o755)
    (repo / "tab\there.py").write_text("t\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "change")
    raw = engine.format_patch(repo, "HEAD")
    assert named_paths(raw) is None  # git quotes "tab\there.py"
    git(repo, "rm", "-q", "tab\there.py")
    git(repo, "commit", "-q", "--amend", "-m", "change")
    raw = engine.format_patch(repo, "HEAD")
    assert named_paths(raw) == {"d/a.py", "d/b.py", "run.sh"}  # a rename, and a mode change (no ---/+++ lines)
    assert named_paths(b"Subject: x\n\nno diff\n") == set()

    index = PathIndex(repo / ".git", "HEAD~1", [raw, raw.replace(b"d/b.py", b"run.sh/b.py")], tmp_path / "index")
    assert index.usable == [True, False]  # run.sh/b.py: its parent is a file in the commit
    entries = index.entries()
    assert set(entries) == {b"d/a.py", b"run.sh"} and entries[b"run.sh"][0] == 0o100644
    assert entries[b"d/a.py"][1] == git(repo, "rev-parse", "HEAD~1:d/a.py").strip()
