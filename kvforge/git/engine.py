"""The git am engine: apply patches in a worktree, one commit each, and explain a failure.

Used by `apply` (a user's tree), `trees` (kvforge's stacks for tests) and later `rebase`. It
never creates branches and never touches a user's repository: callers own the transaction around
it. Worktree helpers for kvforge's own (hidden) worktrees live here too.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvforge.git import gitutil
from kvforge.core.errors import EXIT_APPLY, EXIT_ENV, KvforgeError
from kvforge.git.pathindex import PathIndex, named_paths
from kvforge.project.series import Patch

AM_OPTS = ("am", "-3", "--keep-non-patch", "--committer-date-is-author-date", "--no-gpg-sign")

# `git format-patch` of one commit, the inverse of AM_OPTS: the options and the config that pin every byte.
FORMAT_PATCH = ("format-patch", "-1", "--stdout", "--zero-commit", "--full-index", "--no-signature",
                "--stat=80", "--find-renames", "--diff-algorithm=myers", "--encoding=UTF-8", "--no-color")
# git config that format-patch reads and that no command-line option overrides, pinned to git's default.
PINNED_CONFIG = ("-c", "diff.suppressBlankEmpty=false", "-c", "core.attributesFile=/dev/null",
                 "-c", "format.mboxrd=false")
# Options equal to git's defaults, so that format.* and diff.* config cannot change the bytes.
PINNED_OPTS = ("--subject-prefix=PATCH", "--no-numbered", "--no-signoff", "--no-add-header", "--no-to", "--no-cc",
               "--no-thread", "--no-notes", "--no-base", "--no-attach", "--no-from", "--src-prefix=a/",
               "--dst-prefix=b/", "-U3", "--inter-hunk-context=0", "-O/dev/null", "--no-relative",
               "--indent-heuristic", "--encode-email-headers")


# format_patches' results, (repository, full commit id) -> bytes: the bytes are a function of the commit id alone
# (every setting that changes them is pinned), so a later format_patch of that commit in this process reads them here.
_FORMATTED: dict[tuple[Path, str], bytes] = {}
_ZERO = b"0" * 40
_FULL_SHA = re.compile(r"^[0-9a-f]{40}$")


def format_patch(repo: Path, commit: str) -> bytes:
    """The commit as a patch file: the same bytes on any machine, whatever the user's or the tree's git config
    (every byte-affecting setting is pinned above; renames as renames, non-ASCII paths unquoted)."""
    if _FULL_SHA.match(commit):
        known = _FORMATTED.get((Path(repo).resolve(), commit))
        if known is not None:
            return known
    res = gitutil.run(repo, *PINNED_CONFIG, *FORMAT_PATCH, *PINNED_OPTS, commit, binary=True, check=False)
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise KvforgeError(f"git format-patch failed in {repo}: {last}", EXIT_ENV)
    return res.stdout


def format_patches(repo: Path, base: str, commits: list[str]) -> None:
    """Format the linear stack `commits` on `base` (full ids, oldest first), one `git format-patch` per range of
    consecutive commits, run at once (a few at a time per CPU: run_many; one run over the whole stack leaves the
    second CPU idle): a range per commit for a short stack (their costs differ too much to split it evenly), at
    most 4 ranges per CPU for a long one (500 processes cost more than the diffs), for the format_patch calls
    that follow (kvforge.flow.rebase.commit reads each carried commit). Each patch is written with its own commit id in its
    `From` line (read back to pair file and commit, then zeroed: the bytes of --zero-commit); a result that does
    not pair one file with each commit is dropped (format_patch then runs per commit), so a later format_patch
    returns exactly what it would have computed alone."""
    if len(commits) < 2 or not all(_FULL_SHA.match(c) for c in commits):
        return
    opts = [o for o in FORMAT_PATCH if o not in ("-1", "--stdout", "--zero-commit")]
    parts = min(len(commits), 4 * (os.cpu_count() or 1))
    ends = [len(commits) * (k + 1) // parts - 1 for k in range(parts)]
    ranges = [f"{base if k == 0 else commits[ends[k - 1]]}..{commits[e]}" for k, e in enumerate(ends)]
    found: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory(prefix="kvforge-format-") as tmp:
        outs = [Path(tmp) / str(k) for k in range(len(ranges))]
        calls = [[*PINNED_CONFIG, *opts, *PINNED_OPTS, "--numbered-files", "-o", str(out), r]
                 for out, r in zip(outs, ranges)]
        if any(res.returncode != 0 for res in gitutil.run_many(repo, calls)):
            return
        for f in (f for out in outs for f in out.iterdir()):
            raw = f.read_bytes()
            m = re.match(rb"^From ([0-9a-f]{40}) ", raw)
            if m is None:
                return
            found[m.group(1).decode()] = raw[:5] + _ZERO + raw[45:]
    if sorted(found) != sorted(commits):
        return
    key = Path(repo).resolve()
    _FORMATTED.update({(key, c): raw for c, raw in found.items()})


@dataclass
class PatchOutcome:
    name: str
    fix_id: str
    status: str  # applied | applied (3-way) | in base | failed | not reached
    commit: str | None = None
    detail: str = ""


class ApplyFailure(KvforgeError):
    """A patch did not apply; carries the per-patch outcomes for the report."""

    exit_code = EXIT_APPLY

    def __init__(self, message: str, outcomes: list[PatchOutcome]):
        super().__init__(message)
        self.outcomes = outcomes


def add_worktree(repo: Path, path: Path, commit: str) -> None:
    if path.exists():
        remove_worktree(repo, path)
    gitutil.run(repo, "worktree", "add", "--detach", "-q", str(path), commit)


def remove_worktree(repo: Path, path: Path) -> None:
    gitutil.run(repo, "worktree", "remove", "--force", "--force", str(path), check=False)
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)
    gitutil.run(repo, "worktree", "prune", check=False)


def ensure_worktree(repo: Path, path: Path, commit: str) -> bool:
    """Reuse `path` when it is a worktree of `repo` both ways (`repo` lists it, and its .git leads back to
    `repo`; a `git am` an earlier run left stopped in it is aborted) and return True; otherwise make it
    afresh at `commit` and return False. A stale registration (listed by `repo` while the directory
    belongs to another repository, or is gone) is repaired, never trusted."""
    if _linked_both_ways(repo, path):  # the usual case, read from git's own files: no git process
        if am_in_progress(path):
            gitutil.run(path, "am", "--abort", check=False)
        return True
    listed = gitutil.run(repo, "worktree", "list", "--porcelain", check=False).stdout
    registered = f"worktree {path}\n" in listed + "\n"
    if registered and (path / ".git").exists() and _common_dir(path) == repo.resolve():
        if am_in_progress(path):
            gitutil.run(path, "am", "--abort", check=False)
        return True
    if (path / ".git").exists() and _common_dir(path) not in (None, repo.resolve()):
        owner = _common_dir(path)
        assert owner is not None
        remove_worktree(owner, path)  # kvforge's own directory, registered in another cache repository
    gitutil.run(repo, "worktree", "prune", check=False)
    if registered and path.exists():
        remove_worktree(repo, path)
    add_worktree(repo, path, commit)
    return False


def _gitfile_dir(path: Path) -> Path | None:
    """The git directory a worktree's `.git` file names (`gitdir: DIR`), None when it is not such a file."""
    dotgit = path / ".git"
    if os.environ.get("GIT_DIR") or not dotgit.is_file() or dotgit.is_symlink():
        return None  # $GIT_DIR (git would use it) or a main worktree: git answers
    try:
        text = dotgit.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if not text.startswith("gitdir: ") or text.count("\n") > 1:
        return None
    gitdir = Path(text[len("gitdir: "):].strip())
    return gitdir if gitdir.is_absolute() else path / gitdir


def _linked_both_ways(repo: Path, path: Path) -> bool:
    """What `git worktree list` and `git rev-parse --git-common-dir` say of a healthy linked worktree, from the
    files git keeps for it: `path/.git` names <repo>/worktrees/<id>, whose `gitdir` names `path/.git` back (so
    `git worktree list` lists `path`) and whose `commondir` leads to `repo`. False means "ask git"."""
    gitdir = _gitfile_dir(path)
    if gitdir is None or gitdir.parent != repo.resolve() / "worktrees" or not (gitdir / "HEAD").is_file():
        return False
    try:
        back = (gitdir / "gitdir").read_text(encoding="utf-8").rstrip()
        common = (gitdir / "commondir").read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return False
    common_dir = Path(common) if Path(common).is_absolute() else gitdir / common
    return back == f"{path}/.git" and common_dir.resolve() == repo.resolve()


def _common_dir(path: Path) -> Path | None:
    """The repository a worktree belongs to (its common git directory), None when git cannot tell."""
    res = gitutil.run(path, "rev-parse", "--path-format=absolute", "--git-common-dir", check=False)
    out = res.stdout.strip()
    return Path(out).resolve() if res.returncode == 0 and out else None


def am_series(worktree: Path, patches: list[Patch], base_commit: str,
              borrow: Path | None = None) -> list[PatchOutcome]:
    """`git am -3` the patches in one run; skip ones already in the tree; explain a failure.

    One `git am` call for the whole series keeps the cost that of plain `git am`; the per-patch
    table is recovered from its output ("Applying: <subject>", 3-way fallback, "already applied").
    """
    # `borrow`: another repository's objects, read (never linked) so the 3-way fallback finds preimages.
    env = {"GIT_ALTERNATE_OBJECT_DIRECTORIES": str(borrow / "objects")} if borrow else None
    check_link_paths(worktree, patches)
    outcomes = [PatchOutcome(p.name, p.fix_id, "not reached") for p in patches]
    position = 0
    while position < len(patches):
        res = gitutil.run(worktree, *AM_OPTS, *[str(p.path) for p in patches[position:]], check=False, env=env)
        position = _record(res.stdout + "\n" + res.stderr, patches, outcomes, position, worktree)
        if res.returncode == 0:
            break
        # git am stopped at patches[position].
        failing = patches[position]
        if reverse_applies(worktree, failing):
            outcomes[position].status = "in base"
            outcomes[position].detail = "already contained in the tree (applies in reverse)"
            # --quit, not --abort: --abort would also drop the commits this am run already made.
            gitutil.run(worktree, "am", "--quit", check=False)
            gitutil.run(worktree, "reset", "--hard", "-q", "HEAD", check=False)
            position += 1
            continue
        if borrow:
            own_objects(worktree, env)
        reason = diagnose(worktree, failing, res.stdout + "\n" + res.stderr)
        outcomes[position].status = "failed"
        outcomes[position].detail = reason
        raise ApplyFailure(f"{failing.name}: {reason}", outcomes)
    commits = gitutil.run(worktree, "rev-list", "--reverse", f"{base_commit}..HEAD").stdout.split()
    applied = [o for o in outcomes if o.status.startswith("applied")]
    for o, c in zip(applied, commits):
        o.commit = c
    return outcomes


def _record(output: str, patches: list[Patch], outcomes: list[PatchOutcome], position: int, worktree: Path) -> int:
    """Mark outcomes from git am's output; return the index of the patch am stopped at (or the end)."""
    statuses = am_progress(output)
    for k, status in enumerate(statuses):
        o = outcomes[position + k]
        if status == "no change":
            o.status, o.detail = "in base", "3-way merge found no change: already in the tree"
        else:
            o.status = status
    stopped = am_in_progress(worktree)
    if stopped:
        return max(position + len(statuses) - 1, position)
    return len(patches)


def am_progress(output: str) -> list[str]:
    """What `git am` said of each patch it began, in order: applied | applied (3-way) | no change."""
    statuses: list[str] = []
    for line in output.splitlines():
        if line.startswith("Applying: "):
            statuses.append("applied")
        elif line.startswith("Falling back to patching base and 3-way merge") and statuses:
            statuses[-1] = "applied (3-way)"
        elif ("Patch already applied" in line or line.startswith("No changes")) and statuses:
            statuses[-1] = "no change"
    return statuses


def am_one(worktree: Path, patch_path: Path, head: str | None) -> tuple[str, str | None, str]:
    """`git am -3` one patch on `head` (the worktree's HEAD): (how, new commit or None, git am's output).
    how: applied | applied (3-way) | no change | conflict (git am failed; it may be stopped in the tree)."""
    res = gitutil.run(worktree, *AM_OPTS, str(patch_path), check=False)
    out = res.stdout + "\n" + res.stderr
    if res.returncode != 0:
        return "conflict", None, out
    now = gitutil.rev_parse(worktree, "HEAD")
    if now == head:
        return "no change", None, out
    return ("applied (3-way)" if "applied (3-way)" in am_progress(out) else "applied"), now, out


def stripspace(text: bytes) -> bytes:
    """git's strbuf_stripspace (no comment lines): trailing whitespace of each line removed, runs of empty
    lines made one, none at either end, every line ending in a newline. `git am` cleans a message so."""
    out: list[bytes] = []
    empty = False
    for line in text.split(b"\n"):
        line = line.rstrip(b" \t\n\r")
        if not line:
            empty = bool(out)
            continue
        if empty:
            out.append(b"")
        empty = False
        out.append(line)
    return b"".join(line + b"\n" for line in out)


# Runs of am_without_worktree started ahead (am_ahead): (repository, head, the patches' bytes) -> its future commits.
_AHEAD: dict[tuple[Path, str, tuple[bytes, ...]], Future] = {}


def am_ahead(repo: Path, head: str, raws: "list[bytes]") -> None:
    """Start am_without_worktree of patch files holding `raws` on `head`, in a thread, for a caller that will
    likely ask for it (or for a prefix of it) while it does other work: the rebase commits the series while its
    signals run. Its commits are objects only; a later am_without_worktree of the same bytes on the same head
    (or of a prefix of them) waits for it and takes its answer, which is the one it would compute (the commits
    depend on nothing else); any other call computes its own."""
    key = (Path(repo).resolve(), head, tuple(raws))
    fut: Future = Future()
    _AHEAD.clear()  # one run ahead per process at a time: an earlier one (a watch's previous row) is not asked again
    _AHEAD[key] = fut

    def work() -> None:
        try:
            fut.set_result(_am_without_worktree(repo, head, list(raws)))
        except BaseException as exc:  # handed to the caller that takes it
            fut.set_exception(exc)

    threading.Thread(target=work, name="kvforge-am-ahead", daemon=True).start()


def am_without_worktree(repo: Path, head: str, patches: "list[Path]") -> list[str]:
    """The commits `git am` (AM_OPTS) makes of `patches` on `head`, made without a worktree, for the leading
    patches that apply as they are: `git mailinfo -b` reads author, date and message as am does (subject, a
    blank line, the body, then git's stripspace; a few run ahead at once), `git apply --cached` applies each patch
    to a temporary index holding only the paths the patches name (pathindex.PathIndex; each run of consecutive
    patches that name no path in common in one `git apply --cached` of them joined, _joined_run, which gives the
    entries applying them one by one gives), and one `git fast-import` writes the commits
    from the entries that changed (kvforge's committer, its date the author's: --committer-date-is-author-date;
    author and dates parsed by git as am parses them). Same bytes in, the same commit ids as `git am`.

    Stops at the first patch that does not apply as it is, changes nothing, has no author name or date, or
    names a path the small index cannot answer for (`git am -3` in a worktree decides those: the 3-way merge,
    "no change"); returns the commits made before it, or none if git refuses the stream. Writes objects only:
    no lasting ref (fast-import's temporary one is deleted in the same run), no worktree, no index but its
    own temporary one. A run started by am_ahead for these bytes (or more patches after them) on this head is
    taken instead of a second one."""
    want = [p.read_bytes() for p in patches]
    for (r, h, done), fut in list(_AHEAD.items()):
        if h == head and done[:len(want)] == tuple(want) and r == Path(repo).resolve():
            with contextlib.suppress(Exception):  # it failed: compute here, where the error belongs
                return list(fut.result())[:len(want)]
    return _am_without_worktree(repo, head, want)


def _am_without_worktree(repo: Path, head: str, raws: "list[bytes]") -> list[str]:
    made: list[bytes] = []  # fast-import commands, one commit each
    # fast-import's ref for these commits: this thread's alone; the stream's last `reset` deletes it.
    ref = b"refs/kvforge/am-%d-%d" % (os.getpid(), threading.get_ident())
    width = 2 * (os.cpu_count() or 1)  # mailinfo runs ahead, this many at a time
    with tempfile.TemporaryDirectory(prefix="kvforge-am-") as tmp:
        try:
            index = PathIndex(repo, head, raws, Path(tmp) / "index")
        except gitutil.GitError:  # a head git cannot read
            return []
        env, cwd = index.env, Path(tmp)
        state = index.entries()
        n = next((k for k, ok in enumerate(index.usable) if not ok), len(raws))  # the patches it answers for
        segments = _segments(raws[:n])  # start -> the paths of each patch of a run naming no path in common
        joined: dict[int, dict[bytes, tuple[int, str] | None]] = {}  # patch k -> its paths' entries after it
        with ThreadPoolExecutor(width, thread_name_prefix="kvforge-mailinfo") as pool:  # waits for its last ones
            def mailinfo(k: int) -> "Future[gitutil.Result]":
                """Patch k's mailinfo, started now (while earlier patches are read)."""
                args = ("mailinfo", "-b", str(cwd / f"msg{k}"), str(cwd / f"patch{k}"))
                return pool.submit(lambda: gitutil.run(cwd, *args, stdin=raws[k], env=env, check=False))

            started = [mailinfo(k) for k in range(min(n, width))]  # at most `width` mailinfos past a stop
            for k, raw in enumerate(raws[:n]):
                if k + width < n:
                    started.append(mailinfo(k + width))
                info = started[k].result()
                msg_file, diff_file = cwd / f"msg{k}", cwd / f"patch{k}"
                fields = dict(line.partition(": ")[::2] for line in info.stdout.splitlines())
                when = fields.get("Date", "").encode()
                if info.returncode != 0 or not fields.get("Author") or not when or not diff_file.stat().st_size:
                    break
                if k in segments:  # the run starting here, applied at once (on the index as the patches before left it)
                    joined = _joined_run(cwd, env, raws[k:k + len(segments[k])], segments[k], index, k)
                if k in joined:
                    new = {**state}
                    for path, entry in joined[k].items():
                        if entry is None:
                            new.pop(path, None)
                        else:
                            new[path] = entry
                else:
                    if gitutil.run(cwd, "apply", "--cached", stdin=raw, env=env, check=False).returncode != 0:
                        break  # (the bytes read once: what mailinfo read is what is applied)
                    new = index.entries()
                author = _author(cwd, fields, env)
                if new == state or author is None:
                    break
                message = stripspace(fields.get("Subject", "").encode() + b"\n\n" + msg_file.read_bytes())
                mark = len(made) + 1
                lines = [b"commit " + ref, b"mark :%d" % mark, b"author %s %s" % (author, when),
                         b"committer %s %s" % (_COMMITTER, when), b"data %d" % len(message) + b"\n" + message
                         + (b"from " + head.encode() if mark == 1 else b"from :%d" % (mark - 1))]
                lines += [b"D " + p for p in sorted(set(state) - set(new))]  # deletions first: a file may become a dir
                lines += [b"M %o %s %s" % (new[p][0], new[p][1].encode(), p) for p in sorted(new) if state.get(p) != new[p]]
                made.append(b"\n".join(lines) + b"\n\n")
                state = new
        if not made:
            return []
        stream = b"".join(made) + b"reset " + ref + b"\n\n" + b"".join(b"get-mark :%d\n" % k
                                                                         for k in range(1, len(made) + 1))
        res = gitutil.run(cwd, "-c", "fastimport.unpackLimit=1000", "fast-import", "--quiet", "--force",
                          "--date-format=rfc2822", stdin=stream, env=env, binary=True, check=False)
    return res.stdout.decode().split() if res.returncode == 0 else []


def _segments(raws: "list[bytes]") -> "dict[int, list[set[bytes]]]":
    """The runs of consecutive patches that name no path in common (joinable_paths), two patches or more:
    the index of each run's first patch -> the paths of each of its patches (as the index names them)."""
    out: dict[int, list[set[bytes]]] = {}
    start, run, seen = 0, [], set()  # type: int, list[set[bytes]], set[bytes]
    for k, raw in enumerate([*raws, None]):
        paths = joinable_paths(raw) if raw is not None else None
        got = {p.encode("utf-8", "surrogateescape") for p in paths} if paths is not None else None
        if got is not None and not got & seen:
            run.append(got)
            seen |= got
            continue
        if len(run) >= 2:
            out[start] = run
        start, run, seen = (k, [got], set(got)) if got is not None else (k + 1, [], set())
    return out


def _joined_run(cwd: Path, env: dict[str, str], raws: "list[bytes]", named: "list[set[bytes]]", index: PathIndex,
                first: int) -> "dict[int, dict[bytes, tuple[int, str] | None]]":
    """What `git apply --cached` of each of `raws` in turn (patches that name no path in common: `named`, see
    _segments) does to the index: patch first+k -> its paths' entries after it (None: removed), from one `git
    apply --cached` of them all, joined into one file, which leaves the index as the last of them leaves it (the
    caller goes on from there, or stops at one of them). Empty when that run fails (then each is applied alone,
    in turn, as before), the index as it was.

    Exact because git apply --cached changes only the entries of the paths a patch names, and of patches that
    name no path in common each finds the entries of its paths as the patches before the run left them; the
    joined run applies every diff or none (it writes the index only when all apply)."""
    joined = cwd / f"joined-{first}.patch"
    joined.write_bytes(b"".join(raws))
    saved = index.index.read_bytes()
    if gitutil.run(cwd, "apply", "--cached", str(joined), env=env, check=False).returncode != 0:
        index.index.write_bytes(saved)
        return {}
    after = index.entries()
    return {first + k: {p: after.get(p) for p in paths} for k, paths in enumerate(named)}


_DIFFISH = (b"--- ", b"+++ ", b"diff ", b"@@ ", b"Index: ")
# joinable_paths' answers by the sha256 of the patch's bytes: a rebase asks for each patch's several times (the
# checks of both directions, their errors, the commits), and reading a long patch's lines costs milliseconds.
_JOINABLE: dict[bytes, "frozenset[str] | None"] = {}


def joinable_paths(raw: bytes) -> "frozenset[str] | None":
    """The paths a patch file names when it can be joined with others into one `git apply` input (None: it
    cannot): every path read plainly (pathindex.named_paths), one named at least, the file ending in a newline,
    and nothing before its first `diff --git` that git apply could read as a diff. git apply reads such a
    joined file as it reads each of them alone, in turn, and of patches that name no path in common each diff
    meets only the entries of its own paths."""
    key = hashlib.sha256(raw).digest()
    if key in _JOINABLE:
        return _JOINABLE[key]
    start = raw.find(b"\ndiff --git ")
    paths = named_paths(raw)
    found = None
    if start >= 0 and paths and raw.endswith(b"\n") and \
            not any(line.startswith(_DIFFISH) for line in raw[:start].split(b"\n")):
        found = frozenset(paths)
    if len(_JOINABLE) >= 4096:
        _JOINABLE.clear()
    _JOINABLE[key] = found
    return found


_COMMITTER = b"%s <%s>" % (gitutil.COMMITTER["GIT_COMMITTER_NAME"].encode(),
                           gitutil.COMMITTER["GIT_COMMITTER_EMAIL"].encode())
# Bytes git's ident code strips from either end of a name or email ("crud"; '.' in some git versions only), and
# the bytes it drops inside them.
_CRUD = frozenset(b".,:;<>\"\\'" + bytes(range(33)))
_DROPPED = frozenset(b"<>\n")


def _author(cwd: Path, fields: dict[str, str], env: dict[str, str]) -> bytes | None:
    """The `Name <email>` git am writes for mailinfo's Author and Email: as they are when git would not change
    them, else git's own answer (`git var GIT_AUTHOR_IDENT`), None when git refuses them."""
    name, email = fields["Author"].encode(), fields.get("Email", "").encode()
    if all(v and v[0] not in _CRUD and v[-1] not in _CRUD and not _DROPPED & set(v) for v in (name, email)):
        return b"%s <%s>" % (name, email)
    res = gitutil.run(cwd, "var", "GIT_AUTHOR_IDENT", check=False, binary=True,
                      env={**env, "GIT_AUTHOR_NAME": fields["Author"], "GIT_AUTHOR_EMAIL": fields.get("Email", "")})
    ident = res.stdout.rstrip(b"\n")
    return ident[:ident.rindex(b">") + 1] if res.returncode == 0 and b">" in ident else None


def am_in_progress(worktree: Path) -> bool:
    """A `git am` is stopped in the tree: its git directory has rebase-apply/ (read from the `.git` file of a
    linked worktree; otherwise `git rev-parse --git-path` says where)."""
    gitdir = _gitfile_dir(worktree)
    if gitdir is not None and (gitdir / "HEAD").is_file():
        return (gitdir / "rebase-apply").exists()
    path = gitutil.run(worktree, "rev-parse", "--git-path", "rebase-apply").stdout.strip()
    return (worktree / path).exists() if not os.path.isabs(path) else Path(path).exists()


def reverse_applies(worktree: Path, patch: Patch) -> bool:
    return gitutil.run(worktree, "apply", "--check", "-R", str(patch.path), check=False).returncode == 0


HUNK_FAIL = re.compile(r"error: patch failed: (.+):(\d+)")
NO_FILE = re.compile(r"error: (.+): (does not exist in index|No such file or directory|already exists in (?:index|working directory))")


def diagnose(worktree: Path, patch: Patch, am_output: str) -> str:
    """Name the file, hunk and line that failed, as a release engineer needs it."""
    text = _apply_check(worktree, patch) + "\n" + am_output
    conflicts = re.findall(r"CONFLICT \([^)]*\): Merge conflict in (\S+)", am_output)
    m = HUNK_FAIL.search(text)
    if m:
        path, line = m.group(1), int(m.group(2))
        hunk = patch.hunk_at(path, line)
        where = f"hunk {hunk} of {path}" if hunk else f"a hunk of {path}"
        how = " (and the 3-way merge conflicts)" if path in conflicts else ""
        return f"{where} does not apply at line {line}{how}"
    m = NO_FILE.search(text)
    if m:
        return f"{m.group(1)}: {m.group(2)}"
    if conflicts:
        return f"3-way merge conflict in {', '.join(conflicts)}"
    lines = [ln for ln in am_output.splitlines() if ln.startswith(("error:", "fatal:"))]
    return lines[0] if lines else "git am failed"


def _apply_check(worktree: Path, patch: Patch) -> str:
    """`git apply --check` against HEAD itself: the index may hold am's half-made merge."""
    fd, name = tempfile.mkstemp(prefix="kvforge-index-")
    os.close(fd)
    index = Path(name)
    index.unlink()
    env = {"GIT_INDEX_FILE": str(index)}
    try:
        gitutil.run(worktree, "read-tree", "HEAD", env=env)
        return gitutil.run(worktree, "apply", "--check", "--cached", str(patch.path), check=False, env=env).stderr
    finally:
        index.unlink(missing_ok=True)


def check_link_paths(worktree: Path, patches: list[Patch]) -> None:
    """Refuse a patch that would write through a symbolic link of the tree."""
    prefixes: dict[str, Patch] = {}
    for p in patches:
        for path in p.touched_paths:
            parts = path.split("/")
            for k in range(1, len(parts) + 1):
                prefixes.setdefault("/".join(parts[:k]), p)
    if not prefixes:
        return
    out = gitutil.run(worktree, "ls-tree", "HEAD", "--", *sorted(prefixes), check=False).stdout
    for line in out.splitlines():
        meta, _, name = line.partition("\t")
        if meta.startswith("120000"):
            p = prefixes[name]
            raise ApplyFailure(f"{p.name}: {name} is a symbolic link in the base; writing through it is refused",
                               [PatchOutcome(p.name, p.fix_id, "failed", detail="writes through a symlink")])



def own_objects(worktree: Path, env: dict[str, str] | None) -> None:
    """Make a repository that borrowed objects self-contained: pack everything its refs, HEAD and
    index (a stopped merge's stages too) reach, the borrowed objects included."""
    gitutil.run(worktree, "repack", "-a", "-d", "-q", env=env)
