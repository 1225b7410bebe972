"""Every script in bench/ runs with its smallest settings, exits 0 and prints its table.

The scripts measure; nothing else runs them, and a script nobody runs rots (bench/apply_vs_git_am.py
did when v0.20.2rc got its second component). Here they only have to run: no time is judged.

Slow lane: they use the real releases (the sdists of vLLM 0.20.1, 0.20.2 and 0.33.0 and the 0.20.2
wheel, downloaded once into the user's kvforge cache and linked into this module's own cache) and,
for kv_event_shapes.py, the v0.20.2rc test environment ($KVFORGE_TEST_PYTHON when set, else built
once into ~/.cache/kvforge/envs or $KVFORGE_TEST_ENVS, as the other slow tests do).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvforge.git.bases import download_sdist
from kvforge.wheels.download import download_wheel
from kvforge.core.cache import Cache, default_cache_dir
from kvforge.project.targets import load_target

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH = REPO_ROOT / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))
TIMEOUT = 600


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Cache:
    """A cache of this module's own: the user cache's release files linked in, its environments shared."""
    user = Cache(default_cache_dir())
    files = [download_sdist(load_target(t, REPO_ROOT).component(), user, print)
             for t in ("v0.20.1", "v0.20.2rc", "main")]
    files.append(download_wheel(load_target("v0.20.2rc", REPO_ROOT).component(), user, print))
    cache = Cache(tmp_path_factory.mktemp("kvforge-bench-scripts-cache"))
    for f in files:
        (cache.downloads / f.name).symlink_to(f)
    if not os.environ.get("KVFORGE_TEST_PYTHON"):
        envs = Path(os.environ.get("KVFORGE_TEST_ENVS") or default_cache_dir() / "envs")
        envs.mkdir(parents=True, exist_ok=True)
        (cache.root / "envs").symlink_to(envs, target_is_directory=True)
    return cache


def environ(cache: Cache, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "KVFORGE_ROOT"}
    return {**env, "KVFORGE_CACHE": str(cache.root), **extra}


def run(cmd: list[str], env: dict[str, str], cwd: Path = REPO_ROOT) -> str:
    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert res.returncode == 0, f"{' '.join(cmd)}: exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    return res.stdout


def test_every_script_has_a_smoke_run():
    tested = {"apply_vs_git_am.py", "audit_speed.py", "build_vs_cp.py", "kv_event_shapes.py", "pick_vs_cherry_pick.py",
              "rebase_vs_git_rebase.py", "upstream_truth.py", "watch_all_releases.py"}
    assert set(SCRIPTS) == tested, "a new bench/ script needs its smoke run here"


def test_apply_vs_git_am(cache):
    out = run([sys.executable, str(BENCH / "apply_vs_git_am.py"), "--repeat", "1", "--cache-dir", str(cache.root)],
              environ(cache))
    assert re.search(r"^series\s+patches\s+\+/- lines\s+git init\+fetch\+am \(s\)", out, re.M), out
    assert re.search(r"^ours\s+5\s", out, re.M) and re.search(r"^forward\s+\d+\s", out, re.M), out


def test_audit_speed(cache):
    out = run([sys.executable, str(BENCH / "audit_speed.py"), "--repeat", "1", "--cache-dir", str(cache.root)],
              environ(cache))
    assert re.search(r"^largest series v0\.20\.\w+/vllm\S* \(5 patches, \d+ lines changed\): audit [\d.]+ s, "
                     r"git diff --stat [\d.]+ s \(goal < 2 s: (met|not met)\); median of 1$", out, re.M), out


def test_build_vs_cp(cache):
    out = run([sys.executable, str(BENCH / "build_vs_cp.py"), "--runs", "1"], environ(cache))
    assert re.search(r"^method\s+median s\s+x cp\s+runs$", out, re.M), out
    assert re.search(r"^cp\s+\d", out, re.M) and re.search(r"^kvforge overlay \(writing the wheel\)\s+\d", out, re.M)
    assert "overlay output identical in every run: True" in out, out


def test_rebase_vs_git_rebase(cache):
    out = run([sys.executable, str(BENCH / "rebase_vs_git_rebase.py"), "--repeat", "1", "--cache-dir",
               str(cache.root)], environ(cache))
    assert re.search(r"^series\s+patches\s+onto\s+verdicts\s+git rebase \(s\)", out, re.M), out
    assert re.search(r"^ours\s+\d+\s+0\.20\.2\s", out, re.M) and re.search(r"^forward\s+\d+\s+0\.33\.0\s", out, re.M)


def test_pick_vs_cherry_pick(cache):
    out = run([sys.executable, str(BENCH / "pick_vs_cherry_pick.py"), "--repeat", "1", "--cache-dir",
               str(cache.root)], environ(cache))
    assert re.search(r"^kvforge pick\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+applies\s+present\s+present$", out, re.M), out
    assert re.search(r"^git cherry-pick -x\s+[\d.]+\s", out, re.M) and "ratio kvforge/by hand" in out, out


def test_upstream_truth(cache):
    out = run([sys.executable, str(BENCH / "upstream_truth.py"), "--downloads", str(cache.downloads),
               "--release", "vllm==0.33.0"], environ(cache))
    assert re.search(r"^\| vllm \| 0\.33\.0 \| eagle-lookahead-block-hashes \| upstream \|", out, re.M), out


def test_upstream_truth_compares_a_watch_with_the_table(tmp_path):
    """--compare: a row that agrees is counted, a row against the table is 'wrong' and exits 1."""
    def watch(decision: str, behaviour: str | None) -> Path:
        row = {"fix_id": "kv-events-token-ids", "decision": decision, "behaviour": behaviour, "reason": ""}
        doc = {"releases": [{"version": "0.33.0", "checks": [{"component": "vllm", "target": "main",
                                                               "patches": [row]}]}]}
        path = tmp_path / f"{decision}.json"
        path.write_text(json.dumps(doc))
        return path

    script = [sys.executable, str(BENCH / "upstream_truth.py"), "--compare"]
    good = subprocess.run([*script, str(watch("port proven", "needed?"))], capture_output=True, text=True)
    assert good.returncode == 0 and "| 1 | agree: needed |" in good.stdout, good.stdout + good.stderr
    bad = subprocess.run([*script, str(watch("upstream (by behaviour)", "upstream (by behaviour)"))],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "wrong: main vllm/0.33.0/kv-events-token-ids" in bad.stdout, bad.stdout


def test_watch_all_releases(cache):
    """The small variant: releases after 0.32.0 (0.33.0) from real PyPI, the sdists linked from this module's cache."""
    out = run([sys.executable, str(BENCH / "watch_all_releases.py"), "--since", "0.32.0", "--downloads-from",
               str(cache.downloads)], environ(cache))
    assert re.search(r"^run\s+releases\s+rows\s+carried\s+upstream\s+conflict\s+disagree", out, re.M), out
    assert re.search(r"^kvforge watch, cold \(release files linked from .*\)\s+1\s+2\s", out, re.M), out
    assert re.search(r"^kvforge watch, warm \(downloads and bases cached\)\s+1\s+2\s", out, re.M), out
    assert re.search(r"^kvforge rebase --dry-run loop, warm \(one process per row\)\s+1\s+2\s", out, re.M), out
    assert re.search(r"^vllm 0\.33\.0\s+v0\.20\.2rc/vllm\s+4 upstream, 1 conflict\s+attention", out, re.M), out


def test_kv_event_shapes(cache, tmp_path):
    """As the README runs it: a patched v0.20.2rc tree (`kvforge apply`) and that target's environment
    (`kvforge env --json`: its python and HF home); one model, the script's smallest run."""
    kvforge = [sys.executable, "-m", "kvforge.cli"]
    tree = tmp_path / "vllm-v0.20.2rc"
    run([*kvforge, "apply", "-t", "v0.20.2rc", "--component", "vllm", "--into", str(tree)], environ(cache))
    env = json.loads(run([*kvforge, "env", "-t", "v0.20.2rc", "--json"], environ(cache)))
    out = run([env["python"], str(BENCH / "kv_event_shapes.py"), "--tree", str(tree), "--models", "dsv4"],
              environ(cache, HF_HOME=env["hf_home"], HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu"), cwd=tmp_path)
    assert re.search(r"^\| model \| shape\s+\| events \|", out, re.M), out
    for shape in ("base (unpatched)", "per-run (ours)", "offsets (#44488)"):
        assert re.search(rf"^\| dsv4\s+\| {re.escape(shape)}\s+\|", out, re.M), out
