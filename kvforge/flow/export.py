"""`kvforge export`: write a tree's commits back as a series, all or nothing.

Bytes. Each commit becomes engine.format_patch's output: FORMAT_PATCH plus PINNED_CONFIG / PINNED_OPTS
(engine.py, the one definition), which hold every setting a user's or a tree's git
config could use to change those bytes (subject prefix, numbering, sign-off, extra headers, notes,
a/ b/ prefixes, context, order file, funcname attributes, ...) at git's defaults. So re-exporting an
unchanged commit reproduces its file byte for byte on any machine; renames are exported as renames
(--find-renames) and non-ASCII paths unquoted (core.quotePath=false, gitutil.HERMETIC).

Names. A commit keeps the file name its Fix-Id has in the existing series (the destination's, or,
for a new --out directory, the target's); a new Fix-Id gets NNNN-<fix-id>.patch with the next free
number; --renumber names every file NNNN-<Fix-Id>.patch by position. The series file keeps its
comment lines (the header at the top, comments before and on an entry's line go with that entry).
Files of the series directory that are not patches of the old series (a README, notes) are kept.

Transaction. The series directory is replaced all or nothing through kvforge.project.transaction (its
docstring describes the locks, the staging into a hidden sibling linted with series.read_series, the journal,
the swap and the recovery after a kill), rooted at the project (or, for an --out outside it, at the nearest
existing directory above the --out): a commit without a valid Fix-Id is found before anything is staged, and
on any problem the directory is untouched. Crash points: "export:<step>" for each transaction.CRASH_STEPS.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from kvforge.git import gitutil
from kvforge.project import seriesdir
from kvforge.project.transaction import Transaction, open_transaction
from kvforge.git.engine import format_patch
from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.core.outcome import Done
from kvforge.core.render import table
from kvforge.project.series import FIX_ID_RE, parse_patch
from kvforge.project.targets import display_path, project_root
from kvforge.git.trees import commits_since, resolve_from

FILE_STATUSES = ("unchanged", "rewritten", "new", "removed")  # ExportedFile.status
_NUMBER_RE = re.compile(r"^(\d{4})-")


# ---------------------------------------------------------------- result


@dataclass
class ExportedFile:
    name: str
    fix_id: str
    status: str  # unchanged | rewritten | new | removed
    commit: str | None = None  # None for removed
    subject: str = ""
    old_name: str | None = None  # the name it had in the old series, when that differs (--renumber)


@dataclass
class ExportResult:
    target: str
    component: str
    directory: Path
    source: str  # which tree and branch/rev the commits came from
    repo: Path
    head: str
    base: str
    commits: list[str]
    files: list[ExportedFile] = field(default_factory=list)
    series_file: str = "unchanged"  # unchanged | rewritten | new
    compared_with: Path | None = None  # the old series the statuses refer to
    written: bool = False

    @property
    def shown(self) -> str:
        return display_path(self.directory)

    def count(self, status: str) -> int:
        return sum(1 for f in self.files if f.status == status)

    def summary(self) -> str:
        n = len(self.commits)
        parts = [f"{n} patch" + ("" if n == 1 else "es")]
        parts += [f"{self.count(s)} {s}" for s in ("rewritten", "new", "removed", "unchanged") if self.count(s)]
        line = f"{self.shown}: {', '.join(parts)}"
        if not self.written:
            line += " (nothing written: the series already says this)"
        elif self.series_file != "unchanged" and not any(f.status != "unchanged" for f in self.files):
            line += f" (series file {self.series_file})"
        return line

    def to_json(self) -> dict:
        return {
            "target": self.target, "component": self.component, "directory": str(self.directory),
            "source": self.source, "repo": str(self.repo), "head": self.head, "base": self.base,
            "commits": list(self.commits),
            "files": [vars(f).copy() for f in self.files],
            "series_file": self.series_file,
            "compared_with": str(self.compared_with) if self.compared_with else None,
            "written": self.written, "summary": self.summary(),
        }


# ---------------------------------------------------------------- export


@dataclass
class Commit:
    """A commit as a patch file of the series: its exact bytes, Fix-Id and subject."""

    sha: str
    raw: bytes
    fix_id: str
    subject: str

    @property
    def blame(self) -> str:
        """How a lint complaint about its file names it."""
        return f" (commit {self.sha[:12]} {self.subject})"


def export_target(ctx, out: Path | None = None, renumber: bool = False) -> ExportResult:
    """Export base..head of ctx's tree (ctx.from_rev, or the default tree) into the series directory."""
    base = ctx.base()
    repo, head, what = _source(ctx, base.commit)
    shas = commits_since(repo, base.commit, head, what)
    if not shas:
        raise KvforgeError(f"{what}: no commits on top of the base {base.commit[:12]}: nothing to export "
                           "(to empty the series, edit its `series` file)", EXIT_USAGE)
    commits = [read_commit(repo, sha, what) for sha in shas]
    seen: dict[str, Commit] = {}
    for c in commits:
        if c.fix_id in seen:
            raise KvforgeError(f"{what}: commits {seen[c.fix_id].sha[:12]} and {c.sha[:12]} both have Fix-Id "
                               f"{c.fix_id!r}; each fix is one commit (squash them, or give one a new Fix-Id)",
                               EXIT_USAGE)
        seen[c.fix_id] = c

    dest = Path(out).expanduser().resolve() if out else Path(ctx.component.series_dir).resolve()
    if dest.exists() and not dest.is_dir():
        raise KvforgeError(f"{display_path(dest)} is not a directory", EXIT_USAGE)
    with open_transaction(_root_of(dest), "export", ctx.say, dirs=[dest]) as tx:
        return _export_locked(ctx, tx, dest, commits, renumber, repo, head, base.commit, what)


def _root_of(dest: Path) -> Path:
    """The root of export's transaction: the project, or the nearest existing directory above an --out outside it."""
    root = project_root().resolve()
    if dest.is_relative_to(root):
        return root
    probe = dest.parent
    while not probe.exists():
        probe = probe.parent
    return probe


def _export_locked(ctx, tx: Transaction, dest: Path, commits: list[Commit], renumber: bool, repo: Path, head: str,
                   base: str, what: str) -> ExportResult:
    own = seriesdir.read_listing(dest)  # dest's own series, or None
    if own is None and dest.is_dir() and any(dest.iterdir()):
        raise KvforgeError(f"{display_path(dest)} is not empty and has no `series` file; export into a series "
                           "directory or a new or empty one", EXIT_USAGE)
    ref_dir = dest if own is not None else Path(ctx.component.series_dir).resolve()
    ref = own if own is not None else seriesdir.read_listing(ref_dir)
    result = ExportResult(ctx.target.name, ctx.component.name, dest, what, repo, head, base,
                          [c.sha for c in commits], compared_with=ref_dir if ref is not None else None)

    # Old series: Fix-Id -> (name, bytes), in series order.
    old_by_fix: dict[str, str] = {}
    old_raw: dict[str, bytes] = {}
    if ref is not None:
        for name in ref.names:
            path = ref_dir / name
            if "/" in name or not path.is_file():
                continue
            old_raw[name] = path.read_bytes()
            fid = parse_patch(path, old_raw[name]).value("Fix-Id")
            if fid and fid not in old_by_fix:
                old_by_fix[fid] = name
    managed = set(own.names) | {"series"} if own is not None else {"series"}
    kept = sorted(p.name for p in dest.iterdir() if p.name not in managed) if dest.is_dir() else []

    # Names.
    names: list[str] = []
    taken = set(kept) | set(ref.names if ref else [])
    if renumber:
        names = [f"{n:04d}-{c.fix_id}.patch" for n, c in enumerate(commits, 1)]
    else:
        numbers = [int(m.group(1)) for m in map(_NUMBER_RE.match, taken) if m]
        nxt = max(numbers, default=0) + 1
        for c in commits:
            if c.fix_id in old_by_fix:
                names.append(old_by_fix[c.fix_id])
            else:
                names.append(f"{nxt:04d}-{c.fix_id}.patch")
                nxt += 1
    for name in names:
        if name in kept:
            raise KvforgeError(f"{display_path(dest / name)} is not in the series; export would overwrite it "
                               "(move it away first)", EXIT_USAGE)

    # Statuses, against the old series.
    used_old: set[str] = set()
    for c, name in zip(commits, names):
        old = old_by_fix.get(c.fix_id)
        if old is None:
            status = "new"
        else:
            used_old.add(old)
            status = "unchanged" if old == name and old_raw[old] == c.raw else "rewritten"
        result.files.append(ExportedFile(name, c.fix_id, status, c.sha, c.subject,
                                         old_name=old if old not in (None, name) else None))
    for name in (ref.names if ref else []):
        if name not in used_old:
            fid = parse_patch(ref_dir / name, old_raw[name]).value("Fix-Id") if name in old_raw else None
            result.files.append(ExportedFile(name, fid or "", "removed"))

    series_text = seriesdir.listing_text(ref, names, {f.name: f.old_name or f.name for f in result.files
                                            if f.status in ("unchanged", "rewritten")})
    series_bytes = series_text.encode("utf-8")
    if own is None:
        result.series_file = "new"
    elif (dest / "series").read_bytes() != series_bytes:
        result.series_file = "rewritten"

    # Nothing to do when dest already holds exactly these bytes under these names.
    if own is not None and result.series_file == "unchanged" and set(own.names) == set(names) and all(
            (dest / n).is_file() and (dest / n).read_bytes() == c.raw for n, c in zip(names, commits)):
        return result

    files = {name: c.raw for c, name in zip(commits, names)}
    files[seriesdir.SERIES_FILE] = series_bytes
    tx.stage_dir(dest, files, keep=kept, blame={name: c.blame for c, name in zip(commits, names)})
    tx.commit()
    result.written = True
    return result


def read_commit(repo: Path, sha: str, what: str) -> Commit:
    """The commit as its patch file; one-line KvforgeError when it changes nothing or lacks a valid Fix-Id."""
    raw = format_patch(repo, sha)
    p = parse_patch(Path("commit.patch"), raw)
    subject = p.subject
    if not raw.strip() or not p.diff_line:
        subject = subject or gitutil.run(repo, "log", "-1", "--format=%s", sha).stdout.strip()
        raise KvforgeError(f"{what}: commit {sha[:12]} ({subject}) changes nothing; a patch must change a file "
                           "(drop the commit)", EXIT_USAGE)
    fix_ids = [v.strip() for v in p.values("Fix-Id")]
    if not fix_ids or not FIX_ID_RE.match(fix_ids[0]):
        got = f"its Fix-Id {fix_ids[0]!r} is not a lowercase slug" if fix_ids else "it has no 'Fix-Id:' trailer"
        raise KvforgeError(f"{what}: commit {sha[:12]} ({subject}): {got} in the header block at the end of its "
                           "message (docs/patch-format.md); nothing was written", EXIT_USAGE)
    return Commit(sha, raw, fix_ids[0], subject)


def _source(ctx, base_commit: str) -> tuple[Path, str, str]:
    """(repository, head commit, how to name it in messages) of the tree to export."""
    if ctx.from_rev:
        repo, head = resolve_from(ctx.from_rev)
        return repo, head, f"--from {ctx.from_rev}"
    branch = ctx.branch
    cwd = Path.cwd()
    top = gitutil.run(cwd, "rev-parse", "--show-toplevel", check=False)
    if top.returncode == 0:
        repo = Path(top.stdout.strip())
        if gitutil.run(repo, "cat-file", "-e", f"{base_commit}^{{commit}}", check=False).returncode == 0:
            return repo, _branch_head(repo, branch), f"branch {branch} of {display_path(repo) or '.'}"
    default = cwd / f"{ctx.component.name}-{ctx.target.name}"
    if default.is_dir():
        top = gitutil.run(default, "rev-parse", "--show-toplevel", check=False)
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != default.resolve():
            raise KvforgeError(f"{display_path(default)} is not a git repository; point at your tree with --from DIR "
                               "(or DIR:REV)", EXIT_USAGE)
        return default.resolve(), _branch_head(default, branch), f"branch {branch} of {display_path(default)}"
    raise KvforgeError(f"no tree to export: the repository here does not contain the base {base_commit[:12]} of "
                       f"{ctx.label} and ./{default.name} does not exist; point at your tree with --from DIR "
                       f"(or DIR:REV), or make one with `kvforge apply -t {ctx.target.name}`", EXIT_USAGE)


def _branch_head(repo: Path, branch: str) -> str:
    head = gitutil.rev_parse(repo, f"refs/heads/{branch}^{{commit}}")
    if not head:
        raise KvforgeError(f"{display_path(repo) or '.'} has no branch {branch}; name the commits with --from REV "
                           "(or DIR:REV)", EXIT_USAGE)
    return head


def export_command(ctx, out: Path | None = None, renumber: bool = False) -> Done:
    """`kvforge export`: one row per patch file (its Fix-Id and what happened to it), then the summary."""
    result = export_target(ctx, out=out, renumber=renumber)
    return Done(result.to_json(), table(["patch", "fix-id", "file"], [[e.name, e.fix_id, e.status] for e in result.files])
                + "\n" + result.summary())
