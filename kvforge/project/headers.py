"""A team's patch as it is, and the kvforge header proposed for what it lacks.

`read_patch` reads one patch in any of the forms teams keep: a plain diff (`diff --git`, or bare `---`/`+++`),
a `git format-patch` message, or a quilt patch headed by DEP-3 (Description, Author, Origin, Forwarded,
Applied-Upstream, Bug) or Yocto (a subject line, prose, Upstream-Status, Signed-off-by) lines. `annotate`
makes the format-patch file kvforge carries: what the patch has is kept as it is (subject, message, author,
date, its header lines and its trailer block, byte for byte), and what it lacks is proposed (Fix-Id from the
file name or subject, Kind from the paths it touches, Upstream-Status and links from the upstream URLs it
names, Drop-When from a linked commit or PR, Why from the message, the author's sign-off), every proposed
field named in one `Review:` trailer (kvforge.project.series.REVIEW) that lint warns about until a person
has checked it (`with_review`: lint's warnings, errors with --strict). Nothing here touches git or writes:
callers apply (git am) and write (the transaction).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from email.header import decode_header, make_header
from pathlib import Path

from kvforge.core.errors import EXIT_LINT
from kvforge.core.outcome import Done
from kvforge.project.series import (FIX_ID_RE, REVIEW, TRAILER_RE, author_email, mail_headers, parse_patch, read_series,
                                    review_warnings)
from kvforge.project.targets import load_all, load_target

ZERO = "0" * 40
PR_LINK = re.compile(r"https://github\.com/[\w.-]+/[\w.-]+/pull/\d+")
COMMIT_LINK = re.compile(r"https://github\.com/[\w.-]+/[\w.-]+/commit/([0-9a-f]{7,40})")
DEP3_KEYS = ("description", "subject", "author", "from", "origin", "bug", "forwarded", "applied-upstream",
             "last-update", "reviewed-by", "acked-by")
NEVER = "never [no upstream commit or PR known for it]"


@dataclass
class Header:
    """A patch as its file has it: the message parts, and the diff from its first line on."""

    subject: str
    author: str  # Name <email>, or "" when the patch names none
    date: str  # RFC 2822, or ""
    body: str  # the message after the subject, without the trailer block, as it was
    trailers: list[str]  # the message's trailer block, its lines as they were
    diff: bytes
    fields: dict[str, str] = field(default_factory=dict)  # DEP-3 / Yocto header values, lowercased keys


def _decode(value: str) -> str:
    try:
        return str(make_header(decode_header(value)))
    except Exception:  # a malformed encoded-word: the raw text
        return value


def _is_trailer_block(lines: list[str]) -> bool:
    return bool(lines) and bool(TRAILER_RE.match(lines[0])) and all(
        TRAILER_RE.match(ln) or ln[:1] in (" ", "\t") for ln in lines)


def _split_trailers(message: str) -> tuple[str, list[str]]:
    """(message without its last paragraph, that paragraph's lines) when the last paragraph is trailers."""
    text = message.rstrip("\n")
    head, sep, last = text.rpartition("\n\n")
    lines = last.split("\n")
    if _is_trailer_block(lines):
        return (head if sep else ""), lines
    return text, []


def _fields(lines: list[str]) -> dict[str, str]:
    """Key: value lines (continuations joined), first value of each key, keys lowercased."""
    out: dict[str, str] = {}
    last = None
    for ln in lines:
        m = TRAILER_RE.match(ln)
        if m and ln[:1] not in (" ", "\t"):
            last = m.group(1).lower()
            out.setdefault(last, m.group(2).strip())
        elif last and ln[:1] in (" ", "\t") and ln.strip() != ".":
            out[last] += "\n" + ln.strip()
    return out


def _diff_start(lines: list[str]) -> int | None:
    for k, ln in enumerate(lines):
        if ln.startswith(("diff --git ", "Index: ")):
            return k
        if ln.startswith("--- ") and k + 1 < len(lines) and lines[k + 1].startswith("+++ "):
            return k
    return None


def _path(name: str) -> str:
    """A traditional diff's file name, one leading directory off (patch -p1), its timestamp dropped."""
    name = name.split("\t")[0].strip()
    return name if name == "/dev/null" else name.split("/", 1)[-1]


def _gitify(lines: list[str]) -> str:
    """A diff with every file headed by `diff --git` (quilt's `Index:` / `===` lines dropped), so that git and
    kvforge's parser read it alike and a failure names its hunk; a `diff --git` diff is left as it is."""
    if any(ln.startswith("diff --git ") for ln in lines):
        return "\n".join(lines)
    out: list[str] = []
    k = 0
    while k < len(lines):
        ln = lines[k]
        if ln.startswith("--- ") and k + 1 < len(lines) and lines[k + 1].startswith("+++ "):
            old, new = _path(ln[4:]), _path(lines[k + 1][4:])
            path = new if new != "/dev/null" else old
            out.append(f"diff --git a/{path} b/{path}")
            if old == "/dev/null":
                out.append("new file mode 100644")
            elif new == "/dev/null":
                out.append("deleted file mode 100644")
            out += [f"--- {'/dev/null' if old == '/dev/null' else 'a/' + path}",
                    f"+++ {'/dev/null' if new == '/dev/null' else 'b/' + path}"]
            k += 2
            continue
        if not (ln.startswith(("Index: ", "====")) or (ln and ln[0] not in " +-@\\" and not out)):
            out.append(ln)
        k += 1
    return "\n".join(out)


def read_patch(name: str, raw: bytes) -> Header:
    """The patch file `name` (its bytes `raw`) as a Header; ValueError (one line) when it holds no diff."""
    text = raw.decode("utf-8", "replace")
    lines = text.split("\n")
    if lines[0].startswith("From ") and re.match(r"^From [0-9a-f]{40} ", lines[0]):
        return _read_mail(name, lines, raw)
    start = _diff_start(lines)
    if start is None:
        raise ValueError(f"{name}: no diff in it (neither 'diff --git' nor '---'/'+++' lines)")
    head = lines[:start]
    if "---" in head:  # quilt / Yocto: the header ends at '---', a diffstat may follow
        head = head[:len(head) - 1 - head[::-1].index("---")]
    header = "\n".join(head).strip("\n")
    diff = _gitify(lines[start:]).encode("utf-8")
    fields = _fields([ln for para in header.split("\n\n") for ln in para.split("\n")
                      if _is_trailer_block(para.split("\n"))])
    subject, body = "", header
    desc = fields.get("description") or fields.get("subject")
    first = header.split("\n", 1)[0] if header else ""
    if desc:
        subject = desc.split("\n", 1)[0].strip()
    elif first and not TRAILER_RE.match(first):  # Yocto / a plain message: its first line is the subject
        subject, body = first.strip(), header.split("\n", 1)[1].lstrip("\n") if "\n" in header else ""
    body, trailers = _split_trailers(body)
    # No Author: (Yocto's habit): the first sign-off is the author's.
    author = _decode(fields.get("author") or fields.get("from") or fields.get("signed-off-by")
                     or _fields(trailers).get("signed-off-by") or "")
    return Header(subject, author if author_email(author) else "", "", body, trailers, diff, fields)


def _read_mail(name: str, lines: list[str], raw: bytes) -> Header:
    headers, i = mail_headers(lines)
    start = _diff_start(lines[i:])
    if start is None:
        raise ValueError(f"{name}: a mail with no diff in it")
    start += i
    message = lines[i + 1:start]
    if "---" in message:
        message = message[:len(message) - 1 - message[::-1].index("---")]
    diff_text = "\n".join(lines[start:])
    k = diff_text.rfind("\n-- \n")
    diff = (diff_text[:k + 1] if k >= 0 else diff_text).encode("utf-8")
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", _decode(headers.get("subject", "")))
    body, trailers = _split_trailers("\n".join(message).strip("\n"))
    return Header(subject, _decode(headers.get("from", "")), headers.get("date", ""), body, trailers, diff)


# ---------------------------------------------------------------- the proposal


def slug(text: str) -> str:
    s = re.sub(r"\[[^\]]*\]", " ", text)
    s = re.sub(r"\(#\d+\)", " ", s)
    out = re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")
    while len(out) > 48 and "-" in out:
        out = out.rsplit("-", 1)[0]
    return out


def fix_id_of(name: str, subject: str) -> str:
    """From the file name (without its NNNN- number and suffix), else the subject."""
    stem = re.sub(r"\.(patch|diff)$", "", Path(name).name)
    stem = re.sub(r"^\d{1,4}[-_]", "", stem)
    return slug(stem) or slug(subject) or "patch"


def is_test_path(path: str) -> bool:
    base = path.rsplit("/", 1)[-1]
    return path.startswith("tests/") or "/tests/" in path or base.startswith("test_") or base == "conftest.py"


def touched(diff: bytes) -> list[str]:
    text = diff.decode("utf-8", "replace")
    names = re.findall(r"^diff --git a/\S+ b/(\S+)", text, re.M)
    names += [re.sub(r"^[ab]/", "", n.split("\t")[0]) for n in re.findall(r"^\+\+\+ (\S+)", text, re.M)
              if n != "/dev/null"]
    return sorted(set(names))


def fold(key: str, text: str, width: int = 76) -> list[str]:
    """A trailer `key: text` folded at `width`, continuation lines starting with a space (as lint reads them)."""
    words = text.split()
    lines, cur = [], f"{key}:"
    for w in words:
        if len(cur) + 1 + len(w) > width and cur.strip() != f"{key}:":
            lines.append(cur)
            cur = " " + w
        else:
            cur += " " + w
    return lines + [cur]


def _why(h: Header) -> str:
    desc = h.fields.get("description") or h.fields.get("subject") or ""
    if "\n" in desc:
        return desc.split("\n", 1)[1].replace("\n", " ").strip()
    for para in re.split(r"\n\s*\n", h.body):
        if para.strip() and not _is_trailer_block(para.strip("\n").split("\n")):
            return " ".join(para.split())
    return h.subject


@dataclass
class Proposal:
    """The annotated patch and the fields kvforge proposed in it."""

    raw: bytes
    fix_id: str
    proposed: list[str]


def annotate(name: str, h: Header, *, carrier: str, fix_id: str | None = None, checks: list[str] | None = None,
             date: str = "") -> Proposal:
    """The format-patch file of `h` with kvforge's header: kept fields as they were, missing ones proposed
    (and named in `Review:`). `carrier`: Name <email> for a patch that names no author. A trailer block that
    kvforge's lint would reject where it reads trailers (a DEP-3 `Bug: 1234`) stays in the message, as it was,
    and the header starts a block of its own. ValueError (one line) when the result still does not lint."""
    try:
        return _annotate(name, h, carrier, fix_id, checks, date)
    except ValueError:
        if not h.trailers:
            raise
        body = "\n\n".join(x for x in (h.body.strip("\n"), "\n".join(h.trailers)) if x)
        fields = {**_fields(h.trailers), **h.fields}
        return _annotate(name, Header(h.subject, h.author, h.date, body, [], h.diff, fields), carrier, fix_id,
                         checks, date)


def _annotate(name: str, h: Header, carrier: str, fix_id: str | None, checks: list[str] | None,
              date: str) -> Proposal:
    author = h.author or carrier
    subject = (h.subject or fix_id_of(name, "").replace("-", " ")).replace("\n", " ").strip()
    kept = _fields(h.trailers)
    text = "\n".join([h.body, *h.trailers, *(f"{k}: {v}" for k, v in h.fields.items())])
    prs = list(dict.fromkeys(PR_LINK.findall(text)))
    commits = list(dict.fromkeys(COMMIT_LINK.findall(text)))
    commit_urls = [m.group(0) for m in COMMIT_LINK.finditer(text)]
    own: dict[str, str] = {}  # kvforge fields the patch has outside the trailer block (a Yocto / DEP-3 header)
    for key, value in h.fields.items():
        if key in ("upstream-status", "signed-off-by") and key not in kept:
            own[key] = value
    proposed: list[str] = []
    new: list[str] = []

    def add(key: str, value: str, propose: bool = True) -> None:
        new.extend(fold(key, value) if key == "Why" else [f"{key}: {value}"])
        if propose and key not in proposed:
            proposed.append(key)

    paths = touched(h.diff)
    if "fix-id" not in kept:
        add("Fix-Id", fix_id or fix_id_of(name, subject))
    if "kind" not in kept:
        if paths and all(is_test_path(p) for p in paths):
            add("Kind", "test")
        elif checks:
            add("Kind", "fix")
        else:
            add("Kind", "refactor")
    if "upstream-status" not in kept:
        if "upstream-status" in own:
            add("Upstream-Status", own["upstream-status"].split("\n")[0], propose=False)
        elif commit_urls and (h.fields.get("origin", "").startswith(("upstream", "backport")) or
                              "applied-upstream" in h.fields or not prs):
            add("Upstream-Status", f"Backport [{commit_urls[0]}]")
        elif prs:
            add("Upstream-Status", f"Submitted [{prs[0]}]")
        else:
            add("Upstream-Status", "Pending")
    if "upstream-pr" not in kept:
        for pr in prs:
            add("Upstream-PR", pr)
    if "upstream-commit" not in kept:
        for c in commits[:1]:
            add("Upstream-Commit", c[:12])
    if "why" not in kept:
        add("Why", _why(h) or subject)
    if "drop-when" not in kept:
        add("Drop-When", f"base-contains {commits[0][:12]}" if commits else
            f"upstream-pr-merged {prs[0]}" if prs else NEVER)
    if checks and "checks" not in kept and "kind" not in kept:
        for c in checks:
            add("Checks", c)
    signed = [v for k, v in ((m.group(1).lower(), m.group(2).strip()) for m in map(TRAILER_RE.match, h.trailers) if m)
              if k == "signed-off-by"]
    if not any(author_email(s) == author_email(author) for s in signed):
        yocto = own.get("signed-off-by", "")
        add("Signed-off-by", author, propose=author_email(yocto) != author_email(author))
    if proposed:
        new.append(f"{REVIEW}: {' '.join(proposed)}")
    block = [*h.trailers, *new]
    message = subject + "\n\n" + (h.body.strip("\n") + "\n\n" if h.body.strip() else "") + "\n".join(block) + "\n"
    head = (f"From {ZERO} Mon Sep 17 00:00:00 2001\nFrom: {author}\nDate: {h.date or date}\n"
            f"Subject: [PATCH] {subject}\n\n")
    diff = h.diff if h.diff.endswith(b"\n") else h.diff + b"\n"
    raw = (head + message.split("\n\n", 1)[1] + "---\n").encode("utf-8") + diff
    fid = next((ln.split(":", 1)[1].strip() for ln in block if ln.startswith("Fix-Id:")), "")
    problems = [p for p in parse_patch(Path(name), raw).problems if "diff" not in p.message]
    if problems or not FIX_ID_RE.match(fid):
        raise ValueError(f"{name}: {problems[0].message if problems else f'Fix-Id {fid!r} is not a slug'} "
                         "(fix the patch's header, then import again)")
    return Proposal(raw, fid, proposed)


# ---------------------------------------------------------------- lint: what is still to review


def with_review(done: Done, target_names: tuple[str, ...] = (), component: str | None = None,
                strict: bool = False) -> Done:
    """`kvforge lint`'s outcome with the unreviewed fields of the linted series (series.review_warnings):
    warnings by default, problems (exit 1) with `strict`."""
    targets = [load_target(n) for n in target_names] if target_names else load_all()
    found = [w for t in targets for c in t.components if component is None or c.name == component
             for w in review_warnings(read_series(c.series_dir))]
    if isinstance(done.data, dict):
        done.data["unreviewed"] = [{"file": str(w.path), "line": w.line, "message": w.message} for w in found]
    if not found:
        return done
    if not strict:
        done.notes.extend(str(w) for w in found)
        return done
    lines = [done.text] if done.exit_code else []
    summary = done.aside or done.text.splitlines()[-1]
    return Done(done.data, "\n".join(lines + [str(w) for w in found]), EXIT_LINT,
                aside=f"{summary}; {len(found)} patch{'es' if len(found) > 1 else ''} not reviewed (--strict)")
