"""kvforge watch: the package index's release lists, which releases are new for which target, the report and its
exit codes; for real (slow) against a local index serving PyPI's JSON for the real releases 0.21.0, 0.22.0 and
0.33.0 (tests/data/pypi_watch_index.json: their real file names and sha256 digests, copied from PyPI) with the
real sdists, checked against docs/upstream-truth.md; and the scheduled workflow (ci/github/kvforge-watch.yml):
actionlint, GitHub's workflow schema, and its `run:` steps played as a runner would, twice, with a fake `gh` on
PATH recording the issue upkeep (one create, then edits)."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import REPO_ROOT

from kvforge.core.cache import default_cache_dir
from kvforge.cli import main

INDEX = json.loads((REPO_ROOT / "tests" / "data" / "pypi_watch_index.json").read_text())
WORKFLOW = REPO_ROOT / "ci" / "github" / "kvforge-watch.yml"
USER_DOWNLOADS = default_cache_dir() / "downloads"


@contextlib.contextmanager
def serve_index(index: dict, files: Path | None = None):
    """A package index serving PyPI's JSON API shape ({url}/pypi/<package>/json) for `index`, each file's url
    pointing at {url}/files/<name>, served from `files`."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *_a):
            pass

        def do_GET(self):
            parts = self.path.strip("/").split("/")
            body = None
            if len(parts) == 3 and parts[0] == "pypi" and parts[2] == "json" and parts[1] in index:
                doc = json.loads(json.dumps(index[parts[1]]))
                for entries in doc["releases"].values():
                    for f in entries:
                        f["url"] = f"{url}/files/{f['filename']}"
                body = json.dumps(doc).encode()
            elif len(parts) == 2 and parts[0] == "files" and files is not None and (files / parts[1]).is_file():
                body = (files / parts[1]).read_bytes()
            if body is None:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield url
    finally:
        server.shutdown()
        server.server_close()


def release(version: str, sdist: bool = True, yanked: bool = False, package: str = "vllm") -> list[dict]:
    name = f"{package}-{version}.tar.gz" if sdist else f"{package}-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    return [{"filename": name, "packagetype": "sdist" if sdist else "bdist_wheel", "digests": {"sha256": "0" * 64},
             "size": 1, "yanked": yanked, "upload_time_iso_8601": "2026-01-01T00:00:00Z"}]


def small_project(root: Path, version: str, lifecycle: str | None = None, name: str = "t") -> Path:
    (root / "targets").mkdir(parents=True, exist_ok=True)
    (root / "patches" / name).mkdir(parents=True, exist_ok=True)
    (root / "patches" / name / "series").write_text("")
    life = f'lifecycle = "{lifecycle}"\n' if lifecycle else ""
    (root / "targets" / f"{name}.toml").write_text(f"""name = "{name}"
{life}
[[components]]
name = "vllm"
repo = "https://invalid.invalid/vllm.git"
ref = "v{version}"
series = "patches/{name}"
platforms = ["cpu"]

[components.release]
package = "vllm"
version = "{version}"

[components.tests]
cpu = ["tests/v1/core/test_kv_cache_utils.py"]
""")
    return root


def watch(*args: str, code: int | None = None) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, ["watch", *args])
    if code is not None:
        assert res.exit_code == code, (res.stdout, res.stderr)
    return res.exit_code, res.stdout, res.stderr


# ---------------------------------------------------------------- fast: the index and what counts as new


def test_index_releases_and_what_is_new(monkeypatch):
    """Oldest first; yanked releases and pre-releases (unless the component's own base is one, as vllm-ascend's
    rc's) are not new; one without an sdist is (its row says why it cannot be rebased onto); --since narrows;
    a package the index lacks has no releases."""
    from types import SimpleNamespace

    from kvforge.flow import watch as w
    from kvforge.project.targets import Release

    index = {"vllm": {"releases": {"0.22.0": release("0.22.0"), "0.20.2": release("0.20.2"),
                                   "0.21.0": release("0.21.0"), "0.21.1": release("0.21.1", yanked=True),
                                   "0.23.0rc1": release("0.23.0rc1"), "0.24.0": release("0.24.0", sdist=False),
                                   "bogus": release("x"), "0.25.0": []}},
             "vllm_ascend": {"releases": {"0.20.2rc1": release("0.20.2rc1", package="vllm_ascend"),
                                          "0.21.0rc1": release("0.21.0rc1", package="vllm_ascend")}}}
    with serve_index(index) as url:
        monkeypatch.setenv("KVFORGE_PYPI_URL", url)
        vllm = w.index_releases("vllm")
        ascend = w.index_releases("vllm_ascend")
        assert w.index_releases("nope") == []
    assert [r.version for r in vllm] == ["0.20.2", "0.21.0", "0.21.1", "0.22.0", "0.23.0rc1", "0.24.0"]
    assert vllm[2].yanked and vllm[5].sdist is None and vllm[0].sdist == "vllm-0.20.2.tar.gz"

    def comp(package: str, version: str):  # what new_releases reads of a component
        return SimpleNamespace(release=Release(package, version))

    from packaging.version import Version
    assert [r.version for r in w.new_releases(comp("vllm", "0.20.2"), vllm, None)] == ["0.21.0", "0.22.0", "0.24.0"]
    assert [r.version for r in w.new_releases(comp("vllm", "0.20.2"), vllm, Version("0.21.0"))] == ["0.22.0",
                                                                                                   "0.24.0"]
    assert [r.version for r in w.new_releases(comp("vllm_ascend", "0.20.2rc1"), ascend, None)] == ["0.21.0rc1"]


def test_nothing_new_and_eol_targets_exit_0(tmp_path, monkeypatch):
    """A maintained target on the newest release: nothing new (exit 0, status nothing-new); an eol target on an
    old one is not watched at all (no rebase, no row), and said so."""
    root = small_project(tmp_path / "p", "0.22.0")
    small_project(root, "0.20.2", lifecycle="eol", name="old")
    small_project(root, "nightly", name="odd")  # not a PEP 440 version: said, not watched
    monkeypatch.setenv("KVFORGE_ROOT", str(root))
    monkeypatch.setenv("KVFORGE_CACHE", str(tmp_path / "cache"))
    index = {"vllm": {"releases": {v: release(v) for v in ("0.20.2", "0.21.0", "0.22.0")}}}
    with serve_index(index) as url:
        monkeypatch.setenv("KVFORGE_PYPI_URL", url)
        _c, out, err = watch("--json", code=0)
        doc = json.loads(out)
        assert doc["status"] == "nothing-new" and doc["releases"] == [] and doc["skipped"] == ["old"]
        assert [w["target"] for w in doc["watched"]] == ["t"]
        assert "kvforge: warning: odd/vllm: its release version 'nightly' is not a PEP 440 version; not watched" in err
        _c, out, _e = watch(code=0)
        assert out.startswith(f"nothing new on {url}") and "not watched (lifecycle eol): old" in out
        _c, out, _e = watch("--format", "markdown", code=0)
        assert out.startswith("# kvforge watch") and "nothing new" in out
    assert not (tmp_path / "cache" / "rebase").exists()  # no rebase was started


def test_bad_input_and_unreachable_index(tmp_path, monkeypatch):
    root = small_project(tmp_path / "p", "0.20.2")
    monkeypatch.setenv("KVFORGE_ROOT", str(root))
    monkeypatch.setenv("KVFORGE_CACHE", str(tmp_path / "cache"))
    _c, out, err = watch("--since", "soon", "--json", code=2)
    assert json.loads(out) == {"error": "--since 'soon' is not a release version (e.g. 0.20.2)", "exit": 2}
    _c, _o, err = watch("--target", "nope", code=2)
    assert "nope" in err and "Traceback" not in err
    _c, _o, err = watch("--format", "yaml", code=2)
    _c, _o, err = watch("--checks", "-1", code=2)  # the Checks budget is a count
    assert "--checks" in err and "Traceback" not in err
    monkeypatch.setenv("KVFORGE_WATCH_CHECKS", "many")
    _c, _o, err = watch(code=2)
    assert "KVFORGE_WATCH_CHECKS" in err and "Traceback" not in err
    monkeypatch.delenv("KVFORGE_WATCH_CHECKS")
    monkeypatch.setenv("KVFORGE_PYPI_URL", "http://127.0.0.1:9")  # nothing listens there
    _c, out, err = watch("--json", code=6)
    assert "cannot read the package index http://127.0.0.1:9/pypi/vllm/json" in json.loads(out)["error"]
    assert [line for line in err.splitlines() if "error" in line or "Traceback" in line] == [
        "kvforge: error: cannot read the package index http://127.0.0.1:9/pypi/vllm/json: [Errno 111] "
        "Connection refused"]


def test_a_failed_row_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    """The index lists 0.21.0 and 0.22.0 but serves no file: each row's rebase fails on its download (the old
    base's sdist), each row says so with its exit code, the run goes on to the next, and the exit is 6
    (attention, with a network failure); JSON and markdown carry the error."""
    root = small_project(tmp_path / "p", "0.20.2")
    monkeypatch.setenv("KVFORGE_ROOT", str(root))
    monkeypatch.setenv("KVFORGE_CACHE", str(tmp_path / "cache"))
    index = {"vllm": {"releases": {v: release(v) for v in ("0.20.2", "0.21.0", "0.22.0")}}}
    with serve_index(index) as url:
        monkeypatch.setenv("KVFORGE_PYPI_URL", url)
        _c, out, err = watch("--json", code=6)
        doc = json.loads(out)
        _c, md, _e = watch("--format", "markdown", code=6)
    assert doc["status"] == "attention"
    assert doc["error"] == "attention needed for 2 of 2 new releases: vllm 0.21.0, vllm 0.22.0"
    rows = [(r["version"], c["status"], c["exit"], c["error"]) for r in doc["releases"] for c in r["checks"]]
    assert [r[:3] for r in rows] == [("0.21.0", "attention", 6), ("0.22.0", "attention", 6)]
    assert all("cannot download" in r[3] and "vllm-0.20.2.tar.gz" in r[3] for r in rows), rows
    assert doc["releases"][0]["wheels"] == {} and doc["releases"][0]["wheels_error"] is None
    assert "watch: [2/2] t/vllm 0.20.2 -> 0.22.0" in err
    assert "**error** (exit 6): cannot download" in md and "Wheels: none on the index." in md
    assert not list((tmp_path / "cache" / "downloads").glob("*.tar.gz"))
    # COLUMNS=80 kvforge watch | awk '{ if (length > 80) exit 1 }'
    with serve_index(index) as url:
        monkeypatch.setenv("KVFORGE_PYPI_URL", url)
        _c, wide, _e = watch(code=6)
        monkeypatch.setenv("COLUMNS", "80")
        _c, text, err = watch(code=6)
    assert max(len(ln) for ln in wide.splitlines()) > 80
    assert all(len(ln) <= 80 for ln in text.splitlines()), text
    assert "".join(text.split()).count("cannotdownload") == "".join(wide.split()).count("cannotdownload")
    assert "kvforge: error: attention needed" in err  # a network failure is an error, not only attention


def test_attention_is_a_result_not_an_error():
    """A new release that needs a person (a conflict, a missing wheel) is watch's normal result: said as
    "attention", exit 3; "error" only when --apply stopped or the network failed."""
    from kvforge.flow.watch import Check, ReleaseReport, WatchResult

    chk = Check("t", "vllm", "0.20.2", status="attention")
    rep = WatchResult("https://pypi.org/pypi", None, [], [ReleaseReport("vllm", "0.21.0", None, None, None,
                                                                        checks=[chk])])
    assert (rep.exit_code, rep.error_label) == (3, "attention")
    chk.error, chk.exit = "cannot download", 6
    assert (rep.exit_code, rep.error_label) == (6, "error")


def test_the_watch_workflow_passes_actionlint_and_the_schema():
    from test_matrix import tool

    subprocess.run([tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(WORKFLOW)],
                   check=True, capture_output=True)
    res = subprocess.run([tool("actionlint"), "-no-color", str(WORKFLOW)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    text = WORKFLOW.read_text()
    assert "schedule:" in text and "cron:" in text and "issues: write" in text


# ---------------------------------------------------------------- slow: real releases


REAL = ("vllm-0.20.2.tar.gz", "vllm-0.21.0.tar.gz", "vllm-0.22.0.tar.gz", "vllm-0.33.0.tar.gz")


@pytest.fixture(scope="module")
def real_files(tmp_path_factory) -> Path:
    """The real sdists (downloaded once into the user cache, checked against PyPI's sha256 in the index data)."""
    from kvforge.git.bases import download_sdist
    from kvforge.core.cache import Cache
    from kvforge.project.targets import Release

    user = Cache(default_cache_dir())
    for name in REAL:
        version = name.removeprefix("vllm-").removesuffix(".tar.gz")
        sha = next(f["digests"]["sha256"] for f in INDEX["vllm"]["releases"][version] if f["filename"] == name)

        class Wanted:  # what download_sdist reads of a component
            release = Release("vllm", version, sha)
        download_sdist(Wanted, user, print)
    return user.downloads


def project_copy(dest: Path) -> Path:
    for d in ("targets", "patches"):
        shutil.copytree(REPO_ROOT / d, dest / d)
    return dest


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for d in ("patches", "targets")
            for p in sorted((root / d).rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_watch_real_releases_agree_with_upstream_truth(real_files, tmp_path):
    """v0.20.2rc against a local index with the real 0.21.0, 0.22.0 and 0.33.0 (an empty cache: the sdists are
    served by the index and downloaded, sha256-checked). docs/upstream-truth.md: 0.21.0 has none of the fixes
    (all carried, clean); 0.22.0 has only half of swa-reachable-cache-mask: never dropped, it conflicts;
    0.33.0 has 0001/0002/0004/0005 (dropped on their Drop-When) and not kv-events-token-ids (conflict).
    The wheels are the real ones (0.21.0's first upload, manylinux_2_24, not its -1- rebuild from another commit). Nothing in the project is written."""
    root = project_copy(tmp_path / "project")
    before = files_of(root)
    # No Checks run here (an empty cache has no test environment): behaviour's verdicts are
    # tests/test_watch_behaviour.py's; here the rows beyond the budget say so.
    env = {**os.environ, "KVFORGE_ROOT": str(root), "KVFORGE_CACHE": str(tmp_path / "cache"), "KVFORGE_WATCH_CHECKS": "0"}
    for k in ("KVFORGE_OFFLINE", "KVFORGE_VLLM_REPO", "KVFORGE_CRASH_AT"):
        env.pop(k, None)
    with serve_index(INDEX, real_files) as url:
        env["KVFORGE_PYPI_URL"] = url
        res = subprocess.run([sys.executable, "-m", "kvforge.cli", "watch", "-t", "v0.20.2rc", "--json"], env=env,
                             capture_output=True, text=True, timeout=900)
        assert res.returncode == 3, res.stderr[-3000:]  # attention needed
        doc = json.loads(res.stdout)
        md = subprocess.run([sys.executable, "-m", "kvforge.cli", "watch", "-t", "v0.20.2rc", "--format", "markdown"],
                            env=env, capture_output=True, text=True, timeout=900)
    assert "watch: [1/3] v0.20.2rc/vllm 0.20.2 -> 0.21.0" in res.stderr  # progress on stderr
    assert doc["status"] == "attention" and doc["index"] == url
    assert [(r["package"], r["version"], r["status"]) for r in doc["releases"]] == [
        ("vllm", "0.21.0", "clean"), ("vllm", "0.22.0", "attention"), ("vllm", "0.33.0", "attention")]
    verdicts = {r["version"]: {p["fix_id"]: p["verdict"] for p in r["checks"][0]["patches"]} for r in doc["releases"]}
    assert all(len(r["checks"]) == 1 and r["checks"][0]["target"] == "v0.20.2rc" for r in doc["releases"])
    assert set(verdicts["0.21.0"].values()) == {"carried"}
    assert verdicts["0.22.0"]["two-phase-kv-alloc"] == "carried"
    assert verdicts["0.22.0"]["swa-reachable-cache-mask"] == "conflict"
    assert "upstream" not in verdicts["0.22.0"].values()
    assert verdicts["0.33.0"] == {"two-phase-kv-alloc": "upstream", "swa-reachable-cache-mask": "upstream",
                                  "kv-events-token-ids": "conflict", "swa-retention-queue-split": "upstream",
                                  "eagle-lookahead-block-hashes": "upstream"}
    dw = {r["version"]: {p["fix_id"]: p["drop_when"]["state"] for p in r["checks"][0]["patches"]}
          for r in doc["releases"]}
    assert dw["0.22.0"]["swa-reachable-cache-mask"] == "not met" and dw["0.33.0"]["two-phase-kv-alloc"] == "met"
    assert dw["0.33.0"]["kv-events-token-ids"] == "cannot tell"
    assert doc["releases"][0]["wheels"]["x86_64"]["filename"] == "vllm-0.21.0-cp38-abi3-manylinux_2_24_x86_64.whl"
    assert doc["releases"][0]["wheels"]["x86_64"]["sha256"] == next(
        f["digests"]["sha256"] for f in INDEX["vllm"]["releases"]["0.21.0"]
        if f["filename"] == "vllm-0.21.0-cp38-abi3-manylinux_2_24_x86_64.whl")
    assert doc["releases"][1]["title"] == "kvforge watch: vllm 0.22.0"
    assert "<!-- kvforge-watch: vllm 0.22.0 -->" in doc["releases"][1]["markdown"]
    assert md.returncode == 3 and "| 2 | `0002-swa-reachable-cache-mask.patch` | **conflict** |" in md.stdout
    assert files_of(root) == before  # a dry run: nothing written in the project
    assert sorted(p.name for p in (tmp_path / "cache" / "downloads").glob("*.tar.gz")) == sorted(REAL)
    decided = {r["version"]: {p["fix_id"]: (p["decision"], p["behaviour"]) for p in r["checks"][0]["patches"]}
               for r in doc["releases"]}
    assert decided["0.22.0"]["swa-reachable-cache-mask"] == ("needs a person", "not checked: budget")
    assert decided["0.22.0"]["two-phase-kv-alloc"] == ("carried", None)
    assert decided["0.33.0"]["kv-events-token-ids"] == ("needs a person", "not checked: budget")
    assert [r["cost"] for r in doc["releases"]] == [0, sum(v == "conflict" for v in verdicts["0.22.0"].values()), 1]
    assert doc["checks_run"] == 0


FAKE_GH = r'''#!/usr/bin/env python3
"""A fake `gh`: records every call; keeps issues in a JSON file (label create, issue list/create/edit)."""
import json, sys, os
state, log = {state!r}, {log!r}
args = sys.argv[1:]
with open(log, "a") as f:
    f.write(json.dumps({{"args": args, "repo": os.environ.get("GH_REPO"),
                        "token": "GH_TOKEN" in os.environ}}) + "\n")
issues = json.load(open(state))
def opt(name):
    return args[args.index(name) + 1] if name in args else None
if args[:2] == ["label", "create"]:
    sys.exit(0)
if args[:2] == ["issue", "list"]:
    label = opt("--label")
    print(json.dumps([{{"number": i["number"], "title": i["title"]}} for i in issues if label in i["labels"]]))
    sys.exit(0)
if args[:2] == ["issue", "create"]:
    n = max([i["number"] for i in issues] + [0]) + 1
    issues.append({{"number": n, "title": opt("--title"), "labels": [opt("--label")],
                   "body": open(opt("--body-file")).read(), "edits": 0}})
elif args[:2] == ["issue", "edit"]:
    issue = next(i for i in issues if i["number"] == int(args[2]))
    issue["body"] = open(opt("--body-file")).read()
    issue["edits"] += 1
else:
    sys.exit("fake gh: unexpected " + " ".join(args))
json.dump(issues, open(state, "w"))
'''


@pytest.mark.slow
def test_scheduled_workflow_keeps_one_issue_per_release(real_files, tmp_path, monkeypatch):
    """The workflow's steps, as a runner plays them (tests/test_workflow_run.py's Runner: checkout, setup-python,
    the cache restoring downloads, then every `run:` step with the GITHUB_* variables), twice. The index is the
    local one (vLLM 0.21.0 new for v0.20.2rc: repository variable KVFORGE_WATCH_ARGS="--target v0.20.2rc");
    `gh` is a fake on PATH. First run: one issue created for vllm 0.21.0 with the markdown body; second run: that
    issue edited, none created; an issue of the label with another title (another release) is left alone."""
    from test_workflow_run import Runner, yaml

    wf = yaml().load(WORKFLOW.read_text())
    index = {"vllm": {"info": INDEX["vllm"]["info"],
                      "releases": {v: INDEX["vllm"]["releases"][v] for v in ("0.20.2", "0.21.0")}},
             "vllm_ascend": INDEX["vllm_ascend"]}
    bindir = tmp_path / "bin"
    bindir.mkdir()
    state, log = tmp_path / "issues.json", tmp_path / "gh.log"
    state.write_text(json.dumps([{"number": 7, "title": "kvforge watch: vllm 0.20.9", "labels": ["kvforge-watch"],
                                  "body": "old", "edits": 0}]))
    gh = bindir / "gh"
    gh.write_text(FAKE_GH.format(state=str(state), log=str(log)))
    gh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    checkout = project_copy(tmp_path / "checkout")
    shutil.copytree(REPO_ROOT / "kvforge", checkout / "kvforge", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO_ROOT / "pyproject.toml", checkout / "pyproject.toml")
    shutil.copy2(REPO_ROOT / "README.md", checkout / "README.md")
    (tmp_path / "runner").mkdir()
    runner = Runner(tmp_path / "runner", checkout)
    variables = {"KVFORGE_WATCH_ARGS": "--target v0.20.2rc"}
    runs = []
    with serve_index(index, real_files) as url:
        wf["env"]["KVFORGE_PYPI_URL"] = url  # the one thing replaced: the package index
        for _ in range(2):
            job = runner.run_job(wf, "watch", {}, variables)
            assert job["ok"], "\n".join(runner.log)
            runs.append(job)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert all(c["repo"] == "fork/kvforge" and c["token"] for c in calls)  # GH_REPO, GH_TOKEN (github.token) given
    kinds = [" ".join(c["args"][:2]) for c in calls]
    assert kinds == ["label create", "issue list", "issue create"] + ["label create", "issue list", "issue edit"]
    issues = json.loads(state.read_text())
    assert [(i["number"], i["title"], i["edits"]) for i in issues] == [
        (7, "kvforge watch: vllm 0.20.9", 0), (8, "kvforge watch: vllm 0.21.0", 1)]
    assert issues[1]["body"].startswith("<!-- kvforge-watch: vllm 0.21.0 -->")
    assert "| v0.20.2rc | vllm | 0.20.2 | clean | 5 carried |" in issues[1]["body"]
    assert calls[5]["args"][2] == "8"
    summary = (Path(str(runs[1]["workspace"]) + ".temp") / "summary").read_text()
    assert "# kvforge watch: clean" in summary and "## vllm 0.21.0: all clean" in summary


@pytest.mark.slow
def test_watch_apply_adds_the_clean_release_as_a_target(real_files, tmp_path):
    """--apply against the same local index, watching v0.20.1: 0.21.0 is clean (every patch carried) and becomes
    target v0.21.0 through target add (from v0.20.1); 0.22.0 and 0.33.0 need attention and are not added."""
    root = project_copy(tmp_path / "project")
    env = {**os.environ, "KVFORGE_ROOT": str(root), "KVFORGE_CACHE": str(tmp_path / "cache"), "KVFORGE_WATCH_CHECKS": "0"}
    for k in ("KVFORGE_OFFLINE", "KVFORGE_VLLM_REPO", "KVFORGE_CRASH_AT"):
        env.pop(k, None)
    with serve_index(INDEX, real_files) as url:
        env["KVFORGE_PYPI_URL"] = url
        res = subprocess.run([sys.executable, "-m", "kvforge.cli", "watch", "-t", "v0.20.1", "--apply", "--json"],
                             env=env, capture_output=True, text=True, timeout=1800)
        doc = json.loads(res.stdout)
        assert res.returncode == 3, res.stderr[-3000:]  # 0.22.0 and 0.33.0 still need attention
        status = {r["version"]: r["status"] for r in doc["releases"] if r["package"] == "vllm"}
        # 0.20.2 is clean too but has its target (v0.20.2rc): only 0.21.0 is added
        assert status == {"0.20.2": "clean", "0.21.0": "clean", "0.22.0": "attention", "0.33.0": "attention"}
        (added,) = doc["applied"]
        assert (added["name"], added["state"], added["from_target"]) == ("v0.21.0", "done", "v0.20.1")
        target = (root / "targets" / "v0.21.0.toml").read_text()
        assert 'version = "0.21.0"' in target and "vllm-0.21.0-cp38-abi3-manylinux_2_24_x86_64.whl" in target
        assert (root / "patches" / "v0.21.0" / "series").read_text().split() == \
            (root / "patches" / "v0.20.1" / "series").read_text().split()
        lint = subprocess.run([sys.executable, "-m", "kvforge.cli", "lint"], env=env, capture_output=True, text=True)
        assert lint.returncode == 0, lint.stdout + lint.stderr
        # again: the release has its target now, nothing more is added
        again = subprocess.run([sys.executable, "-m", "kvforge.cli", "watch", "-t", "v0.20.1", "--apply", "--json"],
                               env=env, capture_output=True, text=True, timeout=1800)
        assert json.loads(again.stdout)["applied"] == []
