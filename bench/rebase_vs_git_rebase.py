#!/usr/bin/env python3
"""Benchmark: `kvforge rebase` against a plain `git rebase` (and `git am -3`) of the same commits onto the same base.

Three series:
- ours:    the v0.20.1 series shipped in patches/v0.20.1, moved onto vLLM 0.20.2 (5 patches, all carried);
- large:   ours and 495 synthetic carried changes after it (--large N: N patches in all; 0 leaves it out), each
           appending one line to a vllm/*.py file of its own that is the same in 0.20.1 and 0.20.2 (so each
           applies on both as it is and none is upstream), moved onto 0.20.2 (500 patches, all carried);
- forward: real upstream changes, one patch per vllm/v1/core file changed between v0.20.2 and 0.33.0
           (bench/apply_vs_git_am.py's forward_series, 15 patches) on a v0.20.2 target, moved onto 0.33.0
           (all already upstream: every one is dropped; --no-forward leaves it out).
Bases come from the same cache (imported once before timing; offline, so the sha256 of the new sdist is
the cached archive's).

What is timed, on each side:
- git rebase: `git rebase --onto NEW OLD work` in a user's clone that already holds the old series' commits
  and the new base, checked out on the old series (made once, not timed): one git CLI process, as typed.
- git am -3: `git checkout NEW` + `git am -3` of the series' patch files in that clone (git CLI processes).
- kvforge CLI: `kvforge rebase -t T --onto V --as NEW --json` (the console script pip installs next to this
  interpreter, as a user runs it; `python -m kvforge.cli` where there is none) in a copy of the project, ending
  with the new series and target written (all or nothing): a new Python process, start-up included, with
  its bytecode cached (as after `pip install`; this machine's PYTHONDONTWRITEBYTECODE is overridden by a
  private PYTHONPYCACHEPREFIX).
- kvforge library call: the same run's `kvforge.flow.rebase.run` as kvforge's own clock times it (the --json
  `seconds.total`): what the CLI does once Python and kvforge are loaded. Its parts (also from --json): base
  (--onto resolved, both bases from the cache: the offline sha256 of the new archive, the old stack),
  signals (every patch's reverse-apply, patch-id, upstream-commit, drop-when; the Checks signal runs tests
  and is not run), apply (`git am -3`), write (export, lint, range-diff, the target file).
- start-up: `python -c pass` and `python -c "import kvforge.cli, kvforge.flow.rebase"` (bytecode cached), the
  fixed cost of every CLI run, shown apart.
- git processes: how many git processes one kvforge run starts (an extra, untimed run with a counting `git`
  first on PATH); `git rebase` is one command.
Each side runs --repeat times, alternating; medians. The goal: the kvforge CLI, end to end, <= 1.5x `git rebase`
at 5 and at 500 patches.

--import-release V (repeatable): the cold import of vLLM V's sdist (in the cache's downloads/) as a base
commit, timed once per method into a new repository: kvforge's import (bases.import_archive: one pass over
the archive, blobs in archive order, the commit naming them in path order), the import kvforge had before
(members read in path order, each seeking in the gzip stream; kept here as the baseline), and `tar x` +
`git add -A` + `git commit` (what one types). The commit ids of both kvforge imports must be equal (the id
is a function of the archive's content alone) and the tree of `git add` is shown equal or not.

Usage: python bench/rebase_vs_git_rebase.py [--repeat 5] [--cache-dir DIR] [--large 500] [--no-forward]
       [--import-release 0.22.0 ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from apply_vs_git_am import IDENT_ENV, forward_series  # noqa: E402

from kvforge.git import bases, engine, gitutil  # noqa: E402
from kvforge.git.bases import ensure_base, import_archive  # noqa: E402
from kvforge.core.cache import REF_IMPORT, Cache  # noqa: E402
from kvforge.git.context import Context  # noqa: E402
from kvforge.core.fsutil import sha256_file  # noqa: E402
from kvforge.core.render import table  # noqa: E402
from kvforge.project.series import read_series  # noqa: E402
from kvforge.project.targets import Component, Release, load_target  # noqa: E402
from kvforge.git.trees import open_stack  # noqa: E402


# The console script pip installs next to this interpreter (`kvforge = "kvforge.cli:main"`), as a user runs it.
_SCRIPT = Path(sys.executable).with_name("kvforge")
KVFORGE = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "kvforge.cli"]


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env={**os.environ, **IDENT_ENV}).stdout


def user_clone(repo: Path, commits: list[str], dest: Path) -> Path:
    """A user's clone holding the old series and the new base (made once, outside the timing)."""
    git(dest.parent, "init", "-q", str(dest))
    git(dest, "fetch", "-q", "--no-tags", str(repo), *commits)
    return dest


def cpu_children() -> float:
    """CPU seconds (user + system) of every finished child process and its descendants, so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def time_git_rebase(clone: Path, old_base: str, old_head: str, new_base: str) -> tuple[float, float]:
    """(wall s, CPU s) of the rebase."""
    git(clone, "checkout", "-q", "-f", "-B", "work", old_head)  # the user is on their branch
    cpu, start = cpu_children(), time.perf_counter()
    git(clone, "rebase", "-q", "--onto", new_base, old_base, "work")
    return time.perf_counter() - start, cpu_children() - cpu


def time_git_am(clone: Path, new_base: str, old_head: str, patches: list[Path]) -> float:
    git(clone, "checkout", "-q", "-f", "-B", "work", old_head)
    start = time.perf_counter()
    git(clone, "checkout", "-q", "-B", "work", new_base)
    res = subprocess.run(["git", "am", "-3", "-q", *map(str, patches)], cwd=clone, capture_output=True, text=True,
                         env={**os.environ, **IDENT_ENV})
    if res.returncode != 0:  # a patch already upstream stops git am: skip it, as a user would
        while subprocess.run(["git", "am", "--skip"], cwd=clone, capture_output=True,
                             env={**os.environ, **IDENT_ENV}).returncode != 0:
            pass
    return time.perf_counter() - start


def child_env(work: Path, **extra: str) -> dict[str, str]:
    """The CLI's environment: bytecode cached in a private directory (warmed by the warm-up run)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPYCACHEPREFIX": str(work / "pycache"), **extra}


def time_kvforge(project: Path, cache: Path, target: str, onto: str, as_name: str, env: dict[str, str]) \
        -> tuple[float, dict, float]:
    """(wall s, the --json result, CPU s of the process and its git children)."""
    env = {**env, "KVFORGE_ROOT": str(project), "KVFORGE_CACHE": str(cache), "KVFORGE_OFFLINE": "1"}
    cpu, start = cpu_children(), time.perf_counter()
    res = subprocess.run([*KVFORGE, "rebase", "-t", target, "--onto", onto, "--as", as_name, "--source", "sdist",
                          "--json"], capture_output=True, text=True, env=env, cwd=project)
    took, cpu = time.perf_counter() - start, cpu_children() - cpu
    if res.returncode != 0:
        raise SystemExit(f"kvforge rebase failed ({res.returncode}): {res.stderr.strip()[-400:]}")
    data = json.loads(res.stdout)
    shutil.rmtree(project / "patches" / as_name)
    (project / "targets" / f"{as_name}.toml").unlink()
    return took, data, cpu


def count_git(project: Path, cache: Path, target: str, onto: str, env: dict[str, str], work: Path) \
        -> tuple[int, dict[str, int]]:
    """The git processes one kvforge rebase starts, in all and per git command (`apply`, `mailinfo`, ...): a `git`
    that counts, first on PATH (not timed)."""
    real = shutil.which("git")
    shim = work / "shim"
    shim.mkdir(exist_ok=True)
    log = shim / "count"
    log.write_text("")
    (shim / "git").write_text(f"#!/bin/sh\necho \"$*\" >> '{log}'\nexec '{real}' \"$@\"\n")
    (shim / "git").chmod(0o755)
    time_kvforge(project, cache, target, onto, "counted", {**env, "PATH": f"{shim}:{env.get('PATH', '')}"})
    lines = log.read_text().splitlines()
    by: dict[str, int] = {}
    for line in lines:
        words = line.split()
        while words and words[0].startswith("-"):  # -c name=value pairs and other options before the command
            words = words[2:] if words[0] in ("-c", "-C") else words[1:]
        by[words[0] if words else "?"] = by.get(words[0] if words else "?", 0) + 1
    return len(lines), dict(sorted(by.items(), key=lambda kv: -kv[1]))


def time_python(args: list[str], env: dict[str, str]) -> tuple[float, float]:
    cpu, start = cpu_children(), time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, env=env, capture_output=True)
    return time.perf_counter() - start, cpu_children() - cpu


def make_project(root: Path, name: str, template: str, patches: list[Path]) -> None:
    """A project with target `name`: the template target's vllm component (its first; v0.20.2rc's vllm-ascend is
    left out: `rebase --as` makes one-component targets) with `patches` as its series."""
    (root / "targets").mkdir(parents=True, exist_ok=True)
    src = (ROOT / "targets" / f"{template}.toml").read_text()
    src = "[[components]]".join(src.split("[[components]]")[:2])
    (root / "targets" / f"{name}.toml").write_text(
        src.replace(f'name = "{template}"', f'name = "{name}"').replace(f"patches/{template}", f"patches/{name}"))
    d = root / "patches" / name
    d.mkdir(parents=True, exist_ok=True)
    for p in patches:
        shutil.copy2(p, d / p.name)
    (d / "series").write_text("".join(p.name + "\n" for p in patches))


def carried_series(repo: Path, old: str, new: str, head: str, count: int, skip: set[str], out: Path) -> list[Path]:
    """`count` carried changes chained on `head` (a stack on `old`): each appends one line to its own vllm/*.py
    file that is the same blob in `old` and `new` and that the series before it does not touch (`skip`), so each
    applies on both bases as it is and none is upstream. All commits from one `git fast-import`."""
    changed = set(git(repo, "diff", "--name-only", old, new).split())
    files = []
    for line in git(repo, "ls-tree", "-r", "-l", old, "--", "vllm").splitlines():
        meta, rel = line.split("\t", 1)
        _mode, kind, blob, size = meta.split()
        if kind == "blob" and rel.endswith(".py") and size != "0" and rel not in changed and rel not in skip:
            files.append((rel, blob))
    blobs = subprocess.run(["git", "cat-file", "--batch"], cwd=repo, check=True, capture_output=True,
                           input="".join(f"{b}\n" for _, b in files).encode()).stdout
    contents, pos = [], 0
    for _ in files:
        header_end = blobs.index(b"\n", pos)
        size = int(blobs[pos:header_end].split()[2])
        contents.append(blobs[header_end + 1:header_end + 1 + size])
        pos = header_end + 1 + size + 1
    picked = [(rel, data) for (rel, _), data in zip(files, contents) if data.endswith(b"\n")][:count]
    if len(picked) < count:
        raise SystemExit(f"only {len(picked)} files for {count} carried changes")
    ident = b"kvforge <kvforge@users.noreply.github.com> 1795435200 +0000"
    stream = []
    for n, (rel, data) in enumerate(picked, 1):
        msg = (f"[Misc] bench: carried change {n:04d}\n\nA synthetic carried change, for the benchmark.\n\n"
               f"Fix-Id: bench-carried-{n:04d}\nKind: refactor\nUpstream-Status: Inappropriate [benchmark input]\n"
               f"Why: benchmark input.\nDrop-When: never [benchmark input]\n"
               f"Signed-off-by: kvforge <kvforge@users.noreply.github.com>\n").encode()
        body = data + f"# kvforge bench: carried change {n:04d}\n".encode()
        stream += [b"commit refs/kvforge-bench/carried\n", b"mark :%d\n" % n, b"author %s\n" % ident,
                   b"committer %s\n" % ident, b"data %d\n%s\n" % (len(msg), msg)]
        if n == 1:
            stream.append(f"from {head}\n".encode())
        stream += [b"M 100644 inline %s\ndata %d\n%s\n" % (rel.encode(), len(body), body)]
    marks = out / ".marks"
    subprocess.run(["git", "fast-import", "--quiet", f"--export-marks={marks}"], cwd=repo, check=True,
                   input=b"".join(stream), capture_output=True)
    ids = dict(line.split() for line in marks.read_text().splitlines())
    commits = [ids[f":{n}"] for n in range(1, count + 1)]
    git(repo, "update-ref", "-d", "refs/kvforge-bench/carried")
    marks.unlink()
    engine.format_patches(repo, head, commits)
    paths = []
    for n, commit in enumerate(commits, 1):
        path = out / f"{n + 5000:04d}-bench-carried-{n:04d}.patch"
        path.write_bytes(engine.format_patch(repo, commit))
        paths.append(path)
    return paths


# ---------------------------------------------------------------- the cold import of a release


def import_before(repo: Path, archive: Path, message: bytes) -> str:
    """kvforge's sdist import before this benchmark's change, kept as the baseline: the members listed first
    (getmembers), then read in path order (each one a seek in the gzip stream, backwards ones decompressing it
    again from the start) and written inline."""
    with tarfile.open(archive, "r:*") as tar:
        entries = []
        for m in tar.getmembers():
            parts = m.name.split("/", 1)
            if (m.isfile() or m.issym() or m.islnk()) and len(parts) == 2 and parts[1]:
                entries.append((parts[1], m))
        entries.sort(key=lambda e: e[0])
        proc = gitutil.popen(repo.parent, "-c", "fastimport.unpackLimit=0", "fast-import", "--quiet", "--done",
                             "--force", env={"GIT_DIR": str(repo)})
        assert proc.stdin is not None and proc.stderr is not None
        w = proc.stdin.write
        w(f"commit {REF_IMPORT}\n".encode())
        w(f"author {bases.IMPORT_IDENT} {bases.IMPORT_DATE}\ncommitter {bases.IMPORT_IDENT} {bases.IMPORT_DATE}\n"
          .encode())
        w(b"data %d\n%s\n" % (len(message), message))
        w(b"deleteall\n")
        for path, m in entries:
            if m.issym():
                data, mode = m.linkname.encode(), b"120000"
            else:
                fh = tar.extractfile(m)
                data = fh.read() if fh else b""
                mode = b"100755" if m.mode & 0o111 else b"100644"
            w(b"M %s inline %s\ndata %d\n" % (mode, quote(path), len(data)))
            w(data)
            w(b"\n")
        w(b"done\n")
        proc.stdin.close()
        err = proc.stderr.read().decode(errors="replace")
        if proc.wait() != 0:
            raise SystemExit(f"git fast-import failed: {err}")
    return gitutil.run(repo.parent, "rev-parse", REF_IMPORT, env={"GIT_DIR": str(repo)}).stdout.strip()


def quote(path: str) -> bytes:
    """A path in fast-import's syntax (as kvforge's import writes it)."""
    if any(c in path for c in '"\\\n') or path.startswith(" "):
        return b'"' + path.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").encode() + b'"'
    return path.encode()


def bench_import(version: str, template: Component, cache: Cache, work: Path, say) -> list[str]:
    archive = cache.downloads / f"vllm-{version}.tar.gz"
    if not archive.is_file():
        raise SystemExit(f"--import-release {version}: {archive} is not in the cache (run `kvforge base` for a "
                         "target on it, or rebase onto it, once)")
    comp = replace(template, ref=f"v{version}", wheels=(), release=Release("vllm", version, None))
    digest = sha256_file(archive)

    def fresh(name: str) -> Path:
        repo = work / f"import-{version}-{name}.git"
        shutil.rmtree(repo, ignore_errors=True)
        git(work, "init", "-q", "--bare", str(repo))
        return repo

    say(f"import {version}: kvforge")
    repo = fresh("now")
    start = time.perf_counter()
    now = import_archive(repo, archive, comp, digest)
    t_now = time.perf_counter() - start
    message = gitutil.run(repo.parent, "cat-file", "commit", now, env={"GIT_DIR": str(repo)}).stdout
    message_bytes = (message.split("\n\n", 1)[1] + "\n").encode()
    pack_now = sum(f.stat().st_size for f in (repo / "objects" / "pack").glob("*.pack"))
    tree_now = gitutil.run(repo.parent, "rev-parse", f"{now}^{{tree}}", env={"GIT_DIR": str(repo)}).stdout.strip()
    shutil.rmtree(repo)

    say(f"import {version}: kvforge before")
    repo = fresh("before")
    start = time.perf_counter()
    before = import_before(repo, archive, message_bytes)
    t_before = time.perf_counter() - start
    pack_before = sum(f.stat().st_size for f in (repo / "objects" / "pack").glob("*.pack"))
    shutil.rmtree(repo)

    say(f"import {version}: tar x + git add + git commit")
    tree_dir = work / f"import-{version}-tar"
    shutil.rmtree(tree_dir, ignore_errors=True)
    tree_dir.mkdir()
    start = time.perf_counter()
    subprocess.run(["tar", "xzf", str(archive), "-C", str(tree_dir), "--strip-components=1"], check=True)
    git(tree_dir, "init", "-q")
    git(tree_dir, "-c", "core.autocrlf=false", "add", "-A", "-f")
    git(tree_dir, "commit", "-q", "--no-verify", "-m", f"vllm {version}")
    t_tar = time.perf_counter() - start
    tree_tar = git(tree_dir, "rev-parse", "HEAD^{tree}").strip()
    shutil.rmtree(tree_dir)
    return [version, f"{archive.stat().st_size / 1e6:.0f}", f"{t_before:.1f}", f"{t_now:.1f}",
            f"{t_before / t_now:.1f}x", f"{t_tar:.1f}", "yes" if before == now else f"NO ({before[:12]} {now[:12]})",
            "yes" if tree_tar == tree_now else "no", f"{pack_before / 1e6:.0f} / {pack_now / 1e6:.0f}"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--large", type=int, default=500, metavar="N",
                    help="also a series of N patches: ours and N - 5 synthetic carried changes (0: leave it out)")
    ap.add_argument("--no-forward", action="store_true", help="leave out the 15 upstream patches onto 0.33.0")
    ap.add_argument("--import-release", action="append", default=[], metavar="VERSION",
                    help="also time the cold import of this release's sdist (in the cache), old vs new vs tar+git")
    args = ap.parse_args()
    cache = Cache(args.cache_dir)

    def say(msg):
        print(f"bench: {msg}", file=sys.stderr)

    os.environ["KVFORGE_OFFLINE"] = "1"
    comp_0201 = load_target("v0.20.1").component()
    comp_0202 = load_target("v0.20.2rc").component()
    sha_0330 = load_target("main").component().release.sha256
    base_0201 = ensure_base(comp_0201, cache, "sdist", progress=say)
    base_0202 = ensure_base(replace(comp_0202, wheels=()), cache, "sdist", progress=say)
    base_0330 = ensure_base(replace(comp_0202, ref="v0.33.0", wheels=(),
                                    release=Release("vllm", "0.33.0", sha_0330)), cache, "sdist", progress=say)

    work = Path(tempfile.mkdtemp(prefix="kvforge-bench-rebase-"))
    try:
        env = child_env(work)
        ours = [p.path for p in read_series(ROOT / "patches" / "v0.20.1").patches]
        cases = [("ours", "ours", "v0.20.1", ours, "0.20.2", base_0201, base_0202)]
        if args.large > len(ours):
            make_project(work / "proj-stack", "bench-stack", "v0.20.1", ours)
            os.environ["KVFORGE_ROOT"] = str(work / "proj-stack")
            ours_stack = open_stack(Context.load(cache, "bench-stack", source="sdist"))
            touched = {f for p in read_series(ROOT / "patches" / "v0.20.1").patches for f in p.touched_paths}
            carried_dir = work / "carried"
            carried_dir.mkdir()
            say(f"large: {args.large - len(ours)} synthetic carried changes")
            carried = carried_series(base_0201.repo, base_0201.commit, base_0202.commit, ours_stack.commits[-1],
                                     args.large - len(ours), touched, carried_dir)
            cases.append((f"ours + {len(carried)} carried", "large", "v0.20.1", ours + carried, "0.20.2", base_0201,
                          base_0202))
        if not args.no_forward:
            fwd_dir = work / "fwd"
            fwd_dir.mkdir()
            fwd = forward_series(base_0202.repo, base_0202.commit, base_0330.commit, fwd_dir)
            cases.append(("forward", "forward", "v0.20.2rc", fwd, "0.33.0", base_0202, base_0330))
        rows, parts_rows, cpu_rows, git_rows = [], [], [], []
        for name, slug, template, patches, onto, old, new in cases:
            project = work / f"proj-{slug}"
            target = f"bench-{slug}"
            make_project(project, target, template, patches)
            os.environ["KVFORGE_ROOT"] = str(project)
            ctx = Context.load(cache, target, source="sdist")
            stack = open_stack(ctx)  # the old series as commits (kvforge also reuses it: warm)
            old_head = stack.commits[-1]
            say(f"{name}: warm-up")
            time_kvforge(project, cache.root, target, onto, "warmup", env)
            n_git, git_by = count_git(project, cache.root, target, onto, env, work)
            git_rows.append([name, n_git, ", ".join(f"{c} {n}" for c, n in git_by.items())])
            if old.repo.resolve() != new.repo.resolve():
                raise SystemExit("both bases must be in one cache repository (sdist imports)")
            clone = user_clone(new.repo, [old_head, new.commit], work / f"clone-{slug}")
            rb, am, cli, parts, rb_cpu, cli_cpu = [], [], [], [], [], []
            for i in range(args.repeat):
                say(f"{name}: round {i + 1}/{args.repeat}")
                took, cpu = time_git_rebase(clone, old.commit, old_head, new.commit)
                rb.append(took)
                rb_cpu.append(cpu)
                am.append(time_git_am(clone, new.commit, old_head, patches))
                took, data, cpu = time_kvforge(project, cache.root, target, onto, f"r{i}", env)
                cli.append(took)
                cli_cpu.append(cpu)
                parts.append(data["seconds"])
            verdicts: dict[str, int] = {}
            for p in data["patches"]:
                verdicts[p["verdict"]] = verdicts.get(p["verdict"], 0) + 1
            med = {k: statistics.median(s.get(k, 0.0) for s in parts) for k in ("base", "plan", "apply", "write",
                                                                                "total")}
            r, a, c = (statistics.median(t) for t in (rb, am, cli))
            lib = med["total"]
            rows.append([name, len(patches), onto, ", ".join(f"{v} {n}" for n, v in verdicts.items()),
                         f"{r:.2f}", f"{a:.2f}", f"{lib:.2f}", f"{lib / r:.2f}x", f"{med['plan']:.2f}",
                         f"{lib - med['plan']:.2f}", f"{(lib - med['plan']) / r:.2f}x", f"{c:.2f}", f"{c / r:.2f}x",
                         n_git])
            parts_rows.append([name, f"{med['base']:.2f}", f"{med['plan']:.2f}", f"{med['apply']:.2f}",
                               f"{med['write']:.2f}", f"{lib:.2f}", f"{c - lib:.2f}"])
            rc, kc = statistics.median(rb_cpu), statistics.median(cli_cpu)
            cpu_rows.append([name, rc, kc])
        say("start-up")
        bare, imports = [], []
        for _ in range(args.repeat):
            bare.append(time_python(["-c", "pass"], env))
            imports.append(time_python(["-c", "import kvforge.cli, kvforge.flow.rebase"], env))
        load = os.getloadavg()[0]
        print(f"median of {args.repeat} runs; bases cached; offline; times in seconds, wall clock; "
              f"{os.cpu_count()} CPUs, load average {load:.1f}")
        print("git rebase: one git CLI process. kvforge library: kvforge.flow.rebase.run, as kvforge's clock times it "
              "(--json seconds.total). kvforge CLI: the whole `kvforge rebase ... --json` process (the console "
              "script), as a user runs it.")
        print(table(["series", "patches", "onto", "verdicts", "git rebase (s)", "git am -3 (s)", "kvforge library (s)",
                     "ratio", "signals (s)", "library w/o signals (s)", "ratio", "kvforge CLI (s)", "ratio",
                     "git processes"], rows))
        print("goal: the kvforge CLI <= 1.5x git rebase end to end, at 5 and at 500 patches, with all signals "
              "(reverse-apply, patch-id, upstream-commit, drop-when; the Checks signal runs tests and is not run)")
        print()
        print("where kvforge's time goes (medians, s): base = --onto resolved (offline: the sha256 of the cached "
              "archive), both bases and the old stack from the cache; CLI - library = Python start-up, imports, "
              "loading the target, printing the JSON")
        print(table(["series", "base", "signals", "apply", "write", "library total", "CLI - library"], parts_rows))
        print()
        print("git processes one kvforge rebase starts, per git command (a counting `git` first on PATH, untimed)")
        print(table(["series", "git processes", "per command"], git_rows))
        print()
        print(table(["fixed cost of every CLI run", "median wall (s)", "median CPU (s)"],
                    [["python -c pass", f"{statistics.median(t for t, _ in bare):.2f}",
                      f"{statistics.median(c for _, c in bare):.2f}"],
                     ["python -c 'import kvforge.cli, kvforge.flow.rebase' (bytecode cached)",
                      f"{statistics.median(t for t, _ in imports):.2f}",
                      f"{statistics.median(c for _, c in imports):.2f}"]]))
        print()
        print("CPU seconds (user + system, the process and every git process it started; less sensitive than wall "
              "time to a loaded machine)")
        start_cpu = statistics.median(c for _, c in imports)
        print(table(["series", "git rebase CPU (s)", "kvforge CLI CPU (s)", "ratio", "CLI - start-up CPU (s)", "ratio"],
                    [[n, f"{rc:.2f}", f"{kc:.2f}", f"{kc / rc:.2f}x", f"{kc - start_cpu:.2f}",
                      f"{(kc - start_cpu) / rc:.2f}x"] for n, rc, kc in cpu_rows]))
        if args.import_release:
            irows = [bench_import(v, comp_0202, cache, work, say) for v in args.import_release]
            print()
            print("cold import of a release's sdist as a base commit (once per method, a new repository each)")
            print(table(["release", "sdist (MB)", "kvforge before (s)", "kvforge now (s)", "speed-up",
                         "tar x + git add + commit (s)", "same commit id", "same tree as git add",
                         "pack MB before / now"], irows))
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
