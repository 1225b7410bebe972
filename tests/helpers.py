"""Helpers for tests: run git with a fixed identity, make annotated patches on a real base."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

IDENT = "kvforge <kvforge@users.noreply.github.com>"


def git(cwd: Path, *args: str, env: dict | None = None) -> str:
    full = {**os.environ, "GIT_AUTHOR_NAME": "kvforge", "GIT_AUTHOR_EMAIL": "kvforge@users.noreply.github.com",
            "GIT_COMMITTER_NAME": "kvforge", "GIT_COMMITTER_EMAIL": "kvforge@users.noreply.github.com",
            "GIT_AUTHOR_DATE": "2026-11-22T12:00:00+00:00", "GIT_COMMITTER_DATE": "2026-11-22T12:00:00+00:00",
            **(env or {})}
    return subprocess.run(["git", *args], cwd=cwd, env=full, check=True, capture_output=True, text=True).stdout


def trailers(fix_id: str, kind: str = "refactor", status: str = "Pending", extra: str = "") -> str:
    return (f"Fix-Id: {fix_id}\nKind: {kind}\nUpstream-Status: {status}\n{extra}"
            f"Why: a test patch\n that explains itself.\nDrop-When: never\nSigned-off-by: {IDENT}\n")


def make_patch(repo: Path, start: str, edits: dict[str, tuple[str, str]], subject: str, fix_id: str,
               out: Path, kind: str = "refactor", extra: str = "") -> tuple[Path, str]:
    """Commit `edits` (path -> (old text, new text); old '' creates the file) on `start` without a
    checkout (a temporary index), export it as an annotated patch at `out`; return (path, commit)."""
    index = out.parent / f".index-{fix_id}"
    env = {"GIT_INDEX_FILE": str(index)}
    try:
        git(repo, "read-tree", start, env=env)
        for rel, (old, new) in edits.items():
            text = git(repo, "show", f"{start}:{rel}") if old else ""
            assert old in text, f"{old!r} not in {rel}"
            blob = subprocess.run(["git", "hash-object", "-w", "--stdin"], cwd=repo, check=True, capture_output=True,
                                  input=text.replace(old, new, 1) if old else new, text=True).stdout.strip()
            git(repo, "update-index", "--add", "--cacheinfo", f"100644,{blob},{rel}", env=env)
        tree = git(repo, "write-tree", env=env).strip()
        message = f"{subject}\n\nBody.\n\n{trailers(fix_id, kind, extra=extra)}"
        commit = git(repo, "commit-tree", tree, "-p", start, "-m", message).strip()
    finally:
        index.unlink(missing_ok=True)
    from kvforge.export import format_patch

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(format_patch(repo, commit))
    return out, commit


def write_series(root: Path, *names: str, target: str = "t") -> None:
    (root / "patches" / target / "series").write_text("".join(f"{n}\n" for n in names))
