"""The real-rebase lane (slow, in CI): shipped targets rebased for real (no --dry-run) onto real vLLM releases
from PyPI, each run to completion or to its correct stop within a time bound, patches/ and targets/
checked after each. A copy of the project (a tmp KVFORGE_ROOT) and a test cache that links the user
cache's downloads (each sdist is downloaded once there).

- 0.21.0: every patch carried or dropped as the signals say; the rebase finishes and writes once.
- 0.22.0: stops at 0002 (exit 3) at once; each stop (0002 .. 0005 conflict there) is resolved with the
  real 0.22.0 variant of that fix, tests/data/onto-0.22.0/ (written against 0.22.0's source: 0.22.0
  has half of swa-reachable-cache-mask, see docs/upstream-truth.md), and --continue, repeated, finishes
  it; the new series is byte for byte those files, lints, and applies.
- 0.33.0: the fixes upstream has are dropped; the main-only kv-events conflict stops the rebase.
- `rebase --as` onto 0.22.0 and 0.21.0, then `kvforge build` of the new target with no hand edit: a project
  whose target is v0.20.2rc's vllm component alone (`--as` makes one-component targets), its series the
  shipped one. 0.22.0 stops at 0002 and is resolved with the stored port as above; 0.21.0 carries all five.
  The new target pins the release's first-upload wheels from PyPI's file list; both architectures build:
  aarch64 checked by RECORD, files and metadata (import not run here), x86_64 installed and the series'
  Checks run in a CPU test env (the env is also what installs the aarch64 wheel, so x86_64 costs only its
  Checks, ~1 min). The release wheels are downloaded once into the user cache; the test envs are the user
  cache's (shared, as tests/test_build.py does).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from base64 import urlsafe_b64encode
from hashlib import sha256
from pathlib import Path

import pytest

from kvforge.git import gitutil
from kvforge.core.cache import default_cache_dir
from kvforge.git.engine import AM_OPTS

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parent.parent
BOUND = 240  # seconds: one rebase command, a base import included
BUILD_BOUND = 1200  # seconds: one kvforge build, a first test env (torch, ~1.3 GB) included
TEST_ENVS_DIR = Path(os.environ.get("KVFORGE_TEST_ENVS") or default_cache_dir() / "envs")
ONTO_0220 = Path(__file__).resolve().parent / "data" / "onto-0.22.0"  # the v0.20.2rc series ported to 0.22.0


def _download(version: str) -> Path:
    from kvforge.git.bases import download_sdist
    from kvforge.core.cache import Cache
    from kvforge.project.targets import Release

    user = Cache(default_cache_dir())
    path = user.downloads / f"vllm-{version}.tar.gz"
    if not path.is_file():
        class Wanted:  # what download_sdist reads of a component
            release = Release("vllm", version)
        download_sdist(Wanted, user, print)
    return path


@pytest.fixture(scope="module")
def real_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("rebase-real-cache")
    (cache / "downloads").mkdir()
    for version in ("0.20.1", "0.20.2", "0.21.0", "0.22.0", "0.33.0"):
        src = _download(version)
        try:
            os.link(src, cache / "downloads" / src.name)
        except OSError:
            shutil.copy2(src, cache / "downloads" / src.name)
    return cache


@pytest.fixture()
def proj(tmp_path) -> Path:
    root = tmp_path / "project"
    for d in ("targets", "patches"):
        shutil.copytree(REPO_ROOT / d, root / d)
    return root


def kvforge(root: Path, cache: Path, *args: str, timeout: int = BOUND) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "KVFORGE_ROOT": str(root), "KVFORGE_CACHE": str(cache)}
    for k in ("KVFORGE_OFFLINE", "KVFORGE_VLLM_REPO", "KVFORGE_CRASH_AT"):
        env.pop(k, None)
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-c", "from kvforge.cli import main; main()", *args], env=env,
                       capture_output=True, text=True, timeout=timeout)
    return r, time.monotonic() - t


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for d in ("patches", "targets")
            for p in sorted((root / d).rglob("*")) if p.is_file()}


def lints(root: Path, cache: Path, audited: bool = True) -> None:
    """The series lint clean; `audited=False` for the stored 0.22.0 port, whose hand-made patches change public
    signatures its headers do not acknowledge yet: lint's audit must flag those (exit 1), headers and diffs pass."""
    if audited:
        r, _ = kvforge(root, cache, "lint")
        assert r.returncode == 0, r.stdout + r.stderr
        return
    r, _ = kvforge(root, cache, "lint", "--no-audit")
    assert r.returncode == 0, r.stdout + r.stderr
    r, _ = kvforge(root, cache, "lint")
    assert r.returncode == 1 and "(acknowledge it in the header or undo it)" in r.stdout, r.stdout + r.stderr


def test_0210_every_target_carried_or_dropped(proj, real_cache):
    for target in ("v0.20.1", "v0.20.2rc"):
        r, secs = kvforge(proj, real_cache, "rebase", "-t", target, "--component", "vllm", "--onto", "0.21.0",
                          "--json")
        assert r.returncode == 0, r.stderr
        data = json.loads(r.stdout)
        assert data["state"] == "done" and {p["verdict"] for p in data["patches"]} <= {"carried", "upstream"}
        carried = [p["name"] for p in data["patches"] if p["verdict"] == "carried"]
        series = (proj / "patches" / target / "series").read_text().split()
        assert [n for n in series if not n.startswith("#")] == carried
        text = (proj / "targets" / f"{target}.toml").read_text()
        assert 'ref = "v0.21.0"' in text and 'version = "0.21.0"' in text
        print(f"{target} onto 0.21.0: {len(carried)} carried, {len(data['patches']) - len(carried)} dropped, "
              f"{secs:.1f}s")
    lints(proj, real_cache)


def git(cwd: Path, *args: str) -> str:
    """git as kvforge runs it (its committer, no user config that changes commits)."""
    return gitutil.run(cwd, *args).stdout


def resolve_with_port(worktree: Path, name: str) -> list[str]:
    """Resolve the stop at patch `name` with its real 0.22.0 variant: the stopped `git am` is given up
    (HEAD goes back to the last carried patch) and the stored variant is applied there as kvforge
    applies patches, header included; --continue then carries that commit. Returns the files that
    were in conflict."""
    unmerged = git(worktree, "diff", "--name-only", "--diff-filter=U").split()
    assert unmerged, f"{name}: the rebase stopped without a conflict"
    git(worktree, "am", "--abort")
    git(worktree, *AM_OPTS, str(ONTO_0220 / name))
    return unmerged


def test_0220_stops_at_0002_and_the_port_continues_to_the_end(proj, real_cache, tmp_path):
    before = files(proj)
    r, secs = kvforge(proj, real_cache, "rebase", "-t", "v0.20.2rc", "--component", "vllm", "--onto", "0.22.0",
                      "--json")
    assert r.returncode == 3, r.stderr
    data = json.loads(r.stdout)
    assert data["patches"][data["stopped_at"]]["name"] == "0002-swa-reachable-cache-mask.patch"
    assert data["patches"][0]["verdict"] == "carried"  # 0001 applies three-way
    assert files(proj) == before
    print(f"v0.20.2rc onto 0.22.0: stopped at 0002 in {secs:.1f}s")
    worktree = Path(data["worktree"])
    stops = []
    for n in range(6):
        name = data["patches"][data["stopped_at"]]["name"]
        conflicted = resolve_with_port(worktree, name)
        stops.append(name)
        r, secs = kvforge(proj, real_cache, "rebase", "-t", "v0.20.2rc", "--component", "vllm", "--continue",
                          "--json")
        print(f"  {name} ({', '.join(conflicted)}) resolved with its 0.22.0 variant; --continue {n + 1}: "
              f"exit {r.returncode} in {secs:.1f}s")
        if r.returncode != 3:
            break
        assert files(proj) == before  # nothing written before the end
        data = json.loads(r.stdout)
    assert r.returncode == 0, r.stderr
    assert stops == ["0002-swa-reachable-cache-mask.patch", "0003-kv-events-token-ids.patch",
                     "0004-swa-retention-queue-split.patch", "0005-eagle-lookahead-block-hashes.patch"]
    data = json.loads(r.stdout)
    assert data["state"] == "done"
    assert [(p["name"], p["verdict"]) for p in data["patches"]] == [(n, "carried") for n in
                                                                     (ONTO_0220 / "series").read_text().split()]
    # The new series is the stored port, byte for byte (kvforge export's bytes); nothing else changed
    # but the target file.
    after = files(proj)
    stored = {f"patches/v0.20.2rc/{p.name}": p.read_bytes() for p in sorted(ONTO_0220.iterdir())}
    assert {k: v for k, v in after.items() if k.startswith("patches/v0.20.2rc/")} == stored
    assert {k: v for k, v in after.items() if not k.startswith("patches/v0.20.2rc/")
            and k != "targets/v0.20.2rc.toml"} == \
        {k: v for k, v in before.items() if not k.startswith("patches/v0.20.2rc/")
         and k != "targets/v0.20.2rc.toml"}
    text = (proj / "targets" / "v0.20.2rc.toml").read_text()
    assert 'ref = "v0.22.0"' in text and 'version = "0.22.0"' in text
    # 0.22.0 has no test_backwards_compatibility.py: its selector is kept as a comment (verify would stop on it)
    assert '# not in v0.22.0 (kvforge rebase dropped it): "tests/v1/kv_connector/unit/test_backwards_compatibility.py"' \
        in text
    lints(proj, real_cache, audited=False)
    # The new target applies: base 0.22.0 plus one commit per stored patch, in a tree of the user's.
    into = tmp_path / "vllm-0.22.0-port"
    r, secs = kvforge(proj, real_cache, "apply", "-t", "v0.20.2rc", "--component", "vllm", "--into", str(into))
    assert r.returncode == 0, r.stdout + r.stderr
    subjects = git(into, "log", "--format=%s", "kvforge/base/v0.20.2rc..HEAD").splitlines()
    assert len(subjects) == 5 and subjects[-1].startswith("[Core] Touch every group's local prefix hits")
    assert "def get_num_reachable_tokens" in (into / "vllm/v1/core/single_type_kv_cache_manager.py").read_text()
    assert "0.22.0" in (into / "vllm/_version.py").read_text()
    print(f"  applied in {secs:.1f}s")


def test_0330_drops_the_upstream_fixes_and_stops_at_the_main_only_conflict(proj, real_cache):
    before = files(proj)
    r, secs = kvforge(proj, real_cache, "rebase", "-t", "v0.20.2rc", "--component", "vllm", "--onto", "0.33.0",
                      "--json")
    data = json.loads(r.stdout)
    verdicts = {p["name"]: p["verdict"] for p in data["patches"]}
    print(f"v0.20.2rc onto 0.33.0: exit {r.returncode} in {secs:.1f}s: {verdicts}")
    assert r.returncode == 3, r.stderr
    stopped = data["patches"][data["stopped_at"]]
    assert stopped["fix_id"] == "kv-events-token-ids" and stopped["verdict"] == "conflict"
    assert [p["verdict"] for p in data["patches"][:data["stopped_at"]]] and \
        all(p["verdict"] == "upstream" for p in data["patches"][:data["stopped_at"]])
    assert files(proj) == before
    r, _ = kvforge(proj, real_cache, "rebase", "-t", "v0.20.2rc", "--component", "vllm", "--abort")
    assert r.returncode == 0 and files(proj) == before


# ---------------------------------------------------------------- rebase --as, then kvforge build

# PyPI's first uploads of each release (built from the sdist's commit), per architecture: what the new target
# must pin. Not 0.21.0's `-1-` rebuild (vllm-0.21.0-1-cp38-abi3-manylinux_2_24_x86_64.whl, another upstream
# commit: kvforge build refuses to overlay it on 0.21.0's sdist).
FIRST_UPLOADS = {
    "0.22.0": {
        "aarch64": ("vllm-0.22.0-cp38-abi3-manylinux_2_28_aarch64.whl",
                    "0fbe1ff32e9ad82c56b002de11b061ca6b5b8a256cd11473946d2222115ed267"),
        "x86_64": ("vllm-0.22.0-cp38-abi3-manylinux_2_28_x86_64.whl",
                   "c387a977e35795e8f77b009e019e69722963819c26b55e4a679e09d4279ae35d"),
    },
    "0.21.0": {
        "aarch64": ("vllm-0.21.0-cp38-abi3-manylinux_2_24_aarch64.whl",
                    "d6e63955b595bd2aa364e90f85c0a2e99573e701146db58394da569ddc6f4eea"),
        "x86_64": ("vllm-0.21.0-cp38-abi3-manylinux_2_24_x86_64.whl",
                   "b241b085742cf04a68c82c089d12afe4d9ee729e0c7f81b2b2b9961d36105ee5"),
    },
}


@pytest.fixture(scope="module")
def build_cache(real_cache) -> Path:
    """real_cache plus the release wheels of FIRST_UPLOADS (downloaded once into the user cache, sha256-checked,
    linked here) and the user cache's test environments (shared)."""
    from kvforge.wheels.download import download_wheel
    from kvforge.core.cache import Cache
    from kvforge.project.targets import Release, WheelPin

    user = Cache(default_cache_dir())
    for version, pins in FIRST_UPLOADS.items():
        class Wanted:  # what download_wheel reads of a component
            release = Release("vllm", version)
        for filename, digest in pins.values():
            src = download_wheel(Wanted, user, print, WheelPin(filename, digest))  # type: ignore[arg-type]
            dest = real_cache / "downloads" / filename
            if not dest.exists():
                try:
                    os.link(src, dest)
                except OSError:
                    shutil.copy2(src, dest)
    TEST_ENVS_DIR.mkdir(parents=True, exist_ok=True)
    if not (real_cache / "envs").exists():
        (real_cache / "envs").symlink_to(TEST_ENVS_DIR, target_is_directory=True)
    return real_cache


@pytest.fixture()
def vllm_only(tmp_path) -> Path:
    """A project whose target v0.20.2rc is the shipped one's vllm component alone (its series: the shipped
    patches/v0.20.2rc), as bench/rebase_vs_git_rebase.py's make_project makes it."""
    root = tmp_path / "project"
    (root / "targets").mkdir(parents=True)
    text = (REPO_ROOT / "targets" / "v0.20.2rc.toml").read_text()
    (root / "targets" / "v0.20.2rc.toml").write_text("[[components]]".join(text.split("[[components]]")[:2]))
    shutil.copytree(REPO_ROOT / "patches" / "v0.20.2rc", root / "patches" / "v0.20.2rc")
    return root


def sdist_paths(archive: Path) -> set[str]:
    """Every file and directory of a release's sdist, relative to its top directory (read with tarfile: not
    kvforge's import)."""
    out: set[str] = set()
    with tarfile.open(archive) as tar:
        for name in tar.getnames():
            parts = name.split("/", 1)
            if len(parts) == 2 and parts[1]:
                out.add(parts[1].rstrip("/"))
                p = Path(parts[1]).parent
                while str(p) != ".":
                    out.add(str(p))
                    p = p.parent
    return out


def check_new_target(root: Path, cache: Path, name: str, version: str) -> dict:
    """targets/NAME.toml as `rebase --as` wrote it, read with tomllib: the release and its sdist's sha256, the
    first-upload wheels per architecture and nothing else, every selector a path of the release."""
    doc = tomllib.loads((root / "targets" / f"{name}.toml").read_text())
    assert doc["name"] == name and doc.get("lifecycle") == "maintained" and len(doc["components"]) == 1
    comp = doc["components"][0]
    assert comp["ref"] == f"v{version}" and comp["series"] == f"patches/{name}"
    sdist = cache / "downloads" / f"vllm-{version}.tar.gz"
    assert comp["release"] == {"package": "vllm", "version": version, "sha256": sha256(sdist.read_bytes()).hexdigest()}
    assert "wheel" not in comp  # the old single table is gone
    assert sorted((w["filename"], w["sha256"]) for w in comp["wheels"]) == sorted(FIRST_UPLOADS[version].values())
    have = sdist_paths(sdist)
    selectors = [s for sel in comp["tests"].values() for s in sel]
    assert selectors and [s for s in selectors if s.split("::", 1)[0].rstrip("/") not in have] == []
    assert "tests/v1/kv_connector/unit/test_backwards_compatibility.py" not in selectors  # not in 0.21.0 / 0.22.0
    r, _ = kvforge(root, cache, "lint", "-t", name, "--selections", "--no-audit", "--json")  # selections here; the audit: lints()
    assert r.returncode == 0, r.stdout + r.stderr
    lint = json.loads(r.stdout)
    assert lint["problems"] == [] and len(lint["selections"]) == len(selectors)
    assert all(s["exists"] for s in lint["selections"])
    return comp


def record_hash(data: bytes) -> str:
    return "sha256=" + urlsafe_b64encode(sha256(data).digest()).rstrip(b"=").decode()


def check_built_wheel(build: dict, out: Path, cache: Path, target: str, version: str, arch: str,
                      series: list[str]) -> None:
    """The wheel `kvforge build` left in --out, opened here: its name (local label, build tag, the release
    wheel's platform tag), RECORD (every member listed with its sha256, nothing else), METADATA's version,
    <dist-info>/kvforge.json naming the target and the series, the patched modules differing from the
    release wheel's."""
    upstream_name, upstream_sha = FIRST_UPLOADS[version][arch]
    assert build["ok"] and build["exit"] == 0 and build["pinned"] and build["arch"] == arch
    assert build["upstream"]["filename"] == upstream_name and build["upstream"]["sha256"] == upstream_sha
    local = f"{version}+kvforge.{target}.{build['series']}"
    tag = upstream_name.split("-", 2)[2]  # cp38-abi3-manylinux_..._<arch>.whl
    assert build["filename"] == f"vllm-{local}-1_kvforge_{build['series']}-{tag}"
    path = out / build["filename"]
    assert sha256(path.read_bytes()).hexdigest() == build["sha256"]
    info = f"vllm-{local}.dist-info"
    with zipfile.ZipFile(path) as z, zipfile.ZipFile(cache / "downloads" / upstream_name) as up:
        rows = {file: digest for file, digest, _size in csv.reader(z.read(f"{info}/RECORD").decode().splitlines())}
        assert set(rows) == set(z.namelist())
        assert rows.pop(f"{info}/RECORD") == ""
        replaced = json.loads(z.read(f"{info}/kvforge.json"))["files"]["replace"]
        assert replaced == [c["path"] for c in build["changes"] if c["action"] == "replace"]
        for file in [*replaced, f"{info}/kvforge.json", f"{info}/METADATA"]:
            assert rows[file] == record_hash(z.read(file)), file
        assert f"Version: {local}\n" in z.read(f"{info}/METADATA").decode()
        ident = json.loads(z.read(f"{info}/kvforge.json"))
        assert ident["target"] == target and ident["local_version"] == local and ident["version"] == version
        assert ident["series"]["digest"] == build["series"]
        assert [p["name"] for p in ident["series"]["patches"]] == series
        assert ident["upstream_wheel"] == {"filename": upstream_name, "sha256": upstream_sha}
        core = "vllm/v1/core/single_type_kv_cache_manager.py"
        assert core in replaced and z.read(core) != up.read(core)
        assert "def set_cache_hit_alignment" in z.read(core).decode()  # swa-reachable-cache-mask's
        assert all(z.getinfo(m).CRC == up.getinfo(m).CRC for m in up.namelist()
                   if m.endswith(".so"))  # the compiled files are the release's


def build_both(root: Path, cache: Path, target: str, version: str, out: Path, series: list[str]) -> list[str]:
    """`kvforge build -t TARGET --arch aarch64`, then `--arch x86_64`, each checked; returns timing lines."""
    lines = []
    for arch in ("aarch64", "x86_64"):
        r, secs = kvforge(root, cache, "build", "-t", target, "--arch", arch, "--out", str(out), "--json",
                          timeout=BUILD_BOUND)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        build = json.loads(r.stdout)
        check_built_wheel(build, out, cache, target, version, arch, series)
        v = build["verification"]
        assert v["problems"] == [] and v["record"]["stray"] == [] and v["modules"]["equal"]
        if arch == "aarch64":
            assert "not run" in v["probe"]["not_run"] and "aarch64 wheel on this x86_64 machine" in \
                v["probe"]["not_run"] and v["tests"] == {}
        else:  # installed and imported from site-packages, the series' Checks passed there
            assert v["probe"]["vllm_file"].endswith("/site/vllm/__init__.py") and v["probe"]["version"] == version
            assert v["tests"]["passed"] > 0 and v["tests"]["failed"] == v["tests"]["errors"] == 0
            assert v["tests"]["vllm_modules_elsewhere"] == []
        lines.append(f"  build --arch {arch}: {build['filename']} in {secs:.0f}s ("
                     + (f"{v['tests']['passed']} Checks passed" if v["tests"] else "import not run") + ")")
    assert len(list(out.iterdir())) == 2 and all(p.name.startswith(f"vllm-{version}+kvforge.{target}.")
                                                  for p in out.iterdir())
    return lines


def test_0220_as_new_target_builds_with_no_hand_edit(vllm_only, build_cache, tmp_path):
    """Issue 22's Done-when: `rebase --as v0.22.0` (stops at 0002, each stop resolved with the stored port,
    --continue to the end), and the new target builds both architectures as written."""
    t0 = time.monotonic()
    before = files(vllm_only)
    r, secs = kvforge(vllm_only, build_cache, "rebase", "-t", "v0.20.2rc", "--onto", "0.22.0", "--as", "v0.22.0",
                      "--json")
    assert r.returncode == 3, r.stderr
    data = json.loads(r.stdout)
    assert data["new_target"] == "v0.22.0" and data["sha256_source"] == "pypi"
    assert data["patches"][data["stopped_at"]]["name"] == "0002-swa-reachable-cache-mask.patch"
    lines = [f"v0.20.2rc --onto 0.22.0 --as v0.22.0: stopped at 0002 in {secs:.1f}s"]
    stops = []
    for _ in range(6):
        stops.append(data["patches"][data["stopped_at"]]["name"])
        resolve_with_port(Path(data["worktree"]), stops[-1])
        assert files(vllm_only) == before  # nothing written before the end
        r, secs = kvforge(vllm_only, build_cache, "rebase", "-t", "v0.20.2rc", "--continue", "--json")
        if r.returncode != 3:
            break
        data = json.loads(r.stdout)
    assert r.returncode == 0, r.stderr
    assert stops == ["0002-swa-reachable-cache-mask.patch", "0003-kv-events-token-ids.patch",
                     "0004-swa-retention-queue-split.patch", "0005-eagle-lookahead-block-hashes.patch"]
    data = json.loads(r.stdout)
    series = (ONTO_0220 / "series").read_text().split()
    assert data["state"] == "done" and [(p["name"], p["verdict"]) for p in data["patches"]] == \
        [(n, "carried") for n in series]
    after = files(vllm_only)
    assert {k: v for k, v in after.items() if k in before} == before  # v0.20.2rc is left as it was
    assert {k: v for k, v in after.items() if k.startswith("patches/v0.22.0/")} == \
        {f"patches/v0.22.0/{p.name}": p.read_bytes() for p in sorted(ONTO_0220.iterdir())}
    check_new_target(vllm_only, build_cache, "v0.22.0", "0.22.0")
    lines.append(f"  rebased and checked in {time.monotonic() - t0:.0f}s")
    lines += build_both(vllm_only, build_cache, "v0.22.0", "0.22.0", tmp_path / "dist", series)
    print("\n".join(lines) + f"\n  total {time.monotonic() - t0:.0f}s")


def test_0210_as_new_target_builds_with_no_hand_edit(vllm_only, build_cache, tmp_path):
    """Issue 22's Done-when: `rebase --as v0.21.0` carries all five patches; the new target pins 0.21.0's first
    uploads (manylinux_2_24, not the `-1-` rebuild) and builds both architectures as written."""
    t0 = time.monotonic()
    before = files(vllm_only)
    r, secs = kvforge(vllm_only, build_cache, "rebase", "-t", "v0.20.2rc", "--onto", "0.21.0", "--as", "v0.21.0",
                      "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    series = (REPO_ROOT / "patches" / "v0.20.2rc" / "series").read_text().split()
    assert data["state"] == "done" and [(p["name"], p["verdict"]) for p in data["patches"]] == \
        [(n, "carried") for n in series]
    after = files(vllm_only)
    assert {k: v for k, v in after.items() if k in before} == before
    assert (vllm_only / "patches" / "v0.21.0" / "series").read_text().split() == series
    comp = check_new_target(vllm_only, build_cache, "v0.21.0", "0.21.0")
    assert not any("0.21.0-1-" in w["filename"] for w in comp["wheels"])
    lines = [f"v0.20.2rc --onto 0.21.0 --as v0.21.0: done in {secs:.1f}s"]
    lines += build_both(vllm_only, build_cache, "v0.21.0", "0.21.0", tmp_path / "dist", series)
    print("\n".join(lines) + f"\n  total {time.monotonic() - t0:.0f}s")
