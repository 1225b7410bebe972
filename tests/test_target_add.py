"""kvforge target add: a complete new target for a vLLM release, all files or none.

Fast tests use a local package index (file:// JSON, $KVFORGE_PYPI_URL) and fakes only for input checks and the
target file renderer. The slow tests use real releases from PyPI (vllm 0.21.0 and 0.22.0, vllm_ascend 0.20.2rc1-0.23.0:
real sdists imported as bases, real file lists for the wheel pins) and this project's real series.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvforge.core.cache import Cache, default_cache_dir
from kvforge.cli import main

REPO_ROOT = Path(__file__).resolve().parent.parent


def kvforge(*args: str):
    return CliRunner().invoke(main, list(args))


def run_kvforge(*args: str, crash_at: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KVFORGE_CRASH_AT"}
    if crash_at:
        env["KVFORGE_CRASH_AT"] = crash_at
    return subprocess.run([sys.executable, "-c", "from kvforge.cli import main; main()", *args], env=env,
                          capture_output=True, text=True, timeout=900, cwd=cwd)


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for d in ("patches", "targets") for p in sorted((root / d).rglob("*")) if p.is_file()}


def one_line(r) -> bool:
    """One error line, no traceback (progress lines may come before it)."""
    lines = r.stderr.strip().splitlines()
    return bool(lines) and lines[-1].startswith("kvforge: error: ") and "Traceback" not in r.stderr \
        and sum(ln.startswith("kvforge: error: ") for ln in lines) == 1


@pytest.fixture()
def copy_project(tmp_path, monkeypatch) -> Path:
    """This project's targets/ and patches/ copied into tmp_path (the project itself is never written)."""
    root = tmp_path / "project"
    for d in ("targets", "patches"):
        shutil.copytree(REPO_ROOT / d, root / d)
    monkeypatch.setenv("KVFORGE_ROOT", str(root))
    monkeypatch.delenv("KVFORGE_OFFLINE", raising=False)
    monkeypatch.delenv("KVFORGE_VLLM_REPO", raising=False)
    monkeypatch.delenv("KVFORGE_VLLM_ASCEND_REPO", raising=False)
    return root


ASCEND_DOCKERFILES = {  # vllm_ascend release -> its sdist's Dockerfile (None: the sdist has none)
    "0.20.2rc1": "ARG VLLM_TAG=v0.20.2\n",
    "0.21.0rc1": "FROM base\nARG VLLM_REPO=https://github.com/vllm-project/vllm.git\nARG VLLM_TAG=v0.21.0\n"
                 'ARG VLLM_COMMIT=""\n',
    "0.21.0rc2": "ARG VLLM_TAG=v0.21.0\nARG VLLM_COMMIT=0123456789abcdef0123\n",  # a commit: not a release
    "0.21.0rc3": None,
    "0.22.1rc1": "ARG VLLM_TAG=v0.22.1\n",
}


def small_sdist(path: Path, top: str, dockerfile: str | None) -> None:
    """A tiny sdist: a module, and the Dockerfile (when given) after it, as in the real ones."""
    with tarfile.open(path, "w:gz") as tar:
        for name, text in (("vllm_ascend/__init__.py", ""), ("Dockerfile", dockerfile)):
            if text is None:
                continue
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))


@pytest.fixture()
def local_index(tmp_path, monkeypatch) -> Path:
    """A package index of JSON files (PyPI's JSON API shape) at file://: vllm 0.20.2 .. 0.22.0, vllm_ascend
    (its sdists are real small tarballs with the Dockerfiles above). The cache is tmp_path's."""
    root = tmp_path / "index"
    (root / "pypi" / "vllm_ascend").mkdir(parents=True)
    monkeypatch.setenv("KVFORGE_CACHE", str(tmp_path / "cache"))

    def files(names: list[str]) -> list[dict]:
        out = []
        for n in names:
            data = n.encode()
            if n.startswith("vllm_ascend-"):
                version = n.removeprefix("vllm_ascend-").removesuffix(".tar.gz")
                small_sdist(root / "pypi" / "vllm_ascend" / n, n.removesuffix(".tar.gz"), ASCEND_DOCKERFILES[version])
                data = (root / "pypi" / "vllm_ascend" / n).read_bytes()
            out.append({"filename": n, "packagetype": "sdist" if n.endswith(".tar.gz") else "bdist_wheel",
                        "digests": {"sha256": hashlib.sha256(data).hexdigest()}, "url": n, "size": len(data)})
        return out

    releases = {
        "vllm": {"0.21.0": files(["vllm-0.21.0.tar.gz", "vllm-0.21.0-cp38-abi3-manylinux_2_24_x86_64.whl",
                                  "vllm-0.21.0-1-cp38-abi3-manylinux_2_24_x86_64.whl",
                                  "vllm-0.21.0-cp38-abi3-manylinux_2_24_aarch64.whl"]),
                 "0.22.0": files(["vllm-0.22.0.tar.gz"]), "9.9.9": []},
        "vllm_ascend": {v: files([f"vllm_ascend-{v}.tar.gz"]) for v in ASCEND_DOCKERFILES},
    }
    releases["vllm_ascend"]["0.22.0rc1"] = []  # listed without files: never a candidate
    for package, rel in releases.items():
        (root / "pypi" / package).mkdir(parents=True, exist_ok=True)
        (root / "pypi" / package / "json").write_text(json.dumps({"releases": rel}))
    monkeypatch.setenv("KVFORGE_PYPI_URL", root.as_uri())
    return root


# ---------------------------------------------------------------- fast: the index, the renderer, bad input


def test_pins_and_matching_release_from_the_index(local_index):
    from kvforge.flow.rebase.onto import matching_release, release_pins, release_ref

    pins = release_pins("vllm", "0.21.0")
    assert pins is not None and pins.sha256 == hashlib.sha256(b"vllm-0.21.0.tar.gz").hexdigest()
    # the first upload, not the re-released build 1 (PyPI's vLLM rebuilds come from another commit)
    assert [w.filename for w in pins.wheels] == ["vllm-0.21.0-cp38-abi3-manylinux_2_24_aarch64.whl",
                                                 "vllm-0.21.0-cp38-abi3-manylinux_2_24_x86_64.whl"]
    assert release_pins("vllm", "9.9.9") is None
    assert release_ref("vllm_ascend", "0.21.0rc2") == "releases/v0.21.0rc"
    assert release_ref("vllm", "0.21.0") == "v0.21.0"


def test_matching_release_is_what_the_sdists_dockerfile_builds_on(local_index, tmp_path, monkeypatch):
    """The vllm_ascend release for a vLLM version is the newest whose sdist's Dockerfile says VLLM_TAG=v<version>,
    not the one named like it: a pinned VLLM_COMMIT is not a release, a sdist without a Dockerfile says nothing.
    Each sdist is downloaded once, sha256-checked; a cached copy that is not the index's is fetched again."""
    from kvforge.git import bases
    from kvforge.flow.rebase.onto import matching_release
    from kvforge.flow.targetadd import left_out_reason

    downloads = tmp_path / "downloads"
    downloads.mkdir()
    fetched: list[str] = []
    real = bases.download_pinned
    monkeypatch.setattr("kvforge.flow.rebase.onto.download_pinned",
                        lambda url, dest, *a, **k: (fetched.append(dest.name), real(url, dest, *a, **k))[1])
    found, looked = matching_release("vllm_ascend", "0.21.0", downloads)
    assert found == "0.21.0rc1"  # rc2 pins a commit, rc3 has no Dockerfile, 0.22.1rc1 is built on v0.22.1
    assert [(k.version, k.vllm_tag) for k in looked] == [("0.22.1rc1", "v0.22.1"), ("0.21.0rc3", None),
                                                         ("0.21.0rc2", None), ("0.21.0rc1", "v0.21.0")]
    assert "VLLM_COMMIT" in looked[2].built_on and "not a release" in looked[2].built_on
    assert looked[1].built_on == "no Dockerfile in its sdist"
    assert sorted(fetched) == [f"vllm_ascend-{v}.tar.gz" for v in ("0.21.0rc1", "0.21.0rc2", "0.21.0rc3", "0.22.1rc1")]
    assert matching_release("vllm_ascend", "0.22.1", downloads)[0] == "0.22.1rc1"
    assert matching_release("vllm_ascend", "0.20.2", downloads)[0] == "0.20.2rc1"
    assert len(fetched) == 5  # 0.20.2rc1 once more; every other sdist came from the cache
    found, looked = matching_release("vllm_ascend", "0.22.0", downloads)
    assert found is None and [k.version for k in looked] == ["0.22.1rc1", "0.21.0rc3", "0.21.0rc2", "0.21.0rc1"]
    why = left_out_reason("vllm_ascend", "0.22.0", looked)
    assert "vllm_ascend 0.22.1rc1 is built on vLLM v0.22.1 (its Dockerfile's VLLM_TAG), not 0.22.0" in why
    assert "vllm_ascend 0.21.0rc1 is built on vLLM v0.21.0" in why and "add the component" in why
    assert matching_release("vllm_ascend", "0.40.0", downloads) == (None, [])
    assert "no release near vLLM 0.40.0" in left_out_reason("vllm_ascend", "0.40.0", [])
    (downloads / "vllm_ascend-0.22.1rc1.tar.gz").write_bytes(b"not the index's file")
    assert matching_release("vllm_ascend", "0.22.1", downloads)[0] == "0.22.1rc1"
    assert fetched[-1] == "vllm_ascend-0.22.1rc1.tar.gz" and len(fetched) == 6


def test_render_target_round_trips_every_shipped_target():
    """render_target writes every key parse_target reads: each shipped target, rendered and parsed again, is the
    same target (wheels as [[components.wheels]], lifecycle)."""
    from dataclasses import replace

    from kvforge.flow.rebase.retarget import render_target
    from kvforge.project.targets import load_all, parse_target

    for t in load_all(REPO_ROOT):
        text = render_target(replace(t, lifecycle="maintained"), REPO_ROOT, ["a header"])
        assert text.startswith("# a header\n") and 'lifecycle = "maintained"' in text
        probe = REPO_ROOT / "targets" / f".probe-{os.getpid()}"
        probe.mkdir()
        try:
            path = probe / f"{t.name}.toml"
            path.write_text(text)
            again = parse_target(path, REPO_ROOT)
        finally:
            shutil.rmtree(probe)
        assert again.components == t.components and again.description == t.description


def test_retarget_text_replaces_every_wheel_table():
    from kvforge.flow.rebase.retarget import retarget_text

    text = (REPO_ROOT / "targets" / "v0.20.2rc.toml").read_text()
    pins = [("vllm-0.21.0-1-cp38-abi3-manylinux_2_24_x86_64.whl", "b" * 64),
            ("vllm-0.21.0-1-cp38-abi3-manylinux_2_24_aarch64.whl", "c" * 64)]
    out = retarget_text(text, 0, ref="v0.21.0", version="0.21.0", sha256="a" * 64, wheel=None, old_version="0.20.2",
                        wheels=pins)
    again = retarget_text(out, 0, ref="v0.22.0", version="0.22.0", sha256="d" * 64, wheel=None,
                          old_version="0.21.0", wheels=[("vllm-0.22.0-cp38-abi3-manylinux_2_28_x86_64.whl", "e" * 64)])
    for doc, want in ((out, [p[0] for p in pins]), (again, ["vllm-0.22.0-cp38-abi3-manylinux_2_28_x86_64.whl"])):
        data = tomllib.loads(doc)
        assert [w["filename"] for w in data["components"][0]["wheels"]] == want
        assert "wheel" not in data["components"][0]
        assert data["components"][1]["wheels"] == tomllib.loads(text)["components"][1]["wheels"]  # vllm-ascend's own


@pytest.mark.parametrize("args, exit_code, words", [
    (["0.21"], 2, "not a vLLM release version"),
    (["0.21.0\n"], 2, "not a vLLM release version"),
    (["0.20.2", "--as", "v0.20.2rc"], 2, "targets/v0.20.2rc.toml exists"),
    (["0.20.2", "--as", "x" * 300], 2, "300 characters"),
    (["0.20.2", "--from", "nope"], 2, "unknown target"),
    (["0.20.0"], 2, "no maintained target has a vLLM base older"),
    (["--continue"], 2, "no target add in progress"),
    (["--abort", "--as", "v0.30.0"], 2, "no target add of v0.30.0 in progress"),
    (["0.21.0", "--continue"], 2, "takes no VERSION"),
    (["--continue", "--try"], 2, "takes no VERSION"),
    (["--continue", "--abort"], 2, "exclude each other"),
    ([], 2, "VERSION is required"),
])
def test_bad_input_is_one_line_and_writes_nothing(copy_project, args, exit_code, words):
    before = snapshot(copy_project)
    r = kvforge("target", "add", *args)
    assert r.exit_code == exit_code and one_line(r) and words in r.stderr, r.output
    assert snapshot(copy_project) == before


def test_an_existing_patches_dir_is_never_overwritten(copy_project, local_index):
    (copy_project / "patches" / "v0.21.0").mkdir()
    (copy_project / "patches" / "v0.21.0" / "mine.patch").write_text("my work\n")
    before = snapshot(copy_project)
    r = kvforge("target", "add", "0.21.0", "--json")
    assert r.exit_code == 2 and "patches/v0.21.0 exists" in r.stderr
    assert json.loads(r.stdout) == {"error": json.loads(r.stdout)["error"], "exit": 2}
    assert snapshot(copy_project) == before


def test_offline_and_an_unreachable_index_are_exit_6(copy_project, monkeypatch):
    before = snapshot(copy_project)
    monkeypatch.setenv("KVFORGE_OFFLINE", "1")
    r = kvforge("target", "add", "0.21.0")
    assert r.exit_code == 6 and one_line(r) and "package index" in r.stderr, r.output
    monkeypatch.delenv("KVFORGE_OFFLINE")
    monkeypatch.setenv("KVFORGE_PYPI_URL", "http://127.0.0.1:9")
    r = kvforge("target", "add", "0.21.0", "--json")
    assert r.exit_code == 6 and json.loads(r.stdout)["exit"] == 6
    assert snapshot(copy_project) == before


def test_a_version_the_index_does_not_have_is_exit_2(copy_project, local_index):
    r = kvforge("target", "add", "9.9.9")
    assert r.exit_code == 2 and one_line(r) and "not a release with an sdist" in r.stderr, r.output


def test_help_names_the_steps():
    r = kvforge("target", "add", "--help")
    assert r.exit_code == 0
    for word in ("--continue", "--skip", "--abort", "--dry-run", "--try", "--from", "--as", "[[components.wheels]]",
                 "exit 3", "exit 6"):
        assert word in r.output


# ---------------------------------------------------------------- slow: real releases


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory) -> Cache:
    """A test cache for this module's slow tests (their bases and v0.20.2rc's stacks are made once), seeded with
    the release sdists the user cache holds (downloaded there once)."""
    cache = Cache(tmp_path_factory.mktemp("target-add-cache"))
    user = default_cache_dir() / "downloads"
    for name in ("vllm-0.20.2.tar.gz", "vllm-0.21.0.tar.gz", "vllm-0.22.0.tar.gz", "vllm-0.22.1.tar.gz",
                 "vllm_ascend-0.20.2rc1.tar.gz",
                 "vllm_ascend-0.21.0rc1.tar.gz", "vllm_ascend-0.22.1rc1.tar.gz", "vllm_ascend-0.23.0rc1.tar.gz",
                 "vllm_ascend-0.23.0.tar.gz", "vllm_ascend-0.23.0.post1.tar.gz"):
        if (user / name).is_file():
            shutil.copy2(user / name, cache.downloads / name)
    return cache


@pytest.fixture()
def real_cache(module_cache, monkeypatch) -> Cache:
    monkeypatch.setenv("KVFORGE_CACHE", str(module_cache.root))
    return module_cache


def resolve_all(worktree: Path, side: str) -> None:
    """A mechanical resolution: every conflicted file taken whole from one side (`--ours`: the new release's
    file, the patch's hunks there dropped; `--theirs`: the file as the patch left it on the old release)."""
    unmerged = subprocess.run(["git", "diff", "--name-only", "--diff-filter=U"], cwd=worktree, check=True,
                              capture_output=True, text=True).stdout.split()
    assert unmerged, "stopped at a conflict with nothing unmerged"
    for f in unmerged:
        subprocess.run(["git", "checkout", f"--{side}", "--", f], cwd=worktree, check=True)
        subprocess.run(["git", "add", "--", f], cwd=worktree, check=True)


def drive(first: subprocess.CompletedProcess, name: str, side: str) -> tuple[dict, list[tuple[str, str]]]:
    """Resolve each stop mechanically and --continue until the target add is done: (the last JSON, the patches
    it stopped at)."""
    r, stops = first, []
    for _ in range(12):
        data = json.loads(r.stdout)
        if r.returncode == 0:
            return data, stops
        assert r.returncode == 3, r.stderr
        comp = next(c for c in data["components"] if c["name"] == data["stopped_component"])
        stops.append((comp["name"], next(p["name"] for p in comp["patches"] if p["verdict"] == "conflict")))
        resolve_all(Path(data["worktree"]), side)
        r = run_kvforge("target", "add", "--continue", "--as", name, "--json")
    raise AssertionError("target add did not finish")


@pytest.mark.slow
def test_add_0220_stops_at_the_swa_mask_conflict_then_continues(copy_project, real_cache):
    """Done-when: `target add 0.22.0` stops at swa-reachable-cache-mask (0.22.0 has half of it: never dropped),
    nothing written; --abort leaves everything; after a (mechanical) resolution --continue, killed once inside its
    commit and run again, gives a complete target that lints, applies and is in the matrix."""
    before = snapshot(copy_project)
    r = run_kvforge("target", "add", "0.22.0", "--json")
    assert r.returncode == 3, r.stderr
    data = json.loads(r.stdout)
    vllm = data["components"][0]
    assert data["from_target"] == "v0.20.2rc" and data["stopped_component"] == "vllm"
    verdicts = {p["name"]: p["verdict"] for p in vllm["patches"]}
    assert verdicts["0002-swa-reachable-cache-mask.patch"] == "conflict" and "upstream" not in verdicts.values()
    ascend = data["components"][1]
    assert ascend["name"] == "vllm-ascend"  # none of its releases near 0.22.0 is built on it (their Dockerfiles)
    assert "vllm_ascend 0.22.1rc1 is built on vLLM v0.22.1 (its Dockerfile's VLLM_TAG), not 0.22.0" \
        in ascend["left_out"]
    assert snapshot(copy_project) == before  # nothing in targets/ or patches/
    r = kvforge("target", "add", "--abort")
    assert r.exit_code == 0 and "as they were" in r.output and snapshot(copy_project) == before

    r = run_kvforge("target", "add", "0.22.0", "--json")
    assert r.returncode == 3
    data = json.loads(r.stdout)
    resolve_all(Path(data["worktree"]), "ours")
    r = run_kvforge("target", "add", "--continue", "--json")
    while r.returncode == 3:
        resolve_all(Path(json.loads(r.stdout)["worktree"]), "ours")
        r = run_kvforge("target", "add", "--continue", "--json", crash_at="targetadd:swapped")
    assert r.returncode == -9, r.stderr  # killed after patches/v0.22.0 was written, before the target file
    assert (copy_project / "patches" / "v0.22.0" / "series").is_file()
    assert not (copy_project / "targets" / "v0.22.0.toml").exists()
    r = run_kvforge("target", "add", "--continue", "--json")
    assert r.returncode == 0, r.stderr
    done = json.loads(r.stdout)
    assert done["state"] == "done" and done["written"][-1].endswith("targets/v0.22.0.toml")

    target = tomllib.loads((copy_project / "targets" / "v0.22.0.toml").read_text())
    assert target["lifecycle"] == "maintained" and len(target["components"]) == 1
    comp = target["components"][0]
    assert comp["ref"] == "v0.22.0" and comp["release"]["version"] == "0.22.0"
    assert comp["release"]["sha256"] == "6d41581a9e5288cd69278518a550c6d7ce510ae27a506556a3427d01284be7fe"
    assert sorted(w["filename"] for w in comp["wheels"]) == ["vllm-0.22.0-cp38-abi3-manylinux_2_28_aarch64.whl",
                                                             "vllm-0.22.0-cp38-abi3-manylinux_2_28_x86_64.whl"]
    assert "tests/v1/kv_connector/unit/test_backwards_compatibility.py" not in comp["tests"]["cpu"]  # not in 0.22.0
    text = (copy_project / "targets" / "v0.22.0.toml").read_text()
    assert "vllm-ascend is left out" in text and "upstream commit 0b3ba88f1" in text
    assert (copy_project / "patches" / "v0.22.0" / "series").read_text().split() == \
        (REPO_ROOT / "patches" / "v0.20.2rc" / "series").read_text().split()
    assert {k: v for k, v in snapshot(copy_project).items() if "v0.22.0" not in k} == before

    lint = kvforge("lint", "-t", "v0.22.0")
    assert lint.exit_code == 0, lint.output
    assert kvforge("lint", "-t", "v0.22.0", "--selections").exit_code == 0
    r = kvforge("matrix", "--format", "json")
    assert r.exit_code == 0 and "v0.22.0" in r.output
    r = run_kvforge("apply", "-t", "v0.22.0", "--into", str(copy_project.parent / "tree"), "--json")
    assert r.returncode == 0, r.stderr
    r = kvforge("target", "add", "0.22.0")
    assert r.exit_code == 2 and "exists" in r.stderr  # never overwritten


@pytest.mark.slow
def test_add_0210_leaves_out_vllm_ascend_built_on_0221(copy_project, real_cache):
    """Done-when: `target add 0.21.0`: vLLM's series carries onto 0.21.0 (wheels: the first upload,
    manylinux_2_24, built from the sdist's commit; not the `-1-` rebuild); vllm-ascend is left out: vllm_ascend 0.21.0rc1 is named like 0.21.0 but its sdist's
    Dockerfile builds on vLLM v0.22.1 (0.21.0 lacks the fused_moe.expert_map_manager it imports), and no other
    release near it builds on v0.21.0. The target lints, applies and is in the matrix."""
    r = run_kvforge("target", "add", "0.21.0", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    vllm, ascend = data["components"]
    assert [p["verdict"] for p in vllm["patches"]] == ["carried"] * 5
    assert ascend["name"] == "vllm-ascend" and ascend["version"] is None
    assert ("vllm_ascend 0.21.0rc1 is built on vLLM v0.22.1 (its Dockerfile's VLLM_TAG), not 0.21.0"
            in ascend["left_out"])
    assert "vllm_ascend 0.20.2rc1 is built on vLLM v0.20.2" in ascend["left_out"]
    target = tomllib.loads((copy_project / "targets" / "v0.21.0.toml").read_text())
    assert [c["name"] for c in target["components"]] == ["vllm"]
    assert [w["filename"] for w in target["components"][0]["wheels"]] == [
        "vllm-0.21.0-cp38-abi3-manylinux_2_24_aarch64.whl", "vllm-0.21.0-cp38-abi3-manylinux_2_24_x86_64.whl"]
    text = (copy_project / "targets" / "v0.21.0.toml").read_text()
    assert "vllm-ascend is left out: vllm_ascend 0.22.1rc1 is built on vLLM v0.22.1" in text
    assert not (copy_project / "patches" / "v0.21.0-vllm-ascend").exists()
    assert kvforge("lint", "-t", "v0.21.0").exit_code == 0
    r = kvforge("matrix")
    assert r.exit_code == 0 and "v0_21_0" in r.output and "build-v0_21_0-vllm-ascend" not in r.output
    r = run_kvforge("apply", "-t", "v0.21.0", "--json", cwd=copy_project.parent)
    assert r.returncode == 0, r.stderr
    assert (copy_project.parent / "vllm-v0.21.0").is_dir()
    assert not (copy_project.parent / "vllm-ascend-v0.21.0").exists()


@pytest.mark.slow
def test_add_0221_dry_run_pairs_vllm_ascend_0221rc1(copy_project, real_cache):
    """vLLM 0.22.1 pairs with vllm_ascend 0.22.1rc1, the newest release whose sdist's Dockerfile says
    VLLM_TAG=v0.22.1 (0.23.0* say v0.23.0: reported); --dry-run plans both components and writes nothing."""
    before = snapshot(copy_project)
    r = run_kvforge("target", "add", "0.22.1", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["state"] == "planned" and snapshot(copy_project) == before
    vllm, ascend = data["components"]
    assert vllm["version"] == "0.22.1" and vllm["sha256"].startswith("cd34902729f3")
    assert ascend["version"] == "0.22.1rc1" and ascend["ref"] == "releases/v0.22.1rc" and not ascend["left_out"]
    assert ascend["sha256"] == "8b2dc4585ec4f92332afa00dc301f5fbc669904366959a02dce81603a4351d56"
    assert all(w["filename"].startswith("vllm_ascend-0.22.1rc1-") for w in ascend["wheels"]) and ascend["wheels"]
    series = (REPO_ROOT / "patches" / "v0.20.2rc-vllm-ascend" / "series").read_text().splitlines()
    assert [p["name"] for p in ascend["patches"]] == [ln for ln in series if ln and not ln.startswith("#")]
    assert "vllm-ascend: vllm_ascend 0.23.0 is built on vLLM v0.23.0 (its Dockerfile's VLLM_TAG), not 0.22.1" \
        in data["notes"]


@pytest.mark.slow
def test_first_target_in_a_project_without_targets(tmp_path, monkeypatch, real_cache):
    """A new patch repository (kvforge init): no target to seed from, so the first target has vLLM's pins, its
    upstream commit, an empty series, and as CPU selection vLLM's own cpu_test-marked core suites of the release
    (the selection `kvforge init --release` writes); it lints, applies and is in the matrix."""
    root = tmp_path / "mine"
    (root / "targets").mkdir(parents=True)
    (root / "patches").mkdir()
    monkeypatch.setenv("KVFORGE_ROOT", str(root))
    monkeypatch.delenv("KVFORGE_OFFLINE", raising=False)
    r = run_kvforge("target", "add", "0.21.0", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["from_target"] == "" and data["components"][0]["upstream_commit"] == "9da56fd18"
    target = tomllib.loads((root / "targets" / "v0.21.0.toml").read_text())
    comp = target["components"][0]
    assert comp["ref"] == "v0.21.0" and len(comp["wheels"]) == 2
    from kvforge.ci.scaffold import core_cpu_suites
    from kvforge.git.bases import ensure_base
    from kvforge.project.targets import load_target

    base = ensure_base(load_target("v0.21.0", root).component(), real_cache, "sdist")
    assert comp["tests"] == {"cpu": list(core_cpu_suites(base.repo, base.commit)), "cuda": ["tests/v1/core"]}
    assert "tests/v1/core/test_prefix_caching.py" in comp["tests"]["cpu"] and len(comp["tests"]["cpu"]) > 3
    assert (root / "patches" / "v0.21.0" / "series").read_text() == ""
    assert kvforge("lint").exit_code == 0 and kvforge("matrix").exit_code == 0
    r = run_kvforge("apply", "-t", "v0.21.0", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr


def test_an_in_place_rebase_comments_out_the_selectors_the_new_release_lacks(tmp_path):
    """vLLM 0.22.0 has no tests/v1/kv_connector/unit/test_backwards_compatibility.py: the rebased v0.20.2rc keeps
    it as a comment saying why (verify of the rebased target would stop on it), vllm-ascend's list is untouched."""
    from kvforge.flow.rebase.retarget import comment_out_selectors
    from kvforge.project.targets import parse_target

    gone = "tests/v1/kv_connector/unit/test_backwards_compatibility.py"
    text = (REPO_ROOT / "targets" / "v0.20.2rc.toml").read_text()
    out = comment_out_selectors(text, 0, [gone], "v0.22.0")
    assert f'    # not in v0.22.0 (kvforge rebase dropped it): "{gone}"\n' in out
    assert [ln for ln in out.splitlines() if ln not in text.splitlines()] == [
        f'    # not in v0.22.0 (kvforge rebase dropped it): "{gone}"']
    (tmp_path / "targets").mkdir()
    (tmp_path / "targets" / "v0.20.2rc.toml").write_text(out)
    for d in ("patches/v0.20.2rc", "patches/v0.20.2rc-vllm-ascend"):
        (tmp_path / d).mkdir(parents=True)
    new = parse_target(tmp_path / "targets" / "v0.20.2rc.toml", tmp_path)
    old = parse_target(REPO_ROOT / "targets" / "v0.20.2rc.toml", REPO_ROOT)
    assert list(new.component("vllm").tests["cpu"]) == [s for s in old.component("vllm").tests["cpu"] if s != gone]
    assert new.component("vllm-ascend").tests == old.component("vllm-ascend").tests
    assert comment_out_selectors(text, 1, [gone], "v0.22.0") == text  # another component's list: untouched


# ---------------------------------------------------------------- fast: the one write, killed at every step

COMMIT_SCRIPT = """
import sys
from dataclasses import replace
from pathlib import Path
from kvforge.core.cache import Cache
from kvforge.flow.rebase.state import project_id
from kvforge.flow.targetadd.commit import write_target
from kvforge.flow.targetadd.state import AddState, load_state
from kvforge.project.targets import load_target
root, cache, name = Path(sys.argv[1]), Cache(Path(sys.argv[2])), "v9.9.9"
old = load_target("v0.20.2rc", root)
comps = tuple(replace(c, series_dir=root / "patches" / (name if i == 0 else f"{name}-{c.name}"))
              for i, c in enumerate(old.components))
final = replace(old, name=name, path=root / "targets" / f"{name}.toml", components=comps)
ta = load_state(cache, name) or AddState(
    name=name, version="9.9.9", from_target=old.name, root=str(root), root_id=project_id(root), target_text="",
    components=[c.name for c in comps], left_out={}, upstream={c.name: "0123456789ab" for c in comps},
    done=[c.name for c in comps], started="2026-11-27T00:00:00Z")
print(write_target(cache, ta, final, {}, {}, print))
"""


def test_the_commit_killed_at_every_transaction_step_is_wholly_old_or_new(copy_project, tmp_path):
    """target add's one write (every series directory, then the target file) goes through the project's
    transaction: a SIGKILL at each of its steps, then the next writer's recovery, leaves no target or the
    complete one; `--continue`'s commit (run again on the saved state) then finishes it."""
    from kvforge.project.transaction import COMMIT_POINT, CRASH_STEPS, JOURNAL, settle

    cache = tmp_path / "cache"
    before = snapshot(copy_project)
    tfile = copy_project / "targets" / "v9.9.9.toml"
    dirs = [copy_project / "patches" / "v9.9.9", copy_project / "patches" / "v9.9.9-vllm-ascend"]

    def run(crash: str | None) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "KVFORGE_CRASH_AT"} | (
            {"KVFORGE_CRASH_AT": crash} if crash else {})
        return subprocess.run([sys.executable, "-c", COMMIT_SCRIPT, str(copy_project), str(cache)], env=env,
                              capture_output=True, text=True, timeout=300)

    for step in [s for s in CRASH_STEPS if s != "swap-aside"]:  # new directories: renamed in, no fallback window
        killed = run(f"targetadd:{step}")
        assert killed.returncode == -9, (step, killed.stderr[-2000:])
        settle(copy_project)
        now = snapshot(copy_project)
        if CRASH_STEPS.index(step) < CRASH_STEPS.index(COMMIT_POINT):
            assert now == before, step
        else:
            assert tfile.is_file() and all((d / "series").read_text() == "" for d in dirs), step
        done = run(None)
        assert done.returncode == 0, (step, done.stderr[-2000:])
        assert tfile.is_file() and all((d / "series").read_text() == "" for d in dirs), step
        assert tomllib.loads(tfile.read_text())["name"] == "v9.9.9"
        assert {k: v for k, v in snapshot(copy_project).items() if "v9.9.9" not in k} == before
        assert not (copy_project / JOURNAL).exists()
        assert not [p for p in (copy_project / "patches").iterdir() if p.name.startswith(".")]
        assert kvforge("lint", "-t", "v9.9.9").exit_code == 0, step
        tfile.unlink()  # the project as it was, for the next kill
        for d in dirs:
            shutil.rmtree(d)
        shutil.rmtree(cache / "targetadd", ignore_errors=True)
        assert snapshot(copy_project) == before
