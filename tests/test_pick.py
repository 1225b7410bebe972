"""`kvforge pick`: an upstream change into every target's series, a verdict per target, written all or nothing.

Fast tests: the header pieces (Checks from a diff, the Fix-Id slug, message splitting, in_base insertion
into the real target files) and the all-or-nothing write, killed with SIGKILL at every step.

Slow tests (real releases): the upstream source is a git repository of vllm/v1/core and tests/v1/core as
the PyPI sdists of vLLM 0.20.1, 0.20.2 and 0.21.0 have them (tags v0.20.1, v0.20.2, v0.21.0):
- 0.20.1 -> 0.20.2 in those paths is exactly upstream #41282 (apply_admission_cap: coordinator,
  manager, single_type manager and one new test): one commit, tagged v0.20.2;
- kv_cache_manager.py and tests/v1/core/test_prefix_caching.py of 0.21.0 on top of 0.20.2 (the
  full-sequence admission gate moved into allocate_slots): one commit, then the rest of 0.21.0, tagged.
The code is the releases'; the commit subjects are descriptions written here. Picked into the committed
targets (v0.20.1, v0.20.2rc, main = 0.33.0).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvforge.flow import picksource, pickwrite
from kvforge.project import transaction
from kvforge.git.bases import download_sdist
from kvforge.core.cache import Cache, default_cache_dir
from kvforge.cli import main
from kvforge.project.series import lint_directory, parse_patch, read_series
from kvforge.project.targets import Release, load_target

REPO_ROOT = Path(__file__).resolve().parent.parent


def kvforge(*args: str):
    return CliRunner().invoke(main, list(args))


# ---------------------------------------------------------------- fast: the header

DIFF = b"""diff --git a/tests/v1/core/test_x.py b/tests/v1/core/test_x.py
index 1111111..2222222 100644
--- a/tests/v1/core/test_x.py
+++ b/tests/v1/core/test_x.py
@@ -10,6 +10,7 @@ def test_kept():
     a = 1
     b = 2
     assert a + b == 3
+    assert b - a == 1
 
 
 def test_untouched():
@@ -40,1 +41,5 @@ def test_last():
     pass
+
+
+def test_added():
+    assert True
diff --git a/vllm/v1/core/block_pool.py b/vllm/v1/core/block_pool.py
index 3333333..4444444 100644
--- a/vllm/v1/core/block_pool.py
+++ b/vllm/v1/core/block_pool.py
@@ -1,3 +1,3 @@
-def test_not_a_test_file():
+def test_not_a_test_file(x):
     pass
"""


def test_checks_are_the_test_functions_the_change_adds_or_modifies():
    assert picksource.checks_of(DIFF) == ["tests/v1/core/test_x.py::test_kept", "tests/v1/core/test_x.py::test_added"]


def test_fix_id_slug_and_message_split():
    assert picksource.default_fix_id("[Core][Bugfix] Keep the SWA admission cap (#41282)") == "keep-the-swa-admission-cap"
    subject, body, signs = picksource._split_message("[Core] X (#1)\n\nWhy it matters.\n\nMore.\n\n"
                                               "Signed-off-by: A <a@b.c>\nCo-authored-by: B <b@b.c>\n")
    assert (subject, body) == ("[Core] X (#1)", "Why it matters.\n\nMore.")
    assert signs == ["Signed-off-by: A <a@b.c>", "Co-authored-by: B <b@b.c>"]


def test_annotated_patch_is_lint_clean_with_the_header_filled():
    change = picksource.Change("x", DIFF, "[Core] Fix it (#41282)", "What goes wrong.\n\nDetails.", "Up Stream <u@s.io>",
                         "Fri, 8 May 2026 12:00:00 +0000", "vllm", ["a" * 40],
                         picksource._pr_of("[Core] Fix it (#41282)", "vllm"), False, "0.20.2", ["Signed-off-by: Up Stream <u@s.io>"])
    raw = picksource.annotated(change, "fix-it", picksource.checks_of(DIFF), "Carrier <c@example.com>")
    p = parse_patch(Path("0001-fix-it.patch"), raw)
    assert not p.problems, p.problems
    assert p.value("Upstream-Status") == "Backport [https://github.com/vllm-project/vllm/pull/41282, aaaaaaaaaaaa]"
    assert p.value("Drop-When") == "version >= 0.20.2" and p.kind == "fix" and len(p.checks) == 2
    assert p.values("Signed-off-by") == ["Up Stream <u@s.io>", "Carrier <c@example.com>"]
    assert p.value("Why") == "What goes wrong." and p.author == "Up Stream <u@s.io>"
    change.pr_open, change.first_release = True, None
    p = parse_patch(Path("0001-fix-it.patch"), picksource.annotated(change, "fix-it", [], "Carrier <c@example.com>"))
    assert not p.problems and p.upstream_status == "Pending" and p.kind == "refactor"
    assert p.value("Drop-When") == "upstream-pr-merged https://github.com/vllm-project/vllm/pull/41282"


TEAM_HEADER = """\
From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: Team Dev <dev@team.io>
Date: Fri, 8 May 2026 12:00:00 +0000
Subject: [PATCH] [Core] Keep the team's cap

What goes wrong without it.

Fix-Id: team-cap
Upstream-PR: https://github.com/vllm-project/vllm/pull/41282
Drop-When: upstream-pr-merged https://github.com/vllm-project/vllm/pull/41282
Signed-off-by: Team Dev <dev@team.io>
---
"""


def test_a_team_patch_file_keeps_its_header_and_what_is_added_lints(tmp_path):
    """A team's format-patch file (no upstream commit): its trailer block is kept byte for byte, its Fix-Id is
    the pick's, the fields it lacks are added after it and named in Review:, and the result lints."""
    f = tmp_path / "0007-team-cap.patch"
    f.write_bytes(TEAM_HEADER.encode() + DIFF)
    change = picksource.from_mbox(f, None)
    assert change.fix_id == "team-cap" and change.review
    raw = picksource.annotated(change, change.fix_id, picksource.checks_of(DIFF), "Carrier <c@example.com>")
    p = parse_patch(Path("0001-team-cap.patch"), raw)
    assert not p.problems, p.problems
    kept = TEAM_HEADER.split("\n\n", 2)[2].removesuffix("---\n")
    assert kept.split("Signed-off-by")[0] in raw.decode()  # the file's own trailers, as they were
    assert p.value("Drop-When") == "upstream-pr-merged https://github.com/vllm-project/vllm/pull/41282"
    assert p.values("Signed-off-by") == ["Team Dev <dev@team.io>", "Carrier <c@example.com>"]
    assert p.value("Review") == "Kind Upstream-Status Why Checks"


def test_a_plain_diff_file_gets_a_header_its_lint_accepts(tmp_path):
    """A plain diff (no message, no author): Drop-When is `never [reason]` (the syntax lint takes), the author
    is the carrier (whose sign-off is their own, not a proposal), and every proposed field is named in Review:."""
    f = tmp_path / "0003-keep_it.diff"
    f.write_bytes(b"\n".join(ln for ln in DIFF.split(b"\n") if not ln.startswith((b"diff --git", b"index "))))
    change = picksource.from_mbox(f, None)
    assert change.subject == "keep it" and picksource.default_fix_id(change.subject) == "keep-it"
    raw = picksource.annotated(change, "keep-it", [], "Carrier <c@example.com>")
    p = parse_patch(Path("0001-keep-it.patch"), raw)
    assert not p.problems, p.problems
    assert p.value("Drop-When") == "never [no upstream commit or PR known for it]" and p.author == "Carrier <c@example.com>"
    assert p.value("Review") == "Fix-Id Kind Upstream-Status Why Drop-When"


def test_in_base_goes_to_the_named_component_of_a_real_target_file():
    text = (REPO_ROOT / "targets" / "v0.20.2rc.toml").read_text()
    new = pickwrite._in_base_text(text, "vllm", "swa-admission-cap", 'upstream "#41282"')
    comps = {c["name"]: c for c in tomllib.loads(new)["components"]}
    assert [e["fix_id"] for e in comps["vllm"]["in_base"]][-1] == "swa-admission-cap"
    assert "swa-admission-cap" not in [e["fix_id"] for e in comps["vllm-ascend"].get("in_base", [])]
    assert new.replace('[[components.in_base]]\nfix_id = "swa-admission-cap"\nreason = "upstream \\"#41282\\""\n\n',
                       "") == text  # only the entry is added


def test_offline_pr_and_bad_sources_refuse_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORGE_OFFLINE", "1")
    monkeypatch.setenv("KVFORGE_CACHE", str(tmp_path / "cache"))
    res = kvforge("pick", "https://github.com/vllm-project/vllm/pull/41282", "--dry-run", "--json")
    assert res.exit_code == 6 and json.loads(res.stdout)["error"].startswith("PR https://github.com/")
    res = kvforge("pick", "no-such-thing", "--dry-run")
    assert res.exit_code == 2 and "not a file, a PR number or URL" in res.stderr
    res = kvforge("pick", "--continue", "--abort")
    assert res.exit_code == 2 and "exclude each other" in res.stderr
    two = tmp_path / "two.patch"
    two.write_text(f"From {'1' * 40} Mon Sep 17 00:00:00 2001\n\nFrom {'2' * 40} Mon Sep 17 00:00:00 2001\n")
    res = kvforge("pick", str(two), "--dry-run")
    assert res.exit_code == 2 and "holds 2 patches" in res.stderr and "Traceback" not in res.output


# ---------------------------------------------------------------- fast: all or nothing, killed at every step

CRASH_SCRIPT = """
import base64, json, sys
from pathlib import Path
from kvforge.flow import pickwrite
spec = json.loads(Path(sys.argv[1]).read_text())
plan = pickwrite.Plan({d: {n: base64.b64decode(b) for n, b in f.items()} for d, f in spec["dirs"].items()},
                 {}, spec["targets"])
pickwrite.commit_all(Path(spec["root"]), plan, spec["digests"], lambda m: None)
"""


def _snapshot(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted((root / "patches").rglob("*")) + sorted((root / "targets").glob("*")):
        h.update(str(p.relative_to(root)).encode() + b"\0" + (p.read_bytes() if p.is_file() else b"d") + b"\0")
    return h.hexdigest()


@pytest.mark.parametrize("swap", ["exchange", "rename"])
def test_write_is_all_or_nothing_under_sigkill_at_every_step(tmp_path, swap):
    """Two real series directories and two real target files change in one step; a SIGKILL at any step
    leaves the old or the complete new state once the next pick has recovered."""
    root = tmp_path / "project"
    archive = subprocess.run(["git", "archive", "HEAD", "targets", "patches"], cwd=REPO_ROOT, check=True,
                             capture_output=True).stdout
    root.mkdir()
    subprocess.run(["tar", "x"], cwd=root, input=archive, check=True)
    new_patch = picksource.annotated(picksource.Change("x", DIFF, "[Core] Fix it (#41282)", "Why.", "U <u@s.io>", "Fri, 8 May 2026 "
                                           "12:00:00 +0000", "vllm", ["a" * 40],
                                           signoffs=["Signed-off-by: U <u@s.io>"]),  # upstream's DCO sign-off
                               "fix-it", ["t.py::test_a"],
                               "C <c@example.com>")
    dirs = {}
    for t in ("v0.20.1", "v0.20.2rc"):
        d = root / "patches" / t
        files = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
        files["0006-fix-it.patch"] = new_patch
        files["series"] += b"0006-fix-it.patch\n"
        dirs[str(d)] = {n: base64.b64encode(b).decode() for n, b in files.items()}
    targets = {str(root / "targets" / t): pickwrite._in_base_text((root / "targets" / t).read_text(), "vllm", "fix-it", "r")
               for t in ("main.toml", "v0.20.2rc.toml")}
    digests = {d: transaction.dir_digest(Path(d)) for d in dirs} | {t: transaction.file_digest(Path(t)) for t in targets}
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"root": str(root), "dirs": dirs, "targets": targets, "digests": digests}))
    old = _snapshot(root)
    env = {**os.environ, "KVFORGE_EXPORT_SWAP": swap}
    seen = {"old": [], "new": []}
    steps = [s for s in transaction.CRASH_STEPS if swap == "rename" or s != "swap-aside"]
    if swap == "rename":
        steps.append("swap-aside")
    for step in steps + [None]:
        run_env = {**env, "KVFORGE_CRASH_AT": f"pick:{step}"} if step else env
        res = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, str(spec)], env=run_env, capture_output=True,
                             text=True, cwd=tmp_path)
        assert res.returncode == (-9 if step else 0), (step, res.stderr[-2000:])
        pickwrite.recover(root, lambda m: None)
        leftovers = [p.name for p in (root / "patches").iterdir() if p.name.startswith(".")]
        assert not leftovers, (step, leftovers)
        now = _snapshot(root)
        state = "new" if all(transaction.dir_digest(Path(d)) != digests[d] for d in dirs) and \
            all(Path(t).read_text() == x for t, x in targets.items()) else "old"
        assert now == old if state == "old" else now != old, step
        seen[state].append(step)
        for d in dirs:
            assert not lint_directory(Path(d)), step
        if state == "new":  # back to the old state for the next kill
            subprocess.run(["tar", "x"], cwd=root, input=archive, check=True)
            for d in dirs:
                (Path(d) / "0006-fix-it.patch").unlink()
            assert _snapshot(root) == old
    # Before the journal: rolled back; from the journal on: rolled forward; the plain run writes.
    assert seen["old"] == ["locked", "staging", "staged", "committing"], seen
    assert None in seen["new"] and "committed" in seen["new"] and "done" in seen["new"]


def test_a_stopped_picks_write_finished_by_another_command_is_seen_written(tmp_path):
    """Any command that writes the project may finish an interrupted write (the transaction's one recovery): the
    stopped pick's state records what its write makes of each path, so the next pick sees it done."""
    d, f = tmp_path / "patches" / "t", tmp_path / "targets" / "t.toml"
    d.mkdir(parents=True)
    (d / "series").write_text("0001-x.patch\n")
    f.parent.mkdir()
    f.write_text('name = "t"\n')
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"fix_id": "x", "rows": []}))
    pickwrite._mark_writing(state, {str(d): transaction.dir_digest(d), str(f): transaction.file_digest(f)},
                            {"fix_id": "x"})
    data = json.loads(state.read_text())
    assert data["fix_id"] == "x" and pickwrite.written_by(data) == {"fix_id": "x"}
    f.write_text('name = "t"\n# mine\n')
    assert pickwrite.written_by(data) is None
    assert pickwrite.written_by({"fix_id": "x"}) is None


# ---------------------------------------------------------------- slow: real releases

SUBJECT_41282 = ("[Core] Apply the SWA admission cap only in the full-sequence admission gate (#41282)\n\n"
                 "In forward steps, get_num_blocks_to_allocate must return exactly what\nallocate_new_blocks will "
                 "pull; otherwise block_pool.get_new_blocks raises\nValueError: Cannot get N free blocks from the "
                 "pool.\n\nSigned-off-by: vLLM <noreply@vllm.ai>\n")
SUBJECT_FULL_SEQ = ("[Core] Check that the full sequence fits inside allocate_slots\n\n"
                    "KVCacheManager.can_fit_full_sequence becomes allocate_slots(full_sequence_must_fit=True).\n\n"
                    "Signed-off-by: vLLM <noreply@vllm.ai>\n")
CORE_PATHS = ("vllm/v1/core/", "tests/v1/core/")
GIT_ENV = {"GIT_AUTHOR_NAME": "vLLM", "GIT_AUTHOR_EMAIL": "noreply@vllm.ai", "GIT_COMMITTER_NAME": "vLLM",
           "GIT_COMMITTER_EMAIL": "noreply@vllm.ai", "GIT_AUTHOR_DATE": "2026-05-08T12:00:00+00:00",
           "GIT_COMMITTER_DATE": "2026-05-08T12:00:00+00:00"}


def _git(repo: Path, *args: str, data: bytes | None = None, env: dict | None = None) -> str:
    return subprocess.run(["git", *args], cwd=repo, env={**os.environ, **GIT_ENV, **(env or {})}, check=True,
                          capture_output=True, input=data).stdout.decode().strip()


def _core_files(sdist: Path) -> dict[str, bytes]:
    out = {}
    with tarfile.open(sdist) as tar:
        for m in tar:
            rel = m.name.split("/", 1)[1] if "/" in m.name else ""
            if m.isfile() and rel.startswith(CORE_PATHS):
                f = tar.extractfile(m)
                assert f is not None
                out[rel] = f.read()
    return out


def _commit(repo: Path, files: dict[str, bytes], parent: str | None, message: str) -> str:
    index = repo / ".git" / "kvforge-test-index"
    index.unlink(missing_ok=True)
    env = {"GIT_INDEX_FILE": str(index)}
    lines = []
    for rel, data in sorted(files.items()):
        lines.append(f"100644 blob {_git(repo, 'hash-object', '-w', '--stdin', data=data)}\t{rel}")
    _git(repo, "update-index", "--index-info", data=("\n".join(lines) + "\n").encode(), env=env)
    tree = _git(repo, "write-tree", env=env)
    return _git(repo, "commit-tree", tree, "-m", message, *(["-p", parent] if parent else []))


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    """The source repository (see the module docstring) and the sdists' paths."""
    user = Cache(default_cache_dir())
    sdists = {}
    for v, target in (("0.20.1", "v0.20.1"), ("0.20.2", "v0.20.2rc"), ("0.33.0", "main"), ("0.21.0", None)):
        comp = load_comp(target) if target else load_comp("v0.20.2rc")
        if target is None:  # 0.21.0 is no target's release: same package, its own file
            comp = replace(comp, release=Release("vllm", "0.21.0", None))
        sdists[v] = download_sdist(comp, user, print)
    repo = tmp_path_factory.mktemp("upstream") / "vllm"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    r1, r2, r3 = (_core_files(sdists[v]) for v in ("0.20.1", "0.20.2", "0.21.0"))
    a = _commit(repo, r1, None, "vllm 0.20.1: vllm/v1/core and tests/v1/core of the PyPI sdist")
    _git(repo, "tag", "v0.20.1", a)
    b = _commit(repo, r2, a, SUBJECT_41282)  # 0.20.1 -> 0.20.2 in these paths is #41282, nothing else
    _git(repo, "tag", "v0.20.2", b)
    mid = dict(r2)
    for rel in ("vllm/v1/core/kv_cache_manager.py", "tests/v1/core/test_prefix_caching.py"):
        mid[rel] = r3[rel]
    c = _commit(repo, mid, b, SUBJECT_FULL_SEQ)
    d = _commit(repo, r3, c, "vllm 0.21.0: the rest of vllm/v1/core and tests/v1/core")
    _git(repo, "tag", "v0.21.0", d)
    _git(repo, "update-ref", "refs/heads/main", d)
    return {"repo": repo, "admission_cap": b, "full_seq": c, "sdists": sdists}


def load_comp(target: str):
    return load_target(target, REPO_ROOT).component()


@pytest.fixture()
def picking(tmp_path, monkeypatch, session_cache, upstream):
    """The committed targets/ and patches/ in tmp_path (a git repository with the carrier's identity), the
    session cache with the three releases' sdists; the current directory is a work directory."""
    for v, f in upstream["sdists"].items():
        if not (session_cache.downloads / f.name).exists():
            (session_cache.downloads / f.name).symlink_to(f)
    root = tmp_path / "project"
    archive = subprocess.run(["git", "archive", "HEAD", "targets", "patches"], cwd=REPO_ROOT, check=True,
                             capture_output=True).stdout
    root.mkdir()
    subprocess.run(["tar", "x"], cwd=root, input=archive, check=True)
    _git(root, "init", "-q")
    _git(root, "config", "user.name", "Carrier")
    _git(root, "config", "user.email", "carrier@example.com")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "committed project")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("KVFORGE_ROOT", str(root))
    monkeypatch.setenv("KVFORGE_CACHE", str(session_cache.root))
    monkeypatch.setenv("KVFORGE_OFFLINE", "1")
    return root


def _rows(res) -> dict[str, dict]:
    return {r["target"]: r for r in json.loads(res.stdout)["rows"]}


def _changed(root: Path) -> list[str]:
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=root, check=True,
                         capture_output=True, text=True).stdout
    return out.splitlines()


@pytest.mark.slow
def test_pick_real_upstream_change_into_every_target(picking, upstream, tmp_path):
    root, src = picking, upstream["repo"]
    res = kvforge("pick", "--repo", str(src), "v0.20.2", "--fix-id", "swa-admission-cap", "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    assert _changed(root) == []  # --dry-run writes nothing
    res = kvforge("pick", "--repo", str(src), "v0.20.2", "--fix-id", "swa-admission-cap", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    rows = _rows(res)
    # The release sources: 0.20.1 lacks #41282, 0.20.2 and 0.33.0 have it.
    assert {t: r["verdict"] for t, r in rows.items()} == {"v0.20.1": "applies", "v0.20.2rc": "present",
                                                          "main": "present"}
    fired = {t: {s["name"] for s in r["signals"] if s["fired"]} for t, r in rows.items()}
    assert fired["v0.20.2rc"] == {"reverse-apply", "drop-when"} and "drop-when" in fired["main"]
    assert doc["upstream"]["first_release"] == "0.20.2"
    assert "| v0.20.1/vllm | applies |" in doc["markdown"]
    series = read_series(root / "patches" / "v0.20.1")
    new = series.patches[-1]
    assert new.name == "0006-swa-admission-cap.patch" and not series.all_problems()
    assert new.value("Upstream-Status") == f"Backport [https://github.com/vllm-project/vllm/pull/41282, " \
                                           f"{upstream['admission_cap'][:12]}]"
    assert new.value("Drop-When") == "version >= 0.20.2" and new.author == "vLLM <noreply@vllm.ai>"
    assert new.checks == ["tests/v1/core/test_single_type_kv_cache_manager.py::"
                          "test_predictor_matches_allocator_blocks_calculation_with_admission_cap"]
    assert new.values("Signed-off-by") == ["vLLM <noreply@vllm.ai>", "Carrier <carrier@example.com>"]
    for t in ("v0.20.2rc", "main"):
        comps = {c["name"]: c for c in tomllib.loads((root / "targets" / f"{t}.toml").read_text())["components"]}
        assert comps["vllm"]["in_base"][-1]["fix_id"] == "swa-admission-cap"
    assert sorted(line[3:] for line in _changed(root)) == [
        "patches/v0.20.1/0006-swa-admission-cap.patch", "patches/v0.20.1/series", "targets/main.toml",
        "targets/v0.20.2rc.toml"]
    assert kvforge("lint", "--no-audit").exit_code == 0
    # The picked change adds a parameter to three public methods: the audit flags it until its header says so.
    flagged = [p["message"] for p in json.loads(kvforge("lint", "-t", "v0.20.1", "--json").stdout)["problems"]]
    assert len(flagged) == 3 and all(m.startswith("patch 0006: signature of ") for m in flagged), flagged
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "picked")

    # Picked again: carried where the Fix-Id is carried, present where in_base says so; nothing added twice.
    res = kvforge("pick", "--repo", str(src), "v0.20.2", "--fix-id", "swa-admission-cap", "--json")
    assert res.exit_code == 0, res.output
    assert {t: r["verdict"] for t, r in _rows(res).items()} == {"v0.20.1": "carried", "v0.20.2rc": "present",
                                                                "main": "present"}
    assert json.loads(res.stdout)["status"] == "nothing to write" and _changed(root) == []
    # The same change as a format-patch file under another Fix-Id: the same patch-id is carried.
    mbox = tmp_path / "41282.patch"
    mbox.write_bytes(subprocess.run(["git", "format-patch", "-1", "--stdout", upstream["admission_cap"]], cwd=src,
                                    check=True, capture_output=True).stdout)
    res = kvforge("pick", str(mbox), "--target", "v0.20.1", "--fix-id", "admission-cap-again", "--json")
    assert res.exit_code == 0, res.output
    (row,) = _rows(res).values()
    assert row["verdict"] == "carried" and "0006-swa-admission-cap.patch" in row["detail"]
    assert _changed(root) == []


@pytest.mark.slow
def test_pick_conflict_left_in_a_tree_continue_writes_and_survives_kills(picking, upstream, tmp_path):
    root, src = picking, upstream["repo"]
    res = kvforge("pick", "--repo", str(src), "v0.21.0^", "--fix-id", "full-sequence-must-fit", "--json")
    assert res.exit_code == 3, res.output
    rows = _rows(res)
    # 0.21.0's manager change needs #41282's line on 0.20.1 (named from history); 0.20.2 takes it; 0.33.0 has it.
    assert {t: r["verdict"] for t, r in rows.items()} == {"v0.20.1": "needs prerequisite", "v0.20.2rc": "applies",
                                                          "main": "present"}
    assert rows["v0.20.1"]["prerequisites"][0].startswith(upstream["admission_cap"][:7])
    assert rows["v0.20.1"]["conflicts"] == ["vllm/v1/core/kv_cache_manager.py"]
    assert _changed(root) == []  # nothing written while a target is undecided
    tree = Path(rows["v0.20.1"]["tree"])
    assert tree.parent == tmp_path / "work"
    res = kvforge("pick", "--repo", str(src), "v0.20.2")
    assert res.exit_code == 2 and "in progress" in res.stderr
    res = kvforge("pick", "--continue")
    assert res.exit_code == 3 and "still conflict" in res.stderr and _changed(root) == []

    # The resolution: the pick's side of the conflict (can_fit_full_sequence goes).
    path = tree / "vllm/v1/core/kv_cache_manager.py"
    text = path.read_text()
    head, rest = text.split("<<<<<<< HEAD\n", 1)
    _ours, rest = rest.split("=======\n", 1)
    theirs, tail = rest.split(">>>>>>> ", 1)
    path.write_text(head + theirs + tail.split("\n", 1)[1])
    _git(tree, "add", "-A")
    env = {k: v for k, v in os.environ.items() if k != "KVFORGE_CRASH_AT"}
    cmd = [sys.executable, "-c", "from kvforge.cli import main; main()", "pick", "--continue"]
    # Killed before the commit point: the old state; the pick can still continue.
    killed = subprocess.run(cmd, env={**env, "KVFORGE_CRASH_AT": "pick:committing"}, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    # Killed after one of the two series directories was swapped in: the next run finishes the write.
    killed = subprocess.run(cmd, env={**env, "KVFORGE_CRASH_AT": "pick:swapped"}, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    res = subprocess.run(cmd + ["--json"], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert sorted(line[3:] for line in _changed(root)) == [
        "patches/v0.20.1/0006-full-sequence-must-fit.patch", "patches/v0.20.1/series",
        "patches/v0.20.2rc/0006-full-sequence-must-fit.patch", "patches/v0.20.2rc/series", "targets/main.toml"]
    assert not [p for p in (root / "patches").iterdir() if p.name.startswith(".")]
    for t in ("v0.20.1", "v0.20.2rc"):
        s = read_series(root / "patches" / t)
        assert not s.all_problems() and s.patches[-1].fix_id == "full-sequence-must-fit"
    resolved = (root / "patches/v0.20.1/0006-full-sequence-must-fit.patch").read_text()
    assert "can_fit_full_sequence" in resolved and "full_sequence_must_fit" in resolved
    assert kvforge("pick", "--continue").exit_code == 2  # nothing in progress any more


# Resolved at import, before fixtures point $KVFORGE_CACHE at a throw-away cache (as tests/test_verify_slow.py).
TEST_ENVS = Path(os.environ.get("KVFORGE_TEST_ENVS") or default_cache_dir() / "envs")


def _with_test_envs(session_cache, monkeypatch) -> None:
    """The verify runs use the user's built test environments (the session cache only links them)."""
    TEST_ENVS.mkdir(parents=True, exist_ok=True)
    if not (session_cache.root / "envs").exists():
        (session_cache.root / "envs").symlink_to(TEST_ENVS, target_is_directory=True)
    monkeypatch.delenv("KVFORGE_TEST_PYTHON", raising=False)


def _cut_cpu_selection(root: Path, target: str, module: str) -> None:
    """The target's (first component's) CPU selection cut to one module: the CI budget."""
    toml = root / "targets" / f"{target}.toml"
    text = toml.read_text()
    start = text.index("cpu = [")
    end = text.index("]\n", start) + 2
    toml.write_text(text[:start] + f'cpu = ["{module}"]\n' + text[end:])
    _git(root, "commit", "-qam", f"{target}: one test module")


@pytest.mark.slow
def test_pick_verify_proves_41282_where_it_applies_and_writes_the_series(picking, upstream, session_cache,
                                                                         monkeypatch):
    """#41282 onto every target with --verify: present on 0.20.2 and 0.33.0; on v0.20.1 (its whole series
    carried, the CPU selection cut to the picked test's module) the picked patch is proven: its test, a
    function #41282 adds to an existing module, runs on the tree before the pick with the pick's version of
    that module and fails there on an assertion (the predictor and the allocator disagree), then passes."""
    root = picking
    _with_test_envs(session_cache, monkeypatch)
    _cut_cpu_selection(root, "v0.20.1", "tests/v1/core/test_single_type_kv_cache_manager.py")
    res = kvforge("pick", "--repo", str(upstream["repo"]), "v0.20.2", "--fix-id", "swa-admission-cap", "--verify",
                  "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    rows = _rows(res)
    assert {t: (r["verdict"], r["proof"]) for t, r in rows.items()} == {
        "v0.20.1": ("applies", "proven"), "v0.20.2rc": ("present", "-"), "main": ("present", "-")}
    ev = rows["v0.20.1"]["evidence"]
    (check,) = ev["checks"]
    assert check["node"].endswith("::test_predictor_matches_allocator_blocks_calculation_with_admission_cap")
    assert (check["before"], check["before_how"], check["before_kind"], check["after"]) == (
        "failed", "from the patch", "behaviour", "passed")
    assert "predictor returned" in check["before_message"] and "but allocator pulled" in check["before_message"]
    assert ev["status"] == "proven" and ev["regression"]["ok"] and ev["regression"]["new_failures"] == 0
    assert "| v0.20.1/vllm | applies | proven |" in doc["markdown"]
    assert doc["status"] == "written"
    assert sorted(line[3:] for line in _changed(root)) == [
        "patches/v0.20.1/0006-swa-admission-cap.patch", "patches/v0.20.1/series", "targets/main.toml",
        "targets/v0.20.2rc.toml"]
    series = read_series(root / "patches" / "v0.20.1")
    assert series.patches[-1].fix_id == "swa-admission-cap" and not series.all_problems()
    assert series.patches[-1].checks == [check["node"]]


@pytest.mark.slow
def test_pick_verify_refuses_a_change_whose_test_fails_before_only_for_a_missing_api(picking, upstream,
                                                                                      session_cache, monkeypatch):
    """0.21.0's full-sequence change onto v0.20.2rc (the CPU selection cut to one module): its Checks, two
    tests it changes in tests/v1/core/test_prefix_caching.py, run before the pick with the pick's version of
    the module and fail there only because allocate_slots has no full_sequence_must_fit keyword yet (the
    API the change adds). That is not behaviour: the pick is not proven, exits 4 and writes nothing."""
    root = picking
    _with_test_envs(session_cache, monkeypatch)
    _cut_cpu_selection(root, "v0.20.2rc", "tests/v1/core/test_single_type_kv_cache_manager.py")
    res = kvforge("pick", "--repo", str(upstream["repo"]), "v0.21.0^", "--fix-id", "full-sequence-must-fit",
                  "--target", "v0.20.2rc", "--verify", "--json")
    assert res.exit_code == 4, res.output
    doc = json.loads(res.stdout)
    (row,) = _rows(res).values()
    assert row["verdict"] == "applies" and row["proof"].startswith("failed: ")
    assert "unproven" in row["proof"] and "behavioural reason" in row["proof"]
    ev = row["evidence"]
    assert ev["status"] == "unproven" and len(ev["checks"]) == 2
    for c in ev["checks"]:
        assert c["node"].startswith("tests/v1/core/test_prefix_caching.py::test_can_fit_full_sequence_")
        assert (c["before"], c["before_how"], c["before_kind"]) == ("failed", "from the patch", "absent-api")
        assert "unexpected keyword argument 'full_sequence_must_fit'" in c["before_message"]
    assert doc["status"] == "verify failed" and "not proven on v0.20.2rc/vllm" in doc["error"]
    assert _changed(root) == []  # nothing written


@pytest.mark.slow
def test_pick_after_places_the_patch_after_a_fix_and_reapplies_the_rest(picking, upstream, tmp_path):
    """--after FIX: #41282 goes right after v0.20.1's first fix; the four later patches are re-applied over
    it and re-exported, the series lists the pick in its place, and the written series applies for real."""
    root, src = picking, upstream["repo"]
    res = kvforge("pick", "--repo", str(src), "v0.20.2", "--fix-id", "swa-admission-cap", "--target", "v0.20.1",
                  "--after", "no-such-fix", "--json")
    assert res.exit_code == 2 and "--after no-such-fix: v0.20.1/vllm carries no patch with Fix-Id no-such-fix" \
        in json.loads(res.stdout)["error"] and _changed(root) == []
    old = read_series(root / "patches" / "v0.20.1")
    res = kvforge("pick", "--repo", str(src), "v0.20.2", "--fix-id", "swa-admission-cap", "--target", "v0.20.1",
                  "--after", "two-phase-kv-alloc", "--json")
    assert res.exit_code == 0, res.output
    (row,) = _rows(res).values()
    assert row["verdict"] == "applies" and row["position"] == 2 and "after 0001-two-phase-kv-alloc.patch" in row["detail"]
    new = read_series(root / "patches" / "v0.20.1")
    assert not new.all_problems() and kvforge("lint", "--no-audit").exit_code == 0
    # The picked change adds a parameter to three public methods: the audit flags it until its header says so.
    lint = kvforge("lint", "-t", "v0.20.1", "--json")
    flagged = [p["message"] for p in json.loads(lint.stdout)["problems"]]
    assert lint.exit_code == 1 and len(flagged) == 3 and all(
        m.startswith("patch 0006: signature of ") and "`apply_admission_cap` added" in m for m in flagged), flagged
    assert [p.name for p in new.patches] == [old.patches[0].name, "0006-swa-admission-cap.patch",
                                             *[p.name for p in old.patches[1:]]]
    assert [p.fix_id for p in new.patches[2:]] == [p.fix_id for p in old.patches[1:]]  # headers kept
    changed = sorted(line[3:] for line in _changed(root))
    assert "patches/v0.20.1/0006-swa-admission-cap.patch" in changed and "patches/v0.20.1/series" in changed
    tree = tmp_path / "tree"
    res = kvforge("apply", "-t", "v0.20.1", "--into", str(tree))
    assert res.exit_code == 0, res.output
    log = _git(tree, "log", "--format=%s", "kvforge/base/v0.20.1..kvforge/v0.20.1").splitlines()[::-1]
    assert len(log) == 6 and "(#41282)" in log[1]


def test_githubs_pr_answer_is_type_checked():
    """A PR answer that is not GitHub's (a list, a number where a string belongs) is exit 6 naming the URL and the
    field, never a traceback; null fields are kept as null."""
    from kvforge.core.errors import KvforgeError
    from kvforge.flow.picksource import _pr_meta

    url = "https://api.github.com/repos/vllm-project/vllm/pulls/1"
    assert _pr_meta(url, {"merged_at": None, "title": "t", "extra": 5}) == \
        {"merged_at": None, "merge_commit_sha": None, "title": "t", "body": None}
    for answer, said in (([1], "is not a JSON object"), ({"title": 7}, "has title of type int, not a string")):
        with pytest.raises(KvforgeError) as exc:
            _pr_meta(url, answer)
        assert exc.value.exit_code == 6 and str(exc.value) == f"{url}: GitHub's answer {said}"
