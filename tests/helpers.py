"""Helpers for tests: run git with a fixed identity, make annotated patches on a real base."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
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
    from kvforge.git.engine import format_patch

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(format_patch(repo, commit))
    return out, commit


def write_series(root: Path, *names: str, target: str = "t") -> None:
    (root / "patches" / target / "series").write_text("".join(f"{n}\n" for n in names))


# ---------------------------------------------------------------- a tiny vLLM-like upstream (the `fake` fixture)

CORE = "vllm_like/core.py"
TESTS = "tests/test_core.py"

FILES = {
    "pyproject.toml": "[tool.pytest.ini_options]\nmarkers = [\"cpu_test\"]\n",
    "vllm_like/__init__.py": "",
    CORE: "def double(x):\n    return 2 * x\n\n\ndef clamp(x, lo, hi):\n    return max(lo, x)\n",
    TESTS: ("from vllm_like.core import double\n\n\ndef test_double():\n    assert double(2) == 4\n\n\n"
            "def test_double_zero():\n    assert double(0) == 0\n"),
}

FAKE_TARGET = """\
name = "fake"
description = "a vLLM-like tree for kvforge's own tests"

[[components]]
name = "vllm"
repo = "https://invalid.invalid/vllm.git"
ref = "v1"
series = "patches/fake"
platforms = ["cpu", "cuda"]

[components.release]
package = "vllm"
version = "0.0.1"

[components.tests]
cpu = ["tests/test_core.py"]
cuda = ["tests"]
"""


@dataclass
class Fake:
    root: Path
    upstream: Path
    base: str
    cache: Path

    def patch(self, name: str, edits: dict, kind: str = "fix", checks: tuple[str, ...] = (), start: str | None = None,
              subject: str | None = None) -> str:
        extra = "".join(f"Checks: {c}\n" for c in checks)
        fix_id = name.split("-", 1)[1]
        _, commit = make_patch(self.upstream, start or self.base, edits, subject or f"[Core] {fix_id}", fix_id,
                               self.root / "patches" / "fake" / f"{name}.patch", kind=kind, extra=extra)
        return commit

    def series(self, *names: str) -> None:
        write_series(self.root, *(f"{n}.patch" for n in names), target="fake")
