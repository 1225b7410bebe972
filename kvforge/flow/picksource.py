"""Where a picked change comes from, and the patch file kvforge makes of it.

Sources (`load_source`): a commit or range A..B of a local clone (`--repo DIR REV`), a `git format-patch`
/ mbox file of one message (GitHub's `pull/N.patch` of a one-commit PR), or, online, a PR number or URL
(refused offline, exit 6), or a patch file a team keeps (a plain diff, a DEP-3 or Yocto quilt patch), read by
kvforge.project.headers as `kvforge import` reads it. The component (vllm, vllm-ascend) follows from the
repository. Owns the `Change` as read, and its annotated header (`annotated`: Fix-Id, Kind, Upstream-Status,
Why, Drop-When, Checks and the sign-offs; docs/patch-format.md): a file's own trailer block is kept as it was,
and what kvforge adds to a file's header is named in its `Review:` trailer.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from kvforge.core.cache import Cache
from kvforge.core.errors import EXIT_NETWORK, EXIT_USAGE, KvforgeError
from kvforge.flow import upstream
from kvforge.git import gitutil
from kvforge.git.context import Progress
from kvforge.git.engine import format_patch
from kvforge.project import headers
from kvforge.project.series import REVIEW, TRAILER_RE

REPOS = {"vllm": "vllm-project/vllm", "vllm-ascend": "vllm-project/vllm-ascend"}
ZERO = "0" * 40
KVFORGE_KEYS = ("Fix-Id", "Kind", "Upstream-Status", "Upstream-PR", "Upstream-Commit", "Why", "Drop-When", "Checks")


# ---------------------------------------------------------------- the change


@dataclass
class Change:
    """The upstream change, as read from its source."""

    source: str  # how the user named it
    diff: bytes  # from the first `diff --git` on (full-index where the source had it)
    subject: str
    body: str  # the message without its trailer block
    author: str  # Name <email>
    date: str
    component: str
    commits: list[str] = field(default_factory=list)  # upstream commit ids
    pr_url: str | None = None
    pr_open: bool = False
    first_release: str | None = None  # the first release tag that contains the change (source history)
    signoffs: list[str] = field(default_factory=list)  # the source's Signed-off-by / Co-authored-by lines
    git_dir: str | None = None  # the source repository's git directory (preimage blobs, history)
    rev: str | None = None
    kept: list[str] = field(default_factory=list)  # a file's own trailer block, its lines as they were
    review: bool = False  # a team's file: what kvforge adds to its header is named in `Review:`

    @property
    def fix_id(self) -> str | None:
        """The Fix-Id the source's own header gives, if any."""
        return next((m.group(2).strip() for m in map(TRAILER_RE.match, self.kept) if m and m.group(1) == "Fix-Id"),
                    None)

    @property
    def paths(self) -> list[str]:
        return sorted(set(re.findall(r"^diff --git a/(\S+) b/", self.diff.decode("utf-8", "replace"), re.M)))


def _split_message(message: str) -> tuple[str, str, list[str]]:
    """(subject, body without trailers, sign-off lines) of a commit message."""
    lines = message.strip("\n").split("\n")
    subject = lines[0].strip() if lines else ""
    rest = "\n".join(lines[1:]).strip("\n")
    paras = re.split(r"\n\s*\n", rest) if rest.strip() else []
    signoffs: list[str] = []
    if paras and all(re.match(r"^[A-Za-z][A-Za-z0-9-]*: ", ln) or ln.startswith(" ")
                     for ln in paras[-1].splitlines()):
        signoffs = [ln.strip() for ln in paras[-1].splitlines()
                    if ln.startswith(("Signed-off-by: ", "Co-authored-by: "))]
        paras = paras[:-1]
    return subject, "\n\n".join(paras).strip(), signoffs


def _pr_of(subject: str, component: str) -> str | None:
    m = re.search(r"\(#(\d+)\)\s*$", subject)
    return f"https://github.com/{REPOS.get(component, REPOS['vllm'])}/pull/{m.group(1)}" if m else None


def _release_key(tag: str) -> Version | None:
    m = re.match(r"^v?(\d+\.\d+(?:\.\d+)?)$", tag)  # final releases only: an rc tag is not a release
    if not m:
        return None
    try:
        return Version(m.group(1))
    except InvalidVersion:
        return None


def first_release(repo: Path, commit: str) -> str | None:
    """The lowest release tag (vX.Y.Z) of `repo` that contains `commit`, as X.Y.Z."""
    tags = gitutil.run(repo, "tag", "--contains", commit, check=False).stdout.split()
    found = sorted((v, t) for t in tags if (v := _release_key(t)) is not None)
    return str(found[0][0]) if found else None


def _component_of(repo: Path, given: str | None) -> str:
    if given:
        return given
    url = gitutil.run(repo, "remote", "get-url", "origin", check=False).stdout.strip()
    return "vllm-ascend" if "vllm-ascend" in url else "vllm"


def from_repo(repo_dir: Path, rev: str, component: str | None) -> Change:
    """A commit (or A..B, picked as one change) of a local clone."""
    repo = Path(repo_dir).expanduser()
    if not repo.is_dir():
        raise KvforgeError(f"--repo {repo_dir}: no such directory", EXIT_USAGE)
    if gitutil.run(repo, "rev-parse", "--git-dir", check=False).returncode != 0:
        raise KvforgeError(f"--repo {repo_dir}: not a git repository", EXIT_USAGE)
    git_dir = gitutil.run(repo, "rev-parse", "--absolute-git-dir").stdout.strip()
    comp = _component_of(repo, component)
    if ".." in rev:
        a, b = rev.split("..", 1)
        ca, cb = gitutil.rev_parse(repo, f"{a}^{{commit}}"), gitutil.rev_parse(repo, f"{b or 'HEAD'}^{{commit}}")
        if not ca or not cb:
            raise KvforgeError(f"--repo {repo_dir}: {rev!r} is not a range of commits there", EXIT_USAGE)
        commits = gitutil.run(repo, "rev-list", "--reverse", "--no-merges", f"{ca}..{cb}").stdout.split()
        if not commits:
            raise KvforgeError(f"--repo {repo_dir}: {rev} holds no commit", EXIT_USAGE)
        diff = gitutil.run(repo, "diff", "--full-index", "--binary", "-M", ca, cb, binary=True).stdout
        last = gitutil.run(repo, "log", "-1", "--format=%an <%ae>%n%aD%n%B", cb).stdout
        author, date, message = last.split("\n", 2)
        subject, body, signoffs = _split_message(message)
        shortlog = gitutil.run(repo, "log", "--reverse", "--format=- %h %s", f"{ca}..{cb}").stdout.strip()
        body = (body + "\n\n" if body else "") + f"Picked as one change: {rev}\n{shortlog}"
        head = cb
    else:
        head = gitutil.rev_parse(repo, f"{rev}^{{commit}}") or ""
        if not head:
            raise KvforgeError(f"--repo {repo_dir}: no commit {rev!r} there", EXIT_USAGE)
        commits = [head]
        raw = format_patch(repo, head)
        diff = raw[raw.find(b"\ndiff --git ") + 1:]
        info = gitutil.run(repo, "log", "-1", "--format=%an <%ae>%n%aD%n%B", head).stdout
        author, date, message = info.split("\n", 2)
        subject, body, signoffs = _split_message(message)
    if not diff.startswith(b"diff --git "):
        raise KvforgeError(f"--repo {repo_dir}: {rev} changes no file", EXIT_USAGE)
    diff = _strip_signature(diff)
    return Change(f"{repo_dir} {rev}", diff, subject, body, author, date, comp, commits,
                  _pr_of(subject, comp), False, first_release(repo, head), signoffs, git_dir, rev)


def _strip_signature(diff: bytes) -> bytes:
    k = diff.rfind(b"\n-- \n")
    return diff[:k + 1] if k >= 0 else diff


def from_mbox(path: Path, component: str | None) -> Change:
    """A patch file holding one change: a format-patch / mbox message, or a team's plain or quilt patch
    (kvforge.project.headers reads each, as `kvforge import` does); its own trailer block is kept."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise KvforgeError(f"{path}: cannot read: {exc.strerror or exc}", EXIT_USAGE) from None
    froms = re.findall(rb"^From ([0-9a-f]{40}) ", raw, re.M)
    if len(froms) > 1:
        raise KvforgeError(f"{path}: holds {len(froms)} patches; pick takes one change (squash the PR into one "
                           "commit, or pick its merged commit with --repo DIR REV; `kvforge import` takes a series)",
                           EXIT_USAGE)
    try:
        h = headers.read_patch(Path(path).name, raw)
    except ValueError as exc:
        raise KvforgeError(f"{path}: not a patch: {str(exc).split(': ', 1)[-1]}", EXIT_USAGE) from None
    if not h.diff.startswith(b"diff --git "):
        raise KvforgeError(f"{path}: not a patch: its diff changes no file", EXIT_USAGE)
    subject = h.subject or headers.fix_id_of(Path(path).name, "").replace("-", " ")
    signoffs = [ln.strip() for ln in h.trailers if ln.startswith(("Signed-off-by: ", "Co-authored-by: "))]
    comp = component or "vllm"
    commits = [c.decode() for c in froms if c.decode() != ZERO]
    links = headers.PR_LINK.findall("\n".join(h.trailers))
    # A team's file (no upstream commit, or a kvforge header of its own) keeps its trailer block; an upstream
    # commit's message keeps only its sign-offs, as before.
    own = not commits or any(m and m.group(1) in KVFORGE_KEYS for m in map(TRAILER_RE.match, h.trailers))
    return Change(str(path), _strip_signature(h.diff), subject, h.body.strip(), h.author, h.date, comp, commits,
                  _pr_of(subject, comp) or (links[0] if own and links else None), False, None, signoffs,
                  kept=list(h.trailers) if own else [], review=own)


PR_URL = re.compile(r"^https://github\.com/(vllm-project/(vllm|vllm-ascend))/pull/(\d+)/?$")


def from_pr(spec: str, component: str | None, cache: Cache, say: Progress) -> Change:
    """An upstream PR (number, or URL of vLLM or vllm-ascend): its .patch and description from GitHub."""
    m = PR_URL.match(spec)
    comp = m.group(2) if m else (component or "vllm")
    if comp not in REPOS:
        raise KvforgeError(f"--component {comp}: a PR comes from {' or '.join(REPOS)}", EXIT_USAGE)
    number = m.group(3) if m else spec
    repo = REPOS[comp]
    if os.environ.get("KVFORGE_OFFLINE") == "1":
        raise KvforgeError(f"PR {spec}: $KVFORGE_OFFLINE=1; download https://github.com/{repo}/pull/{number}.patch "
                           "and pick the file", EXIT_NETWORK)
    say(f"fetching {repo}#{number} from GitHub")
    try:
        with urllib.request.urlopen(f"https://api.github.com/repos/{repo}/pulls/{number}", timeout=20) as r:
            meta = json.load(r)
        with urllib.request.urlopen(f"https://github.com/{repo}/pull/{number}.patch", timeout=60) as r:
            data = r.read()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise KvforgeError(f"PR {spec}: cannot reach GitHub ({getattr(exc, 'reason', exc)}); download "
                           f"https://github.com/{repo}/pull/{number}.patch and pick the file", EXIT_NETWORK) from None
    with tempfile.NamedTemporaryFile(suffix=".patch", dir=cache.root, delete=False) as fh:
        fh.write(data)
    try:
        change = from_mbox(Path(fh.name), comp)
    finally:
        os.unlink(fh.name)
    meta = _pr_meta(f"https://api.github.com/repos/{repo}/pulls/{number}", meta)
    change.source = f"{repo}#{number}"
    change.pr_url = f"https://github.com/{repo}/pull/{number}"
    change.pr_open = not meta.get("merged_at")
    merged = meta.get("merge_commit_sha")
    if merged and not change.pr_open:
        change.commits = [merged]
    change.subject = meta.get("title") or change.subject
    change.body = (meta.get("body") or "").strip() or change.body
    return change


def _pr_meta(url: str, meta: object) -> dict[str, str | None]:
    """GitHub's PR answer, the fields pick reads type-checked (each a string or null); exit 6 naming the URL and
    the field otherwise (an answer that is not GitHub's: a proxy's page, an API change)."""
    if not isinstance(meta, dict):
        raise KvforgeError(f"{url}: GitHub's answer is not a JSON object", EXIT_NETWORK)
    out: dict[str, str | None] = {}
    for key in ("merged_at", "merge_commit_sha", "title", "body"):
        value = meta.get(key)
        if value is not None and not isinstance(value, str):
            raise KvforgeError(f"{url}: GitHub's answer has {key} of type {type(value).__name__}, not a string",
                               EXIT_NETWORK)
        out[key] = value
    return out


def load_source(source: str, repo_dir: Path | None, component: str | None, cache: Cache, say: Progress) -> Change:
    if repo_dir is not None:
        return from_repo(repo_dir, source, component)
    if Path(source).expanduser().is_file():
        return from_mbox(Path(source).expanduser(), component)
    if re.match(r"^\d+$", source) or PR_URL.match(source):
        return from_pr(source, component, cache, say)
    raise KvforgeError(f"SOURCE {source!r}: not a file, a PR number or URL; for a commit of a clone use "
                       "--repo DIR REV", EXIT_USAGE)


# ---------------------------------------------------------------- the header


def default_fix_id(subject: str) -> str:
    return headers.slug(subject) or "upstream-fix"


def checks_of(diff: bytes) -> list[str]:
    """The test functions the change adds or modifies (a +/- line inside them): pytest node ids path::name."""
    out: list[str] = []
    path = None
    current: str | None = None
    for line in diff.decode("utf-8", "replace").splitlines():
        if line.startswith("diff --git "):
            m = re.match(r"^diff --git a/\S+ b/(\S+)", line)
            path = m.group(1) if m and upstream.is_test_path(m.group(1)) and m.group(1).endswith(".py") else None
            current = None
            continue
        if path is None or line.startswith(("---", "+++")):
            continue
        if line.startswith("@@"):
            m = re.match(r"^@@ [^@]* @@ (?:async )?def (test_\w+)\(", line)
            current = m.group(1) if m else None
            continue
        body = line[1:]
        m = re.match(r"^(?:async )?def (\w+)\(", body)
        if m or re.match(r"^(class |@|\S)", body):
            current = m.group(1) if m and m.group(1).startswith("test_") else None
            if m and line.startswith("+") and current:
                out.append(f"{path}::{current}")
            continue
        if line[:1] in "+-" and body.strip() and current:
            out.append(f"{path}::{current}")
    return list(dict.fromkeys(out))


def drop_when(change: Change) -> str:
    if change.first_release:
        return f"version >= {change.first_release}"
    if change.commits and not change.pr_open:
        return f"base-contains {change.commits[-1][:12]}"
    if change.pr_url:
        return f"upstream-pr-merged {change.pr_url}"
    return headers.NEVER


def annotated(change: Change, fix_id: str, checks: list[str], signoff: str) -> bytes:
    """The change as a format-patch file with kvforge's header (git am reads it; export re-writes it). A file's
    own trailer block is kept as it was; only the fields it lacks are added (named in `Review:` for a team's
    file)."""
    kept = {m.group(1).lower() for m in map(TRAILER_RE.match, change.kept) if m and change.kept}
    kind = next((m.group(2).strip() for m in map(TRAILER_RE.match, change.kept) if m and m.group(1) == "Kind"),
                "fix" if checks else "refactor")
    where = ", ".join(x for x in (change.pr_url, change.commits[-1][:12] if change.commits else None) if x)
    if change.pr_open:
        status = "Pending"
    elif where:
        status = f"Backport [{where}]"
    else:
        status = "Pending"
    why = (re.split(r"\n\s*\n", change.body)[0] if change.body else "") or change.subject
    why = re.sub(r"^#+\s*\w[\w ]*\n", "", why.strip()).strip() or change.subject  # a PR template's "## Purpose"
    author = change.author or signoff
    new: list[tuple[str, list[str]]] = [("Fix-Id", [f"Fix-Id: {fix_id}"]), ("Kind", [f"Kind: {kind}"]),
                                        ("Upstream-Status", [f"Upstream-Status: {status}"])]
    if change.pr_url:
        new.append(("Upstream-PR", [f"Upstream-PR: {change.pr_url}"]))
    new += [("Upstream-Commit", [f"Upstream-Commit: {c[:12]}"]) for c in change.commits[-1:] if not change.pr_open]
    new.append(("Why", headers.fold("Why", why)))
    new.append(("Drop-When", [f"Drop-When: {drop_when(change)}"]))
    if kind == "fix":
        new.append(("Checks", [f"Checks: {c}" for c in checks]))
    trailers = list(change.kept)
    proposed: list[str] = []
    for key, lines in new:
        if key.lower() not in kept and lines:
            trailers += lines
            proposed.append(key)
    # A team's file gets its author's sign-off proposed (for review); an upstream change's sign-offs are its own.
    own = [f"Signed-off-by: {author}"] if change.review else []
    signs = [s for s in dict.fromkeys(change.signoffs + own + [f"Signed-off-by: {signoff}"]) if s not in change.kept]
    if change.kept:
        trailers = [t for t in trailers if t not in signs] + signs
        if signs and f"Signed-off-by: {author}" in signs:
            proposed.append("Signed-off-by")
    else:
        trailers += signs
    if change.review and proposed:
        trailers.append(f"{REVIEW}: {' '.join(proposed)}")
    body = change.body.replace("\n---\n", "\n- - -\n")
    subject = change.subject.replace("\n", " ")
    msg = f"{subject}\n\n" + (body + "\n\n" if body else "") + "\n".join(trailers) + "\n"
    head = f"From {ZERO} Mon Sep 17 00:00:00 2001\nFrom: {author}\nDate: {change.date}\nSubject: [PATCH] "
    return (head + msg.split("\n", 1)[0] + "\n\n" + msg.split("\n\n", 1)[1] + "---\n").encode("utf-8") + change.diff


def carrier(root: Path, given: str | None) -> str:
    """Name <email> of whoever carries the patch: --signoff, else git's committer identity at the project."""
    if given:
        ident = given
    else:
        name = gitutil.run(root, "config", "user.name", check=False).stdout.strip()
        email = gitutil.run(root, "config", "user.email", check=False).stdout.strip()
        ident = f"{name} <{email}>" if name and email else ""
    if not re.match(r"^.+ <[^<>@\s]+@[^<>\s]+>$", ident):
        raise KvforgeError("no identity for Signed-off-by: set git's user.name and user.email, or pass "
                           "--signoff 'Name <email>'", EXIT_USAGE)
    return ident
