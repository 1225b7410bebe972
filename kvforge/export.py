"""Write a branch's commits back as a series: `git format-patch` with options fixed for stable bytes.

Re-exporting a commit that did not change reproduces its patch file byte for byte: zero commit id
in the From line, full blob ids, no version signature, fixed stat width and diff algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import gitutil
from .errors import KvforgeError
from .fsutil import atomic_write_bytes, atomic_write_text
from .series import FIX_ID_RE, TRAILER_RE

FORMAT_PATCH = ("format-patch", "-1", "--stdout", "--zero-commit", "--full-index", "--no-signature",
                "--stat=80", "--no-renames", "--diff-algorithm=myers", "--encoding=UTF-8", "--no-color")


@dataclass
class Exported:
    name: str
    fix_id: str
    changed: bool


def format_patch(repo: Path, commit: str) -> bytes:
    text = gitutil.run(repo, *FORMAT_PATCH, commit).stdout
    return (text + "\n").encode("utf-8")


def fix_id_of(repo: Path, commit: str) -> str:
    body = gitutil.run(repo, "log", "-1", "--format=%B", commit).stdout
    for line in body.splitlines():
        m = TRAILER_RE.match(line)
        if m and m.group(1) == "Fix-Id" and FIX_ID_RE.match(m.group(2).strip()):
            return m.group(2).strip()
    raise KvforgeError(f"commit {commit[:12]} has no 'Fix-Id:' trailer; add the header before exporting")


def export_range(repo: Path, base: str, head: str, out_dir: Path) -> list[Exported]:
    """Export base..head into out_dir (one file per commit) and rewrite out_dir/series."""
    commits = gitutil.run(repo, "rev-list", "--reverse", "--no-merges", f"{base}..{head}").stdout.split()
    if not commits:
        raise KvforgeError(f"no commits between {base[:12]} and {head}: nothing to export")
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Exported] = []
    for n, commit in enumerate(commits, 1):
        fix_id = fix_id_of(repo, commit)
        name = f"{n:04d}-{fix_id}.patch"
        data = format_patch(repo, commit)
        path = out_dir / name
        changed = not path.is_file() or path.read_bytes() != data
        if changed:
            atomic_write_bytes(path, data)
        written.append(Exported(name, fix_id, changed))
    keep = {e.name for e in written}
    series = out_dir / "series"
    header = [ln for ln in (series.read_text().splitlines() if series.is_file() else []) if ln.startswith("#")]
    atomic_write_text(series, "\n".join(header + [e.name for e in written]) + "\n")
    for stale in out_dir.glob("*.patch"):
        if stale.name not in keep:
            stale.unlink()
    return written
