"""The shipped GitHub workflow (ci/github/kvforge.yml), run here as a runner would run it, as far as
this machine allows: the plan job's steps make the matrix, then the build job of v0.20.2rc/vllm and
the cpu job of v0.20.2rc/vllm-ascend (the smallest real cpu job) run their `run:` steps in order,
with the matrix values and the GITHUB_* variables a runner sets, in a fresh workspace with its own
interpreter (what actions/setup-python gives). `uses:` steps are played by what the action does:
checkout (the project copied, a git repository), setup-python (the runner's python first on PATH),
cache (the shared downloads/envs restored), upload-artifact (its path globs, include-hidden-files
and if-no-files-found rules of v4.4+), download-artifact and the report step (its report_paths glob
over what was downloaded, each file parsed as JUnit). GPU/NPU jobs are not run (no hardware): their
`if:` is evaluated, with and without the repository variables that opt in.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conftest import REPO_ROOT

from kvforge.core.cache import default_cache_dir

WORKFLOW = REPO_ROOT / "ci" / "github" / "kvforge.yml"
SHARED = default_cache_dir()
EXPR = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")


def yaml():
    ruamel = pytest.importorskip("ruamel.yaml", reason="ruamel.yaml comes with check-jsonschema (test extra)")
    return ruamel.YAML(typ="safe")


# ---------------------------------------------------------------- GitHub expressions (the subset the workflow uses)

def lookup(ctx: dict, name: str):
    value = ctx
    for part in name.split("."):
        value = value.get(part, "") if isinstance(value, dict) else ""
    return value


def evaluate(expr: str, ctx: dict):
    """A GitHub Actions expression: contexts (a.b.c), 'strings', ==, !=, &&, ||, !, always(), cancelled(),
    success(), fromJSON(x)."""
    tokens = re.findall(r"'(?:[^']|'')*'|==|!=|&&|\|\||!|\(|\)|,|[A-Za-z_][A-Za-z0-9_.\-]*|\S", expr)
    out = []
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if t.startswith("'"):
            out.append(repr(t[1:-1].replace("''", "'")))
        elif t in ("==", "!="):
            out.append(t)
        elif t == "&&":
            out.append(" and ")
        elif t == "||":
            out.append(" or ")
        elif t == "!":
            out.append(" not ")
        elif t in ("(", ")", ","):
            out.append(t)
        elif t in ("true", "false"):
            out.append(str(t == "true"))
        elif i + 1 < len(tokens) and tokens[i + 1] == "(":
            out.append(f"_fn_{t}")
        else:
            out.append(f"_ctx({t!r})")
        i += 1
    fns = {"_fn_always": lambda: True, "_fn_cancelled": lambda: False,
           "_fn_success": lambda: ctx.get("_job_ok", True), "_fn_failure": lambda: not ctx.get("_job_ok", True),
           "_fn_fromJSON": lambda x: x, "_fn_hashFiles": lambda *a: "h" + str(len(a)),
           "_ctx": lambda n: lookup(ctx, n)}
    return eval("".join(out), {"__builtins__": {}}, fns)  # noqa: S307 (our own workflow's expressions)


def substitute(text: str, ctx: dict) -> str:
    return EXPR.sub(lambda m: str(evaluate(m.group(1), ctx)), text)


def condition(step_or_job: dict, ctx: dict) -> bool:
    cond = step_or_job.get("if")
    if cond is None:
        return ctx.get("_job_ok", True)
    text = str(cond).strip()
    m = EXPR.fullmatch(text)
    value = evaluate(m.group(1) if m else text, ctx)
    status_fn = re.search(r"\b(always|cancelled|success|failure)\(", text)
    return bool(value) and (bool(status_fn) or ctx.get("_job_ok", True))


# ---------------------------------------------------------------- the runner

class Runner:
    """One machine: a workspace (the checkout), its python (setup-python), artifacts (the run's store)."""

    def __init__(self, tmp: Path, project: Path):
        self.tmp, self.project = tmp, project
        self.artifacts = tmp / "artifacts"
        self.artifacts.mkdir()
        self.log: list[str] = []
        self.uploaded: dict[str, list[str]] = {}

    def workspace(self, job_id: str) -> Path:
        """actions/checkout: the project at this commit, as a git repository, in a fresh directory."""
        self.runs = getattr(self, "runs", 0) + 1
        ws = self.tmp / "work" / f"{self.runs}-{job_id}"
        shutil.copytree(self.project, ws, symlinks=True)
        return ws

    def python_bin(self) -> Path:
        """actions/setup-python: an interpreter of its own (a venv), first on PATH."""
        venv = self.tmp / "hostedtoolcache" / "python"
        if not venv.exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        return venv / "bin"

    def run_job(self, wf: dict, job_name: str, matrix: dict, variables: dict, needs: dict | None = None) -> dict:
        job = wf["jobs"][job_name]
        ws = self.workspace(f"{job_name}-{matrix.get('id', 'plan')}")
        temp = ws.parent / f"{ws.name}.temp"
        temp.mkdir()
        github = {"workspace": str(ws), "base_ref": "", "event_name": "push", "ref": "refs/heads/main",
                  "repository": "fork/kvforge", "sha": "0" * 40}
        ctx = {"matrix": matrix, "github": github, "vars": variables, "needs": needs or {},
               "runner": {"os": "Linux", "arch": "X64", "temp": str(temp)}, "steps": {}, "_job_ok": True}
        ctx["env"] = {k: substitute(str(v), ctx) for k, v in {**wf.get("env", {}), **job.get("env", {})}.items()}
        base_env = {k: v for k, v in os.environ.items() if not k.startswith(("KVFORGE_", "PYTEST", "VIRTUAL_ENV"))}
        base_env.update({"CI": "true", "GITHUB_ACTIONS": "true", "GITHUB_WORKSPACE": str(ws),
                         "GITHUB_EVENT_NAME": "push", "GITHUB_REF": github["ref"], "GITHUB_SHA": github["sha"],
                         "GITHUB_REPOSITORY": github["repository"], "GITHUB_BASE_REF": "", "GITHUB_RUN_ID": "1",
                         "GITHUB_JOB": job_name, "RUNNER_OS": "Linux", "RUNNER_ARCH": "X64", "RUNNER_TEMP": str(temp),
                         **ctx["env"]})
        path = [str(self.python_bin())] + base_env.get("PATH", "").split(os.pathsep)
        outputs: dict[str, str] = {}
        shell = ((job.get("defaults") or {}).get("run") or {}).get("shell")
        for n, step in enumerate(job["steps"]):
            if not condition(step, ctx):
                self.log.append(f"{job_name}: skipped step {n} ({step.get('name') or step.get('uses')})")
                continue
            if "uses" in step:
                self.use(step, ctx, ws)
                continue
            script = substitute(step["run"], ctx)
            env = {**base_env, "PATH": os.pathsep.join(path),
                   **{k: substitute(str(v), ctx) for k, v in (step.get("env") or {}).items()}}
            out_file = temp / f"output-{n}"
            out_file.write_text("")
            env["GITHUB_OUTPUT"], env["GITHUB_STEP_SUMMARY"] = str(out_file), str(temp / "summary")
            argv = ["bash", "-e", "-c", script] if not (step.get("shell") or shell) else \
                ["bash", "--login", "-e", "-c", script]
            t0 = time.monotonic()
            res = subprocess.run(argv, cwd=ws, env=env, capture_output=True, text=True, timeout=1800)
            self.log.append(f"{job_name}/{step.get('name', script.splitlines()[0])}: exit {res.returncode} "
                            f"in {time.monotonic() - t0:.0f}s")
            if res.returncode != 0:
                ctx["_job_ok"] = False
                self.log.append(res.stdout[-3000:] + res.stderr[-3000:])
            step_out = dict(line.split("=", 1) for line in out_file.read_text().splitlines() if "=" in line)
            if step.get("id"):
                ctx["steps"][step["id"]] = {"outputs": step_out}
        for key, value in (job.get("outputs") or {}).items():
            outputs[key] = substitute(str(value), ctx)
        return {"ok": ctx["_job_ok"], "outputs": outputs, "workspace": ws}

    def use(self, step: dict, ctx: dict, ws: Path) -> None:
        action = step["uses"].split("@")[0]
        given = {k: substitute(str(v).lower() if isinstance(v, bool) else str(v), ctx)
                 for k, v in (step.get("with") or {}).items()}
        if action in ("actions/checkout", "actions/setup-python"):
            return  # the workspace and the interpreter are there already
        if action == "actions/cache":  # restore: the shared downloads and test environments
            for line in given["path"].splitlines():
                rel = line.strip()
                if rel:
                    dest = ws / rel
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    (SHARED / Path(rel).name).mkdir(parents=True, exist_ok=True)
                    dest.symlink_to(SHARED / Path(rel).name, target_is_directory=True)
            return
        if action == "actions/upload-artifact":
            files = upload_paths(ws, given["path"], given.get("include-hidden-files", "false") == "true")
            hidden = upload_paths(ws, given["path"], True)
            if not files:
                rule = given.get("if-no-files-found", "warn")
                assert rule != "error", f"upload {given['name']}: no files for {given['path']!r}"
                self.log.append(f"upload {given['name']}: no files ({rule}); hidden ones left out: {hidden}")
                return
            dest = self.artifacts / given["name"]
            for f in files:
                rel = Path(f).relative_to(upload_root(ws, given["path"]))
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, dest / rel)
            self.uploaded[given["name"]] = files
            return
        if action == "actions/download-artifact":
            into = ws / given.get("path", ".")
            names = [p.name for p in self.artifacts.iterdir()
                     if fnmatch.fnmatch(p.name, given.get("pattern") or given.get("name", "*"))]
            for name in names:  # with a pattern, each artifact in a directory of its name
                shutil.copytree(self.artifacts / name, into / name if given.get("pattern") else into,
                                dirs_exist_ok=True)
            return
        if action == "mikepenz/action-junit-report":
            reports = [Path(p) for p in glob.glob(str(ws / given["report_paths"]), recursive=True)]
            if given.get("require_tests") == "true":
                assert reports, f"report: nothing matches {given['report_paths']}"
            ctx.setdefault("reports", []).extend(reports)
            return
        raise AssertionError(f"the test does not know action {action}")


def upload_root(ws: Path, paths: str) -> Path:
    """upload-artifact's root: the longest common directory of the patterns' parts before a wildcard."""
    roots = []
    for line in paths.splitlines():
        parts = []
        for part in Path(line.strip()).parts:
            if any(c in part for c in "*?["):
                break
            parts.append(part)
        roots.append(ws.joinpath(*parts) if parts else ws)
    common = Path(os.path.commonpath([str(r) for r in roots]))
    return common if common.is_dir() else common.parent


def upload_paths(ws: Path, paths: str, include_hidden: bool) -> list[str]:
    """The files upload-artifact (v4.4+) uploads for `paths`: globs relative to the workspace; without
    include-hidden-files, none with a path part starting with '.'."""
    out: set[str] = set()
    for line in paths.splitlines():
        pattern = line.strip()
        if not pattern:
            continue
        for f in glob.glob(str(ws / pattern), recursive=True, include_hidden=True):
            if not Path(f).is_file():
                continue
            rel = Path(f).relative_to(ws)
            if not include_hidden and any(p.startswith(".") for p in rel.parts):
                continue
            out.add(f)
    return sorted(out)


def matrix_of(outputs: dict, kind: str) -> list[dict]:
    import json

    return json.loads(outputs[kind])["include"]


# ---------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def wf():
    return yaml().load(WORKFLOW.read_text())


@pytest.fixture(scope="module")
def project_copy(tmp_path_factory):
    """This project as a checkout: its tracked and modified files (not .venv, caches), a git repository."""
    dest = tmp_path_factory.mktemp("checkout") / "kvforge"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for f in filter(None, files):
        src = REPO_ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)
    for args in (["init", "-q", "-b", "main"], ["add", "-A"],
                 ["-c", "user.name=ci", "-c", "user.email=ci@example.invalid", "commit", "-q", "-m", "checkout"]):
        subprocess.run(["git", *args], cwd=dest, check=True)
    return dest


def test_hardware_lanes_are_opt_in_and_never_block_the_report(wf, project_copy, tmp_path):
    """No repository variables (a fork): the plan job gives no cuda/npu job and those jobs' `if:` is false;
    with KVFORGE_CUDA_RUNS_ON / KVFORGE_NPU_RUNS_ON set, both appear on those labels. The report job runs
    whatever the lanes did, unless the run was cancelled."""
    runner = Runner(tmp_path, project_copy)
    plan = runner.run_job(wf, "plan", {}, {})
    assert plan["ok"], "\n".join(runner.log)
    out = plan["outputs"]
    assert out["has_cuda"] == "false" and out["has_npu"] == "false", out
    assert out["has_build"] == "true" and out["has_cpu"] == "true"
    assert matrix_of(out, "cuda") == [] and matrix_of(out, "npu") == []
    needs = {"plan": {"outputs": out, "result": "success"}, "build": {"result": "success"}}
    for lane in ("cuda", "npu"):
        assert not condition(wf["jobs"][lane], {"vars": {}, "needs": needs}), lane
        assert "runs_on" in str(wf["jobs"][lane]["runs-on"])
    report = wf["jobs"]["report"]
    assert set(report["needs"]) >= {"build", "cpu", "cuda", "npu"}
    assert condition(report, {"needs": needs, "_job_ok": False})  # runs after failed or skipped lanes
    assert "cancelled()" in str(report["if"])

    variables = {"KVFORGE_CUDA_RUNS_ON": "self-hosted,linux,x64,gpu", "KVFORGE_NPU_RUNS_ON": "linux-aarch64-a2b3-1"}
    opted = runner.run_job(wf, "plan", {}, variables)["outputs"]
    cuda, npu = matrix_of(opted, "cuda"), matrix_of(opted, "npu")
    assert cuda and all(j["runs_on"] == ["self-hosted", "linux", "x64", "gpu"] for j in cuda)
    assert npu and all(j["runs_on"] == ["linux-aarch64-a2b3-1"] for j in npu)
    needs = {"plan": {"outputs": opted}, "build": {"result": "success"}}
    assert condition(wf["jobs"]["cuda"], {"vars": variables, "needs": needs})
    assert condition(wf["jobs"]["npu"], {"vars": variables, "needs": needs})


def test_npu_job_mirrors_vllm_ascends_own(wf):
    """vllm-ascend's releases/v0.20.2rc workflows: a login shell (CANN's environment), git and
    safe.directory before checkout, the build's apt packages, the Ascend index, and the step's env."""
    npu = wf["jobs"]["npu"]
    assert npu["defaults"]["run"]["shell"] == "bash -el {0}"
    assert "repo.huaweicloud.com/ascend/repos/pypi" in npu["env"]["PIP_EXTRA_INDEX_URL"]
    runs = "\n".join(s.get("run", "") for s in npu["steps"])
    for needed in ("apt-get install -y git", "safe.directory", "gcc g++ cmake libnuma-dev", "npu-smi info"):
        assert needed in runs, needed
    first_uses = next(i for i, s in enumerate(npu["steps"]) if s.get("uses", "").startswith("actions/checkout"))
    assert any("git" in s.get("run", "") for s in npu["steps"][:first_uses])
    text = WORKFLOW.read_text()
    assert "_e2e_test.yaml" in text and "pr_test_light.yaml" in text  # each step names its source


@pytest.mark.slow
def test_build_and_cpu_jobs_run_here_and_the_report_gets_their_junit(wf, project_copy, tmp_path):
    """The plan job's matrix, then build (v0.20.2rc/vllm) and cpu (v0.20.2rc/vllm-ascend) run step by step;
    every upload finds its files under upload-artifact's hidden-file rule; the report job downloads
    junit-* and its report_paths glob finds every JUnit file, each a JUnit document with test cases."""
    runner = Runner(tmp_path, project_copy)
    plan = runner.run_job(wf, "plan", {}, {})
    assert plan["ok"], "\n".join(runner.log)
    build = next(j for j in matrix_of(plan["outputs"], "build") if j["id"] == "build-v0_20_2rc-vllm")
    cpu = next(j for j in matrix_of(plan["outputs"], "cpu") if j["id"] == "cpu-v0_20_2rc-vllm-ascend")
    t0 = time.monotonic()
    b = runner.run_job(wf, "build", build, {})
    assert b["ok"], "\n".join(runner.log)
    c = runner.run_job(wf, "cpu", cpu, {})
    assert c["ok"], "\n".join(runner.log)
    seconds = time.monotonic() - t0
    # The wheel and both JUnit sets were uploaded; the JUnit files lie under .kvforge-cache (hidden), so
    # they are there only because the workflow says include-hidden-files.
    assert [Path(f).name for f in runner.uploaded[build["artifact"]]] and \
        all(f.endswith(".whl") for f in runner.uploaded[build["artifact"]])
    for job in (build, cpu):
        junit = runner.uploaded[f"junit-{job['id']}"]
        assert junit, job["id"]
        assert upload_paths(b["workspace"] if job is build else c["workspace"], job["junit"], False) == [], \
            "these paths are hidden: without include-hidden-files upload-artifact would leave them out"
    # The report job: download-artifact (pattern junit-*) and the report action's glob.
    ctx_holder: dict = {}
    report_job = wf["jobs"]["report"]
    ws = runner.workspace("report")
    ctx = {"github": {"workspace": str(ws)}, "needs": {}, "matrix": {}, "vars": {}, "_job_ok": True}
    for step in report_job["steps"]:
        runner.use(step, ctx, ws)
    reports = ctx.get("reports", [])
    ctx_holder["n"] = len(reports)
    assert len(reports) == sum(len(runner.uploaded[f"junit-{j['id']}"]) for j in (build, cpu))
    cases = 0
    for r in reports:
        root = ET.parse(r).getroot()
        assert root.tag in ("testsuites", "testsuite"), r
        cases += len(root.findall(".//testcase"))
    assert cases > 0
    print("\n".join(runner.log))
    print(f"build + cpu jobs ran in {seconds:.0f}s; {len(reports)} JUnit files, {cases} test cases reported")
