"""The rebase's speed-ups change no answer: every batched or file-read shortcut is compared here with the read it
replaces (the speed itself is measured by bench/rebase_vs_git_rebase.py, never by a timed test).

- upstream.Probe (one index of the base, the apply checks in a few joined `git apply --check` runs read per
  path, one `git cherry` over the stack, one cat-file batch) gives each patch the signals gather() gives it alone;
- engine.am_without_worktree (a run of patches naming no path in common applied in one `git apply --cached`)
  makes git am's commits;
- engine.format_patches (one `git format-patch` for a stack) gives format_patch's bytes for each commit;
- engine's worktree checks read from git's files agree with git (`worktree list`, `rev-parse --git-path`);
- bases.import_archive (one pass over the archive) makes the commit the path-ordered inline import made;
- gitutil.run_many returns what run returns, in order.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import tarfile
from pathlib import Path

from helpers import CORE, git, make_patch

from kvforge.git import engine
from kvforge.core import fsutil
from kvforge.git import gitutil
from kvforge.git.bases import IMPORT_DATE, IMPORT_IDENT, import_archive
from kvforge.core.cache import REF_IMPORT
from kvforge.flow.rebase.commit import equal_pairs, same_change
from kvforge.flow.rebase.steps import rerere_enabled
from kvforge.project.series import parse_patch
from kvforge.project.targets import Component, Release
from kvforge.flow import upstream
from kvforge.flow.upstream import NewBase, Probe, gather

CLAMP = {CORE: ("return max(lo, x)", "return min(max(lo, x), hi)")}
DOUBLE = {CORE: ("return 2 * x", "return x + x")}
EXTRA = {"vllm_like/extra.py": ("", "X = 1\n")}
SIDE = {"vllm_like/side.py": ("", "Y = 2\n")}


def _commit_on(repo: Path, start: str, edits: dict, message: str) -> str:
    """A commit of upstream's own on `start`, made without a checkout."""
    index = repo / ".git" / "speed-index"
    env = {"GIT_INDEX_FILE": str(index)}
    git(repo, "read-tree", start, env=env)
    for rel, (old, new) in edits.items():
        text = git(repo, "show", f"{start}:{rel}") if old else ""
        blob = subprocess.run(["git", "hash-object", "-w", "--stdin"], cwd=repo, check=True, capture_output=True,
                              input=text.replace(old, new, 1) if old else new, text=True).stdout.strip()
        git(repo, "update-index", "--add", "--cacheinfo", f"100644,{blob},{rel}", env=env)
    tree = git(repo, "write-tree", env=env).strip()
    index.unlink()
    return git(repo, "commit-tree", tree, "-p", start, "-m", message).strip()


def _stack(fake, specs: list[tuple[str, dict, str]]):
    """A linear series on the fake base: [(name, edits, extra trailers)] -> (patches, commits)."""
    patches, commits, head = [], [], fake.base
    for name, edits, extra in specs:
        path, head = make_patch(fake.upstream, head, edits, f"[Core] {name}", name,
                                fake.root / "patches" / "fake" / f"{name}.patch", kind="fix", extra=extra)
        patches.append(parse_patch(path))
        commits.append(head)
    return patches, commits


def _count_git(monkeypatch) -> list[tuple[str, ...]]:
    """Every gitutil.run call's arguments from now on, in order (the calls still run)."""
    calls: list[tuple[str, ...]] = []
    run = gitutil.run

    def counting(cwd, *args, **kw):
        calls.append(args)
        return run(cwd, *args, **kw)

    monkeypatch.setattr(gitutil, "run", counting)
    return calls


def test_probe_answers_as_each_read_alone(fake, monkeypatch):
    patches, commits = _stack(fake, [
        ("clamp", CLAMP, ""),  # upstream cherry-picked it: reverse-apply and patch-id fire
        ("double", DOUBLE, ""),  # upstream lacks it: applies forward
        ("extra", EXTRA, "Upstream-Commit: 0123456789\n"),  # a new file; a commit the repository lacks
    ])
    git(fake.upstream, "tag", "old-head", commits[-1])
    picked = _commit_on(fake.upstream, fake.base, CLAMP, "[Core] clamp upstream (#1)")
    side = _commit_on(fake.upstream, picked, SIDE, "side")
    nb = NewBase(fake.upstream / ".git", side, "0.2.0", side, True)
    patches[2].trailers.append(type(patches[2].trailers[0])("Drop-When", f"base-contains {picked[:10]}", 0))
    alone = [gather(nb, p, c) for p, c in zip(patches, commits)]
    run = gitutil.run
    calls = _count_git(monkeypatch)
    with Probe(nb, patches, commits) as probe:
        shared = [gather(nb, p, c, probe=probe) for p, c in zip(patches, commits)]
        assert probe.cherry(commits[0]) is not None  # the one git cherry over the stack answered
    assert shared == alone
    assert [s.fired for s in alone[0][:2]] == [True, True] and alone[1][0].fired is False
    # The base's entries for the paths the series names, read once for the series (one ls-tree); never all of it.
    assert sum(1 for a in calls if a[0] == "ls-tree") == 1 and not any(a[0] == "read-tree" for a in calls)
    assert sum(1 for a in calls if a[0] == "cherry") == 1

    # A base that holds the stack itself: the one-run shortcut would count later patches as upstream; it is not
    # taken, and every answer is still the per-patch one.
    merged = _commit_on(fake.upstream, commits[-1], SIDE, "merged the series")
    nb2 = NewBase(fake.upstream / ".git", merged, None, merged, True)
    monkeypatch.setattr(gitutil, "run", run)
    alone2 = [gather(nb2, p, c) for p, c in zip(patches, commits)]
    with Probe(nb2, patches, commits) as probe:
        assert [gather(nb2, p, c, probe=probe) for p, c in zip(patches, commits)] == alone2
        assert probe.cherry(commits[0]) is None
    # A patch the probe was not made for, and one whose new file sits under a file of the base (a partial index
    # cannot know that entry), are checked against the base's whole index: the answers a check alone gives.
    other, _ = make_patch(fake.upstream, fake.base, SIDE, "[Core] side", "side", fake.root / "side.patch")
    under = fake.root / "under.patch"
    under.write_bytes(patches[2].raw.replace(b"vllm_like/extra.py", CORE.encode() + b"/x.py"))
    odd = [parse_patch(other), parse_patch(under)]
    for made_for, asked in (([patches[0]], odd[0]), ([patches[0], odd[1]], odd[1])):
        alone3 = gather(nb, asked, None)
        calls = _count_git(monkeypatch)
        with Probe(nb, made_for, commits[:1]) as probe:
            assert gather(nb, asked, None, probe=probe) == alone3
        assert sum(1 for a in calls if a[0] == "read-tree") == 1
        monkeypatch.setattr(gitutil, "run", run)


def test_format_patches_gives_format_patch_bytes(fake, monkeypatch):
    repo = fake.upstream
    a = _commit_on(repo, fake.base, {"vllm_like/ünïcode name.py": ("", "A = 'é'\n")}, "[Misc] non-ASCII path\n\nBody é.")
    git(repo, "checkout", "-q", "--detach", a)
    git(repo, "mv", CORE, "vllm_like/core2.py")
    git(repo, "commit", "-qm", "[Misc] a rename")
    b = git(repo, "rev-parse", "HEAD").strip()
    (repo / "blob.bin").write_bytes(bytes(range(256)) * 4)
    (repo / "run.sh").write_text("#!/bin/sh\n")
    (repo / "run.sh").chmod(0o755)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "[Misc] binary and executable")
    c = git(repo, "rev-parse", "HEAD").strip()
    expected = {x: engine.format_patch(repo, x) for x in (a, b, c)}
    engine.format_patches(repo, fake.base, [a, b, c])
    calls = []
    run = gitutil.run
    monkeypatch.setattr(gitutil, "run", lambda *args, **kw: calls.append(args) or run(*args, **kw))
    assert {x: engine.format_patch(repo, x) for x in (a, b, c)} == expected
    assert calls == []  # all three came from format_patches
    # A list that is not the stack base..tip pairs nothing: each commit is formatted alone again.
    d = _commit_on(repo, c, SIDE, "[Misc] side")
    engine.format_patches(repo, fake.base, [a, d])
    assert engine.format_patch(repo, d) and any(args[-1] == d for _cwd, *args in calls)



def test_format_patches_over_ranges_of_several_commits(fake, monkeypatch):
    repo, head, commits = fake.upstream, fake.base, []
    for k in range(6):
        head = _commit_on(repo, head, {f"vllm_like/r{k}.py": ("", f"R = {k}\n")}, f"[Misc] r{k}\n\nBody {k}.")
        commits.append(head)
    expected = {x: engine.format_patch(repo, x) for x in commits}
    engine._FORMATTED.clear()
    monkeypatch.setattr(engine.os, "cpu_count", lambda: 1)  # 4 ranges for 6 commits: some hold two
    ran = []
    run_many = gitutil.run_many
    monkeypatch.setattr(gitutil, "run_many", lambda cwd, calls, **kw: ran.extend(calls) or run_many(cwd, calls, **kw))
    engine.format_patches(repo, fake.base, commits)
    assert len(ran) == 4
    calls = []
    run = gitutil.run
    monkeypatch.setattr(gitutil, "run", lambda *args, **kw: calls.append(args) or run(*args, **kw))
    assert {x: engine.format_patch(repo, x) for x in commits} == expected
    assert calls == []

def test_worktree_state_read_from_files_agrees_with_git(fake, monkeypatch, tmp_path):
    bare = tmp_path / "repo.git"
    git(tmp_path, "clone", "-q", "--bare", str(fake.upstream), str(bare))
    wt = tmp_path / "wt"
    engine.add_worktree(bare, wt, fake.base)

    def git_says_am(path: Path) -> bool:
        p = git(path, "rev-parse", "--git-path", "rebase-apply").strip()
        return (path / p).exists() if not Path(p).is_absolute() else Path(p).exists()

    assert engine.am_in_progress(wt) is git_says_am(wt) is False
    patch, _ = make_patch(fake.upstream, fake.base, {CORE: ("return max(lo, x)", "return lo")}, "[Core] a", "a",
                          tmp_path / "a.patch")
    other = _commit_on(fake.upstream, fake.base, {CORE: ("return max(lo, x)", "return hi")}, "conflicting")
    git(fake.upstream, "push", "-q", str(bare), f"{other}:refs/heads/other")
    git(wt, "checkout", "-q", "--detach", other)
    subprocess.run(["git", "am", "-3", str(patch)], cwd=wt, capture_output=True)
    assert engine.am_in_progress(wt) is git_says_am(wt) is True
    calls = []
    run = gitutil.run
    monkeypatch.setattr(gitutil, "run", lambda *args, **kw: calls.append(args) or run(*args, **kw))
    assert engine.ensure_worktree(bare, wt, fake.base) is True  # reused: its stopped git am is aborted
    assert [args[1:3] for args in calls] == [("am", "--abort")]
    assert engine.am_in_progress(wt) is git_says_am(wt) is False
    # A worktree whose registration points elsewhere is not trusted from the files: git decides (made afresh).
    (bare / "worktrees" / "wt" / "gitdir").write_text(f"{tmp_path}/elsewhere/.git\n")
    assert engine.ensure_worktree(bare, wt, fake.base) is False
    assert engine.ensure_worktree(bare, wt, fake.base) is True


def test_rerere_enabled_is_read_from_the_config_file(tmp_path):
    repo = tmp_path / "r.git"
    git(tmp_path, "init", "-q", "--bare", str(repo))
    assert rerere_enabled(repo) is False
    git(repo, "config", "rerere.autoupdate", "true")
    assert rerere_enabled(repo) is False
    git(repo, "config", "rerere.enabled", "true")
    assert rerere_enabled(repo) is True


def _import_in_path_order(repo: Path, archive: Path, message: bytes) -> str:
    """The import as kvforge made it before (the oracle): members in path order, each one's bytes inline."""
    with tarfile.open(archive, "r:*") as tar:
        entries = []
        for m in tar.getmembers():
            parts = m.name.split("/", 1)
            if (m.isfile() or m.issym() or m.islnk()) and len(parts) == 2 and parts[1]:
                entries.append((parts[1], m))
        entries.sort(key=lambda e: e[0])
        out = [f"commit {REF_IMPORT}\nauthor {IMPORT_IDENT} {IMPORT_DATE}\ncommitter {IMPORT_IDENT} {IMPORT_DATE}\n"
               .encode(), b"data %d\n%s\ndeleteall\n" % (len(message), message)]
        for path, m in entries:
            if m.issym():
                data, mode = m.linkname.encode(), b"120000"
            else:
                fh = tar.extractfile(m)
                data = fh.read() if fh else b""
                mode = b"100755" if m.mode & 0o111 else b"100644"
            out += [b"M %s inline %s\ndata %d\n" % (mode, path.encode(), len(data)), data, b"\n"]
        out.append(b"done\n")
    subprocess.run(["git", "fast-import", "--quiet", "--done", "--force"], input=b"".join(out), check=True,
                   env={"GIT_DIR": str(repo), "PATH": "/usr/bin:/bin"})
    return git(repo.parent, "rev-parse", REF_IMPORT, env={"GIT_DIR": str(repo)}).strip()


def test_one_pass_import_makes_the_path_ordered_commit(tmp_path):
    """Members out of path order, a path twice (the later wins), a file and a directory of one name in both
    orders, a symbolic link, a hard link, an executable, a directory entry: the same commit as before."""
    archive = tmp_path / "fake-1.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        def add(name: str, data: bytes = b"", mode: int = 0o644, kind: bytes = tarfile.REGTYPE, link: str = ""):
            info = tarfile.TarInfo(f"fake-1.0/{name}")
            info.type, info.mode, info.linkname = kind, mode, link
            info.size = len(data) if kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
        add("z.py", b"z = 1\n")
        add("fake/_version.py", b"__commit_id__ = commit_id = 'gabcdef012'\n")
        add("a/b.py", b"first\n")
        add("a/b.py", b"second\n")
        add("d/x.py", b"in a directory\n")
        add("d", b"a file named like the directory\n")
        add("e", b"a file first\n")
        add("e/y.py", b"then a directory\n")
        add("bin/run", b"#!/bin/sh\n", mode=0o755)
        add("link", kind=tarfile.SYMTYPE, link="z.py")
        add("hard", kind=tarfile.LNKTYPE, link="fake-1.0/z.py")
        add("dir", kind=tarfile.DIRTYPE, mode=0o755)
        add("m.py", b"m\n")
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    comp = Component(name="fake", repo="https://invalid.invalid/fake.git", ref="v1.0",
                     release=Release("fake", "1.0", digest), series_dir=tmp_path, platforms=("cpu",), tests={})
    now, before = tmp_path / "now.git", tmp_path / "before.git"
    for r in (now, before):
        git(tmp_path, "init", "-q", "--bare", str(r))
    commit = import_archive(now, archive, comp, digest)
    message = git(now.parent, "cat-file", "commit", commit, env={"GIT_DIR": str(now)}).split("\n\n", 1)[1]
    assert "Upstream-Commit-Id: abcdef012" in message
    assert _import_in_path_order(before, archive, message.encode()) == commit


def test_run_many_returns_what_run_returns_in_order(fake):
    calls = [["rev-parse", "HEAD"], ["cat-file", "-e", "0" * 40], ["log", "-1", "--format=%s"]] * 5
    many = gitutil.run_many(fake.upstream, calls, jobs=3)
    alone = [gitutil.run(fake.upstream, *c, check=False) for c in calls]
    assert [(r.returncode, r.stdout) for r in many] == [(r.returncode, r.stdout) for r in alone]
    assert [r.returncode != 0 for r in many[:3]] == [False, True, False]


def test_remembered_sha256_is_read_again_when_the_file_changes(tmp_path):
    """fsutil.sha256_remembered gives sha256_file's digest; a file rewritten in place with the same size and its
    old mtime put back (what would fool a size+mtime memo) is read again: its ctime moved."""
    f = tmp_path / "vllm-9.9.9.tar.gz"
    f.write_bytes(b"a" * 4096)
    first = fsutil.sha256_remembered(f)
    assert first == fsutil.sha256_file(f) == hashlib.sha256(b"a" * 4096).hexdigest()
    memo = tmp_path / ".vllm-9.9.9.tar.gz.sha256"
    assert memo.read_text().split()[0] == first
    assert fsutil.sha256_remembered(f) == first  # from the memo
    st = f.stat()
    f.write_bytes(b"b" * 4096)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
    assert fsutil.sha256_remembered(f) == hashlib.sha256(b"b" * 4096).hexdigest()
    memo.write_text("garbage")
    assert fsutil.sha256_remembered(f) == hashlib.sha256(b"b" * 4096).hexdigest()


def test_a_remembered_parse_is_each_callers_own(tmp_path):
    """series.parse_patch remembers parses by (path, bytes): a caller that adds a problem or a trailer changes no
    other caller's Patch, and other bytes under the same name are parsed anew."""
    src = Path(__file__).resolve().parent.parent / "patches" / "v0.20.1" / "0003-kv-events-token-ids.patch"
    a = parse_patch(src)
    a.problems.append("mine")  # type: ignore[arg-type]
    a.trailers[0].value = "changed"
    a.files.clear()
    b = parse_patch(src)
    assert b.problems == [] and b.trailers[0].value != "changed" and b.files
    assert b.fix_id == "kv-events-token-ids"
    other = parse_patch(src, src.read_bytes().replace(b"Fix-Id: kv-events-token-ids", b"Fix-Id: other-id"))
    assert other.fix_id == "other-id" and parse_patch(src).fix_id == "kv-events-token-ids"
    # The same clean bytes under another name: that name, the same reading; a defect names its own file.
    staged = parse_patch(tmp_path / "staged.patch", src.read_bytes())
    assert staged.path == tmp_path / "staged.patch" and staged.files == b.files and staged.trailers == b.trailers
    broken = src.read_bytes().replace(b"Fix-Id: kv-events-token-ids\n", b"")
    assert {p.path for p in parse_patch(tmp_path / "x.patch", broken).problems} == {tmp_path / "x.patch"}
    assert {p.path for p in parse_patch(tmp_path / "y.patch", broken).problems} == {tmp_path / "y.patch"}


def _patch_file(repo: Path, start: str, edits: dict, message: str, author: str, out: Path) -> Path:
    """A format-patch file of a commit of `edits` on `start` with this exact message and author ('Name <email>')."""
    name, email = author[:-1].split(" <")
    commit = _commit_on(repo, start, edits, "x")
    tree = git(repo, "rev-parse", f"{commit}^{{tree}}").strip()
    env = {"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_AUTHOR_DATE": "1700000000 +0130"}
    made = subprocess.run(["git", "commit-tree", tree, "-p", start], cwd=repo, input=message.encode(), check=True,
                          capture_output=True, env={**os.environ, **env}).stdout.decode().strip()
    out.write_bytes(engine.format_patch(repo, made))
    return out


def test_commits_made_without_a_worktree_are_git_ams(fake, tmp_path):
    """engine.am_without_worktree makes the commits `git am` (AM_OPTS) makes of the same files on the same base,
    id for id (author, dates, message after stripspace, tree), on a base where the files moved; it stops at the
    first patch that does not apply as it is, and returns the commits made before it."""
    up = fake.upstream
    patches = [
        _patch_file(up, fake.base, CLAMP, "[Core][tag] clamp: keep [tags]   \n\n\n\nBody  with trailing  \n\n\n"
                    "Fix-Id: clamp\n", "Zo\u00eb \u00dcn\u00efcode <zoe@example.com>", tmp_path / "1.patch"),
        _patch_file(up, fake.base, EXTRA, "extra file\n", "A B <ab@example.com>", tmp_path / "2.patch"),
        _patch_file(up, fake.base, SIDE, "side\n\nbody\n", "C D <cd@example.com>", tmp_path / "3.patch"),
    ]
    moved = _commit_on(up, fake.base, {CORE: ("def double(x):", "# moved\n\n\ndef double(x):")}, "upstream moves it")
    made = engine.am_without_worktree(up / ".git", moved, patches)
    assert len(made) == 3
    wt = tmp_path / "wt"
    git(up, "worktree", "add", "-q", "--detach", str(wt), moved)
    git(wt, *engine.AM_OPTS, *map(str, patches), env=gitutil.COMMITTER)
    assert git(wt, "rev-list", "--reverse", f"{moved}..HEAD").split() == made
    assert git(up, "log", "-1", "--format=%an", made[0]).strip() == "Zo\u00eb \u00dcn\u00efcode"
    assert git(up, "log", "-1", "--format=%s", made[0]).strip() == "[Core][tag] clamp: keep [tags]"

    # Upstream changed the line the second patch changes: it does not apply as it is; the first is made, and
    # `git am -3` of the second in a worktree is the conflict the rebase stops at.
    shifted = _commit_on(up, moved, {CORE: ("return 2 * x", "return 2 * x  # upstream")}, "upstream edits double")
    double = _patch_file(up, fake.base, DOUBLE, "double\n", "C D <cd@example.com>", tmp_path / "4.patch")
    made2 = engine.am_without_worktree(up / ".git", shifted, [patches[1], double, patches[2]])
    assert len(made2) == 1
    git(wt, "checkout", "-q", "--detach", made2[0])
    assert engine.am_one(wt, double, made2[0])[0] == "conflict"
    assert engine.am_without_worktree(up / ".git", "0" * 40, patches) == []  # a head git cannot read: nothing


def test_a_joined_check_is_read_only_when_every_error_names_one_patchs_path(fake):
    """upstream._attribute: a joined `git apply --check` that passes answers every check (passed); one that fails
    answers each check from the errors naming its paths (the last one its detail), and none when a line names no
    path of the batch (a corrupt patch, a warning) or git said nothing: those checks are then asked alone."""
    patches, _ = _stack(fake, [(f"a{k}", {f"vllm_like/a{k}.py": ("", f"A{k} = {k}\n")}, "") for k in range(3)])
    batch = [(p, [f"vllm_like/a{k}.py"], True) for k, p in enumerate(patches)]
    res = gitutil.Result
    assert upstream._attribute(batch, res(0, "", "warning: anything\n")) == [(True, "")] * 3
    failed = res(1, "", "error: patch failed: vllm_like/a2.py:1\nerror: vllm_like/a2.py: patch does not apply\n"
                        "error: vllm_like/a0.py: does not exist in index\n")
    assert upstream._attribute(batch, failed) == [(False, "vllm_like/a0.py: does not exist in index"), (True, ""),
                                                  (False, "vllm_like/a2.py: patch does not apply")]
    for stderr in ("error: corrupt patch at line 12\n", "error: vllm_like/other.py: patch does not apply\n",
                   "error: vllm_like/a0.py: patch does not apply\nwarning: 1 line adds whitespace errors.\n", ""):
        assert upstream._attribute(batch, res(1, "", stderr)) is None


def test_patches_naming_no_path_in_common_are_applied_in_one_run(fake, tmp_path, monkeypatch):
    """am_without_worktree applies the leading patches that name no path in common in one `git apply --cached` (a
    file of them joined) and makes the commits `git am` makes of them one by one; the patches after them (here one
    that changes a path an earlier one made) are applied alone, on top; a joined run that fails (a patch that does
    not apply) leaves each to be applied alone, and the commits before that patch are made."""
    up = fake.upstream
    patches = [_patch_file(up, fake.base, {f"vllm_like/j{k}.py": ("", f"J{k} = {k}\n")}, f"j{k}\n\nbody {k}\n",
                           "A B <ab@example.com>", tmp_path / f"j{k}.patch") for k in range(5)]
    patches.append(_patch_file(up, fake.base, {CORE: ("def double(x):", "# edited\n\n\ndef double(x):")},
                               "core\n", "C D <cd@example.com>", tmp_path / "core.patch"))
    patches.append(_patch_file(up, fake.base, CLAMP, "clamp\n", "C D <cd@example.com>", tmp_path / "clamp.patch"))
    calls = _count_git(monkeypatch)
    made = engine.am_without_worktree(up / ".git", fake.base, patches)
    applies = [a for a in calls if a[0] == "apply"]
    assert len(applies) == 2 and "joined" in applies[0][-1]  # 6 joined (core too), clamp alone
    wt = tmp_path / "wt"
    git(up, "worktree", "add", "-q", "--detach", str(wt), fake.base)
    git(wt, *engine.AM_OPTS, *map(str, patches), env=gitutil.COMMITTER)
    assert git(wt, "rev-list", "--reverse", f"{fake.base}..HEAD").split() == made and len(made) == 7
    # A run after patches that share a path (core, then clamp: both change CORE) is joined too, on top of them.
    reordered = [patches[5], patches[6], *patches[:5]]
    calls.clear()
    made3 = engine.am_without_worktree(up / ".git", fake.base, reordered)
    applies = [a for a in calls if a[0] == "apply"]
    assert len(applies) == 2 and "joined" not in applies[0][-1] and "joined" in applies[1][-1]
    git(wt, "checkout", "-q", "--detach", fake.base)
    git(wt, *engine.AM_OPTS, *map(str, reordered), env=gitutil.COMMITTER)
    assert git(wt, "rev-list", "--reverse", f"{fake.base}..HEAD").split() == made3 and len(made3) == 7
    # Upstream changed the line the core patch changes: the joined run fails; the four before it are made.
    shifted = _commit_on(up, fake.base, {CORE: ("def double(x):", "def double(y):")}, "upstream edits double")
    made2 = engine.am_without_worktree(up / ".git", shifted, patches[:5] + patches[5:6])
    assert len(made2) == 5
    git(wt, "checkout", "-q", "--detach", shifted)
    git(wt, *engine.AM_OPTS, *map(str, patches[:5]), env=gitutil.COMMITTER)
    assert git(wt, "rev-list", "--reverse", f"{shifted}..HEAD").split() == made2


def test_equal_pairs_is_what_git_range_diff_prints(fake, tmp_path):
    """rebase.commit.equal_pairs writes git range-diff's "=" lines (numbers padded, abbreviations, subjects) for a
    series moved to a base where its lines shifted; same_change tells a moved patch from an edited one."""
    up = fake.upstream
    olds = [_patch_file(up, fake.base, CLAMP, "[Core] clamp\n", "A B <ab@example.com>", tmp_path / "a1.patch"),
            _patch_file(up, fake.base, SIDE, "[Core] side\n", "A B <ab@example.com>", tmp_path / "a2.patch")]
    wt = tmp_path / "wt"
    git(up, "worktree", "add", "-q", "--detach", str(wt), fake.base)
    git(wt, *engine.AM_OPTS, *map(str, olds), env=gitutil.COMMITTER)
    old_head = git(wt, "rev-parse", "HEAD").strip()
    moved = _commit_on(up, fake.base, {CORE: ("def double(x):", "# moved\n\n\ndef double(x):")}, "moved")
    news = engine.am_without_worktree(up / ".git", moved, olds)
    old_commits = git(up, "rev-list", "--reverse", f"{fake.base}..{old_head}").split()
    want = git(up, "range-diff", "--no-color", f"{fake.base}..{old_head}", f"{moved}..{news[-1]}")
    assert equal_pairs(up / ".git", old_commits, news) == want
    assert " = " in want
    new_bytes = [engine.format_patch(up, c) for c in news]
    assert len(news) == 2 and new_bytes[0] != olds[0].read_bytes()  # the hunk moved...
    assert all(same_change(p.read_bytes(), b) for p, b in zip(olds, new_bytes))  # ...the change did not
    assert not same_change(olds[0].read_bytes(), new_bytes[0].replace(b"+    return min(max(lo, x), hi)",
                                                                      b"+    return min(max(lo, x),hi)"))
    assert not same_change(olds[0].read_bytes(), new_bytes[0].replace(b"[Core] clamp", b"[Core] Clamp"))
    assert equal_pairs(up / ".git", old_commits, news[:1]) is None  # sides of different lengths: git's to say


def test_a_run_started_ahead_is_taken_when_it_answers_the_call(fake, tmp_path, monkeypatch):
    """engine.am_ahead's run answers a later am_without_worktree of the same bytes on the same head, or of a prefix
    of them (no second mailinfo), with the commits a fresh run makes; other bytes or another head run anew."""
    up = fake.upstream
    patches = [_patch_file(up, fake.base, CLAMP, "[Core] clamp\n", "A B <ab@example.com>", tmp_path / "1.patch"),
               _patch_file(up, fake.base, SIDE, "[Core] side\n", "A B <ab@example.com>", tmp_path / "2.patch")]
    fresh = engine.am_without_worktree(up / ".git", fake.base, patches)
    calls = _count_git(monkeypatch)
    monkeypatch.setattr(engine, "_AHEAD", {})
    engine.am_ahead(up / ".git", fake.base, [p.read_bytes() for p in patches])
    assert engine.am_without_worktree(up / ".git", fake.base, patches) == fresh
    assert engine.am_without_worktree(up / ".git", fake.base, patches[:1]) == fresh[:1]
    assert sum(1 for a in calls if a[0] == "mailinfo") == 2  # the run ahead's, once per patch
    assert engine.am_without_worktree(up / ".git", fresh[0], patches[1:]) == fresh[1:]  # another head: its own
    edited = tmp_path / "3.patch"
    edited.write_bytes(patches[1].read_bytes().replace(b"[Core] side", b"[Core] side, edited"))
    assert engine.am_without_worktree(up / ".git", fake.base, [patches[0], edited])[0] == fresh[0]
    assert sum(1 for a in calls if a[0] == "mailinfo") == 5


def test_commits_without_a_worktree_for_every_kind_of_change(tmp_path, monkeypatch):
    """The small index and the fast-import stream make `git am`'s commits for every kind of change a patch can
    make: a new file, a deletion that empties a directory, a rename, a mode change, a symlink, a path with a
    space, an author whose name git trims ("crud" at either end); and stop, with the commits before it, at a
    patch whose path is a directory in the base (a file becoming a directory: the worktree's to apply)."""
    repo = tmp_path / "r"
    git(tmp_path, "init", "-q", str(repo))
    for rel, text in {"a/keep.py": "k\n", "gone/only.py": "o\n", "old name.py": "n\n" * 20, "run.sh": "echo\n",
                      "d/x.py": "x\n"}.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base", env={**gitutil.COMMITTER, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@x"})
    base = git(repo, "rev-parse", "HEAD").strip()
    steps = [("new file", "Ann <ann@example.com>", lambda: (repo / "a" / "new file.py").write_text("n\n")),
             ("empty a dir", "Bo Jr. <bo@example.com>", lambda: (repo / "gone" / "only.py").unlink()),
             ("rename", "'Cy' <.cy@example.com.>", lambda: (repo / "old name.py").rename(repo / "new name.py")),
             ("mode", "Di, <di@example.com>", lambda: (repo / "run.sh").chmod(0o755)),
             ("link", "Ed <ed@example.com>", lambda: (repo / "a" / "link").symlink_to("keep.py"))]
    files = []
    for k, (subject, author, change) in enumerate(steps):
        change()
        git(repo, "add", "-A")
        name, email = author[:-1].split(" <")
        git(repo, "commit", "-qm", subject, env={**gitutil.COMMITTER, "GIT_AUTHOR_NAME": name,
                                                  "GIT_AUTHOR_EMAIL": email, "GIT_AUTHOR_DATE": f"17000{k}0000 +0200"})
        files.append(tmp_path / f"{k}.patch")
        files[-1].write_bytes(engine.format_patch(repo, "HEAD"))
    (repo / "d" / "x.py").unlink()
    (repo / "d" / "x.py").mkdir()
    (repo / "d" / "x.py" / "y.py").write_text("y\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "file to dir", env=gitutil.COMMITTER)
    files.append(tmp_path / "dir.patch")
    files[-1].write_bytes(engine.format_patch(repo, "HEAD"))

    made = engine.am_without_worktree(repo / ".git", base, files[:-1])
    wt = tmp_path / "wt"
    git(repo, "worktree", "add", "-q", "--detach", str(wt), base)
    git(wt, *engine.AM_OPTS, *map(str, files[:-1]), env=gitutil.COMMITTER)
    assert made == git(wt, "rev-list", "--reverse", f"{base}..HEAD").split()
    assert len(made) == 5 and git(repo, "log", "-1", "--format=%an|%ae", made[2]).strip() == "Cy|cy@example.com"
    assert git(repo, "for-each-ref", "refs/kvforge/").strip() == ""  # fast-import's temporary ref is gone
    monkeypatch.chdir(tmp_path)
    assert engine.am_without_worktree(repo / ".git", base, [Path(f.name) for f in files[:-1]]) == made  # relative
    assert engine.am_without_worktree(repo / ".git", made[-1], files[-1:]) == []  # d/x.py: a file in the base
    assert engine.am_without_worktree(repo / ".git", made[-1], [*files[-1:], files[0]]) == []


def test_batched_apply_checks_answer_as_each_check_alone(fake, monkeypatch):
    # Ten patches: four files the new base has (reverse-apply), four it lacks (forward), one it has with other
    # content (neither way), one changing a file another patch makes (never in that one's batch).
    specs = [(f"f{k}", {f"vllm_like/f{k}.py": ("", f"F{k} = {k}\n")}, "") for k in range(9)]
    specs.append(("f0-again", {"vllm_like/f0.py": ("F0 = 0", "F0 = 10")}, ""))
    patches, commits = _stack(fake, specs)
    upstream = _commit_on(fake.upstream, fake.base, {**{f"vllm_like/f{k}.py": ("", f"F{k} = {k}\n") for k in range(4)},
                                                     "vllm_like/f8.py": ("", "F8 = 'other'\n")}, "upstream")
    nb = NewBase(fake.upstream / ".git", upstream, "0.2.0", upstream, False)
    alone = [gather(nb, p, c) for p, c in zip(patches, commits)]
    assert [s[0].fired for s in alone] == [True] * 4 + [False] * 4 + [None, False]
    runs: list[list[list[str]]] = []
    run_many = gitutil.run_many

    def counting(cwd, calls, **kw):
        runs.append([list(c) for c in calls])
        return run_many(cwd, calls, **kw)

    monkeypatch.setattr(gitutil, "run_many", counting)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)  # one joined run per direction where the paths allow
    with Probe(nb, patches, commits) as probe:
        assert [gather(nb, p, c, probe=probe) for p, c in zip(patches, commits)] == alone
    # Passes and failures of both directions were read from the joined runs' errors: no check was asked alone
    # but f0-again's (f0.py is named by f0 too, so it is in neither joined run): 2 joined runs and 2 alone.
    checks = [c for calls in runs for c in calls if c[0] == "apply"]
    assert len(checks) == 4, checks
    # A series the base lacks entirely: one joined run of its reverse checks (all fail), one of its forward ones.
    runs.clear()
    with Probe(nb, patches[4:8], commits[4:8]) as probe:
        assert [gather(nb, p, c, probe=probe) for p, c in zip(patches[4:8], commits[4:8])] == alone[4:8]
    checks = [c for calls in runs for c in calls if c[0] == "apply"]
    assert sorted("-R" in c for c in checks) == [False, True]
    assert all(sum(a.startswith("--include=") for a in c) == 4 for c in checks)
