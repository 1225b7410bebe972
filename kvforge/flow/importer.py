"""`kvforge import -t TARGET SOURCE`: a team's existing series into a target, in one all-or-nothing step.

Sources (`read_sources`), each a list of (name, bytes) in series order: a directory of patch files (the order
of its quilt-style `series` file, else `--order FILE`, else name order), a `git format-patch` mbox of one or
more messages, or a fork branch's commits (`--repo CLONE BASE..BRANCH`, oldest first, merges refused).

Each patch gets kvforge's header from kvforge.project.headers (what it has kept, what it lacks proposed and
named in `Review:`). Then, as `apply` does, `git am -3` applies them in one run on the target's stack tip (the
base, or the base with the series the target already carries) in a worktree of kvforge's own in the cache: a
patch that does not apply is named with its file, hunk and line, and nothing is written. The commits are then
written by kvforge.flow.export (the one transaction of the project, crash points `export:<step>`); the series
directory is the old one or the whole new one. The worktree is removed either way.
"""

from __future__ import annotations

import email.utils
import re
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.core.outcome import Done
from kvforge.core.render import table
from kvforge.flow.export import export_target
from kvforge.flow.picksource import carrier, checks_of
from kvforge.git import gitutil
from kvforge.git.context import Context
from kvforge.git.engine import ApplyFailure, add_worktree, am_series, format_patch, remove_worktree
from kvforge.git.trees import open_stack, scratch_dir
from kvforge.project import headers
from kvforge.project.seriesdir import parse_listing
from kvforge.project.series import parse_patch
from kvforge.project.targets import display_path, project_root


@dataclass
class Source:
    """One patch as the team has it."""

    name: str  # its file name, or the commit it is
    raw: bytes
    date: str = ""  # RFC 2822 date for a patch that carries none (a plain diff: its file's time)
    by_file: bool = True  # its name is a file name (a proposed Fix-Id comes from it), not a message or commit


@dataclass
class Imported:
    name: str  # the source's name
    fix_id: str
    proposed: list[str]
    status: str = "not reached"  # git am's word: applied | applied (3-way) | in base | failed
    file: str = ""  # the series file it became


@dataclass
class ImportResult:
    target: str
    component: str
    source: str
    patches: list[Imported] = field(default_factory=list)
    written: bool = False
    directory: str = ""
    dry_run: bool = False

    def to_json(self) -> dict:
        return {"target": self.target, "component": self.component, "source": self.source,
                "directory": self.directory, "written": self.written, "dry_run": self.dry_run,
                "patches": [vars(p) for p in self.patches],
                "unreviewed": sum(bool(p.proposed) for p in self.patches)}

    def render(self) -> str:
        rows = [[p.name, p.file or "-", p.fix_id, p.status, " ".join(p.proposed) or "-"] for p in self.patches]
        n, todo = len(self.patches), sum(bool(p.proposed) for p in self.patches)
        where = f"{self.directory}: " if self.directory else ""
        what = "dry run, nothing written" if self.dry_run else "written" if self.written else "nothing written"
        return (table(["source", "file", "fix-id", "applied", "proposed (to review)"], rows)
                + f"\n{where}{n} patch{'es' if n != 1 else ''} imported from {self.source} ({what}); "
                + f"{todo} with proposed fields to review (`kvforge lint` lists them)")


# ---------------------------------------------------------------- sources


def _mtime_date(path: Path) -> str:
    return email.utils.formatdate(path.stat().st_mtime, localtime=False)


def from_directory(directory: Path, order: Path | None) -> list[Source]:
    """The patch files of a directory, in its `series` file's order, `order`'s, or by name."""
    listing = order or (directory / "series" if (directory / "series").is_file() else None)
    if listing is not None:
        try:
            text = listing.read_text(encoding="utf-8-sig")
        except OSError as exc:
            raise KvforgeError(f"{listing}: cannot read: {exc.strerror or exc}", EXIT_USAGE) from None
        # quilt's lines may carry options after the name (`x.patch -p1`): the name is the first word.
        names = [e.name.split()[0] for e in parse_listing(text).entries if e.name.strip()]
    else:
        names = sorted(p.name for p in directory.iterdir() if p.is_file() and p.suffix in (".patch", ".diff"))
    out = []
    for name in names:
        path = directory / name
        if not path.is_file():
            raise KvforgeError(f"{listing}: lists {name}, which is not a file in {directory}", EXIT_USAGE)
        out.append(Source(name, path.read_bytes(), _mtime_date(path)))
    if not out:
        raise KvforgeError(f"{directory}: no patch files (*.patch, *.diff, or a `series` file naming them)", EXIT_USAGE)
    return out


def from_mbox(path: Path) -> list[Source]:
    """Each message of a `git format-patch --stdout` mbox."""
    raw = path.read_bytes()
    starts = [m.start() for m in re.finditer(rb"^From [0-9a-f]{40} ", raw, re.M)]
    if not starts:
        raise KvforgeError(f"{path}: not an mbox of `git format-patch` messages (no 'From <commit>' line)", EXIT_USAGE)
    parts = [raw[a:b] for a, b in zip(starts, starts[1:] + [len(raw)])]
    out = []
    for k, part in enumerate(parts, 1):
        out.append(Source(f"{path.name}#{k}", part, by_file=False))
    return out


def from_branch(clone: Path, spec: str) -> list[Source]:
    """BASE..BRANCH of a clone: each commit as `git format-patch` writes it."""
    if ".." not in spec:
        raise KvforgeError(f"--repo {clone} {spec}: give a range BASE..BRANCH (the fork branch's commits)", EXIT_USAGE)
    if gitutil.run(clone, "rev-parse", "--git-dir", check=False).returncode != 0:
        raise KvforgeError(f"--repo {clone}: not a git repository", EXIT_USAGE)
    a, b = spec.split("..", 1)
    ca, cb = gitutil.rev_parse(clone, f"{a}^{{commit}}"), gitutil.rev_parse(clone, f"{b or 'HEAD'}^{{commit}}")
    if not ca or not cb:
        raise KvforgeError(f"--repo {clone}: {spec!r} is not a range of commits there", EXIT_USAGE)
    merges = gitutil.run(clone, "rev-list", "--merges", f"{ca}..{cb}").stdout.split()
    if merges:
        raise KvforgeError(f"--repo {clone}: {merges[0][:12]} in {spec} is a merge; a series is linear history",
                           EXIT_USAGE)
    commits = gitutil.run(clone, "rev-list", "--reverse", f"{ca}..{cb}").stdout.split()
    if not commits:
        raise KvforgeError(f"--repo {clone}: {spec} holds no commit", EXIT_USAGE)
    return [Source(c[:12], format_patch(clone, c), by_file=False) for c in commits]


def read_sources(source: str | None, order: Path | None, repo: tuple[Path, str] | None) -> tuple[str, list[Source]]:
    """(how to name the source, its patches in order)."""
    if repo is not None:
        if source:
            raise KvforgeError("give SOURCE or --repo CLONE RANGE, not both", EXIT_USAGE)
        clone = Path(repo[0]).expanduser()
        return f"{display_path(clone)} {repo[1]}", from_branch(clone, repo[1])
    if not source:
        raise KvforgeError("SOURCE is required: a directory of patches, an mbox file, or --repo CLONE BASE..BRANCH",
                           EXIT_USAGE)
    path = Path(source).expanduser()
    if order is not None and not path.is_dir():
        raise KvforgeError("--order FILE orders a directory of patches; SOURCE is not one", EXIT_USAGE)
    if path.is_dir():
        return display_path(path), from_directory(path, order)
    if path.is_file():
        raw = path.read_bytes()
        if len(re.findall(rb"^From [0-9a-f]{40} ", raw, re.M)) >= 1:
            return display_path(path), from_mbox(path)
        return display_path(path), [Source(path.name, raw, _mtime_date(path))]
    raise KvforgeError(f"SOURCE {source!r}: no such file or directory", EXIT_USAGE)


# ---------------------------------------------------------------- the import


def _unique(fid: str, taken: set[str]) -> str:
    k, out = 2, fid
    while out in taken:
        out, k = f"{fid}-{k}", k + 1
    return out


def annotate_all(sources: list[Source], taken: set[str], ident: "str | None" = None) -> list[headers.Proposal]:
    """Each source with kvforge's header; Fix-Ids kvforge proposes are made unique (against `taken` too)."""
    who: list[str] = []

    def carrier_ident() -> str:
        if not who:
            who.append(ident or carrier(project_root(), None))
        return who[0]

    out = []
    for s in sources:
        try:
            h = headers.read_patch(s.name, s.raw)
            proposed = headers.fix_id_of(s.name, h.subject) if s.by_file else headers.slug(h.subject) or "patch"
            wanted = None if re.search(r"^Fix-Id:", "\n".join(h.trailers), re.M) else _unique(proposed, taken)
            p = headers.annotate(s.name, h, carrier=h.author or carrier_ident(), fix_id=wanted,
                                 checks=checks_of(h.diff), date=s.date or email.utils.formatdate(0))
        except ValueError as exc:
            raise KvforgeError(f"{exc}; nothing was written", EXIT_USAGE) from None
        if p.fix_id in taken:
            raise KvforgeError(f"{s.name}: Fix-Id {p.fix_id!r} is already used (by the target's series or an earlier "
                               "patch); nothing was written", EXIT_USAGE)
        taken.add(p.fix_id)
        out.append(p)
    return out


def import_series(ctx: Context, source: str | None, order: Path | None = None, repo: tuple[Path, str] | None = None,
                  dry_run: bool = False) -> ImportResult:
    label, sources = read_sources(source, order, repo)
    series = ctx.series()
    proposals = annotate_all(sources, {p.fix_id for p in series.patches})
    result = ImportResult(ctx.target.name, ctx.component.name, label, dry_run=dry_run,
                          patches=[Imported(s.name, p.fix_id, p.proposed) for s, p in zip(sources, proposals)])
    base = ctx.base()
    tip = open_stack(ctx).commits[-1] if series.patches else base.commit
    work = scratch_dir(ctx.cache, "import")
    wt = work / "tree"
    try:
        files = []
        for n, p in enumerate(proposals, 1):
            path = work / f"{n:04d}-{p.fix_id}.patch"
            path.write_bytes(p.raw)
            files.append(parse_patch(path, p.raw))
        ctx.say(f"applying {len(files)} patches to {ctx.label} ({tip[:12]})")
        add_worktree(base.repo, wt, tip)
        try:
            outcomes = am_series(wt, files, tip)
        except ApplyFailure as exc:
            for imp, o in zip(result.patches, exc.outcomes):
                imp.status = o.status
            src = result.patches[next(k for k, o in enumerate(exc.outcomes) if o.status == "failed")].name
            raise KvforgeError(f"{src}: {str(exc).split(': ', 1)[1]} on {ctx.label}; nothing was written",
                               exc.exit_code, data=result.to_json()) from None
        for imp, o in zip(result.patches, outcomes):
            imp.status = o.status
        if dry_run:
            return result
        head = gitutil.rev_parse(wt, "HEAD") or tip
        exported = export_target(replace(ctx, from_rev=f"{wt}:{head}"))
        names = {f.fix_id: f.name for f in exported.files}
        for imp in result.patches:
            imp.file = names.get(imp.fix_id, "")
        result.written, result.directory = exported.written, exported.shown
        return result
    finally:
        remove_worktree(base.repo, wt)
        shutil.rmtree(work, ignore_errors=True)


def import_command(ctx: Context, source: str | None, order: Path | None = None,
                   repo: tuple[Path, str] | None = None, dry_run: bool = False) -> Done:
    """`kvforge import`: a row per patch (its file, Fix-Id, how it applied, what kvforge proposed)."""
    result = import_series(ctx, source, order, repo, dry_run)
    notes = [f"{p.name}: already in {ctx.label}'s base (git am found nothing to change); not imported"
             for p in result.patches if p.status == "in base"]
    return Done(result.to_json(), result.render(), notes=notes)
