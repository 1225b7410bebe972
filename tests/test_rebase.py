"""`kvforge rebase`: per-patch verdicts, the ledger, stops, --continue/--skip/--abort after real kills,
the one-step commit, and the two done-when cases on real vLLM releases.

Fast cases use the `fake` fixture (a tiny git upstream, tag v1; the tests add a tag v2). The real
cases rebase real series onto real PyPI sdists (imported once per session into the session cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import CORE, FILES, git

from kvforge.project import ledger
from kvforge.cli import main
from kvforge.project.series import read_series
from kvforge.project.transaction import CRASH_STEPS

REPO_ROOT = Path(__file__).resolve().parent.parent
SIGKILLED = -9
V0330_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"


def kvforge(*args: str):
    return CliRunner().invoke(main, list(args))


def run_kvforge(*args: str, crash_at: str | None = None, swap: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ}
    env.pop("KVFORGE_CRASH_AT", None)
    if crash_at:
        env["KVFORGE_CRASH_AT"] = crash_at
    if swap:
        env["KVFORGE_EXPORT_SWAP"] = swap
    return subprocess.run([sys.executable, "-c", "from kvforge.cli import main; main()", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under patches/ and targets/ (names included)."""
    out = {}
    for d in ("patches", "targets"):
        for p in sorted((root / d).rglob("*")):
            if p.is_file():
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# ---------------------------------------------------------------- the fake upstream and its v2

# v2 has the clamp fix (0001) and rewrites double (where 0003 conflicts).
V2_CORE = FILES[CORE].replace("return max(lo, x)", "return min(max(lo, x), hi)").replace("return 2 * x", "return x + x")


def tag_v2(fake, core: str = V2_CORE) -> str:
    (fake.upstream / CORE).write_text(core)
    git(fake.upstream, "commit", "-qam", "v2: clamp honours hi")
    git(fake.upstream, "tag", "v2")
    return git(fake.upstream, "rev-parse", "HEAD").strip()


def fake_series(fake, conflict: bool = False) -> None:
    """0001 clamp (in v2), 0002 a new helper (carried), [0003 edits the line v2 changed: conflicts]."""
    first = fake.patch("0001-clamp-hi", {CORE: ("return max(lo, x)", "return min(max(lo, x), hi)")},
                       kind="refactor")
    second = fake.patch("0002-triple", {CORE: ("def clamp", "def triple(x):\n    return 3 * x\n\n\ndef clamp")},
                        kind="refactor", start=first)
    names = ["0001-clamp-hi", "0002-triple"]
    if conflict:
        fake.patch("0003-clamp-lo", {CORE: ("return 2 * x", "return 2 * int(x)")}, kind="refactor", start=second)
        names.append("0003-clamp-lo")
    fake.series(*names)


def state_dir(fake) -> Path:
    return fake.cache / "rebase" / "fake-vllm"


def test_rebase_drops_upstream_carries_the_rest_and_writes_once(fake):
    fake_series(fake)
    new = tag_v2(fake)
    before = (fake.root / "targets" / "fake.toml").read_text()
    r = kvforge("rebase", "-t", "fake", "--onto", "v2", "--repo", str(fake.upstream), "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    verdicts = {p["name"]: p["verdict"] for p in data["patches"]}
    assert verdicts == {"0001-clamp-hi.patch": "upstream", "0002-triple.patch": "carried"}
    assert "reverse-apply" in data["patches"][0]["fired"]
    assert data["state"] == "done" and data["new_base"] == new
    series_dir = fake.root / "patches" / "fake"
    assert (series_dir / "series").read_text() == "0002-triple.patch\n"
    assert not (series_dir / "0001-clamp-hi.patch").exists()
    entries = ledger.load(series_dir)
    assert [(e.file, e.fix_id, e.decision, e.onto_ref) for e in entries] == [
        ("0001-clamp-hi.patch", "clamp-hi", "upstream", "v2")]
    assert any(s["name"] == "reverse-apply" and s["fired"] for s in entries[0].signals)
    after = (fake.root / "targets" / "fake.toml").read_text()
    assert after == before.replace('ref = "v1"', 'ref = "v2"')  # a text edit: everything else kept
    assert kvforge("lint").exit_code == 0
    assert not state_dir(fake).exists()
    status = kvforge("status", "--json")  # kvforge status shows the ledger
    assert status.exit_code == 0 and "clamp-hi" in status.stdout, status.output
    # The range-diff shows the dropped patch and the carried one.
    assert "clamp-hi" in data["range_diff"] and "triple" in data["range_diff"]


def test_dry_run_writes_nothing_and_shows_the_plan(fake):
    fake_series(fake, conflict=True)
    tag_v2(fake)
    before = snapshot(fake.root)
    r = kvforge("rebase", "-t", "fake", "--onto", "v2", "--repo", str(fake.upstream), "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["state"] == "planned"
    assert [p["verdict"] for p in data["patches"]] == ["upstream", "carried", "conflict"]
    assert snapshot(fake.root) == before
    assert not state_dir(fake).exists()


def test_killed_rebase_continues_through_a_conflict(fake):
    fake_series(fake, conflict=True)
    tag_v2(fake)
    before = snapshot(fake.root)
    args = ("rebase", "-t", "fake", "--onto", "v2", "--repo", str(fake.upstream))
    killed = run_kvforge(*args, crash_at="rebase:state-saved")  # after 0002 is applied and recorded
    assert killed.returncode == SIGKILLED, killed.stderr
    assert snapshot(fake.root) == before
    again = kvforge(*args)
    assert again.exit_code == 2 and "in progress" in again.stderr  # one rebase at a time
    stopped = kvforge("rebase", "-t", "fake", "--continue")
    assert stopped.exit_code == 3, stopped.output
    assert "0003-clamp-lo.patch" in stopped.stderr and "conflict" in stopped.stdout
    tree = fake.cache / "trees" / ".work" / "rebase-fake-vllm-vllm-git"
    text = (tree / CORE).read_text()
    assert "<<<<<<<" in text and ">>>>>>>" in text
    assert snapshot(fake.root) == before
    # Not resolved yet: --continue refuses and names the file.
    refused = kvforge("rebase", "-t", "fake", "--continue")
    assert refused.exit_code == 3 and CORE in refused.stderr
    resolved = V2_CORE.replace("return x + x", "return int(x) + int(x)")
    resolved = resolved.replace("def clamp", "def triple(x):\n    return 3 * x\n\n\ndef clamp")
    (tree / CORE).write_text(resolved)
    git(tree, "add", CORE)
    done = kvforge("rebase", "-t", "fake", "--continue", "--json")
    assert done.exit_code == 0, done.output
    data = json.loads(done.stdout)
    assert [p["verdict"] for p in data["patches"]] == ["upstream", "carried", "carried"]
    series_dir = fake.root / "patches" / "fake"
    assert (series_dir / "series").read_text() == "0002-triple.patch\n0003-clamp-lo.patch\n"
    assert "Fix-Id: clamp-lo" in (series_dir / "0003-clamp-lo.patch").read_text()
    assert 'ref = "v2"' in (fake.root / "targets" / "fake.toml").read_text()
    assert kvforge("lint").exit_code == 0
    assert not state_dir(fake).exists()


@pytest.mark.parametrize("crash_at", ["rebase:planned", "rebase:patch-applied"])
def test_abort_after_a_kill_restores_everything_byte_for_byte(fake, crash_at):
    fake_series(fake, conflict=True)
    tag_v2(fake)
    before = snapshot(fake.root)
    killed = run_kvforge("rebase", "-t", "fake", "--onto", "v2", "--repo", str(fake.upstream), crash_at=crash_at)
    assert killed.returncode == SIGKILLED, killed.stderr
    assert state_dir(fake).exists()
    aborted = kvforge("rebase", "-t", "fake", "--abort")
    assert aborted.exit_code == 0, aborted.output
    assert snapshot(fake.root) == before
    assert not state_dir(fake).exists()
    tree = fake.cache / "trees" / ".work" / "rebase-fake-vllm-vllm-git"
    assert not tree.exists() or not (tree / git(tree, "rev-parse", "--git-path", "rebase-apply").strip()).exists()
    assert kvforge("rebase", "-t", "fake", "--abort").exit_code == 2  # nothing left to abort


def test_abort_at_a_conflict_and_skip_records_the_user_drop(fake):
    fake_series(fake, conflict=True)
    tag_v2(fake)
    before = snapshot(fake.root)
    args = ("rebase", "-t", "fake", "--onto", "v2", "--repo", str(fake.upstream))
    assert kvforge(*args).exit_code == 3
    assert kvforge("rebase", "-t", "fake", "--abort").exit_code == 0
    assert snapshot(fake.root) == before
    assert kvforge(*args).exit_code == 3  # the same stop again
    skipped = kvforge("rebase", "-t", "fake", "--skip")
    assert skipped.exit_code == 0, skipped.output
    entries = ledger.load(fake.root / "patches" / "fake")
    assert [(e.fix_id, e.decision) for e in entries] == [("clamp-hi", "upstream"), ("clamp-lo", "skipped")]
    assert (fake.root / "patches" / "fake" / "series").read_text() == "0002-triple.patch\n"


def test_disagreeing_signals_stop_and_are_never_dropped(fake, monkeypatch):
    """decide() says "disagree" for 0001 (whose change v2 has): the rebase stops there, shows the
    signals, and drops it only when the user says --skip; --continue carries it."""
    from kvforge.flow import upstream

    fake.patch("0001-triple", {CORE: ("def clamp", "def triple(x):\n    return 3 * x\n\n\ndef clamp")},
               kind="refactor")
    fake.series("0001-triple")
    tag_v2(fake)
    monkeypatch.setattr(upstream, "decide", lambda signals: ("disagree", "test: strong signals disagree"))
    before = snapshot(fake.root)
    r = kvforge("rebase", "-t", "fake", "--onto", "v2", "--repo", str(fake.upstream), "--json")
    assert r.exit_code == 3
    data = json.loads(r.stdout)
    assert data["state"] == "stopped" and data["stop_kind"] == "disagree"
    assert data["patches"][0]["verdict"] == "disagree" and data["patches"][0]["signals"]
    assert snapshot(fake.root) == before  # not dropped, nothing written
    r = kvforge("rebase", "-t", "fake", "--continue", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["patches"][0]["verdict"] == "carried"
    assert (fake.root / "patches" / "fake" / "series").read_text() == "0001-triple.patch\n"
    assert ledger.load(fake.root / "patches" / "fake") == []


def test_kill_inside_the_commit_step_is_finished_by_the_next_run(fake):
    fake_series(fake)
    tag_v2(fake)
    args = ("rebase", "-t", "fake", "--onto", "v2", "--repo", str(fake.upstream))
    killed = run_kvforge(*args, crash_at="rebase:swapped")  # the series swapped in, the target not yet
    assert killed.returncode == SIGKILLED
    # The series is the new one, the target not yet: --abort is refused, --continue finishes it.
    assert (fake.root / "patches" / "fake" / "series").read_text() == "0002-triple.patch\n"
    assert 'ref = "v1"' in (fake.root / "targets" / "fake.toml").read_text()
    refused = kvforge("rebase", "-t", "fake", "--abort")
    assert refused.exit_code == 2 and "--continue" in refused.stderr
    done = kvforge("rebase", "-t", "fake", "--continue")
    assert done.exit_code == 0, done.output
    assert 'ref = "v2"' in (fake.root / "targets" / "fake.toml").read_text()
    assert len(ledger.load(fake.root / "patches" / "fake")) == 1
    assert not state_dir(fake).exists()
    assert not [p for p in (fake.root / "patches").iterdir() if p.name.startswith(".")]


def files_of(d: Path) -> dict[str, bytes] | None:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())} if d.is_dir() else None


# The commit step replaces patches/<target> and targets/<target>.toml in one transaction of the project, as export
# does: a SIGKILL at each of its steps (both swaps) leaves the old or the complete new series, and the next run
# finishes it.
@pytest.mark.parametrize("step,swap", [(step, swap) for swap in ("exchange", "rename") for step in CRASH_STEPS
                                       if not (swap == "exchange" and step == "swap-aside")])
def test_sigkill_in_the_commit_at_every_seriesdir_step(fake, step, swap):
    fake_series(fake)
    tag_v2(fake)
    d = fake.root / "patches" / "fake"
    old = files_of(d)
    killed = run_kvforge("rebase", "-t", "fake", "--onto", "v2", "--repo", str(fake.upstream),
                         crash_at=f"rebase:{step}", swap=swap)
    assert killed.returncode == SIGKILLED, killed.stderr

    def is_new(files: dict[str, bytes] | None) -> bool:
        return (files is not None and sorted(files) == ["0002-triple.patch", "dropped.toml", "series"]
                and files["series"] == b"0002-triple.patch\n")

    after = files_of(d)
    if step == "swap-aside":  # the fallback's one window: both complete versions beside the missing directory
        assert after is None
        assert files_of(d.parent / ".fake.kvforge-old") == old and is_new(files_of(d.parent / ".fake.kvforge-new"))
    elif CRASH_STEPS.index(step) < CRASH_STEPS.index("swapped"):
        assert after == old, step
    else:
        assert is_new(after), step
    ref = "v1" if CRASH_STEPS.index(step) < CRASH_STEPS.index("written") else "v2"  # the target: after the series
    assert f'ref = "{ref}"' in (fake.root / "targets" / "fake.toml").read_text()
    done = kvforge("rebase", "-t", "fake", "--continue")
    assert done.exit_code == 0, done.output
    assert is_new(files_of(d)) and 'ref = "v2"' in (fake.root / "targets" / "fake.toml").read_text()
    assert [(e.file, e.decision) for e in ledger.load(d)] == [("0001-clamp-hi.patch", "upstream")]
    assert not state_dir(fake).exists()
    assert not [p for p in (fake.root / "patches").iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("forge", ["verdict", "position-type", "position-range", "missing-key", "unknown-key",
                                   "signal", "stop-kind"])
def test_a_malformed_or_forged_state_is_one_line_exit_2(fake, forge):
    fake_series(fake, conflict=True)
    tag_v2(fake)
    assert kvforge("rebase", "-t", "fake", "--onto", "v2", "--repo", str(fake.upstream)).exit_code == 3
    path = state_dir(fake) / "state.json"
    good = json.loads(path.read_text())
    data = json.loads(path.read_text())
    if forge == "verdict":
        data["steps"][0]["verdict"] = "maybe"
    elif forge == "position-type":
        data["position"] = "2"
    elif forge == "position-range":
        data["position"] = 7
    elif forge == "missing-key":
        del data["plan"]["repo"]
    elif forge == "unknown-key":
        data["plan"]["extra"] = 1
    elif forge == "signal":
        data["steps"][1]["signals"][0] = {"fired": True}
    else:
        data["stopped"]["kind"] = "boom"
    path.write_text(json.dumps(data))
    for action in ("--continue", "--skip"):
        r = kvforge("rebase", "-t", "fake", action)
        assert r.exit_code == 2, r.output
        assert "malformed rebase state" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    path.write_text(json.dumps(good))
    assert kvforge("rebase", "-t", "fake", "--skip").exit_code == 0  # the good state still works


def test_as_new_target_leaves_the_old_one_untouched(fake):
    fake_series(fake)
    tag_v2(fake)
    before = snapshot(fake.root)
    r = kvforge("rebase", "-t", "fake", "--onto", "v2", "--repo", str(fake.upstream), "--as", "fake2")
    assert r.exit_code == 0, r.output
    after = snapshot(fake.root)
    assert {k: v for k, v in after.items() if "fake2" not in k} == before
    text = (fake.root / "targets" / "fake2.toml").read_text()
    assert 'name = "fake2"' in text and 'series = "patches/fake2"' in text and 'ref = "v2"' in text
    assert (fake.root / "patches" / "fake2" / "series").read_text() == "0002-triple.patch\n"
    assert kvforge("lint").exit_code == 0
    refused = kvforge("rebase", "-t", "fake", "--onto", "v2", "--repo", str(fake.upstream), "--as", "fake2")
    assert refused.exit_code == 2 and "exists" in refused.output


def test_retarget_text_keeps_comments_and_moves_release():
    from kvforge.flow.rebase.retarget import retarget_text

    text = (REPO_ROOT / "targets" / "v0.20.2rc.toml").read_text()
    out = retarget_text(text, 0, ref="v0.21.0", version="0.21.0", sha256="a" * 64, wheel=None, old_version="0.20.2",
                        name="v0.21", series="patches/v0.21")
    assert 'ref = "v0.21.0"' in out and 'version = "0.21.0"' in out and f'sha256 = "{"a" * 64}"' in out
    vllm_part = out.split("[[components]]")[1]
    assert "[components.wheel]" not in out and "manylinux" not in vllm_part  # the old release's pins are gone
    assert out.count("vllm_ascend-0.20.2rc1-") == text.count("vllm_ascend-0.20.2rc1-")  # vllm-ascend's stay
    assert 'name = "v0.21"' in out and 'series = "patches/v0.21"' in out
    kept = [ln for ln in text.splitlines() if ln.lstrip().startswith("#") and "wheel" not in ln.lower()]
    assert kept and all(ln in out.splitlines() for ln in kept)
    out2 = retarget_text(text, 0, ref="v0.21.0", version="0.21.0", sha256="b" * 64,
                         wheel=("vllm-0.21.0-cp38-abi3-manylinux_2_35_x86_64.whl", "c" * 64), old_version="0.20.2")
    assert 'filename = "vllm-0.21.0-cp38-abi3-manylinux_2_35_x86_64.whl"' in out2 and "c" * 64 in out2
    assert "vllm-0.20.2-" not in out2 and out2.count("[[components.wheels]]") == text.count("[[components.wheels]]") - 1


# ---------------------------------------------------------------- real vLLM releases


def _sdist(session_cache, version: str) -> None:
    """Put the real vllm sdist into the session cache (from the user's cache; downloaded there once)."""
    from kvforge.git.bases import download_sdist
    from kvforge.core.cache import Cache, default_cache_dir
    from kvforge.project.targets import Release

    name = f"vllm-{version}.tar.gz"
    dst = session_cache.downloads / name
    if dst.is_file():
        return
    user = Cache(default_cache_dir())
    if not (user.downloads / name).is_file():
        class Wanted:  # what download_sdist reads of a component
            release = Release("vllm", version)
        download_sdist(Wanted, user, print)
    shutil.copy2(user.downloads / name, dst)


@pytest.fixture()
def real_project(tmp_path, monkeypatch, session_cache):
    """A copy of this project's targets/ and patches/ as they are now (the working tree), in tmp_path:
    the project itself is never written."""
    for version in ("0.20.1", "0.33.0"):
        _sdist(session_cache, version)  # before KVFORGE_CACHE names the session cache
    root = tmp_path / "project"
    for d in ("targets", "patches"):
        shutil.copytree(REPO_ROOT / d, root / d)
    monkeypatch.setenv("KVFORGE_ROOT", str(root))
    monkeypatch.setenv("KVFORGE_CACHE", str(session_cache.root))
    monkeypatch.setenv("KVFORGE_OFFLINE", "1")
    monkeypatch.delenv("KVFORGE_VLLM_REPO", raising=False)
    return root


def _patched_tree(cache, target: str) -> str:
    from kvforge.git.context import Context
    from kvforge.git.trees import open_stack

    ctx = Context.load(cache, target, source="sdist")
    stack = open_stack(ctx)
    return subprocess.run(["git", "rev-parse", f"{stack.commits[-1]}^{{tree}}"], cwd=stack.base.repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_v0201_rebased_onto_0202_is_the_v0202rc_series(real_project, session_cache, base_v0202):
    """Done-when: rebase --target v0.20.1 --onto 0.20.2 --as scratch gives the tree of v0.20.2rc's series
    (both computed here, from the series as they are now)."""
    r = kvforge("rebase", "-t", "v0.20.1", "--onto", "0.20.2", "--as", "scratch", "--source", "sdist", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    names = [p.name for p in read_series(real_project / "patches" / "v0.20.1").patches]
    assert [p["verdict"] for p in data["patches"]] == ["carried"] * len(names)
    assert data["sha256"] == "58809377798c5335c6e2fe30092abda54d9200b5b8a717b3735a63f5daa0e383"
    _cache, base = base_v0202
    assert data["new_base"] == base.commit
    rebased = subprocess.run(["git", "rev-parse", f"{data['patches'][-1]['commit']}^{{tree}}"], cwd=base.repo,
                             check=True, capture_output=True, text=True).stdout.strip()
    assert rebased == _patched_tree(session_cache, "v0.20.2rc")
    written = real_project / "patches" / "scratch"
    assert (written / "series").read_text().split() == [p["name"] for p in data["patches"]]
    assert (real_project / "targets" / "v0.20.1.toml").read_bytes() == \
        (REPO_ROOT / "targets" / "v0.20.1.toml").read_bytes()
    assert kvforge("lint", "-t", "scratch").exit_code == 0


def test_real_upstream_commits_are_all_found_upstream(real_project, session_cache, base_v0202, tmp_path):
    """Done-when: the 15 vllm/v1/core changes from v0.20.2 to 0.33.0, as a v0.20.2 series, rebased onto
    0.33.0: every one is dropped as upstream, none carried."""
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    try:
        from apply_vs_git_am import forward_series
    finally:
        sys.path.remove(str(REPO_ROOT / "bench"))
    from kvforge.git.bases import ensure_base
    from kvforge.project.targets import Release, load_target

    cache, base = base_v0202
    comp = load_target("v0.20.2rc").component()
    snap = ensure_base(replace(comp, ref="v0.33.0", wheels=(), release=Release("vllm", "0.33.0", V0330_SHA256)),
                       cache, "sdist")
    out = tmp_path / "fwd"
    out.mkdir()
    patches = forward_series(base.repo, base.commit, snap.commit, out)
    assert len(patches) == 15
    d = real_project / "patches" / "fwd"
    d.mkdir()
    for p in patches:
        shutil.copy2(p, d / p.name)
    (d / "series").write_text("".join(p.name + "\n" for p in patches))
    src = (real_project / "targets" / "v0.20.2rc.toml").read_text()
    (real_project / "targets" / "fwd.toml").write_text(
        src.replace('name = "v0.20.2rc"', 'name = "fwd"').replace("patches/v0.20.2rc", "patches/fwd"))
    r = kvforge("rebase", "-t", "fwd", "--onto", "0.33.0", "--source", "sdist", "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert [p["verdict"] for p in data["patches"]] == ["upstream"] * 15, \
        [(p["name"], p["verdict"], p["reason"]) for p in data["patches"]]
    assert all("reverse-apply" in p["fired"] for p in data["patches"])  # not on Drop-When alone
    assert data["range_diff"].count(" < -:  ------- ") == 15


def test_results_are_outcomes():
    from kvforge.core.outcome import Outcome
    from kvforge.flow.rebase.result import Aborted, RebaseResult
    from kvforge.flow.rebase.state import Step, Verdict

    a = Aborted("t", "rebase of t/vllm aborted: patches/ and targets/ are as they were")
    assert isinstance(a, Outcome) and a.exit_code == 0 and a.error is None and a.render() == a.message
    assert a.to_json() == {"target": "t", "state": "aborted", "message": a.message}
    r = RebaseResult("t", "vllm", "t", None, "v2", "a" * 40, "b" * 40, None, "git", "stopped",
                     [Step("0001-p.patch", "p", Verdict.CONFLICT)], message="0001-p.patch does not apply")
    assert isinstance(r, Outcome) and r.exit_code == 3 and r.error == r.message
    data = json.loads(json.dumps(r.to_json()))
    assert data["error"] == r.message and data["exit"] == 3 and data["patches"][0]["verdict"] == "conflict"
    assert "stopped: t -> t onto v2" in r.render()
    r.state = "done"
    assert r.exit_code == 0 and r.error is None and "error" not in r.to_json()
