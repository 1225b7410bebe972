"""kvforge matrix: CI jobs as data, the GitHub workflow and Buildkite pipelines that consume them,
validated with check-jsonschema's vendored schemas and actionlint, and the CPU job run for real."""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import git

from kvforge.core.cache import default_cache_dir
from kvforge.cli import main

# Resolved at import, before fixtures point $KVFORGE_CACHE at a throw-away cache.
ENVS = Path(os.environ.get("KVFORGE_TEST_ENVS") or default_cache_dir() / "envs")
USER_CACHE = default_cache_dir()
REPO = Path(__file__).resolve().parent.parent
WORKFLOW = REPO / "ci" / "github" / "kvforge.yml"
BOOTSTRAP = REPO / "ci" / "buildkite" / "pipeline.yml"
PATCH = REPO / "patches" / "v0.20.2rc" / "0001-two-phase-kv-alloc.patch"

TARGET = """\
name = "{name}"

[[components]]
name = "vllm"
repo = "https://invalid.invalid/vllm.git"
ref = "v0.20.2"
series = "patches/{name}"
platforms = {platforms}

[components.release]
package = "vllm"
version = "0.20.2"
{wheel}
[components.tests]
{tests}
"""
WHEEL = """
[components.wheel]
filename = "vllm-0.20.2-cp38-abi3-manylinux_2_35_x86_64.whl"
sha256 = "22a7dd06eb03371298e13d6100f3dedbf307352342aaf08e87c929c60aae9b4d"
"""


def write_target(root: Path, name: str, platforms: list[str], wheel: bool, patch: bool) -> None:
    tests = "\n".join(f'{p} = ["tests/v1/core/test_kv_cache_utils.py"]' for p in platforms)
    (root / "targets" / f"{name}.toml").write_text(TARGET.format(name=name, platforms=json.dumps(platforms),
                                                                 wheel=WHEEL if wheel else "", tests=tests))
    series = root / "patches" / name
    series.mkdir(parents=True, exist_ok=True)
    if patch:
        shutil.copy(PATCH, series / PATCH.name)
    (series / "series").write_text(f"{PATCH.name}\n" if patch else "")


@pytest.fixture()
def proj(tmp_path, monkeypatch):
    """Targets a (cpu, cuda, npu; a wheel pin; one real patch) and b (cpu only, empty series), in git."""
    root = tmp_path / "proj"
    (root / "targets").mkdir(parents=True)
    write_target(root, "a", ["cpu", "cuda", "npu"], wheel=True, patch=True)
    write_target(root, "b", ["cpu"], wheel=False, patch=False)
    (root / "kvforge").mkdir()
    (root / "kvforge" / "x.py").write_text("x = 1\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "start")
    monkeypatch.setenv("KVFORGE_ROOT", str(root))
    monkeypatch.chdir(root)
    return root


def matrix(*args: str, code: int = 0):
    res = CliRunner().invoke(main, ["matrix", *args])
    assert res.exit_code == code, res.output
    return res


def matrix_json(*args: str) -> dict:
    return json.loads(matrix("--format", "json", *args).stdout)


def tool(name: str) -> str:
    """A validator installed with kvforge's test extra (next to this python), else skip saying why."""
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if not found:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]' installs it); cannot validate here")
    return found


def yaml():
    ruamel = pytest.importorskip("ruamel.yaml", reason="ruamel.yaml comes with check-jsonschema (test extra)")
    y = ruamel.YAML(typ="rt")
    y.width = 4096
    return y


# ---------------------------------------------------------------- the jobs

def test_jobs_are_targets_x_kinds_and_each_command_is_kvforge(proj):
    doc = matrix_json()
    jobs = {j["id"]: j for j in doc["jobs"]}
    assert sorted(jobs) == ["build-a-vllm", "build-a-vllm-empty", "cpu-a-vllm", "cpu-b-vllm", "cuda-a-vllm",
                            "npu-a-vllm"]
    assert all(j["command"].startswith("kvforge ") for j in jobs.values())
    # every pinned wheel (the aarch64 overlay too, on the x86_64 runner); vLLM without a device for the npu
    # deployment, in its own job, artifact and directory (the cuda job's download holds no other wheel)
    assert jobs["build-a-vllm"]["command"] == "kvforge build --target a --arch all --out dist/a"
    empty = jobs["build-a-vllm-empty"]
    assert empty["command"] == "kvforge build --target a --device empty --out dist/a-empty"
    assert empty["artifact"] == "wheel-a-vllm-empty" and empty["artifact_path"] == "dist/a-empty/*.whl"
    assert empty["junit"] == [".kvforge-cache/builds/a/vllm/*/verify-cpu-empty.xml"]
    assert jobs["cpu-b-vllm"]["command"] == "kvforge verify --target b"
    cuda, npu = jobs["cuda-a-vllm"], jobs["npu-a-vllm"]
    assert cuda["needs"] == ["build-a-vllm"] and "--wheel dist/a --platform cuda" in cuda["command"]
    assert "pip install dist/a/*_$(uname -m).whl" in "\n".join(cuda["setup"]) and cuda["artifact"] == "wheel-a-vllm"
    assert "VLLM_TARGET_DEVICE=empty" in "\n".join(npu["setup"]) and "vllm-ascend" in "\n".join(npu["setup"])
    assert npu["command"].startswith("kvforge test --target a --platform npu") and npu["container"]
    # Generated, never run: nothing reports the hardware jobs as passed.
    assert {j["id"]: j["runs_here"] for j in jobs.values() if not j["runs_here"]} == {"cuda-a-vllm": False,
                                                                                     "npu-a-vllm": False}
    assert "never reported as passed" in doc["not_run"]
    assert "tests/v1/core/test_kvforge_two_phase_kv_alloc.py" in cuda["source_files"]
    assert any(s.startswith("tests/v1/core/test_kvforge_two_phase_kv_alloc.py::") for s in cuda["selection"])
    # Runner labels are platforms.py's defaults unless --runs-on says otherwise.
    from kvforge.project.platforms import PLATFORMS

    assert cuda["runs_on"] == list(PLATFORMS["cuda"].labels("github"))
    doc = matrix_json("--runs-on", "npu=linux-aarch64-a2b3-1", "--kind", "npu")
    assert [j["runs_on"] for j in doc["jobs"]] == [["linux-aarch64-a2b3-1"]]
    matrix("--runs-on", "gpu=x", code=2)
    table = matrix().stdout
    assert "no (cuda runner)" in table and "never run or reported as passed" in table


def test_shards_and_the_github_256_job_limit(proj):
    doc = matrix_json("--cuda-shards", "3")
    assert [j["command"].split("--shard ")[-1] for j in doc["jobs"] if j["kind"] == "cuda"] == ["1/3", "2/3", "3/3"]
    res = matrix("--format", "github", "--cuda-shards", "257", code=2)
    assert "at most 256" in res.stderr
    res = matrix("--json", "--cuda-shards", "0", code=2)
    assert json.loads(res.stdout)["exit"] == 2


def test_changed_since_selects_the_targets_whose_series_or_file_changed(proj):
    assert {t["target"] for t in matrix_json("--changed-since", "HEAD")["targets"] if t["selected"]} == set()
    (proj / "patches" / "b" / "series").write_text("\n")
    assert [j["target"] for j in matrix_json("--changed-since", "HEAD")["jobs"]] == ["b"]
    git(proj, "commit", "-q", "-am", "b")
    (proj / "patches" / "a" / "new.patch").write_text("untracked\n")
    doc = matrix_json("--changed-since", "HEAD~1")
    assert {t["target"]: t["reason"] for t in doc["targets"] if t["selected"]} == {
        "a": "patches/a/new.patch changed", "b": "patches/b/series changed"}
    (proj / "patches" / "a" / "new.patch").unlink()
    (proj / "targets" / "a.toml").write_text((proj / "targets" / "a.toml").read_text() + "\n")
    assert {j["target"] for j in matrix_json("--changed-since", "HEAD")["jobs"]} == {"a"}
    git(proj, "checkout", "-q", "--", "targets/a.toml")
    (proj / "kvforge" / "x.py").write_text("x = 2\n")  # kvforge itself: every target
    assert {j["target"] for j in matrix_json("--changed-since", "HEAD")["jobs"]} == {"a", "b"}
    res = matrix("--format", "json", "--changed-since", "no-such-rev", code=2)
    assert "no such revision" in json.loads(res.stdout)["error"]


# ---------------------------------------------------------------- GitHub Actions

def github_matrices(*args: str) -> dict[str, dict]:
    out = {}
    for line in matrix("--format", "github", *args).stdout.splitlines():
        key, _, value = line.partition("=")
        out[key] = json.loads(value) if not key.startswith("has_") else value
    return out


def test_github_outputs_one_matrix_per_kind(proj):
    m = github_matrices()
    assert set(m) == {f"{p}{k}" for k in ("build", "cpu", "cuda", "npu") for p in ("", "has_")}
    assert [e["id"] for e in m["cpu"]["include"]] == ["cpu-a-vllm", "cpu-b-vllm"]
    assert m["has_npu"] == "true" and all(len(m[k]["include"]) <= 256 for k in ("build", "cpu", "cuda", "npu"))
    assert "\n" in m["cuda"]["include"][0]["setup"]  # run: executes each line (bash -e)


def test_workflow_passes_the_github_workflow_schema_and_actionlint():
    subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(WORKFLOW)],
                   check=True, capture_output=True)
    res = subprocess.run([tool("actionlint"), "-no-color", str(WORKFLOW)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_workflow_with_the_generated_matrix_inlined_passes_both(proj, tmp_path):
    """fromJSON replaced by this project's real matrix: actionlint then checks every matrix.X the jobs use."""
    y = yaml()
    wf = y.load(WORKFLOW.read_text())
    m = github_matrices()
    for kind in ("build", "cpu", "cuda", "npu"):
        assert "fromJSON(needs.plan.outputs." + kind in wf["jobs"][kind]["strategy"]["matrix"]
        wf["jobs"][kind]["strategy"]["matrix"] = m[kind]
    out = tmp_path / "kvforge.yml"
    buf = io.StringIO()
    y.dump(wf, buf)
    out.write_text(buf.getvalue())
    subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(out)], check=True,
                   capture_output=True)
    res = subprocess.run([tool("actionlint"), "-no-color", str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    # ... and a matrix missing a key a job uses is caught, so the check above means something.
    del wf["jobs"]["cpu"]["strategy"]["matrix"]["include"][0]["command"]
    for e in wf["jobs"]["cpu"]["strategy"]["matrix"]["include"]:
        e.pop("command", None)
    buf = io.StringIO()
    y.dump(wf, buf)
    out.write_text(buf.getvalue())
    res = subprocess.run([tool("actionlint"), "-no-color", str(out)], capture_output=True, text=True)
    assert res.returncode != 0 and "command" in res.stdout


# ---------------------------------------------------------------- Buildkite

def test_buildkite_pipeline_passes_buildkites_schema(proj, tmp_path):
    out = tmp_path / "pipeline.yml"
    out.write_text(matrix("--format", "buildkite", "--cuda-shards", "2").stdout)
    doc = yaml().load(out.read_text())
    keys = [s["key"] for s in doc["steps"]]
    assert keys == ["build-a-vllm", "build-a-vllm-empty", "cpu-a-vllm", "cuda-a-vllm-1of2", "cuda-a-vllm-2of2",
                    "npu-a-vllm", "cpu-b-vllm"]
    cuda = doc["steps"][3]
    assert cuda["depends_on"] == ["build-a-vllm"] and cuda["agents"] == {"queue": "gpu_1_queue"}
    assert cuda["commands"][0].startswith("buildkite-agent artifact download")
    assert list(doc["steps"][0]["if_changed"]) == ["targets/a.toml", "patches/a/**", "kvforge/**", "pyproject.toml"]
    for path in (out, BOOTSTRAP):
        res = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.buildkite", str(path)],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stdout + res.stderr
    bad = tmp_path / "bad.yml"
    bad.write_text(out.read_text().replace("timeout_in_minutes:", "device: l4\n    timeout_in_minutes:", 1))
    res = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.buildkite", str(bad)],
                         capture_output=True, text=True)
    assert res.returncode != 0  # vLLM's own keys are not Buildkite's: hence two formats


def test_vllm_format_uses_vllms_own_step_keys(proj):
    """Steps for a vLLM fork: only keys and devices the .buildkite steps of vLLM 0.20.2 AND 0.33.0 use
    (a fork of either); the CPU step judges against the base (kvforge verify), a CI-file-only change runs it."""
    import tarfile

    from kvforge.git.bases import download_sdist
    from kvforge.core.cache import Cache
    from kvforge.project.targets import load_target

    y = yaml()
    keys, devices = [], []
    for name in ("v0.20.2rc", "main"):
        sdist = download_sdist(load_target(name, REPO).component(), Cache(USER_CACHE), print)
        theirs, known = set(), set()
        with tarfile.open(sdist) as tar:
            for member in tar:
                if "/.buildkite/" in member.name and member.name.endswith(".yaml") and (
                        "/test_areas/" in member.name or "/hardware_tests/" in member.name):
                    doc = y.load(tar.extractfile(member).read().decode())
                    for step in (doc or {}).get("steps") or []:
                        theirs |= set(step)
                        known.add(step.get("device"))  # None: vLLM's default GPU agents
        keys.append(theirs)
        devices.append(known)
    theirs, known = keys[0] & keys[1], devices[0] & devices[1]
    assert {"label", "key", "device", "source_file_dependencies", "commands"} <= theirs
    # 0.20.2 knows no "l4"; 0.33.0 disabled its Ascend step (hardware_tests/ascend_npu.yaml: steps: []), so
    # ascend_npu is judged against 0.20.2, the release vllm-ascend's branches build on
    assert "l4" not in devices[0] and None in known and "cpu-small" in known and "ascend_npu" in devices[0]
    matrix("--format", "buildkite-vllm", code=2)  # one fork, one target
    ours = y.load(matrix("--format", "buildkite-vllm", "--target", "a").stdout)
    assert set(ours) == {"group", "depends_on", "steps"}
    assert [s.get("device") for s in ours["steps"]] == ["cpu-small", None, "ascend_npu"]
    for step in ours["steps"]:
        assert set(step) <= theirs, set(step) - theirs
        assert step.get("device") in (known | {"ascend_npu"})
        assert "vllm/v1/core/kv_cache_coordinator.py" in step["source_file_dependencies"]
        assert ".buildkite/test_areas/kvforge_a.yaml" in step["source_file_dependencies"]
    cpu, cuda, npu = ours["steps"]
    assert "kvforge verify --target a" in cpu["commands"][-1] and "--from" in cpu["commands"][-1]
    assert cuda["commands"][0].startswith("pytest -v -s v1/core/test_kv_cache_utils.py")
    assert npu["soft_fail"] is True


# ---------------------------------------------------------------- the CPU job, run for real

@pytest.mark.slow
def test_the_cpu_job_from_the_matrix_runs(project, base_v0202, monkeypatch):
    """`kvforge matrix --format json`'s cpu job for a target on the real 0.20.2 base, run as CI runs it."""
    cache, _base = base_v0202
    ENVS.mkdir(parents=True, exist_ok=True)
    if not (cache.root / "envs").exists():
        (cache.root / "envs").symlink_to(ENVS, target_is_directory=True)
    monkeypatch.delenv("KVFORGE_TEST_PYTHON", raising=False)
    sel = '["tests/v1/core/test_kv_cache_utils.py::test_free_kv_cache_block_queue_initialization"]'
    text = (project / "targets" / "t.toml").read_text().replace('["tests/v1/core/test_kv_cache_utils.py"]', sel)
    (project / "targets" / "t.toml").write_text(text)
    jobs = matrix_json("--kind", "cpu")["jobs"]
    assert [j["id"] for j in jobs] == ["cpu-t-vllm"] and jobs[0]["runs_here"]
    argv = shlex.split(jobs[0]["command"])
    assert argv[0] == "kvforge"
    res = subprocess.run([sys.executable, "-m", "kvforge.cli", *argv[1:], "--json"], capture_output=True, text=True,
                         cwd=project, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    report = json.loads(res.stdout)
    assert report["ok"] and report["regression"]["passed"] == 1


# ---------------------------------------------------------------- a component built on another: its NPU lane

ON_VLLM = """
[[components]]
name = "vllm-ascend"
repo = "https://invalid.invalid/vllm-ascend.git"
ref = "releases/v0.20.2rc"
series = "patches/c-vllm-ascend"
platforms = ["cpu", "npu"]
requires = "vllm"

[components.release]
package = "vllm_ascend"
version = "0.20.2rc1"

[components.tests]
standins = ["torch_npu"]
cpu = ["tests/ut/test_envs.py"]
npu = ["tests/ut", "tests/ut/test_envs.py"]
"""


def test_npu_job_of_vllm_ascend_installs_both_patched_trees_and_is_never_run(proj, tmp_path):
    write_target(proj, "c", ["cpu"], wheel=False, patch=False)
    (proj / "targets" / "c.toml").write_text((proj / "targets" / "c.toml").read_text() + ON_VLLM)
    (proj / "patches" / "c-vllm-ascend").mkdir()
    (proj / "patches" / "c-vllm-ascend" / "series").write_text("")
    jobs = {j["id"]: j for j in matrix_json("--target", "c")["jobs"]}
    # vLLM without a device (what the Ascend deployment installs under vllm-ascend) is built for it
    assert sorted(jobs) == ["build-c-vllm-empty", "cpu-c-vllm", "cpu-c-vllm-ascend", "npu-c-vllm-ascend"]
    assert jobs["cpu-c-vllm-ascend"]["command"] == "kvforge verify --target c --component vllm-ascend"
    npu = jobs["npu-c-vllm-ascend"]
    from kvforge.project.platforms import PLATFORMS

    assert npu["runs_on"] == ["linux-aarch64-a2b3-1"] and not npu["runs_here"]
    assert npu["container"] == PLATFORMS["npu"].container and "cann:9.0.0-910b" in npu["container"]
    assert npu["setup"][1:] == [
        "kvforge apply --target c",
        # vllm-ascend's releases/v0.20.2rc .github/workflows/_e2e_test.yaml: triton out, triton-ascend in
        "VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE=0.20.2 python3 -m pip install -e vllm-c "
        "&& python3 -m pip uninstall -y triton",
        "python3 -m pip install -r vllm-ascend-c/requirements-dev.txt "
        "&& python3 -m pip install --force-reinstall --no-deps triton-ascend==3.2.1 "
        "&& python3 -m pip install -e vllm-ascend-c pytest tblib"]
    assert npu["command"] == ("cd vllm-ascend-c && python3 -m pytest -o junit_family=xunit2 "
                              "--junitxml=kvforge-c-vllm-ascend-npu.xml tests/ut")
    assert npu["junit"] == ["vllm-ascend-c/kvforge-c-vllm-ascend-npu.xml"]
    # vLLM's own CI format describes vLLM's tree: the vllm-ascend jobs are not in it.
    assert [s["device"] for s in yaml().load(matrix("--format", "buildkite-vllm", "--target", "c").stdout)["steps"]] \
        == ["cpu-small"]
    # The generated GitHub matrix and Buildkite pipeline with this job pass their validators.
    y = yaml()
    wf = y.load(WORKFLOW.read_text())
    m = github_matrices("--target", "c")
    assert [e["id"] for e in m["npu"]["include"]] == ["npu-c-vllm-ascend"]
    for kind in ("cpu", "npu"):  # build and cuda have no job here: their fromJSON stays
        wf["jobs"][kind]["strategy"]["matrix"] = m[kind]
    out = tmp_path / "kvforge.yml"
    buf = io.StringIO()
    y.dump(wf, buf)
    out.write_text(buf.getvalue())
    res = subprocess.run([tool("actionlint"), "-no-color", str(out)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    pipe = tmp_path / "pipeline.yml"
    pipe.write_text(matrix("--format", "buildkite", "--target", "c").stdout)
    # The NPU step's container gets what vLLM's run-npu-test.sh passes to docker run: the card, the Ascend
    # device nodes, the host's driver and tools.
    step = next(st for st in y.load(pipe.read_text())["steps"] if st["key"] == "npu-c-vllm-ascend")
    docker = step["plugins"][0]["docker#v5.12.0"]
    assert {"/dev/davinci0", "/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"} <= set(docker["devices"])
    assert any(v.startswith("/usr/local/Ascend/driver/lib64/") for v in docker["volumes"])
    res = subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.buildkite", str(pipe)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    step = next(s for s in yaml().load(pipe.read_text())["steps"] if s["key"] == "npu-c-vllm-ascend")
    assert step["plugins"][0]["docker#v5.12.0"]["image"] == npu["container"]


def test_eol_targets_have_no_job_in_any_format(proj):
    """`lifecycle = "eol"`: the target is listed (why) but no format carries a job of it."""
    text = (proj / "targets" / "a.toml").read_text()
    (proj / "targets" / "a.toml").write_text('lifecycle = "eol"\n' + text)
    doc = matrix_json()
    assert {j["target"] for j in doc["jobs"]} == {"b"}
    assert [(t["target"], t["selected"], t["reason"]) for t in doc["targets"]] == [
        ("a", False, "lifecycle eol"), ("b", True, "all targets")]
    for fmt in ("github", "buildkite", "commands", "table"):
        out = matrix("--format", fmt).stdout
        assert "--target a" not in out and "-a-vllm" not in out, fmt
        assert "--target b" in out, fmt


def test_a_build_job_per_component_builds_every_pinned_wheel(proj):
    """Two pins (x86_64, aarch64): one build job, `--arch all`; a target without an npu component gets no
    empty-device job."""
    path = proj / "targets" / "a.toml"
    path.write_text(path.read_text().replace('platforms = ["cpu", "cuda", "npu"]', 'platforms = ["cpu", "cuda"]')
                    .replace('npu = ["tests/v1/core/test_kv_cache_utils.py"]', "")
                    .replace("[components.wheel]\n", "[[components.wheels]]\n")
                    .replace("[components.tests]", "[[components.wheels]]\n"
                             'filename = "vllm-0.20.2-cp38-abi3-manylinux_2_35_aarch64.whl"\n'
                             'sha256 = "76ccf4c0554556c06f6b0fb1643742d4cf97dcc69f6ef3f04556d0764126035a"\n\n'
                             "[components.tests]"))
    jobs = {j["id"]: j for j in matrix_json("--kind", "build")["jobs"]}
    assert list(jobs) == ["build-a-vllm"]
    assert jobs["build-a-vllm"]["command"] == "kvforge build --target a --arch all --out dist/a"
