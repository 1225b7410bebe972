"""`kvforge init DIR`: a new patch repository of another team's, run by the installed kvforge.

DIR gets targets/ and patches/ (what project discovery, kvforge.targets.project_root, looks for), a README
with the two commands (install kvforge, run the checks and CPU jobs), a .gitignore (the cache CI keeps in
the checkout, the trees kvforge makes), the CI files (GitHub Actions and Buildkite: kvforge's own
ci/github/kvforge.yml and ci/buildkite/pipeline.yml, shipped in kvforge/data/init, installing kvforge with
$KVFORGE_INSTALL instead of from the checkout; `kvforge matrix` puts that same command in every job's
setup), and with --release a first target: the release's PyPI sdist pinned by sha256 (kvforge.bases's
package-index reader), an empty series, the KV-cache manager's CPU tests as its selection.

All or nothing: everything, git repository and first commit included, is made in a hidden sibling
`.DIR.kvforge-init-PID` and renamed to DIR in one step (DIR must not exist or be an empty directory); a
killed init leaves only that hidden directory, which the next init removes. Nothing of the user's is
touched: a DIR with anything in it is refused.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable

from packaging.version import InvalidVersion, Version

from kvforge import DATA
from kvforge.git import gitutil
from kvforge import __version__
from kvforge.git.bases import pypi_url, release_files
from kvforge.core.cache import Cache
from kvforge.core.errors import EXIT_NETWORK, EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import crashpoint, remove_stale, sha256_remembered
from kvforge.core.outcome import Done
from kvforge.project.targets import TARGET_NAME_RE, parse_target

DATA = DATA / "init"
UPSTREAMS = ("vllm", "vllm-ascend")
STALE = r"^\.{name}\.kvforge-init-(?P<pid>\d+)$"
# The CPU tests of vLLM's KV-cache manager (in every release since 0.20); `kvforge test --scan --try` finds more.
VLLM_CPU = ("tests/v1/core/test_prefix_caching.py", "tests/v1/core/test_single_type_kv_cache_manager.py",
            "tests/v1/core/test_kv_cache_utils.py")
# vllm-ascend's scheduler-side unit tests that run on CPU with kvforge's stand-ins (as this project's v0.20.2rc).
ASCEND_CPU = ("tests/ut/core/test_profiling_chunk.py", "tests/ut/test_ascend_config.py", "tests/ut/test_envs.py")
ASCEND_STANDINS = ("torch_npu", "torchair", "vllm_ascend._build_info", "torchvision")
SOURCE_INSTALL = "python3 -m pip install -e ."  # how kvforge's own CI files install it (from the checkout)
Say = Callable[[str], None]


@dataclass(frozen=True)
class Pin:
    package: str
    version: str
    sha256: str
    source: str  # where the sha256 came from


def install_command(spec: str | None = None) -> tuple[str, str]:
    """(the pip command that installs this kvforge elsewhere, how it was found). `spec`: a pip requirement the
    user gave; else the installed distribution's PEP 610 direct_url.json (a git URL and commit, a local path),
    else kvforge==<version> from the package index."""
    if spec is not None:
        if not spec.strip() or any(c in spec for c in "\n\r'\"`$\\"):
            raise KvforgeError(f"--install {spec!r}: give a pip requirement (e.g. 'kvforge @ git+https://host/"
                               "org/kvforge@v0.1.0'), without quotes, backslashes, '$' or newlines", EXIT_USAGE)
        return f"python3 -m pip install {shlex.quote(spec.strip())}", "--install"
    try:
        dist = metadata.distribution("kvforge")
        direct = json.loads(dist.read_text("direct_url.json") or "null")
    except (metadata.PackageNotFoundError, ValueError):
        direct = None
    if isinstance(direct, dict) and isinstance(direct.get("url"), str):
        url, vcs = direct["url"], direct.get("vcs_info")
        if isinstance(vcs, dict) and vcs.get("vcs") == "git" and vcs.get("commit_id"):
            req = f"kvforge @ git+{url}@{vcs['commit_id']}"
            return f"python3 -m pip install {shlex.quote(req)}", "the installed kvforge's git source"
        if (direct.get("dir_info") or {}).get("editable"):
            return f"python3 -m pip install {shlex.quote(url.removeprefix('file://'))}", \
                "the checkout kvforge is installed from (editable; a path of this machine: pass --install for CI)"
        return f"python3 -m pip install {shlex.quote(f'kvforge @ {url}')}", \
            "where the installed kvforge came from (a path of this machine: pass --install for CI)"
    return f"python3 -m pip install {shlex.quote(f'kvforge=={__version__}')}", "the package index"


def sdist_pin(package: str, version: str, cache: Cache) -> Pin:
    """The release's sdist and its sha256 from the package index (offline: a copy in the cache, said so)."""
    filename = f"{re.sub(r'[-_.]+', '_', package).lower()}-{version}.tar.gz"
    if not os.environ.get("KVFORGE_OFFLINE"):
        index, files = release_files(package, version)
        if not files:
            raise KvforgeError(f"--release {version}: {package} {version} is not a release on the package index "
                               f"({pypi_url()})", EXIT_USAGE)
        for f in files:
            sha = (f.get("digests") or {}).get("sha256")
            if f.get("filename") == filename and isinstance(sha, str):
                return Pin(package, version, sha, index)
        raise KvforgeError(f"--release {version}: {package} {version} has no sdist {filename} on the package index "
                           f"({index}); kvforge needs the release source", EXIT_USAGE)
    local = cache.downloads / filename
    if not local.is_file():
        raise KvforgeError(f"--release {version}: offline ($KVFORGE_OFFLINE) and the cache has no {filename} to take "
                           "its sha256 from", EXIT_NETWORK)
    return Pin(package, version, sha256_remembered(local), f"{local} (offline: not checked against the package index)")


def _toml_list(items: tuple[str, ...] | list[str], indent: str = "    ") -> str:
    return "[\n" + "".join(f"{indent}{json.dumps(i)},\n" for i in items) + "]"


def _release_block(pin: Pin) -> str:
    return (f"\n[components.release]\n# The offline source: the PyPI sdist, its sha256 from {pin.source}.\n"
            f"package = {json.dumps(pin.package)}\nversion = {json.dumps(pin.version)}\n"
            f"sha256 = {json.dumps(pin.sha256)}\n"
            "# No release wheel is pinned ([[components.wheels]], which `kvforge build` overlays): "
            "`kvforge target add`\n# pins them per platform tag.\n")


def target_text(name: str, upstream: str, pins: dict[str, Pin]) -> str:
    """The first target's file: vLLM alone, or vLLM (no series needed) under vllm-ascend."""
    vllm = pins["vllm"]
    lines = [f"name = {json.dumps(name)}",
             f"description = {json.dumps(f'{upstream} {pins[upstream].version} (written by kvforge init)')}",
             'lifecycle = "maintained"', "",
             "[[components]]", 'name = "vllm"', 'repo = "https://github.com/vllm-project/vllm.git"',
             f"ref = {json.dumps('v' + vllm.version)}", f"series = {json.dumps(f'patches/{name}')}",
             f"platforms = {json.dumps(['cpu', 'cuda'] if upstream == 'vllm' else ['cpu'])}",
             _release_block(vllm), "[components.tests]",
             "# Run from the root of the base or patched tree; every test a patch names in Checks is added. vLLM's",
             "# KV-cache manager tests; `kvforge test -t {0} --scan --try` finds the other modules the series touches."
             .format(name),
             f"cpu = {_toml_list(VLLM_CPU)}"]
    if upstream == "vllm":
        lines += ['cuda = ["tests/v1/core"]']
    else:
        asc = pins["vllm-ascend"]
        lines += ["", "[[components]]", 'name = "vllm-ascend"', 'repo = "https://github.com/vllm-project/vllm-ascend.git"',
                  f"ref = {json.dumps('v' + asc.version)}", f"series = {json.dumps(f'patches/{name}-vllm-ascend')}",
                  'platforms = ["cpu", "npu"]', 'requires = "vllm"', _release_block(asc), "[components.tests]",
                  "# Run from the vllm-ascend tree with the patched vLLM tree importable; NPU-only modules are",
                  "# kvforge's declared stand-ins (they raise when the code under test uses them).",
                  f"standins = {json.dumps(list(ASCEND_STANDINS))}", f"cpu = {_toml_list(ASCEND_CPU)}",
                  'npu = ["tests/ut"]']
    return "\n".join(lines) + "\n"


def ci_text(install: str) -> tuple[str, str]:
    """kvforge's own GitHub workflow and Buildkite step (data/init copies), installing kvforge with `install`
    (set as $KVFORGE_INSTALL, which `kvforge matrix` puts in every job's setup) instead of from the checkout."""
    github = (DATA / "github-kvforge.yml").read_text(encoding="utf-8")
    buildkite = (DATA / "buildkite-pipeline.yml").read_text(encoding="utf-8")
    note = (f"# Written by `kvforge init` (kvforge {__version__}) for a patch repository that does not hold kvforge:\n"
            "# $KVFORGE_INSTALL installs it, here and in every job `kvforge matrix` generates.\n")
    if SOURCE_INSTALL not in github or "\nenv:\n" not in github or SOURCE_INSTALL not in buildkite \
            or "\nenv:\n" not in buildkite:
        raise AssertionError("kvforge/data/init's CI files no longer have the install step or env: to rewrite")
    github = note + github.replace(SOURCE_INSTALL, "${{ env.KVFORGE_INSTALL }}").replace(
        "\nenv:\n", f"\nenv:\n  KVFORGE_INSTALL: {json.dumps(install)}\n", 1)
    buildkite = note + buildkite.replace(json.dumps(SOURCE_INSTALL), json.dumps('eval "$$KVFORGE_INSTALL"')).replace(
        "\nenv:\n", f"\nenv:\n  KVFORGE_INSTALL: {json.dumps(install)}\n", 1)
    return github, buildkite


def fill(template: str, values: dict[str, str]) -> str:
    """@@NAME@@ placeholders (not jinja2: the CI files and the README are full of ${{ }} and {})."""
    return re.sub(r"@@([A-Z_]+)@@", lambda m: values[m.group(1)], template)


def _author_env(where: Path) -> dict[str, str]:
    """The user's git identity for the first commit when git has one, else kvforge's."""
    res = gitutil.run(where, "var", "GIT_AUTHOR_IDENT", check=False)
    if res.returncode == 0 and res.stdout.strip():
        return {}
    return {"GIT_AUTHOR_NAME": "kvforge", "GIT_AUTHOR_EMAIL": "kvforge@users.noreply.github.com"}


def init_project(dest: Path, upstream: str, release: str | None, name: str | None, install: str | None,
                 cache: Cache, say: Say | None = None) -> dict:
    """Make the project at `dest` (see the module docstring); returns what was written."""
    say = say or (lambda _m: None)
    if upstream not in UPSTREAMS:
        raise KvforgeError(f"--upstream must be one of {', '.join(UPSTREAMS)}, not {upstream!r}", EXIT_USAGE)
    dest = Path(os.path.abspath(dest))
    if dest.exists() or dest.is_symlink():
        if not dest.is_dir() or dest.is_symlink():
            raise KvforgeError(f"{dest}: exists and is not a directory; kvforge init makes a new project in a new or "
                               "empty directory", EXIT_USAGE)
        if any(dest.iterdir()):
            raise KvforgeError(f"{dest}: not empty; kvforge init makes a new project only in a new or empty "
                               "directory (nothing was written)", EXIT_USAGE)
    if not dest.parent.is_dir():
        raise KvforgeError(f"{dest.parent}: no such directory (the new project's parent must exist)", EXIT_USAGE)
    if name is not None and not TARGET_NAME_RE.fullmatch(name):
        raise KvforgeError(f"--name {name!r}: a target name is letters, digits, '.', '_' and '-'", EXIT_USAGE)
    if release is not None:
        try:
            Version(release)
        except InvalidVersion:
            raise KvforgeError(f"--release {release!r} is not a release version (e.g. 0.20.2, 0.20.2rc1)",
                               EXIT_USAGE) from None
    cmd, how = install_command(install)

    pins: dict[str, Pin] = {}
    tname = None
    if release is not None:
        tname = name or f"v{release}"
        if upstream == "vllm":
            say(f"pinning vllm {release} (the package index's sdist sha256)")
            pins["vllm"] = sdist_pin("vllm", release, cache)
        else:
            vllm_version = Version(release).base_version  # vllm-ascend 0.20.2rc1 is built on vLLM 0.20.2
            say(f"pinning vllm-ascend {release} and vLLM {vllm_version} (the package index's sdist sha256)")
            pins["vllm-ascend"] = sdist_pin("vllm_ascend", release, cache)
            pins["vllm"] = sdist_pin("vllm", vllm_version, cache)

    remove_stale(dest.parent, STALE.format(name=re.escape(dest.name)))
    stage = dest.parent / f".{dest.name}.kvforge-init-{os.getpid()}"
    try:
        _write(stage, dest.name, upstream, tname, pins, cmd)
        gitutil.run(stage, "init", "-q", "-b", "main")
        gitutil.run(stage, "add", "-A")
        what = f"targets/{tname}.toml" if tname else "no target yet"
        gitutil.run(stage, "commit", "-q", "-m", f"kvforge init: a patch repository for {upstream} ({what})",
                    env=_author_env(stage))
        crashpoint("init:before-rename")
        os.rename(stage, dest)  # one step; an empty `dest` directory is replaced (POSIX rename)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    files = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*")
                   if p.is_file() and ".git" not in p.relative_to(dest).parts)
    commit = gitutil.run(dest, "rev-parse", "HEAD").stdout.strip()
    return {"project": str(dest), "upstream": upstream, "target": tname, "install": cmd, "install_from": how,
            "files": files, "commit": commit,
            "pins": {k: {"package": p.package, "version": p.version, "sha256": p.sha256, "source": p.source}
                     for k, p in pins.items()}}


def _write(stage: Path, title: str, upstream: str, tname: str | None, pins: dict[str, Pin], install: str) -> None:
    stage.mkdir()
    (stage / "targets").mkdir()
    (stage / "patches").mkdir()
    if tname is None:  # git keeps no empty directory, and discovery needs both
        (stage / "targets" / ".gitkeep").write_text("")
        (stage / "patches" / ".gitkeep").write_text("")
    else:
        series_dirs = [f"patches/{tname}"] + ([f"patches/{tname}-vllm-ascend"] if upstream == "vllm-ascend" else [])
        for d in series_dirs:
            (stage / d).mkdir()
            (stage / d / "series").write_text("")
        path = stage / "targets" / f"{tname}.toml"
        path.write_text(target_text(tname, upstream, pins), encoding="utf-8")
        parse_target(path, stage)  # what kvforge init writes, kvforge reads: a failure here is a kvforge bug
    readme = fill((DATA / "README.md.in").read_text(encoding="utf-8"), {
        "NAME": title, "UPSTREAM": upstream, "INSTALL": install, "KVFORGE_VERSION": __version__,
        "UPSTREAM_TITLE": {"vllm": "vLLM", "vllm-ascend": "vllm-ascend (on vLLM)"}[upstream]})
    (stage / "README.md").write_text(readme, encoding="utf-8")
    shutil.copyfile(DATA / "gitignore", stage / ".gitignore")
    github, buildkite = ci_text(install)
    (stage / ".github" / "workflows").mkdir(parents=True)
    (stage / ".github" / "workflows" / "kvforge.yml").write_text(github, encoding="utf-8")
    (stage / ".buildkite").mkdir()
    (stage / ".buildkite" / "pipeline.yml").write_text(buildkite, encoding="utf-8")


def render(doc: dict) -> str:
    out = [f"kvforge init: {doc['project']} (a git repository, first commit {doc['commit'][:12]})"]
    out += [f"  {f}" for f in doc["files"]]
    for k, p in doc["pins"].items():
        out.append(f"{k} {p['version']}: sdist sha256 {p['sha256'][:16]}... from {p['source']}")
    out.append(f"kvforge is installed there with: {doc['install']}  ({doc['install_from']})")
    out.append(f"next: cd {shlex.quote(doc['project'])} && kvforge lint"
               + (f" && kvforge apply -t {doc['target']}" if doc["target"] else " && kvforge target add VERSION"))
    return "\n".join(out)


def init_command(dest: Path, upstream: str, release: str | None, name: str | None, install: str | None,
                 cache: Cache, say: Say | None = None) -> Done:
    """`kvforge init DIR`: the new project, as an Outcome."""
    doc = init_project(dest, upstream, release, name, install, cache, say)
    return Done(doc, render(doc))
