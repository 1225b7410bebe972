"""`kvforge init DIR`: another team's patch repository, run by the installed kvforge (kvforge/ci/scaffold.py).

Fast tests: what init writes (a git repository with one commit; CI files that pass actionlint and the
schemas, with the generated matrix inlined and every job installing kvforge from $KVFORGE_INSTALL), its
refusals (nothing written) and a SIGKILL before the final rename (nothing but a hidden directory, swept by the
next init). Slow test: kvforge pip-installed (not editable) into a fresh venv from a copy of this checkout;
then, outside this checkout, `kvforge init --release 0.20.2` (the real PyPI sha256), `lint`, `apply`, `pick`
of a real upstream change (0.21.0's full-sequence admission gate, made from the 0.20.2 and 0.21.0 sdists as
tests/test_pick.py makes it) and `verify` of the picked patch.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvforge.ci import scaffold
from kvforge.cli import main

REPO_ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def kvforge(*args: str):
    return CliRunner().invoke(main, list(args))


def tool(name: str) -> str:
    return str(BIN / name) if (BIN / name).exists() else name


def yaml():
    from ruamel.yaml import YAML  # check-jsonschema's dependency (the [test] extra)

    y = YAML()
    y.width = 4096
    return y


@pytest.fixture()
def here(tmp_path, monkeypatch):
    """An empty work directory outside any project; no $KVFORGE_ROOT."""
    monkeypatch.delenv("KVFORGE_ROOT", raising=False)
    monkeypatch.setenv("KVFORGE_CACHE", str(tmp_path / "cache"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


def test_the_ci_templates_are_this_projects_own_ci_files():
    """kvforge/data/init holds this project's CI files (the wheel has no ci/); ci/github/kvforge.yml and
    ci/buildkite/pipeline.yml are links to them, so there is one copy to edit."""
    for link, data in (("ci/github/kvforge.yml", "github-kvforge.yml"), ("ci/buildkite/pipeline.yml",
                                                                        "buildkite-pipeline.yml")):
        assert (REPO_ROOT / link).is_symlink() and (REPO_ROOT / link).resolve() == (scaffold.DATA / data).resolve()


def test_the_watch_template_is_this_projects_watch_workflow():
    """kvforge/data/init's watch workflow is ci/github/kvforge-watch.yml, byte for byte (init rewrites only its
    install step)."""
    assert (scaffold.DATA / "github-kvforge-watch.yml").read_bytes() == \
        (REPO_ROOT / "ci/github/kvforge-watch.yml").read_bytes()


def test_init_writes_a_committed_project_that_kvforge_finds(here):
    res = kvforge("init", "team", "--install", "kvforge @ git+https://example.org/org/kvforge@v0.1.0", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    team = here / "team"
    assert doc["files"] == [".buildkite/pipeline.yml", ".github/workflows/kvforge-watch.yml",
                            ".github/workflows/kvforge.yml", ".gitignore", "README.md", "patches/.gitkeep",
                            "targets/.gitkeep"]
    install = "python3 -m pip install 'kvforge @ git+https://example.org/org/kvforge@v0.1.0'"
    assert doc["install"] == install and doc["target"] is None
    git = lambda *a: subprocess.run(["git", *a], cwd=team, check=True, capture_output=True, text=True).stdout  # noqa
    assert git("rev-parse", "HEAD").strip() == doc["commit"] and git("status", "--porcelain") == ""
    assert git("ls-files").split() == doc["files"]
    assert len(git("log", "--format=%H").split()) == 1
    readme = (team / "README.md").read_text()
    assert install in readme and "kvforge matrix --kind cpu --format commands | sh -ex" in readme
    assert "@@" not in readme
    os.chdir(team)  # discovery: the current directory
    for args in (("lint",), ("targets",), ("status",), ("matrix",)):
        r = kvforge(*args)
        assert r.exit_code == 0, (args, r.output)
    assert not [p for p in here.iterdir() if p.name != "team"]  # nothing else was made


def test_generated_ci_passes_actionlint_and_schemas_with_the_matrix_inlined(here, tmp_path, session_cache):
    """The project's own matrix (one target, written as --release writes it, pinned offline from the cache),
    generated as the workflow's plan step does with $KVFORGE_INSTALL set, inlined into the workflow."""
    cache = Path(os.environ["KVFORGE_CACHE"])
    (cache / "downloads").mkdir(parents=True)
    sdist = session_cache.downloads / "vllm-0.20.2.tar.gz"  # the real sdist (conftest downloads it once)
    (cache / "downloads" / sdist.name).symlink_to(sdist)
    env = {**os.environ, "KVFORGE_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-m", "kvforge.cli", "init", "team", "--release", "0.20.2", "--json",
                          "--install", "kvforge==0.1.0"], cwd=here, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    team = here / "team"
    assert json.loads(run.stdout)["pins"]["vllm"]["sha256"] == \
        "58809377798c5335c6e2fe30092abda54d9200b5b8a717b3735a63f5daa0e383"  # = this project's v0.20.2rc pin
    wf_path = team / ".github/workflows/kvforge.yml"
    y = yaml()
    wf = y.load(wf_path.read_text())
    install = wf["env"]["KVFORGE_INSTALL"]
    assert install == "python3 -m pip install kvforge==0.1.0"
    assert wf["jobs"]["plan"]["steps"][2]["run"] == "${{ env.KVFORGE_INSTALL }}"
    # the plan step's script, as the runner would run it
    plan = next(s for s in wf["jobs"]["plan"]["steps"] if s.get("id") == "matrix")
    out = tmp_path / "github_output"
    script = plan["run"]
    r = subprocess.run(["bash", "-e", "-c", script], cwd=team, capture_output=True, text=True,
                       env={**env, "PATH": f"{BIN}:{os.environ['PATH']}", "GITHUB_OUTPUT": str(out),
                            "KVFORGE_INSTALL": install, "BASE_REF": "", "CUDA_RUNS_ON": "", "NPU_RUNS_ON": ""})
    assert r.returncode == 0, r.stderr
    outputs = dict(line.split("=", 1) for line in out.read_text().splitlines())
    cpu = json.loads(outputs["cpu"])["include"]
    assert [j["command"] for j in cpu] == ["kvforge verify --target v0.20.2"]
    assert cpu[0]["setup"] == install  # every job installs kvforge as the workflow says, not from a checkout
    for kind in ("build", "cpu", "cuda", "npu"):
        m = json.loads(outputs[kind])
        if m["include"]:
            wf["jobs"][kind]["strategy"]["matrix"] = m
    inlined = tmp_path / "kvforge.yml"
    buf = io.StringIO()
    y.dump(wf, buf)
    inlined.write_text(buf.getvalue())
    for path in (wf_path, inlined):
        subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(path)],
                       check=True, capture_output=True)
        res = subprocess.run([tool("actionlint"), "-no-color", str(path)], capture_output=True, text=True)
        assert res.returncode == 0, res.stdout + res.stderr
    bk = team / ".buildkite/pipeline.yml"
    res = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.buildkite", str(bk)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    doc = y.load(bk.read_text())
    assert doc["env"]["KVFORGE_INSTALL"] == install and doc["steps"][0]["commands"][0] == 'eval "$$KVFORGE_INSTALL"'
    # the first step's commands (Buildkite turns $$ into $), up to the upload
    for cmd in doc["steps"][0]["commands"][1:3]:
        cmd = cmd.replace("$$", "$")
        r = subprocess.run(["bash", "-e", "-c", cmd], cwd=team, capture_output=True, text=True,
                           env={**env, "PATH": f"{BIN}:{os.environ['PATH']}", "KVFORGE_INSTALL": install})
        assert r.returncode == 0, (cmd, r.stderr)
    pipeline = yaml().load((team / ".kvforge-pipeline.yml").read_text())
    step = next(st for st in pipeline["steps"] if st["key"] == "cpu-v0_20_2-vllm")
    assert step["commands"] == [install, "kvforge verify --target v0.20.2"]
    # .gitignore covers what those commands wrote
    assert subprocess.run(["git", "status", "--porcelain"], cwd=team, capture_output=True, text=True).stdout == ""
    target = tomllib.loads((team / "targets/v0.20.2.toml").read_text())
    assert target["components"][0]["release"]["version"] == "0.20.2"


@pytest.mark.parametrize("setup,message", [
    (lambda d: (d.mkdir(), (d / "mine.txt").write_text("mine")), "not empty"),
    (lambda d: d.write_text("a file"), "exists and is not a directory"),
])
def test_init_refuses_a_used_destination_writing_nothing(here, setup, message):
    dest = here / "dest"
    setup(dest)
    before = sorted(p.name for p in here.iterdir())
    res = kvforge("init", "dest", "--json")
    assert res.exit_code == 2
    assert message in json.loads(res.stdout)["error"] and "\n" not in json.loads(res.stdout)["error"]
    assert sorted(p.name for p in here.iterdir()) == before
    if dest.is_dir():
        assert (dest / "mine.txt").read_text() == "mine"


def test_init_bad_options_are_one_line_exit_2(here):
    for args, word in ((("x", "--release", "not a version"), "--release"), (("x", "--name", "a/b"), "--name"),
                       (("x", "--install", "kvforge'; rm -rf /"), "--install"), (("missing/x",), "no such directory"),
                       (("x", "--upstream", "sglang"), "--upstream")):
        res = kvforge("init", *args)
        assert res.exit_code == 2, (args, res.output)
        assert word in res.stderr
    assert list(here.iterdir()) == []


def test_init_into_an_empty_directory_and_after_a_kill(here):
    """An empty DIR is replaced in one rename; SIGKILL just before it leaves only the hidden staging directory,
    which the next init removes."""
    (here / "empty").mkdir()
    assert kvforge("init", "empty").exit_code == 0
    assert (here / "empty" / ".git").is_dir()
    env = {**os.environ, "KVFORGE_CRASH_AT": "init:before-rename"}
    run = subprocess.run([sys.executable, "-m", "kvforge.cli", "init", "killed"], cwd=here, env=env,
                         capture_output=True, text=True)
    assert run.returncode == -9
    left = sorted(p.name for p in here.iterdir())
    assert left[0].startswith(".killed.kvforge-init-") and left[1:] == ["empty"]
    assert kvforge("init", "killed").exit_code == 0
    assert sorted(p.name for p in here.iterdir()) == ["empty", "killed"]


def test_init_in_place_writes_into_the_current_directory_never_replacing_it(here):
    """`kvforge init` (DIR defaults to .) writes into the directory the shell is in: the same inode after, so a
    shell there is not left in a deleted directory. A kill before the move leaves only a hidden staging directory
    inside it, which the next init removes."""
    proj = here / "proj"
    proj.mkdir()
    inode = proj.stat().st_ino
    os.chdir(proj)
    res = kvforge("init", "--json")
    assert res.exit_code == 0, res.output
    assert proj.stat().st_ino == inode and Path(os.getcwd()).samefile(proj)
    assert json.loads(res.stdout)["project"] == str(proj) and (proj / ".git").is_dir()
    assert not [p for p in proj.iterdir() if p.name.startswith(".kvforge-init-")]
    os.chdir(here)
    (here / "k").mkdir()
    env = {**os.environ, "KVFORGE_CRASH_AT": "init:before-rename"}
    run = subprocess.run([sys.executable, "-m", "kvforge.cli", "init"], cwd=here / "k", env=env,
                         capture_output=True, text=True)
    assert run.returncode == -9
    [left] = list((here / "k").iterdir())
    assert left.name.startswith(".kvforge-init-")
    assert subprocess.run([sys.executable, "-m", "kvforge.cli", "init"], cwd=here / "k", capture_output=True).returncode == 0
    assert (here / "k" / ".git").is_dir() and not [p for p in (here / "k").iterdir() if p.name.startswith(".kvforge-init-")]


def test_init_ships_a_wheel_of_this_kvforge_never_a_local_path(here, tmp_path):
    """Without --install, an editable (or local-path) kvforge has no source CI can reach: init writes a wheel of
    it into ci/ and every workflow installs that; the wheel installs and carries the docs (`kvforge help`)."""
    res = kvforge("init", "team", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    team = here / "team"
    [wheel] = [f for f in doc["files"] if f.startswith("ci/") and f.endswith(".whl")]
    assert doc["install"] == f"python3 -m pip install ./{wheel}"
    assert str(REPO_ROOT) not in (team / ".github/workflows/kvforge.yml").read_text()
    for wf in ("kvforge.yml", "kvforge-watch.yml"):
        text = (team / ".github/workflows" / wf).read_text()
        assert yaml().load(text)["env"]["KVFORGE_INSTALL"] == doc["install"] and "pip install -e ." not in text
        res = subprocess.run([tool("actionlint"), "-no-color", str(team / ".github/workflows" / wf)],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stdout + res.stderr
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(team / wheel)],
                   check=True, capture_output=True)
    assert (site / "kvforge" / "data" / "docs" / "targets.md").is_file()
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-m", "kvforge.cli", "help", "targets"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=True).stdout
    assert out == (REPO_ROOT / "docs" / "targets.md").read_text()
    # the same kvforge, the same wheel: a second init writes the same bytes
    assert kvforge("init", "team2").exit_code == 0
    assert (here / "team2" / wheel).read_bytes() == (team / wheel).read_bytes()


# ---------------------------------------------------------------- slow: the pip-installed kvforge, real releases

def _sh(cmd: list[str], cwd: Path, env: dict, ok: bool = True, timeout: float = 1800) -> subprocess.CompletedProcess:
    run = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if ok:
        assert run.returncode == 0, f"{cmd}: exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run


@pytest.mark.slow
def test_installed_kvforge_init_lint_apply_pick_verify(tmp_path):
    from test_pick import SUBJECT_41282, _commit, _core_files, _git

    from kvforge.git.bases import download_sdist
    from kvforge.core.cache import Cache, default_cache_dir
    from kvforge.project.targets import Release, load_target
    from dataclasses import replace

    # kvforge from a copy of this checkout's files (no build/ or egg-info leftovers), installed as a wheel
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO_ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for rel in filter(None, files):
        if (REPO_ROOT / rel).is_file() and not rel.startswith(("targets/", "patches/")):
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / rel, src / rel)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("KVFORGE_ROOT", "KVFORGE_CACHE", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    _sh(["python3", "-m", "pip", "install", "-q", str(src)], tmp_path, env)
    kv = str(venv / "bin" / "kvforge")
    site = _sh(["python3", "-c", "import kvforge, sys; print(kvforge.__file__)"], tmp_path, env).stdout.strip()
    assert site.startswith(str(venv)) and (Path(site).parent / "data/init/github-kvforge.yml").is_file()

    work = tmp_path / "work"
    work.mkdir()
    doc = json.loads(_sh([kv, "init", "team", "--json"], work, env).stdout)
    team = work / "team"
    # installed from a local directory (a path of this machine): CI installs the wheel init shipped into ci/
    assert doc["install"] == "python3 -m pip install ./ci/kvforge-0.1.0-py3-none-any.whl" and str(src) not in \
        (team / ".github/workflows/kvforge.yml").read_text()
    # The workflow's install step, run as CI runs it (here: over the same install)
    install = yaml().load((team / ".github/workflows/kvforge.yml").read_text())["env"]["KVFORGE_INSTALL"]
    assert install == doc["install"]
    _sh(["bash", "-e", "-c", install], team, env)
    _sh(["git", "config", "user.name", "Carrier"], team, env)
    _sh(["git", "config", "user.email", "carrier@example.com"], team, env)

    # target add: the team's first target, pinned from the real package index (sdist, upstream commit, wheels)
    ta = json.loads(_sh([kv, "target", "add", "0.20.1", "--json"], team, env).stdout)
    assert ta["components"][0]["upstream_commit"] == "f98b2747f" and len(ta["components"][0]["wheels"]) == 2
    _sh([kv, "lint"], team, env)
    _sh([kv, "lint", "--selections"], team, env)
    _sh([kv, "apply", "-t", "v0.20.1", "--json"], team, env)
    assert (team / "vllm-v0.20.1" / "vllm" / "v1" / "core" / "kv_cache_manager.py").is_file()
    assert "vllm-v0.20.1" not in _sh(["git", "status", "--porcelain"], team, env).stdout  # the tree is ignored

    # A real upstream change: #41282 (vllm/v1/core and tests/v1/core 0.20.1 -> 0.20.2 of the PyPI sdists)
    user = Cache(default_cache_dir())
    comp = load_target("v0.20.1", REPO_ROOT).component()
    sdists = {v: download_sdist(replace(comp, release=Release("vllm", v, None)) if v != "0.20.1" else comp, user,
                                print) for v in ("0.20.1", "0.20.2")}
    repo = tmp_path / "upstream"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    a = _commit(repo, _core_files(sdists["0.20.1"]), None, "vllm 0.20.1: vllm/v1/core and tests/v1/core of the sdist")
    _git(repo, "tag", "v0.20.1", a)
    b = _commit(repo, _core_files(sdists["0.20.2"]), a, SUBJECT_41282)
    _git(repo, "tag", "v0.20.2", b)

    offline = {**env, "KVFORGE_OFFLINE": "1"}
    r = _sh([kv, "pick", "--repo", str(repo), b, "--fix-id", "swa-admission-cap", "--json"], team, offline)
    (row,) = json.loads(r.stdout)["rows"]
    assert (row["target"], row["verdict"]) == ("v0.20.1", "applies")
    patch = team / "patches/v0.20.1/0001-swa-admission-cap.patch"
    assert patch.is_file() and (team / "patches/v0.20.1/series").read_text().split() == [patch.name]
    from kvforge.project.series import read_series

    (p,) = read_series(team / "patches/v0.20.1").patches
    assert p.value("Drop-When") == "version >= 0.20.2" and p.checks, p.checks
    _sh([kv, "lint", "--no-audit"], team, env)
    # The picked change adds a parameter to public methods: lint's audit flags it until the header acknowledges it.
    audit = _sh([kv, "lint"], team, env, ok=False)
    assert audit.returncode == 1 and "patch 0001: signature of " in audit.stdout, audit.stdout[-2000:]

    # verify: the picked fix proven in the team's project (its new test function fails on 0.20.1 for a behavioural
    # reason, with the patch's test-side change laid over the old tree, and passes after it)
    r = _sh([kv, "verify", "-t", "v0.20.1", "--json"], team, offline, ok=False, timeout=3600)
    assert r.returncode == 0, r.stderr[-3000:]
    vdoc = json.loads(r.stdout)
    (vp,) = vdoc["patches"]
    assert (vp["fix_id"], vp["status"]) == ("swa-admission-cap", "proven"), vp
    assert all(c["before"] == "failed" and c["before_kind"] == "behaviour" and c["after"] == "passed"
               for c in vp["checks"]), vp["checks"]
    assert vdoc["regression"]["compare"]["new_failures"] == 0


@pytest.mark.slow
def test_init_vllm_ascend_release_pins_both_sdists_from_pypi(here, monkeypatch):
    """vllm-ascend 0.20.2rc1 from the real package index: vLLM 0.20.2 under it, both pins equal to the ones this
    project's v0.20.2rc carries, and the selections exist in the real bases (the user cache's sdists)."""
    monkeypatch.delenv("KVFORGE_CACHE")
    res = kvforge("init", "asc", "--upstream", "vllm-ascend", "--release", "0.20.2rc1", "--json")
    assert res.exit_code == 0, res.output
    pins = {k: (p["version"], p["sha256"]) for k, p in json.loads(res.stdout)["pins"].items()}
    ours = tomllib.loads((REPO_ROOT / "targets/v0.20.2rc.toml").read_text())["components"]
    assert pins == {c["name"]: (c["release"]["version"], c["release"]["sha256"]) for c in ours}
    os.chdir(here / "asc")
    t = tomllib.loads(Path("targets/v0.20.2rc1.toml").read_text())
    assert [(c["name"], c["ref"], c.get("requires")) for c in t["components"]] == [
        ("vllm", "v0.20.2", None), ("vllm-ascend", "v0.20.2rc1", "vllm")]
    r = kvforge("lint", "--selections")
    assert r.exit_code == 0, r.output
    m = json.loads(kvforge("matrix", "--format", "json").stdout)
    assert {(j["component"], j["kind"]) for j in m["jobs"]} >= {("vllm", "cpu"), ("vllm-ascend", "cpu")}
