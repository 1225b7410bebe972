"""Annotated patches and the series files that order them.

A patch is a `git format-patch` file whose commit message ends in git trailers (docs/patch-format.md).
Parsing keeps line numbers so every complaint can name file and line. Nothing here writes patches:
exports go through git itself (export.py), never through a re-serialising parser. The `series` file's
syntax (reading and writing it) is kvforge.project.seriesdir's; read_series lints what it lists.
"""

from __future__ import annotations

import functools
import hashlib
import re
import shlex
from dataclasses import dataclass, field, replace
from email.header import decode_header, make_header
from pathlib import Path, PurePosixPath
from typing import Callable

import unidiff

from kvforge.core.errors import EXIT_ENV, KvforgeError
from kvforge.project.seriesdir import parse_listing, recover

FIX_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")
TRAILER_RE = re.compile(r"^([A-Za-z][A-Za-z0-9-]*):\s?(.*)$")
COMMIT_RE = re.compile(r"^[0-9a-f]{7,40}$")
URL_RE = re.compile(r"^https?://\S+$")
NODE_ID_RE = re.compile(r"^[\w./-]+\.py(::[^\s]+)?$")

PATCH_KINDS = ("fix", "refactor", "test")
# Upstream-Status value -> whether a bracketed detail is required.
STATUSES = {
    "Pending": False,
    "Submitted": True,
    "Backport": True,
    "Accepted": False,
    "Inappropriate": True,
}
DROP_WHEN_RE = re.compile(
    r"^(base-contains [0-9a-f]{7,40}|version >= \d+\.\d+(\.\d+)?\S*|upstream-pr-merged https?://\S+|never(\s+\[.+\])?)$"
)
# Acknowledges: the risky kinds of change a patch may declare it means (kvforge.proof.audit flags the others).
ACK_KINDS = ("decorator-moved", "decorator-removed", "removed", "renamed", "signature", "call-added")
ACK_RE = re.compile(r"^(?P<kind>[a-z-]+)\s+(?:(?P<path>[\w./-]+\.py)::)?(?P<name>[A-Za-z_][\w.]*(?:@\d+)?)"
                    r"(?::\s+(?P<reason>\S.*))?$")
# `Review: Fix-Id Kind ...`: the fields kvforge proposed (import, pick) that no person has checked yet. Lint warns
# (`kvforge lint --strict`: fails) until the reviewer removes each name, or the trailer.
REVIEW = "Review"
REQUIRED = ("Fix-Id", "Kind", "Upstream-Status", "Why", "Drop-When", "Signed-off-by")
SINGLE = ("Fix-Id", "Kind", "Upstream-Status", "Why", "Drop-When")


@dataclass
class Problem:
    """One lint finding: where it is and what is wrong."""

    path: Path
    line: int | None
    message: str

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line else f"{self.path}"
        return f"{where}: {self.message}"


@dataclass
class Trailer:
    key: str
    value: str
    line: int


@dataclass(frozen=True)
class Acknowledgement:
    """`Acknowledges: <kind> [<file>::]<qualified name>[: <reason>]`: a change of a risky kind the patch means."""

    kind: str
    name: str
    path: str  # "" when the name alone says it (any file the patch touches)
    reason: str
    line: int

    def matches(self, kind: str, names: tuple[str, ...], path: str) -> bool:
        return self.kind == kind and self.name in names and self.path in ("", path)

    def __str__(self) -> str:
        where = f"{self.path}::" if self.path else ""
        return f"{self.kind} {where}{self.name}" + (f": {self.reason}" if self.reason else "")


def parse_acknowledgement(value: str, line: int = 0) -> Acknowledgement | None:
    """One Acknowledges: value, or None when it is not `<kind> [<file>::]<name>[: <reason>]` of a known kind."""
    m = ACK_RE.match(value.strip())
    if not m or m.group("kind") not in ACK_KINDS:
        return None
    return Acknowledgement(m.group("kind"), m.group("name"), m.group("path") or "", m.group("reason") or "", line)


@dataclass
class Patch:
    """A parsed annotated patch. `problems` holds what lint reports; parsing itself never raises."""

    path: Path
    raw: bytes
    subject: str = ""
    author: str = ""
    trailers: list[Trailer] = field(default_factory=list)
    diff_line: int = 0
    files: list[unidiff.PatchedFile] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.name

    def values(self, key: str) -> list[str]:
        return [t.value for t in self.trailers if t.key.lower() == key.lower()]

    def value(self, key: str) -> str | None:
        vals = self.values(key)
        return vals[0] if vals else None

    @property
    def fix_id(self) -> str:
        return self.value("Fix-Id") or self.path.stem

    @property
    def kind(self) -> str:
        return self.value("Kind") or "fix"

    @property
    def upstream_status(self) -> str:
        return self.value("Upstream-Status") or "?"

    @property
    def checks(self) -> list[str]:
        return self.values("Checks")

    @property
    def bug_checks(self) -> list[str]:
        """The Checks that show the bug (`Bug-Checks:`; default: every Check). Only these say whether a release
        still has the bug; the others test what this variant adds (its API, its knobs) and judge a port."""
        named = set(self.values("Bug-Checks"))
        return [c for c in self.checks if c in named] if named else self.checks

    @property
    def depends_on(self) -> list[str]:
        return self.values("Depends-On")

    @property
    def acknowledgements(self) -> list[Acknowledgement]:
        """The well-formed Acknowledges: trailers, in order (lint reports the others)."""
        out = []
        for t in self.trailers:
            if t.key.lower() == "acknowledges":
                ack = parse_acknowledgement(t.value, t.line)
                if ack is not None:
                    out.append(ack)
        return out

    @property
    def touched_paths(self) -> list[str]:
        return sorted({_strip_prefix(f.target_file if f.target_file != "/dev/null" else f.source_file) for f in self.files})

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()

    def hunk_at(self, path: str, line: int) -> int | None:
        """1-based number of the hunk of `path` whose preimage starts at `line` (as git reports it)."""
        for f in self.files:
            if _strip_prefix(f.source_file) == path or _strip_prefix(f.target_file) == path:
                for i, h in enumerate(f, 1):
                    if h.source_start == line or (h.source_length == 0 and h.source_start + 1 == line):
                        return i
        return None


def _strip_prefix(name: str) -> str:
    for prefix in ("a/", "b/"):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _decode(value: str) -> str:
    try:
        return str(make_header(decode_header(value)))
    except Exception:  # a malformed encoded-word: keep the raw text, lint will still show it
        return value


def mail_headers(lines: list[str], bad: Callable[[int, str], None] | None = None) -> tuple[dict[str, str], int]:
    """The RFC 822 headers of a mail (`lines[0]` is its `From ` line): lower-case keys, folded continuation lines
    joined; and the index of the blank line that ends them (len(lines) when none does). A line that is neither a
    header nor a continuation is skipped, and given to `bad` (its line number, why) when there is one."""
    headers: dict[str, str] = {}
    i, last = 1, None
    while i < len(lines) and lines[i] != "":
        line = lines[i]
        if line[:1] in (" ", "\t") and last:
            headers[last] += " " + line.strip()
        elif ":" in line:
            key, _, value = line.partition(":")
            last = key.strip().lower()
            headers[last] = value.strip()
        elif bad is not None:
            bad(i + 1, f"malformed mail header line {line!r}")
        i += 1
    return headers, i


def parse_patch(path: Path, raw: bytes | None = None) -> Patch:
    """Parse one format-patch file (or `raw`, its bytes, named `path`); every defect becomes a Problem.

    A parse is a function of (path, bytes) alone, so it is remembered for the process (a rebase reads one
    series three times), and a clean one of the bytes alone (its path appears nowhere but in `path`: a rebase
    reads its new files again under their staged names): each call gets its own Patch and lists; the unidiff
    objects in `files` are shared and read-only."""
    path = Path(path)
    if raw is None:
        try:
            raw = path.read_bytes()
        except OSError as exc:
            patch = Patch(path=path, raw=b"")
            patch.problems.append(Problem(path, None, f"cannot read: {exc.strerror or exc}"))
            return patch
    done = _clean(raw) or _parsed(path, raw)
    return replace(done, path=path, trailers=[replace(t) for t in done.trailers], files=list(done.files),
                   problems=list(done.problems))


# Sized for the longest series kvforge meets (a 500-patch rebase reads each patch in several passes: with 256
# entries each pass evicted what the next one needed).
@functools.lru_cache(maxsize=4096)
def _clean(raw: bytes) -> Patch | None:
    """The parse of `raw` when it has no problem (a Problem names the path), else None."""
    done = _parse(Path("kvforge-unnamed.patch"), raw)
    return None if done.problems else done


@functools.lru_cache(maxsize=4096)
def _parsed(path: Path, raw: bytes) -> Patch:
    """The parse of a patch with problems, which name `path`."""
    return _parse(path, raw)


def _parse(path: Path, raw: bytes) -> Patch:
    patch = Patch(path=path, raw=raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        patch.problems.append(Problem(path, None, f"not UTF-8 ({exc.reason} at byte {exc.start})"))
        return patch
    lines = text.split("\n")

    def bad(line: int | None, message: str) -> None:
        patch.problems.append(Problem(path, line, message))

    # Two whole-file conversions an editor makes: each is one problem, not hundreds of follow-on ones.
    if text.startswith("\ufeff"):
        bad(None, "starts with a UTF-8 byte-order mark (git format-patch writes none); remove it with "
                  f"`sed -i '1s/^\\xEF\\xBB\\xBF//' {shlex.quote(str(path))}`")
        return patch
    if lines[0].endswith("\r"):
        # The mail header is CRLF: the file was converted. (CR inside diff lines can be a tree file's
        # own line endings, so only the header decides.)
        bad(None, "has CRLF line endings (git format-patch writes LF); "
                  f"convert with `sed -i 's/\\r$//' {shlex.quote(str(path))}`")
        return patch
    if not lines or not lines[0].startswith("From "):
        bad(1, "not a git format-patch file (first line must be 'From <commit> <date>')")
        return patch

    headers, i = mail_headers(lines, bad)
    for key in ("from", "date", "subject"):
        if key not in headers:
            bad(2, f"missing mail header '{key.capitalize()}:'")
    patch.author = _decode(headers.get("from", ""))
    patch.subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", _decode(headers.get("subject", "")))

    # Message body runs to the '---' line; the diff starts at the first 'diff --git'.
    body_start = i + 1
    end = body_start
    while end < len(lines) and lines[end] != "---" and not lines[end].startswith("diff --git "):
        end += 1
    if end >= len(lines):
        bad(None, "no '---' separator or diff found after the commit message")
        return patch
    _parse_trailers(patch, lines, body_start, end, bad)

    diff_start = next((k for k in range(end, len(lines)) if lines[k].startswith("diff --git ")), None)
    if diff_start is None:
        bad(end + 1, "patch has no 'diff --git' section")
        return patch
    patch.diff_line = diff_start + 1
    diff_lines = lines[diff_start:]
    # format-patch's signature ('-- ' then the git version) is not part of the diff.
    for k in range(len(diff_lines) - 1, -1, -1):
        if diff_lines[k] == "-- ":
            diff_lines = diff_lines[:k]
            break
    _check_paths(patch, diff_lines, diff_start, bad)
    try:
        patch.files = list(unidiff.PatchSet("\n".join(diff_lines) + "\n"))
    except unidiff.UnidiffParseError as exc:
        bad(patch.diff_line, f"diff does not parse: {str(exc).strip()}")
        return patch
    if not patch.files:
        bad(patch.diff_line, "diff changes no file")
    return patch


def _parse_trailers(patch: Patch, lines: list[str], start: int, end: int, bad) -> None:
    # The trailer block is the last paragraph of the message.
    stop = end
    while stop > start and lines[stop - 1].strip() == "":
        stop -= 1
    first = stop
    while first > start and lines[first - 1].strip() != "":
        first -= 1
    trailers: list[Trailer] = []
    for k in range(first, stop):
        line = lines[k]
        if line[:1] in (" ", "\t"):
            if not trailers:
                bad(k + 1, "continuation line before any trailer")
                continue
            trailers[-1].value += " " + line.strip()
            continue
        m = TRAILER_RE.match(line)
        if not m:
            bad(k + 1, f"not a 'Key: value' trailer in the header block: {line!r}")
            continue
        trailers.append(Trailer(m.group(1), m.group(2).strip(), k + 1))
    patch.trailers = trailers
    trailer_line = first + 1
    _check_trailers(patch, trailer_line, bad)


def _check_trailers(patch: Patch, block_line: int, bad) -> None:
    seen: dict[str, list[Trailer]] = {}
    for t in patch.trailers:
        seen.setdefault(t.key, []).append(t)
    for key in REQUIRED:
        if key not in seen:
            bad(block_line, f"missing required header '{key}:'")
    for key in SINGLE:
        if len(seen.get(key, [])) > 1:
            bad(seen[key][1].line, f"'{key}:' given more than once")
    for t in patch.trailers:
        v = t.value
        if not v:
            bad(t.line, f"'{t.key}:' is empty")
            continue
        if t.key == "Fix-Id" and not FIX_ID_RE.match(v):
            bad(t.line, f"Fix-Id {v!r} must be a lowercase slug (letters, digits, '-')")
        elif t.key == "Kind" and v not in PATCH_KINDS:
            bad(t.line, f"Kind {v!r} is not one of {', '.join(PATCH_KINDS)}")
        elif t.key == "Upstream-Status":
            _check_status(t, bad)
        elif t.key in ("Upstream-PR", "Bug") and not URL_RE.match(v):
            bad(t.line, f"{t.key} {v!r} is not a URL")
        elif t.key == "Upstream-Commit" and not COMMIT_RE.match(v):
            bad(t.line, f"Upstream-Commit {v!r} is not a commit id (7-40 hex digits)")
        elif t.key == "Drop-When" and not DROP_WHEN_RE.match(v):
            bad(t.line, f"Drop-When {v!r} must be 'base-contains <commit>', 'version >= X.Y.Z', "
                        "'upstream-pr-merged <url>' or 'never [reason]'")
        elif t.key == "Checks":
            if not NODE_ID_RE.match(v):
                bad(t.line, f"Checks {v!r} is not a pytest node id (path/to/test_x.py::test_name)")
            elif not _safe_relpath(v.split("::")[0]):
                bad(t.line, f"Checks {v!r} points outside the tree")
        elif t.key == "Bug-Checks" and v not in patch.checks:
            bad(t.line, f"Bug-Checks {v!r} is not one of the patch's 'Checks:'")
        elif t.key == "Acknowledges" and parse_acknowledgement(v) is None:
            m = ACK_RE.match(v)
            if m and m.group("kind") not in ACK_KINDS:
                bad(t.line, f"Acknowledges {v!r}: {m.group('kind')!r} is not a kind to acknowledge "
                            f"({', '.join(ACK_KINDS)})")
            else:
                bad(t.line, f"Acknowledges {v!r} must be '<kind> [<file>::]<qualified name>[: <reason>]'")
        elif t.key == "Depends-On" and not FIX_ID_RE.match(v):
            bad(t.line, f"Depends-On {v!r} is not a Fix-Id")
        elif t.key == "Signed-off-by" and not re.match(r"^.+ <[^<>@\s]+@[^<>\s]+>$", v):
            bad(t.line, f"Signed-off-by {v!r} must be 'Name <email>'")
    acks: dict[tuple[str, str, str], int] = {}
    for t in seen.get("Acknowledges", []):
        ack = parse_acknowledgement(t.value, t.line)
        if ack is not None:
            ack_key = (ack.kind, ack.path, ack.name)
            if ack_key in acks:
                bad(t.line, f"Acknowledges {ack.kind} {ack.name} given twice (first on line {acks[ack_key]})")
            acks.setdefault(ack_key, t.line)
    if patch.kind == "fix" and "Checks" not in seen and "Kind" in seen:
        bad(block_line, "Kind fix needs at least one 'Checks:' test that proves it (or say 'Kind: refactor')")
    _check_author_signoff(patch, seen.get("Signed-off-by", []), block_line, bad)


def unreviewed(patch: Patch) -> list[str]:
    """The header fields `Review:` still names: proposed by kvforge, not yet checked by a person."""
    return [name for v in patch.values(REVIEW) for name in v.replace(",", " ").split()]


def review_warnings(series: Series) -> list[Problem]:
    """One warning per patch with unreviewed fields (not lint problems: a series under review still applies)."""
    out = []
    for p in series.patches:
        names = unreviewed(p)
        if names:
            line = next(t.line for t in p.trailers if t.key.lower() == REVIEW.lower())
            out.append(Problem(p.path, line, f"unreviewed: {', '.join(names)} (proposed by kvforge; check each, then "
                                             f"remove its name from '{REVIEW}:', or the line)"))
    return out


def author_email(ident: str) -> str:
    """'Name <a@b>' -> 'a@b' (lowercased); '' when there is none."""
    m = re.search(r"<([^<>\s]+@[^<>\s]+)>\s*$", ident or "")
    return m.group(1).lower() if m else ""


def _check_author_signoff(patch: Patch, signoffs: list[Trailer], block_line: int, bad) -> None:
    """DCO: the commit author (From:) signs off too; the DCO app compares the author's email with the
    Signed-off-by lines. A carrier adds their own sign-off after the author's, never instead of it."""
    email = author_email(patch.author)
    if not email or not signoffs:
        return  # a missing From: or Signed-off-by is reported on its own
    if not any(author_email(t.value) == email for t in signoffs):
        bad(signoffs[0].line, f"the author {patch.author!r} has no Signed-off-by of their own (DCO: the "
                              f"author must sign off; add 'Signed-off-by: {patch.author}' if they certified it, "
                              "or make the From: the person who did)")


def _check_status(t: Trailer, bad) -> None:
    m = re.match(r"^([A-Za-z-]+)(?:\s+\[(.*)\])?\s*$", t.value)
    if not m or m.group(1) not in STATUSES:
        bad(t.line, f"Upstream-Status {t.value!r} is not one of {', '.join(STATUSES)} (with [detail] where needed)")
        return
    name, detail = m.group(1), m.group(2)
    if STATUSES[name] and not (detail and detail.strip()):
        what = {"Submitted": "the PR url", "Backport": "the upstream PR or commit", "Inappropriate": "the reason"}[name]
        bad(t.line, f"Upstream-Status {name} needs [{what}]")


def _safe_relpath(p: str) -> bool:
    if not p or p.startswith("/") or "\\" in p:
        return False
    parts = PurePosixPath(p).parts
    return ".." not in parts and ".git" not in parts and "" not in parts


def _check_paths(patch: Patch, diff_lines: list[str], offset: int, bad) -> None:
    for k, line in enumerate(diff_lines):
        lineno = offset + k + 1
        if line.startswith("diff --git "):
            names = line[len("diff --git "):].split(" ")
            for name in names:
                if not _safe_relpath(_strip_prefix(name.strip('"'))):
                    bad(lineno, f"path {name!r} escapes the tree")
        elif line.startswith(("--- ", "+++ ")):
            name = line[4:].split("\t")[0].strip('"')
            if name != "/dev/null" and (not name.startswith(("a/", "b/")) or not _safe_relpath(_strip_prefix(name))):
                bad(lineno, f"path {name!r} escapes the tree")
        elif line.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
            name = line.split(" ", 2)[2]
            if not _safe_relpath(name):
                bad(lineno, f"path {name!r} escapes the tree")
        elif line.startswith(("new file mode 120000", "new mode 120000")):
            bad(lineno, "patch creates a symbolic link (writes through links are refused)")


@dataclass
class Series:
    """An ordered list of patches in one directory, as its `series` file says."""

    directory: Path
    patches: list[Patch]
    problems: list[Problem]

    @property
    def digest(self) -> str:
        """Identifies the series' content: changes whenever any patch or the order changes."""
        h = hashlib.sha256()
        for p in self.patches:
            h.update(p.name.encode() + b"\0" + p.raw + b"\0")
        return h.hexdigest()[:16]

    def by_fix_id(self) -> dict[str, Patch]:
        return {p.fix_id: p for p in self.patches}

    def all_problems(self) -> list[Problem]:
        out = list(self.problems)
        for p in self.patches:
            out.extend(p.problems)
        return out


def read_series(directory: Path) -> Series:
    """Read `directory/series` and parse every patch it lists; problems are collected, not raised. A missing
    directory whose interrupted swap left it beside itself is put back first (kvforge.project.seriesdir.recover)."""
    directory = Path(directory)
    series_file = directory / "series"
    problems: list[Problem] = []
    if not directory.is_dir():
        recover(directory)  # a swap killed between the fallback's two renames: finish it (or say how)
    if not directory.is_dir():
        raise KvforgeError(f"{directory}: series directory does not exist")
    if not series_file.is_file():
        raise KvforgeError(f"{series_file}: missing (one patch file name per line, in order)")
    patches: list[Patch] = []
    listed: dict[str, int] = {}
    try:
        data = series_file.read_bytes()
    except OSError as exc:
        raise KvforgeError(f"{series_file}: cannot read: {exc.strerror or exc}", EXIT_ENV) from None
    try:
        # A UTF-8 byte-order mark (Windows editors add one) is tolerated: only kvforge reads this
        # file, the mark is invisible in every editor, and without utf-8-sig it would become part of
        # the first file name and give a baffling "<name> does not exist".
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        problems.append(Problem(series_file, data.count(b"\n", 0, exc.start) + 1,
                                f"not UTF-8 ({exc.reason} at byte {exc.start})"))
        return Series(directory=directory, patches=[], problems=problems)
    for entry in parse_listing(text).entries:
        name, n = entry.name, entry.number
        if name in listed:
            problems.append(Problem(series_file, n, f"{name} is listed twice (first on line {listed[name]})"))
            continue
        listed[name] = n
        if "/" in name or name.startswith("."):
            problems.append(Problem(series_file, n, f"{name!r} must be a plain file name in {directory}"))
            continue
        path = directory / name
        if not path.is_file():
            problems.append(Problem(series_file, n, f"{name} does not exist"))
            continue
        patches.append(parse_patch(path))
    for extra in sorted(directory.glob("*.patch")):
        if extra.name not in listed:
            problems.append(Problem(extra, None, "patch file is not listed in the series file"))
    seen: dict[str, Patch] = {}
    for p in patches:
        fid = p.value("Fix-Id")
        if not fid:
            continue
        if fid in seen:
            line = next(t.line for t in p.trailers if t.key == "Fix-Id")
            problems.append(Problem(p.path, line, f"Fix-Id {fid!r} already used by {seen[fid].name}"))
        for dep in p.depends_on:
            if dep not in seen:
                line = next(t.line for t in p.trailers if t.key == "Depends-On" and t.value == dep)
                problems.append(Problem(p.path, line, f"Depends-On {dep!r} is not an earlier patch of this series"))
        seen[fid] = p
    return Series(directory=directory, patches=patches, problems=problems)


def load_clean_series(component) -> Series:
    """The component's series, refusing it (one line, the first problem) when lint finds anything."""
    series = read_series(component.series_dir)
    problems = series.all_problems()
    if problems:
        more = f" (and {len(problems) - 1} more; run `kvforge lint`)" if len(problems) > 1 else ""
        raise KvforgeError(f"{problems[0]}{more}")
    return series


def lint_directory(directory: Path) -> list[Problem]:
    """Every problem lint finds in the series of `directory` (what seriesdir checks before a swap)."""
    return read_series(directory).all_problems()
