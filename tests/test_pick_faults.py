"""`kvforge pick` under faults: real kills, a real full disk, a real read-only cache, corrupt state, bad input.

Every run is a real `kvforge` process on the committed targets (tests/test_pick.py's `picking` project and
upstream repository of the vLLM release sources). The change picked is made here: one line of vLLM 0.20.1's
kv_cache_coordinator.py that the first v0.20.1 patch also changes, so it applies to the base of v0.20.1 and
conflicts with its series (a tree of the user's is made at the conflict). Processes are found in /proc.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_pick import _changed, _git, picking, upstream  # noqa: F401  (fixtures)

KVFORGE = [sys.executable, "-c", "from kvforge.cli import main; main()"]
COORDINATOR = "vllm/v1/core/kv_cache_coordinator.py"
FIX = "iterate-copy"


def kv(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(KVFORGE + list(args), capture_output=True, text=True, env=env, timeout=600)


def one_line(res: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("kvforge: error")]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def _tweak(repo: Path) -> str:
    """A commit on v0.20.1: the managers are iterated over a copy (conflicts with v0.20.1's 0001)."""
    index = repo / ".git" / "kvforge-faults-index"
    env = {"GIT_INDEX_FILE": str(index)}
    _git(repo, "read-tree", "v0.20.1", env=env)
    text = _git(repo, "show", f"v0.20.1:{COORDINATOR}") + "\n"
    new = text.replace("for i, manager in enumerate(self.single_type_managers):",
                       "for i, manager in enumerate(list(self.single_type_managers)):")
    assert new != text
    blob = _git(repo, "hash-object", "-w", "--stdin", data=new.encode())
    _git(repo, "update-index", "--cacheinfo", f"100644,{blob},{COORDINATOR}", env=env)
    tree = _git(repo, "write-tree", env=env)
    index.unlink()
    return _git(repo, "commit-tree", tree, "-p", "v0.20.1", "-m",
                "[Core] Iterate over a copy of the managers\n\nSigned-off-by: vLLM <noreply@vllm.ai>")


def _pick(upstream: dict, *more: str) -> list[str]:
    return ["pick", "--repo", str(upstream["repo"]), _tweak(upstream["repo"]), "--fix-id", FIX, *more]


def _state(cache_root: Path) -> list[Path]:
    return sorted((cache_root / "pick").glob("*/state.json"))


def _git_processes(marker: str) -> list[str]:
    """Live git processes (not zombies) whose arguments or working directory name `marker`."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cwd = os.readlink(d / "cwd")
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == b"git" and state != "Z" and (
                marker in cwd or any(marker.encode() in a for a in argv)):
            found.append(f"{d.name}: {b' '.join(argv).decode(errors='replace')}")
    return found


def _wait_for_git(proc: subprocess.Popen, marker: str, words: tuple[bytes, ...], limit: float = 300) -> str:
    """Poll /proc until a git process of `proc`'s run whose arguments hold all of `words` runs; its command."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and proc.poll() is None:
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                argv = (d / "cmdline").read_bytes().split(b"\0")
                cwd = os.readlink(d / "cwd")
            except OSError:
                continue
            if argv and os.path.basename(argv[0]) == b"git" and all(w in argv for w in words) and (
                    marker in cwd or any(marker.encode() in a for a in argv)):
                return b" ".join(argv).decode(errors="replace")
        time.sleep(0.002)
    raise AssertionError(f"no git {words} seen; kvforge: {proc.poll()}")


@pytest.mark.slow
def test_sigterm_during_pick_ends_every_git_process_it_started(picking, upstream, session_cache):
    """Was: exit 143 and "its child processes were ended", while `git worktree add` and the `git reset --hard`
    it runs kept running (GitPython's call is not ended by an exception; git's own helpers are its children);
    and a SIGKILLed pick's scratch worktree stayed in the cache, registered, for good."""
    args = _pick(upstream, "--target", "v0.20.1", "--dry-run")
    assert kv(*args).returncode == 3  # the base and the stack are in the cache: the next run reaches git at once
    marker = str(session_cache.root)
    proc = subprocess.Popen(KVFORGE + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = _wait_for_git(proc, marker, (b"reset", b"--hard"))
    os.kill(proc.pid, signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "its child processes were ended" in err, (seen, err)
    assert _git_processes(marker) == [], seen
    assert _changed(picking) == [] and _state(session_cache.root) == []
    # SIGKILL (no cleanup can run) at the same moment, to kvforge and its git: the next pick removes the
    # dead run's scratch directory and prunes its worktree's registration.
    proc = subprocess.Popen(KVFORGE + args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    _wait_for_git(proc, marker, (b"reset", b"--hard"))
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -9
    work = session_cache.root / "trees" / ".work"
    assert list(work.glob(f".pick.{proc.pid}.*"))
    assert kv(*args).returncode == 3
    assert list(work.glob(".pick.*")) == []
    listing = _git(session_cache.root / "repos" / "vllm-sdist.git", "worktree", "list", "--porcelain").splitlines()
    assert not [ln for ln in listing if ln.startswith(("locked", "prunable"))], listing


@pytest.mark.slow
def test_a_stopped_pick_dry_runs_write_nothing_and_an_unusable_state_is_aborted(picking, upstream, session_cache):
    """Was: `--continue --dry-run` ran `git am --continue` in the user's tree (its HEAD moved) and `--abort
    --dry-run` deleted the state; a state of the wrong types was exit 70, a truncated one blocked even
    `--abort`, the way out its own message gave."""
    res = kv(*_pick(upstream, "--target", "v0.20.1"))
    assert res.returncode == 3, res.stderr
    (state,) = _state(session_cache.root)
    tree = Path.cwd() / f"vllm-v0.20.1-pick-{FIX}"
    path = tree / COORDINATOR
    text = path.read_text()
    head, rest = text.split("<<<<<<< HEAD\n", 1)
    _ours, rest = rest.split("=======\n", 1)
    theirs, tail = rest.split(">>>>>>> ", 1)
    path.write_text(head + theirs + tail.split("\n", 1)[1])
    _git(tree, "add", "-A")
    before = (_git(tree, "rev-parse", "HEAD"), _git(tree, "status", "--porcelain"), state.read_bytes())
    res = kv("pick", "--continue", "--dry-run")
    assert res.returncode == 0 and "git am --continue" in res.stderr, res.stderr
    res = kv("pick", "--abort", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert (_git(tree, "rev-parse", "HEAD"), _git(tree, "status", "--porcelain"), state.read_bytes()) == before
    assert (tree / ".git" / "rebase-apply").is_dir() and _changed(picking) == []

    good = state.read_bytes()
    data = json.loads(good)
    data["rows"][0]["tree"] = 5
    for bad in (json.dumps(data), good[: len(good) // 2].decode()):
        state.write_text(bad)
        res = kv("pick", "--continue")
        line = one_line(res)
        assert res.returncode == 2 and str(state) in line and "kvforge pick --abort" in line, line
        assert kv("pick", "--repo", str(upstream["repo"]), "v0.20.2", "--dry-run").returncode == 2
        res = kv("pick", "--abort")
        assert res.returncode == 0 and not state.exists(), res.stderr
        assert kv("pick", "--abort").returncode == 2  # nothing in progress any more
        state.parent.mkdir(parents=True, exist_ok=True)
    assert (tree / ".git").is_dir() and _changed(picking) == []  # the user's tree stays


@pytest.mark.slow
def test_after_refused_by_a_later_target_leaves_nothing(picking, upstream, session_cache):
    """Was: the tree made at v0.20.1's conflict stayed when main (which lacks the --after fix) refused."""
    res = kv(*_pick(upstream, "--target", "v0.20.1", "--target", "main", "--after", "eagle-lookahead-block-hashes"))
    line = one_line(res)
    assert res.returncode == 2 and "main/vllm carries no patch with Fix-Id eagle-lookahead-block-hashes" in line
    assert list(Path.cwd().iterdir()) == [] and _state(session_cache.root) == [] and _changed(picking) == []


@pytest.mark.slow
def test_bad_options_are_refused_before_anything(picking, upstream, session_cache):
    """Was: `--exclude v0.20.l` and `--fix-id ''` accepted (exit 0), a PR's unknown --component a KeyError
    (exit 70)."""
    cases = [(["--exclude", "v0.20.l"], "--exclude v0.20.l: no such target"), (["--fix-id", ""], "--fix-id ''")]
    for more, words in cases:
        res = kv("pick", "--repo", str(upstream["repo"]), "v0.20.2", "--dry-run", *more)
        assert res.returncode == 2 and words in one_line(res), res.stderr
    env = {**os.environ, "KVFORGE_OFFLINE": "0"}
    res = kv("pick", "41282", "--component", "vllm-foo", "--dry-run", env=env)
    assert res.returncode == 2 and "--component vllm-foo" in one_line(res), res.stderr
    assert list(Path.cwd().iterdir()) == [] and _state(session_cache.root) == [] and _changed(picking) == []


@pytest.mark.parametrize("how", ["a-file", "read-only"])
def test_an_unusable_cache_is_exit_5(tmp_path, monkeypatch, how):
    """Was: PermissionError / NotADirectoryError, exit 70."""
    root = Path(__file__).resolve().parent.parent
    cache = tmp_path / "cache"
    if how == "a-file":
        cache.write_text("")
    else:
        cache.mkdir()
        cache.chmod(0o555)
        if os.geteuid() == 0:  # root writes into a read-only directory; an immutable one refuses root too
            if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(cache)]).returncode != 0:
                pytest.skip("root writes into a read-only directory and chattr +i is not available")
    env = {**os.environ, "KVFORGE_ROOT": str(root), "KVFORGE_CACHE": str(cache), "KVFORGE_OFFLINE": "1"}
    try:
        res = kv("pick", "--repo", str(root), "HEAD", "--target", "v0.20.1", env=env)
    finally:
        if how == "read-only" and os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(cache)], check=True)
    line = one_line(res)
    assert res.returncode == 5 and f"cannot write the kvforge cache at {cache / 'pick'}" in line, res.stderr


@pytest.mark.slow
def test_a_full_disk_while_picking_is_exit_5_and_leaves_nothing(picking, upstream, session_cache):
    """A 64 KiB tmpfs, filled, over <cache>/trees/.work (a user and mount namespace: no root needed). Was:
    OSError 28, exit 70."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("no user and mount namespaces here (unshare -rm)")
    work = session_cache.root / "trees" / ".work"
    work.mkdir(parents=True, exist_ok=True)
    script = (f'mount -t tmpfs -o size=64k tmpfs "{work}" && head -c 1048576 /dev/zero > "{work}/fill"; '
              'exec "$@"')
    res = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *KVFORGE,
                          *_pick(upstream, "--target", "v0.20.1")], capture_output=True, text=True, timeout=600)
    line = one_line(res)
    assert res.returncode == 5 and "No space left on device" in line, res.stderr
    assert list(Path.cwd().iterdir()) == [] and _state(session_cache.root) == [] and _changed(picking) == []


@pytest.mark.slow
def test_a_sigkilled_apply_leaves_a_cache_the_next_apply_repairs(picking, session_cache):
    """`kvforge apply --into` killed with its git (SIGKILL to the process group) while `git worktree add` makes
    the stack's worktree (its "initializing" lock) and while git holds the worktree's index.lock; then apply
    again. Was: exit 5 "git checkout failed in <cache>/trees/.work/v0.20.1-vllm: remove the file manually to
    continue", and a locked worktree stayed registered."""
    repo = session_cache.root / "repos" / "vllm-sdist.git"
    wt = session_cache.root / "trees" / ".work" / "v0.20.1-vllm"
    dest = Path.cwd() / "tree"
    for moment in ("locked", "index.lock"):
        if repo.is_dir():  # the stack is built again, in a worktree made again
            refs = _git(repo, "for-each-ref", "--format=%(refname)", "refs/kvforge/stacks/v0.20.1/").split()
            _git(repo, "update-ref", "--stdin", data="".join(f"delete {r}\n" for r in refs).encode())
            if moment == "locked":
                subprocess.run(["git", "worktree", "remove", "--force", "--force", str(wt)], cwd=repo,
                               capture_output=True)
        proc = subprocess.Popen(KVFORGE + ["apply", "-t", "v0.20.1", "--into", str(dest)], start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while proc.poll() is None and not list(repo.glob(f"worktrees/{wt.name}*/{moment}")):
            assert time.monotonic() < deadline
            time.sleep(0.001)
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait() == -9, moment
    res = kv("apply", "-t", "v0.20.1", "--into", str(dest))
    assert res.returncode == 0, res.stderr
    listing = _git(repo, "worktree", "list", "--porcelain").splitlines()
    assert not [ln for ln in listing if ln.startswith(("locked", "prunable"))], listing
    assert len(_git(dest, "log", "--format=%s", "kvforge/base/v0.20.1..kvforge/v0.20.1").splitlines()) == 5

