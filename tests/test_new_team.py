"""A new team's path, as a user walks it: kvforge from a wheel of this checkout's files, `pip install`ed (not editable)
into a fresh venv; `kvforge init` in an empty directory (the team's repository), `target add 0.20.2`, `import` of
two plain `git diff` files that apply to vLLM 0.20.2, `git commit`; then the workflow init generated, run by
tests/test_workflow_run.py's runner: its plan job, the new target's build job and cpu job, each green.

The package index is a local one (file://, $KVFORGE_PYPI_URL) listing vllm 0.20.2's sdist and wheels with the
sha256 pins this project's v0.20.2rc carries; the test cache links the user cache's downloads (the sdist and
wheels, downloaded there once) and test environments, as the workflow's actions/cache step does for its jobs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from test_workflow_run import SHARED, Runner, matrix_of, yaml

from kvforge.core.cache import Cache
from kvforge.git.bases import ensure_base
from kvforge.project.targets import load_target

EDITS = {  # file name -> (path, old, new): each applies to vLLM 0.20.2 alone and after the other
    "queue-note.diff": ("vllm/v1/core/kv_cache_utils.py", "class FreeKVCacheBlockQueue:",
                        "class FreeKVCacheBlockQueue:  # team: the free list"),
    "pool-note.diff": ("vllm/v1/core/block_pool.py", "class BlockPool:", "class BlockPool:  # team: the block pool"),
}


def _sh(cmd: list[str], cwd: Path, env: dict, timeout: float = 1800) -> str:
    run = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, f"{cmd}: exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run.stdout


def _local_index(root: Path) -> Path:
    """PyPI's JSON API shape for vllm 0.20.2: the sdist and the two manylinux wheels, pinned as v0.20.2rc pins them."""
    (comp,) = [c for c in tomllib.loads((REPO_ROOT / "targets/v0.20.2rc.toml").read_text())["components"]
               if c["name"] == "vllm"]
    files = [{"filename": "vllm-0.20.2.tar.gz", "packagetype": "sdist", "url": "vllm-0.20.2.tar.gz",
              "digests": {"sha256": comp["release"]["sha256"]}}]
    files += [{"filename": w["filename"], "packagetype": "bdist_wheel", "url": w["filename"],
               "digests": {"sha256": w["sha256"]}} for w in comp["wheels"]]
    (root / "pypi" / "vllm").mkdir(parents=True)
    (root / "pypi" / "vllm" / "json").write_text(json.dumps({"releases": {"0.20.2": files}}))
    return root


def _plain_diffs(base_repo: Path, commit: str, work: Path, out: Path) -> None:
    """The team's patches: each edit as `git diff` prints it, on the files of vLLM 0.20.2."""
    work.mkdir()
    out.mkdir()
    git = lambda *a: subprocess.run(["git", *a], cwd=work, check=True, capture_output=True).stdout  # noqa: E731
    git("init", "-q")
    for name, (path, old, new) in EDITS.items():
        text = subprocess.run(["git", "--git-dir", str(base_repo), "show", f"{commit}:{path}"], check=True,
                              capture_output=True, text=True).stdout
        assert old in text, (path, old)
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).write_text(text)
        git("add", path)
        (work / path).write_text(text.replace(old, new, 1))
        (out / name).write_bytes(git("diff"))
        git("checkout", "-q", "--", path)


@pytest.mark.slow
def test_a_new_team_from_pip_install_to_a_green_cpu_job(tmp_path):
    seconds: dict[str, float] = {}
    t0 = time.monotonic()
    # 1. a wheel of this kvforge, pip-installed (not editable) into a fresh venv
    # (of a copy of the checkout's files: pip builds in the source tree, and a build/ left there would be in the
    # next wheel, stale modules included)
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO_ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for rel in filter(None, files):
        if rel.startswith(("targets/", "patches/")) or not (REPO_ROOT / rel).exists():
            continue
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        if (REPO_ROOT / rel).is_symlink():  # kvforge/data/docs -> docs: the link, as git has it
            (src / rel).symlink_to(os.readlink(REPO_ROOT / rel))
        else:
            shutil.copy2(REPO_ROOT / rel, src / rel)
    dist = tmp_path / "dist"
    _sh([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(src)], tmp_path,
        dict(os.environ))
    (wheel,) = dist.glob("kvforge-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVFORGE_", "VIRTUAL_ENV"))}
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    _sh(["python3", "-m", "pip", "install", "-q", str(wheel)], tmp_path, env)
    kv = str(venv / "bin" / "kvforge")
    site = _sh(["python3", "-c", "import kvforge; print(kvforge.__file__)"], tmp_path, env).strip()
    assert site.startswith(str(venv)), site
    assert _sh([kv, "help", "targets"], tmp_path, env) == (REPO_ROOT / "docs/targets.md").read_text()
    seconds["pip install"] = time.monotonic() - t0

    # 2. init in an empty directory, target add 0.20.2 (a local index, the user cache's downloads), import, commit
    t0 = time.monotonic()
    cache = tmp_path / "cache"
    cache.mkdir()
    for d in ("downloads", "envs"):
        (SHARED / d).mkdir(parents=True, exist_ok=True)
        (cache / d).symlink_to(SHARED / d, target_is_directory=True)
    env.update({"KVFORGE_CACHE": str(cache), "KVFORGE_PYPI_URL": _local_index(tmp_path / "index").as_uri()})
    team = tmp_path / "team"
    team.mkdir()
    doc = json.loads(_sh([kv, "init", "--json"], team, env))
    assert doc["project"] == str(team) and (team / ".github/workflows/kvforge.yml").is_file()
    for key, value in (("user.name", "Carrier"), ("user.email", "carrier@example.com")):
        _sh(["git", "config", key, value], team, env)
    seconds["init"] = time.monotonic() - t0

    t0 = time.monotonic()
    ta = json.loads(_sh([kv, "target", "add", "0.20.2", "--json"], team, env))
    assert ta["components"][0]["upstream_commit"] and len(ta["components"][0]["wheels"]) == 2, ta
    seconds["target add"] = time.monotonic() - t0

    t0 = time.monotonic()
    base = ensure_base(load_target("v0.20.2", team).component(), Cache(cache), "sdist")
    patches = tmp_path / "team-patches"
    _plain_diffs(base.repo, base.commit, tmp_path / "diffs", patches)
    offline = {**env, "KVFORGE_OFFLINE": "1"}
    imp = json.loads(_sh([kv, "import", "-t", "v0.20.2", str(patches), "--json"], team, offline))
    assert imp["written"] is True and [p["fix_id"] for p in imp["patches"]] == ["pool-note", "queue-note"], imp
    _sh([kv, "lint"], team, offline)
    _sh(["git", "add", "-A"], team, env)
    _sh(["git", "commit", "-qm", "vLLM 0.20.2 and our two patches"], team, env)
    assert _sh(["git", "status", "--porcelain"], team, env) == ""
    seconds["import + commit"] = time.monotonic() - t0

    # 3. the generated workflow: plan, then the new target's build job and cpu job
    wf = yaml().load((team / ".github/workflows/kvforge.yml").read_text())
    install = wf["env"]["KVFORGE_INSTALL"]
    assert install == doc["install"] == "python3 -m pip install ./ci/kvforge-0.1.0-py3-none-any.whl"
    (tmp_path / "runner").mkdir()
    runner = Runner(tmp_path / "runner", team)
    t0 = time.monotonic()
    plan = runner.run_job(wf, "plan", {}, {})
    assert plan["ok"], "\n".join(runner.log)
    seconds["plan job"] = time.monotonic() - t0
    (build,) = [j for j in matrix_of(plan["outputs"], "build") if j["id"] == "build-v0_20_2-vllm"]
    (cpu,) = [j for j in matrix_of(plan["outputs"], "cpu") if j["id"] == "cpu-v0_20_2-vllm"]
    assert build["setup"] == cpu["setup"] == install
    assert build["command"].startswith("kvforge build ") and "v0.20.2" in build["command"], build
    assert cpu["command"] == "kvforge verify --target v0.20.2", cpu
    t0 = time.monotonic()
    b = runner.run_job(wf, "build", build, {})
    assert b["ok"], "\n".join(runner.log)
    seconds["build job"] = time.monotonic() - t0
    wheels = [Path(f).name for f in runner.uploaded[build["artifact"]]]
    assert wheels and all(w.startswith("vllm-0.20.2+kvforge.v0.20.2.") and w.endswith(".whl") for w in wheels), wheels
    t0 = time.monotonic()
    c = runner.run_job(wf, "cpu", cpu, {})
    assert c["ok"], "\n".join(runner.log)
    seconds["cpu job"] = time.monotonic() - t0
    ran = [line for line in runner.log if line.startswith("cpu/")]
    assert ran[-1].startswith("cpu/${{ matrix.command }}: exit 0 "), ran  # verify exited 0
    assert runner.uploaded[f"junit-{cpu['id']}"]
    print("\n".join(runner.log))
    print("; ".join(f"{k} {v:.0f}s" for k, v in seconds.items()))
