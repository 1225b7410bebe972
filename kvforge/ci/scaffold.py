"""`kvforge init [DIR]`: a new patch repository of another team's, run by the installed kvforge.

DIR (default: the current directory) gets targets/ and patches/ (what project discovery,
kvforge.project.targets.project_root, looks for), a README with the two commands (install kvforge, run the checks and
CPU jobs), a .gitignore (the cache CI keeps in the checkout, the trees kvforge makes), the CI files (GitHub
Actions and Buildkite: kvforge's own ci/github/kvforge.yml, ci/github/kvforge-watch.yml and
ci/buildkite/pipeline.yml, shipped in kvforge/data/init, installing kvforge with $KVFORGE_INSTALL instead of from
the checkout; `kvforge matrix` puts that same command in every job's setup), and with --release a first target:
the release's PyPI sdist pinned by sha256 (kvforge.git.bases's package-index reader), an empty series, vLLM's CPU
core suites as its CPU selection (`core_cpu_suites`, the selection `kvforge target add` gives a first target).

Where CI gets kvforge (docs/init.md): --install REQUIREMENT when given; else the git URL and commit the running
kvforge was installed from (PEP 610 direct_url.json), when it names a remote; else a wheel of the running
kvforge, written by `kvforge_wheel` from its installed files, shipped into the repository (ci/) and installed
from there. Never a path of the machine that ran init: a CI runner has none of them.

All or nothing: a DIR that does not exist is made in a hidden sibling `.DIR.kvforge-init-PID` and renamed to
DIR in one step. An existing empty DIR (`.` included) is written in place, never replaced (a shell in it would be
left in a deleted directory): everything is made in a hidden `DIR/.kvforge-init-PID`, then moved up entry by
entry; a failure takes back the entries moved. A killed init leaves only a hidden staging directory, which the
next init removes. Nothing of the user's is touched: a DIR with anything else in it is refused.

Two inits of one DIR at once: the placing step (rename or move up) runs under an exclusive lock on DIR's parent and
re-checks DIR there, so one init places its whole project and the other is refused (EXIT_USAGE, its staging
removed). A file system that refuses a write (read-only, permissions, full) is one line, EXIT_ENV, nothing left; a
DIR or --name too long to be a file name is refused before anything is written (EXIT_USAGE), by the rule kvforge
applies to target names (kvforge.project.targets.target_name_problem).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable

from packaging.version import InvalidVersion, Version

from kvforge import DATA
from kvforge.git import gitutil
from kvforge import __version__
from kvforge.git.bases import ensure_base
from kvforge.core.index import pypi_url, release_files
from kvforge.core.cache import Cache
from kvforge.core.errors import EXIT_ENV, EXIT_NETWORK, EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import crashpoint, remove_stale, sha256_remembered
from kvforge.core.outcome import Done
from kvforge.project.targets import parse_target, target_name_problem

DATA = DATA / "init"
UPSTREAMS = ("vllm", "vllm-ascend")
STALE = r"^\.{name}\.kvforge-init-(?P<pid>\d+)$"
STALE_INSIDE = r"^\.kvforge-init-(?P<pid>\d+)$"  # the staging directory inside an existing DIR
WHEEL_DIR = "ci"  # where a shipped kvforge wheel lies in the new repository
# vLLM's core suites: the test modules under CORE_TESTS that vLLM marks CPU-only (pytest.mark.cpu_test) are a
# first target's CPU selection; a release that marks none gets VLLM_CPU, the KV-cache manager's CPU tests (in every
# release since 0.20). `kvforge test --scan --try` finds the other modules a series reaches.
CORE_TESTS = "tests/v1/core/"
CPU_MARK = "pytest.mark.cpu_test"
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


@dataclass(frozen=True)
class Install:
    command: str  # the pip command CI runs ($KVFORGE_INSTALL)
    how: str  # where it installs kvforge from, said to the user
    wheel: tuple[str, bytes] | None = None  # (file name, bytes) of a kvforge wheel shipped in WHEEL_DIR


def install_plan(spec: str | None = None) -> Install:
    """How the new repository's CI installs kvforge (see the module docstring): --install, else the running
    kvforge's git source, else a wheel of the running kvforge shipped into the repository."""
    if spec is not None:
        cmd, how = install_command(spec)
        return Install(cmd, how)
    git = _git_source()
    if git is not None:
        return Install(f"python3 -m pip install {shlex.quote(git)}", "the installed kvforge's git source")
    name, data = kvforge_wheel()
    digest = hashlib.sha256(data).hexdigest()
    return Install(f"python3 -m pip install ./{WHEEL_DIR}/{name}",
                   f"a wheel of this kvforge shipped in the repository, {WHEEL_DIR}/{name}, sha256 {digest[:16]}...; "
                   "--install REQUIREMENT to take kvforge from elsewhere", (name, data))


def _git_source() -> str | None:
    """`kvforge @ git+URL@COMMIT` when the running kvforge was installed from a git remote (not a local path)."""
    try:
        direct = json.loads(metadata.distribution("kvforge").read_text("direct_url.json") or "null")
    except (metadata.PackageNotFoundError, ValueError):
        return None
    if not isinstance(direct, dict) or not isinstance(direct.get("url"), str):
        return None
    url, vcs = direct["url"], direct.get("vcs_info")
    if isinstance(vcs, dict) and vcs.get("vcs") == "git" and vcs.get("commit_id") and not url.startswith("file:"):
        return f"kvforge @ git+{url}@{vcs['commit_id']}"
    return None


def kvforge_wheel() -> tuple[str, bytes]:
    """A wheel (file name, bytes) of the running kvforge, from its installed files: the package (its data, the
    docs included) and the installed METADATA and entry points. The same kvforge gives the same bytes (entries
    sorted, a fixed date), so the repository's copy changes only when kvforge does."""
    root = Path(__file__).resolve().parent.parent  # the kvforge package
    try:
        dist = metadata.distribution("kvforge")
        meta, entry_points = dist.read_text("METADATA"), dist.read_text("entry_points.txt")
    except metadata.PackageNotFoundError:
        meta = entry_points = None
    meta = meta or f"Metadata-Version: 2.1\nName: kvforge\nVersion: {__version__}\n"
    entry_points = entry_points or "[console_scripts]\nkvforge = kvforge.cli:main\n"
    info = f"kvforge-{__version__}.dist-info"
    files: dict[str, bytes] = {}
    found = [Path(d) / f for d, dirs, names in os.walk(root, followlinks=True)  # data/docs may be a link
             if "__pycache__" not in Path(d).parts for f in names]
    for path in sorted(found):
        rel = path.relative_to(root)
        if path.suffix in (".pyc", ".pyo") or not path.is_file():
            continue
        files[f"kvforge/{rel.as_posix()}"] = path.read_bytes()
    files[f"{info}/METADATA"] = meta.encode("utf-8")
    files[f"{info}/entry_points.txt"] = entry_points.encode("utf-8")
    files[f"{info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: kvforge init\nRoot-Is-Purelib: true\n"
                              b"Tag: py3-none-any\n")
    record = "".join(f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},"
                     f"{len(d)}\n" for n, d in files.items())
    files[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode("utf-8")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in files.items():
            entry = zipfile.ZipInfo(n, (1980, 1, 1, 0, 0, 0))
            entry.external_attr = 0o644 << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(entry, d)
    return f"kvforge-{__version__}-py3-none-any.whl", buf.getvalue()


def install_command(spec: str | None = None) -> tuple[str, str]:
    """(the pip command that installs this kvforge elsewhere, how it was found). `spec`: a pip requirement the
    user gave; else the installed distribution's PEP 610 direct_url.json (a git URL and commit, a local path),
    else kvforge==<version> from the package index. (init takes `install_plan`, which never gives a local path.)"""
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


def core_cpu_suites(repo: Path, commit: str) -> tuple[str, ...]:
    """vLLM's own CPU-marked core suites in the base tree `commit` of `repo`: the test_*.py modules under
    CORE_TESTS that use CPU_MARK (vLLM runs them in its cpu_test lane), in path order; VLLM_CPU when none is."""
    res = gitutil.run(repo, "grep", "-l", "-F", CPU_MARK, commit, "--", f"{CORE_TESTS}*.py", check=False)
    found = sorted(line.split(":", 1)[1] for line in res.stdout.splitlines() if ":" in line)
    found = [p for p in found if Path(p).name.startswith("test_")]
    return tuple(found) or VLLM_CPU


def first_selection_comment(cpu: tuple[str, ...]) -> list[str]:
    """The comment above a first target's CPU selection: where it came from."""
    if cpu == VLLM_CPU:
        return ["vLLM's KV-cache manager CPU tests (this release marks no core suite CPU-only).",
                "`kvforge test -t TARGET --scan --try` adds the other modules a series reaches that run on CPU."]
    return [f"vLLM's own CPU-only core suites: the modules under {CORE_TESTS} marked {CPU_MARK} in this release",
            "(vLLM's cpu_test lane). `kvforge test -t TARGET --scan --try` adds the other modules a series reaches."]


def _toml_list(items: tuple[str, ...] | list[str], indent: str = "    ") -> str:
    return "[\n" + "".join(f"{indent}{json.dumps(i)},\n" for i in items) + "]"


def _release_block(pin: Pin) -> str:
    return (f"\n[components.release]\n# The offline source: the PyPI sdist, its sha256 from {pin.source}.\n"
            f"package = {json.dumps(pin.package)}\nversion = {json.dumps(pin.version)}\n"
            f"sha256 = {json.dumps(pin.sha256)}\n"
            "# No release wheel is pinned ([[components.wheels]], which `kvforge build` overlays): "
            "`kvforge target add`\n# pins them per platform tag.\n")


def target_text(name: str, upstream: str, pins: dict[str, Pin], cpu: tuple[str, ...] = VLLM_CPU) -> str:
    """The first target's file: vLLM alone, or vLLM (no series needed) under vllm-ascend; `cpu`: vLLM's CPU
    selection (core_cpu_suites of its base, the selection `kvforge target add` gives a first target)."""
    vllm = pins["vllm"]
    lines = [f"name = {json.dumps(name)}",
             f"description = {json.dumps(f'{upstream} {pins[upstream].version} (written by kvforge init)')}",
             'lifecycle = "maintained"', "",
             "[[components]]", 'name = "vllm"', 'repo = "https://github.com/vllm-project/vllm.git"',
             f"ref = {json.dumps('v' + vllm.version)}", f"series = {json.dumps(f'patches/{name}')}",
             f"platforms = {json.dumps(['cpu', 'cuda'] if upstream == 'vllm' else ['cpu'])}",
             _release_block(vllm), "[components.tests]",
             "# Run from the root of the base or patched tree; every test a patch names in Checks is added.",
             *(f"# {line}" for line in first_selection_comment(cpu)),
             f"cpu = {_toml_list(cpu)}"]
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


def watch_text(install: str) -> str:
    """kvforge's own scheduled watch workflow (data/init's copy of ci/github/kvforge-watch.yml), installing kvforge
    with `install` ($KVFORGE_INSTALL) instead of from the checkout."""
    watch = (DATA / "github-kvforge-watch.yml").read_text(encoding="utf-8")
    if SOURCE_INSTALL not in watch or "\nenv:\n" not in watch:
        raise AssertionError("kvforge/data/init's watch workflow no longer has the install step or env: to rewrite")
    note = (f"# Written by `kvforge init` (kvforge {__version__}): $KVFORGE_INSTALL installs kvforge.\n")
    return note + watch.replace(SOURCE_INSTALL, "${{ env.KVFORGE_INSTALL }}").replace(
        "\nenv:\n", f"\nenv:\n  KVFORGE_INSTALL: {json.dumps(install)}\n", 1)


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
    if name is not None:
        problem = target_name_problem(name)
        if problem is not None:
            shown = name if len(name) <= 40 else name[:37] + "..."
            raise KvforgeError(f"--as {shown!r}: the name {problem}", EXIT_USAGE)
    _check_name_fits(dest)
    try:
        in_place = _check_destination(dest)
    except OSError as exc:
        raise _write_refused(dest, exc) from None
    if release is not None:
        try:
            Version(release)
        except InvalidVersion:
            raise KvforgeError(f"--release {release!r} is not a release version (e.g. 0.20.2, 0.20.2rc1)",
                               EXIT_USAGE) from None
    plan = install_plan(install)
    cmd, how = plan.command, plan.how

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

    if in_place:
        stage = dest / f".kvforge-init-{os.getpid()}"
    else:
        stage = dest.parent / f".{dest.name}.kvforge-init-{os.getpid()}"
    try:
        if not in_place:
            remove_stale(dest.parent, STALE.format(name=re.escape(dest.name)))
        _write(stage, dest.name, upstream, tname, pins, cmd, plan.wheel, cache, say)
        gitutil.run(stage, "init", "-q", "-b", "main")
        gitutil.run(stage, "add", "-A")
        what = f"targets/{tname}.toml" if tname else "no target yet"
        gitutil.run(stage, "commit", "-q", "-m", f"kvforge init: a patch repository for {upstream} ({what})",
                    env=_author_env(stage))
        crashpoint("init:before-rename")
        with _placing(dest):
            _still_free(dest, stage if in_place else None)
            if in_place:
                _move_up(stage, dest)
            else:
                os.rename(stage, dest)  # one step
    except OSError as exc:
        shutil.rmtree(stage, ignore_errors=True)
        raise _write_refused(dest, exc) from None
    except gitutil.GitError as exc:
        shutil.rmtree(stage, ignore_errors=True)
        last = (exc.stderr.strip().splitlines() or [str(exc)])[-1]
        raise KvforgeError(f"{dest}: cannot make the new project's git repository ({last}); nothing was written",
                           EXIT_ENV) from None
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


def _check_name_fits(dest: Path) -> None:
    """DIR's name, with the staging directory's prefix and suffix, must be a file name here (EXIT_USAGE)."""
    try:
        most = os.pathconf(dest.parent if dest.parent.is_dir() else "/", "PC_NAME_MAX")
    except (OSError, ValueError):
        most = 255
    extra = len(f"..kvforge-init-{os.getpid()}")
    size = len(os.fsencode(dest.name))
    if size + extra > most:
        shown = dest.name if len(dest.name) <= 40 else dest.name[:37] + "..."
        raise KvforgeError(f"{dest.parent}/{shown}: the directory name is {size} bytes long (at most {most - extra}: "
                           f"init stages it beside as .NAME.kvforge-init-PID); nothing was written", EXIT_USAGE)


def _check_destination(dest: Path) -> bool:
    """Whether DIR exists (an empty directory: written in place); a refusal when it cannot be a new project."""
    if dest.exists() or dest.is_symlink():
        if not dest.is_dir() or dest.is_symlink():
            raise KvforgeError(f"{dest}: exists and is not a directory; kvforge init makes a new project in a new or "
                               "empty directory", EXIT_USAGE)
        remove_stale(dest, STALE_INSIDE)
        if any(dest.iterdir()):
            raise KvforgeError(f"{dest}: not empty; kvforge init makes a new project only in a new or empty "
                               "directory (nothing was written)", EXIT_USAGE)
        return True
    if not dest.parent.is_dir():
        raise KvforgeError(f"{dest.parent}: no such directory (the new project's parent must exist)", EXIT_USAGE)
    return False


@contextlib.contextmanager
def _placing(dest: Path) -> Iterator[None]:
    """An exclusive lock on DIR's parent directory while a project is placed at DIR (two inits of one DIR)."""
    fd = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _still_free(dest: Path, stage: Path | None) -> None:
    """Under the lock: DIR is still missing (a new DIR) or holds nothing but `stage` (in place)."""
    if stage is None:
        taken = dest.exists() or dest.is_symlink()
    else:
        taken = any(entry.name != stage.name for entry in dest.iterdir())
    if taken:
        raise KvforgeError(f"{dest}: written by another process (another kvforge init?) while this init ran; "
                           "that is left as it is, nothing of this init was kept", EXIT_USAGE)


def _write_refused(where: Path, exc: OSError) -> KvforgeError:
    """An OSError while writing the new project as one line: a name too long is bad input, anything else (read-only,
    permissions, a full disk) the environment's."""
    why = exc.strerror or str(exc)
    if exc.errno == errno.ENAMETOOLONG:
        return KvforgeError(f"{where}: a name too long for this file system ({why}); nothing was written", EXIT_USAGE)
    return KvforgeError(f"{where}: cannot write the new project ({why}); nothing was written", EXIT_ENV)


def _move_up(stage: Path, dest: Path) -> None:
    """Every entry of `stage` (inside `dest`) into `dest`, then `stage` removed; a failure moves back the entries
    already moved, so `dest` is left as it was (empty but for `stage`, which the caller removes)."""
    moved: list[str] = []
    try:
        for entry in sorted(os.listdir(stage)):
            os.rename(stage / entry, dest / entry)
            moved.append(entry)
        stage.rmdir()
    except BaseException:
        for entry in reversed(moved):
            os.rename(dest / entry, stage / entry)
        raise


def _write(stage: Path, title: str, upstream: str, tname: str | None, pins: dict[str, Pin], install: str,
           wheel: tuple[str, bytes] | None = None, cache: Cache | None = None, say: Say | None = None) -> None:
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
        first = parse_target(path, stage)  # what kvforge init writes, kvforge reads: a failure here is a kvforge bug
        if cache is not None:  # vLLM's base, for its CPU-marked core suites (as `kvforge target add` selects)
            base = ensure_base(first.component("vllm"), cache, "sdist", None, say)
            path.write_text(target_text(tname, upstream, pins, core_cpu_suites(base.repo, base.commit)),
                            encoding="utf-8")
            parse_target(path, stage)
    readme = fill((DATA / "README.md.in").read_text(encoding="utf-8"), {
        "NAME": title, "UPSTREAM": upstream, "INSTALL": install, "KVFORGE_VERSION": __version__,
        "UPSTREAM_TITLE": {"vllm": "vLLM", "vllm-ascend": "vllm-ascend (on vLLM)"}[upstream]})
    (stage / "README.md").write_text(readme, encoding="utf-8")
    shutil.copyfile(DATA / "gitignore", stage / ".gitignore")
    github, buildkite = ci_text(install)
    (stage / ".github" / "workflows").mkdir(parents=True)
    (stage / ".github" / "workflows" / "kvforge.yml").write_text(github, encoding="utf-8")
    (stage / ".github" / "workflows" / "kvforge-watch.yml").write_text(watch_text(install), encoding="utf-8")
    if wheel is not None:
        (stage / WHEEL_DIR).mkdir()
        (stage / WHEEL_DIR / wheel[0]).write_bytes(wheel[1])
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
