"""`kvforge audit`: what each patch of a series changes in the program, and which of those changes it did
not say it means.

verify proves what the Checks run; a change no test executes (a decorator that moves, a default that
changes, a definition removed while callers remain) passes it. The audit reads each patch's Python
files before and after it (kvforge.proof.semantic) and lists, per definition and per module-level
statement, what changed. Six kinds are risky (series.ACK_KINDS): a decorator moved or lost, a
definition removed or renamed while the patched tree still references its name, a signature change
of a public name, a module-level call added to a module that existed. A risky change the patch's
header does not acknowledge (`Acknowledges:`, docs/patch-format.md) is a problem, reported as
`FILE:LINE: patch NNNN: <what changed> (acknowledge it in the header or undo it)`; so is an
acknowledgement that matches nothing (a header that says more than the patch does). Everything else
(new definitions, body edits, imports, assignments) is listed for review, never flagged.

The trees are the stack's commits (kvforge.git.trees: one commit per patch, built once in the cache):
the audit reads only the blobs of the files each patch names, in one `git cat-file --batch`, and greps
the patched tree once per patch that removes or renames something, so it runs on every lint. It reads
the cache's repository and writes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvforge.core.errors import EXIT_LINT, KvforgeError
from kvforge.core.outcome import Outcome
from kvforge.core.render import table
from kvforge.env.components import contexts, run_each
from kvforge.git import gitutil
from kvforge.git.context import Context
from kvforge.git.trees import Stack, open_stack
from kvforge.project.series import ACK_KINDS, Acknowledgement, Patch, Problem, read_series
from kvforge.project.targets import load_all, load_target
from kvforge.proof.semantic import Change, Unparsable, compare

FORMATS = ("table", "markdown", "json")
REFERENCE_KINDS = ("removed", "renamed")  # risky only while the patched tree still uses the old name
ADVICE = "(acknowledge it in the header or undo it)"


@dataclass
class Finding:
    """A change, where it is, and what the audit makes of it."""

    path: str
    change: Change
    risky: bool = False
    why: str = ""  # why it is risky (e.g. where the removed name is still referenced)
    acknowledged: Acknowledgement | None = None

    @property
    def flagged(self) -> bool:
        return self.risky and self.acknowledged is None

    def to_json(self) -> dict:
        return {"file": self.path, **self.change.to_json(), "risky": self.risky, "why": self.why,
                "acknowledged": str(self.acknowledged) if self.acknowledged else None, "flagged": self.flagged}


@dataclass
class FileAudit:
    path: str
    status: str  # modified | added | deleted | renamed (from old_path)
    added: int
    removed: int
    old_path: str = ""
    python: bool = False
    error: str = ""  # a side that does not parse: listed, never guessed at

    @property
    def stat(self) -> str:
        return f"+{self.added} -{self.removed}"

    def to_json(self) -> dict:
        return {"file": self.path, "status": self.status, "old_path": self.old_path or None, "python": self.python,
                "added": self.added, "removed": self.removed, "error": self.error or None}


@dataclass
class PatchAudit:
    n: int
    name: str
    fix_id: str
    files: list[FileAudit] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    unused: list[Acknowledgement] = field(default_factory=list)  # acknowledgements that match no change
    in_base: bool = False

    @property
    def number(self) -> str:
        """NNNN: the file's number (0008-...patch), else the position."""
        m = re.match(r"^(\d{4})-", self.name)
        return m.group(1) if m else f"{self.n:04d}"

    @property
    def flagged(self) -> list[Finding]:
        return [f for f in self.findings if f.flagged]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.findings:
            out[f.change.kind] = out.get(f.change.kind, 0) + 1
        return out

    def to_json(self) -> dict:
        return {"n": self.n, "patch": self.name, "fix_id": self.fix_id, "in_base": self.in_base,
                "files": [f.to_json() for f in self.files], "changes": [f.to_json() for f in self.findings],
                "counts": self.counts(), "flagged": len(self.flagged),
                "unused_acknowledgements": [{"line": a.line, "value": str(a)} for a in self.unused]}


@dataclass
class AuditReport:
    """The audit of one component's series: an Outcome (table, markdown or JSON)."""

    target: str
    component: str
    series: str
    digest: str
    origin: str
    patches: list[PatchAudit]
    series_dir: Path
    fmt: str = "table"
    seconds: float = 0.0

    def problems(self) -> list[Problem]:
        """What lint reports as problems: each unacknowledged risky change."""
        out: list[Problem] = []
        for p in self.patches:
            for f in p.flagged:
                what = f.change.detail + (f" ({f.why})" if f.why else "")
                out.append(Problem(Path(f.path), f.change.line, f"patch {p.number}: {what} {ADVICE}"))
        return out

    def stale(self) -> list[Problem]:
        """Each acknowledgement that matches no change (shown, never a failure: it hides nothing, and a series
        rebased onto a release that already has the change keeps such lines until someone removes them)."""
        return [Problem(self.series_dir / p.name, a.line,
                        f"Acknowledges {a.kind} {a.name}: patch {p.number} makes no such change (remove the line)")
                for p in self.patches for a in p.unused]

    @property
    def exit_code(self) -> int:
        return EXIT_LINT if self.problems() else 0

    @property
    def error(self) -> str | None:
        n = len(self.problems())
        return f"audit {self.target}/{self.component}: {n} problem{'s' if n != 1 else ''}" if n else None

    def to_json(self) -> Any:
        return {"target": self.target, "component": self.component, "series": self.series, "digest": self.digest,
                "origin": self.origin, "patches": [p.to_json() for p in self.patches],
                "problems": [{"file": str(p.path), "line": p.line, "message": p.message} for p in self.problems()],
                "seconds": round(self.seconds, 3)}

    def render(self) -> str:
        return render_markdown(self) if self.fmt == "markdown" else render_table(self)


# ---------------------------------------------------------------- reading the stack

def _read_blobs(repo: Path, specs: Sequence[str]) -> dict[str, str | None]:
    """`<commit>:<path>` -> the blob's text (None: no such file), all in one `git cat-file --batch`."""
    if not specs:
        return {}
    out = gitutil.run(repo, "cat-file", "--batch", stdin="".join(s + "\n" for s in specs), binary=True).stdout
    blobs: dict[str, str | None] = {}
    pos = 0
    for spec in specs:
        end = out.index(b"\n", pos)
        header = out[pos:end].decode(errors="replace").split()
        pos = end + 1
        if len(header) < 3 or header[-1] == "missing" or header[1] != "blob":
            blobs[spec] = None
            continue
        size = int(header[2])
        blobs[spec] = out[pos:pos + size].decode("utf-8", errors="replace")
        pos += size + 1
    return blobs


def _files(patch: Patch) -> list[FileAudit]:
    out = []
    for f in patch.files:
        src, dst = f.source_file, f.target_file
        src = src[2:] if src.startswith("a/") else src
        dst = dst[2:] if dst.startswith("b/") else dst
        if f.is_added_file:
            status, path, old = "added", dst, ""
        elif f.is_removed_file:
            status, path, old = "deleted", src, src
        elif src != dst:
            status, path, old = "renamed", dst, src
        else:
            status, path, old = "modified", dst, dst
        out.append(FileAudit(path, status, f.added, f.removed, old_path=old if status == "renamed" else "",
                             python=path.endswith(".py")))
    return out


def _references(repo: Path, commit: str, names: Iterable[str]) -> dict[str, list[tuple[str, int]]]:
    """Where each name is still used in the Python files of `commit` (a line that defines it aside)."""
    names = sorted(set(names))
    if not names:
        return {}
    args = ["grep", "-n", "-w", "-F", "--no-color", "-I"]
    for name in names:
        args += ["-e", name]
    res = gitutil.run(repo, *args, commit, "--", "*.py", check=False)
    found: dict[str, list[tuple[str, int]]] = {n: [] for n in names}
    words = {n: re.compile(rf"(?<![\w]){re.escape(n)}(?![\w])") for n in names}
    for line in res.stdout.splitlines():
        parts = line.split(":", 3)  # <commit>:<path>:<line>:<text>
        if len(parts) < 4 or not parts[2].isdigit():
            continue
        path, lineno, text = parts[1], int(parts[2]), parts[3]
        for n, word in words.items():
            if word.search(text) and not re.match(rf"^\s*(async\s+def|def|class)\s+{re.escape(n)}\b", text):
                found[n].append((path, lineno))
    return found


def audit_stack(stack: Stack) -> list[PatchAudit]:
    """Every patch's files and changes, with the risky ones matched against its acknowledgements."""
    repo, commits = stack.base.repo, stack.commits
    patches = stack.series.patches
    files = [_files(p) for p in patches]
    specs: list[str] = []
    for n, fs in enumerate(files, 1):
        for f in fs:
            if f.python:
                if f.status != "added":
                    specs.append(f"{commits[n - 1]}:{f.old_path or f.path}")
                if f.status != "deleted":
                    specs.append(f"{commits[n]}:{f.path}")
    blobs = _read_blobs(repo, specs)
    out = []
    for n, (patch, fs) in enumerate(zip(patches, files), 1):
        audit = PatchAudit(n, patch.name, patch.fix_id, fs, in_base=commits[n] == commits[n - 1])
        for f in fs:
            if not f.python:
                continue
            old = None if f.status == "added" else blobs.get(f"{commits[n - 1]}:{f.old_path or f.path}")
            new = None if f.status == "deleted" else blobs.get(f"{commits[n]}:{f.path}")
            if audit.in_base:
                continue
            try:
                changes = compare(old, new)
            except Unparsable as exc:
                f.error = str(exc)
                continue
            for c in changes:
                audit.findings.append(_judge(f, c))
        names = [f.change.name.rsplit(".", 1)[-1].split("@", 1)[0] for f in audit.findings
                 if f.change.kind in REFERENCE_KINDS and f.risky]
        refs = _references(repo, commits[n], names)
        for finding in audit.findings:
            if finding.change.kind in REFERENCE_KINDS and finding.risky:
                short = finding.change.name.rsplit(".", 1)[-1].split("@", 1)[0]
                where = refs.get(short, [])
                if where:
                    first = ", ".join(f"{p}:{ln}" for p, ln in where[:2])
                    more = f" and {len(where) - 2} more" if len(where) > 2 else ""
                    finding.why = f"`{short}` is still referenced at {first}{more}"
                else:
                    finding.risky = False
        _acknowledge(audit, patch.acknowledgements)
        out.append(audit)
    return out


def _judge(f: FileAudit, c: Change) -> Finding:
    """Whether a change is of a risky kind (references are checked after, once per patch)."""
    risky = c.kind in ("decorator-moved", "decorator-removed")
    if c.kind in REFERENCE_KINDS:
        risky = not c.nested
    elif c.kind == "signature":
        risky = c.public and not c.nested
    elif c.kind == "call-added":
        risky = f.status != "added"  # a new module runs only when something imports it (an import-added)
    return Finding(f.path, c, risky)


def _acknowledge(audit: PatchAudit, acks: list[Acknowledgement]) -> None:
    used: set[int] = set()
    for finding in audit.findings:
        if not finding.risky and finding.change.kind not in ACK_KINDS:
            continue
        c = finding.change
        names = (c.name, c.other) if c.other else (c.name,)
        for i, a in enumerate(acks):
            if a.matches(c.kind, names, finding.path):
                finding.acknowledged = a if finding.risky else None
                used.add(i)
                break
    audit.unused = [a for i, a in enumerate(acks) if i not in used]


# ---------------------------------------------------------------- rendering

def _rows(p: PatchAudit) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for f in p.files:
        if not f.python or f.error:
            rows.append([f"{f.path}", "text" if not f.python else "unparsed", "",
                         f"{f.status}, {f.stat}" + (f": {f.error}" if f.error else ""), ""])
    for fd in p.findings:
        c = fd.change
        mark = "FLAGGED" if fd.flagged else ("acknowledged" if fd.acknowledged else "")
        detail = c.detail + (f" ({fd.why})" if fd.why else "")
        rows.append([f"{fd.path}:{c.line}", c.kind, c.name, detail, mark])
    return rows


def _summary(p: PatchAudit) -> str:
    counts = p.counts()
    text = ", ".join(f"{v} {k}" for k, v in counts.items()) or "no change to Python definitions"
    acked = sum(1 for f in p.findings if f.acknowledged)
    return (f"{p.name} ({p.fix_id}): {text}" + (f"; {acked} acknowledged" if acked else "")
            + (f"; {len(p.flagged)} FLAGGED" if p.flagged else "") + (" (in base: no change)" if p.in_base else ""))


def render_table(report: AuditReport) -> str:
    lines = [f"{report.target}/{report.component}: series {report.series} ({report.digest}, {report.origin}): "
             f"{len(report.patches)} patches"]
    for p in report.patches:
        lines.append("")
        lines.append(_summary(p))
        rows = _rows(p)
        if rows:
            lines.append(table(["where", "kind", "name", "what", "status"], rows))
        lines += [f"  unused: Acknowledges {a} (line {a.line}): the patch makes no such change" for a in p.unused]
    problems = report.problems()
    lines.append("")
    lines += [str(pr) for pr in problems]
    lines += [f"warning: {pr}" for pr in report.stale()]
    lines.append(f"audit {report.target}/{report.component}: " + (
        f"{len(problems)} problem{'s' if len(problems) != 1 else ''}" if problems else "clean")
        + f" ({report.seconds:.2f}s)")
    return "\n".join(lines)


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(report: AuditReport) -> str:
    lines = [f"## Audit of {report.target}/{report.component} ({report.series}, {report.digest})", ""]
    for p in report.patches:
        lines += [f"### {p.name}", "", _summary(p).split(": ", 1)[1], ""]
        rows = _rows(p)
        if rows:
            lines += ["| where | kind | name | what | status |", "|---|---|---|---|---|"]
            lines += ["| " + " | ".join(f"`{_md(r[0])}`" if i == 0 else _md(r[i]) for i in range(5)) + " |"
                      for r in rows]
            lines.append("")
        lines += [f"- unused: `Acknowledges: {a}`" for a in p.unused]
    problems = report.problems()
    if problems:
        lines += ["**Problems**", ""] + [f"- `{_md(str(pr))}`" for pr in problems]
    return "\n".join(lines)


# ---------------------------------------------------------------- commands

def audit_target(ctx: Context, fmt: str = "table") -> AuditReport:
    """ctx's series (the files, or --from's commits) audited patch by patch."""
    import time

    start = time.monotonic()
    stack = open_stack(ctx)
    patches = audit_stack(stack)
    return AuditReport(ctx.target.name, ctx.component.name, ctx.component.series_dir.name, stack.digest,
                       stack.origin, patches, ctx.component.series_dir, fmt, time.monotonic() - start)


def audit_command(ctx: Context, fmt: str = "table", component: str | None = None) -> Outcome:
    """`kvforge audit`: each component of the target (or the one given), in order."""
    if fmt not in FORMATS:
        raise KvforgeError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    return run_each(contexts(ctx, component), lambda c: audit_target(c, fmt))


def lint_problems(cache, target_names: Sequence[str] = (), component: str | None = None,
                  progress=None) -> list[Problem]:
    """The audit's problems of every series lint checks (the named targets', all when none; only
    `component`'s when given). A series lint already refuses (its own problems) is skipped: its
    problems are lint's."""
    targets = [load_target(n) for n in target_names] if target_names else load_all()
    out: list[Problem] = []
    for t in targets:
        for c in t.components:
            if component is not None and c.name != component:
                continue
            if read_series(c.series_dir).all_problems():
                continue
            kw = {"progress": progress} if progress is not None else {}
            out += audit_target(Context.load(cache, t.name, c.name, **kw)).problems()
    return out
