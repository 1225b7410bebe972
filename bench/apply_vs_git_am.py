#!/usr/bin/env python3
"""Benchmark: `kvforge apply` against plain `git am -3` on the same patches and the same base.

Two real series on the vLLM v0.20.2 tree:
- ours:    the v0.20.2rc series shipped in patches/v0.20.2rc;
- forward: real upstream changes, one patch per file of vllm/v1/core that changed between v0.20.2
           and 0.33.0 (the main snapshot), i.e. thousands of lines across >= 5 patches.
Both tools start from the same cached base repository and end with a standalone repository of the
user's own (no link into the cache) with the series as commits on a checked-out branch. The
baseline is what a user types without kvforge: `git init` + `git fetch <cache repo> <base>` +
`git checkout` + `git am -3`. kvforge is measured twice: "new series" (its stack for the series is
forgotten first, so git am runs: the first apply of an edited series) and "known series" (the
stack is reused, as after `kvforge verify`). Each side runs --repeat times, alternating; the table
reports medians and the ratios to plain git.

Usage: python bench/apply_vs_git_am.py [--repeat 5] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvforge.git.bases import ensure_base  # noqa: E402
from kvforge.core.cache import Cache  # noqa: E402
from kvforge.git.engine import format_patch  # noqa: E402
from kvforge.core.render import table  # noqa: E402
from kvforge.project.series import read_series  # noqa: E402
from kvforge.project.targets import load_target  # noqa: E402

IDENT_ENV = {"GIT_AUTHOR_NAME": "kvforge", "GIT_AUTHOR_EMAIL": "kvforge@users.noreply.github.com",
             "GIT_COMMITTER_NAME": "kvforge", "GIT_COMMITTER_EMAIL": "kvforge@users.noreply.github.com",
             "GIT_AUTHOR_DATE": "2026-11-22T12:00:00+00:00", "GIT_COMMITTER_DATE": "2026-11-22T12:00:00+00:00"}


def git(cwd: Path, *args: str, env: dict | None = None, input: str | None = None) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, input=input,
                          env={**os.environ, **IDENT_ENV, **(env or {})}).stdout


def forward_series(repo: Path, old: str, new: str, out: Path) -> list[Path]:
    """One annotated patch per vllm/v1/core file that changed from `old` to `new`, chained on `old`."""
    files = git(repo, "diff", "--name-only", old, new, "--", "vllm/v1/core").split()
    index = out / ".index"
    env = {"GIT_INDEX_FILE": str(index)}
    git(repo, "read-tree", old, env=env)
    parent, paths = old, []
    for n, rel in enumerate(files, 1):
        blob = git(repo, "rev-parse", f"{new}:{rel}").strip() if git(repo, "ls-tree", new, "--", rel) else None
        if blob:
            git(repo, "update-index", "--add", "--cacheinfo", f"100644,{blob},{rel}", env=env)
        else:
            git(repo, "update-index", "--force-remove", rel, env=env)
        tree = git(repo, "write-tree", env=env).strip()
        slug = rel.rsplit("/", 1)[-1].removesuffix(".py").replace("_", "-")
        msg = (f"[Core] forward-port {rel} to 0.33.0\n\nReal upstream change, for the benchmark.\n\n"
               f"Fix-Id: fwd-{slug}\nKind: refactor\nUpstream-Status: Accepted\nWhy: benchmark input.\n"
               f"Drop-When: version >= 0.33.0\nSigned-off-by: kvforge <kvforge@users.noreply.github.com>\n")
        parent = git(repo, "commit-tree", tree, "-p", parent, "-m", msg).strip()
        path = out / f"{n:04d}-fwd-{slug}.patch"
        path.write_bytes(format_patch(repo, parent))
        paths.append(path)
    index.unlink(missing_ok=True)
    return paths


def make_project(root: Path, name: str, patches: list[Path]) -> None:
    """A project with target `name`: v0.20.2rc's vllm component (its first; vllm-ascend is left out)
    with `patches` as its series."""
    src = (ROOT / "targets" / "v0.20.2rc.toml").read_text()
    src = "[[components]]".join(src.split("[[components]]")[:2])
    (root / "targets").mkdir(parents=True, exist_ok=True)
    (root / "targets" / f"{name}.toml").write_text(
        src.replace('name = "v0.20.2rc"', f'name = "{name}"').replace("patches/v0.20.2rc", f"patches/{name}"))
    d = root / "patches" / name
    d.mkdir(parents=True, exist_ok=True)
    for p in patches:
        shutil.copy2(p, d / p.name)
    (d / "series").write_text("".join(p.name + "\n" for p in patches))


def time_git_am(repo: Path, base: str, patches: list[Path], dest: Path) -> float:
    start = time.perf_counter()
    git(dest.parent, "init", "-q", str(dest))
    git(dest, "fetch", "-q", "--no-tags", str(repo), base)
    git(dest, "checkout", "-q", "-b", "work", base)
    git(dest, "am", "-3", "-q", *map(str, patches))
    return time.perf_counter() - start


def forget_stacks(repo: Path) -> None:
    for ref in git(repo, "for-each-ref", "--format=%(refname)", "refs/kvforge/stacks").split():
        git(repo, "update-ref", "-d", ref)


def time_kvforge(project: Path, cache: Path, name: str, dest: Path, branch: str) -> float:
    env = {**os.environ, "KVFORGE_ROOT": str(project), "KVFORGE_CACHE": str(cache), "KVFORGE_OFFLINE": "1"}
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "kvforge.cli", "apply", "-t", name, "--component", "vllm", "--into",
                          str(dest), "--branch", branch], capture_output=True, text=True, env=env)
    if res.returncode != 0:
        raise SystemExit(f"kvforge apply -t {name} failed (exit {res.returncode}): {res.stderr.strip()}")
    return time.perf_counter() - start


def cleanup(dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cache-dir", type=Path, default=None)
    args = ap.parse_args()
    cache = Cache(args.cache_dir)

    def say(msg):
        print(f"bench: {msg}", file=sys.stderr)

    t0 = time.perf_counter()
    base = ensure_base(load_target("v0.20.2rc").component(), cache, "sdist", progress=say)
    base_cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    ensure_base(load_target("v0.20.2rc").component(), cache, "sdist")
    base_warm = time.perf_counter() - t0
    snap = ensure_base(load_target("main").component(), cache, "sdist", progress=say)

    work = Path(tempfile.mkdtemp(prefix="kvforge-bench-"))
    try:
        fwd = forward_series(base.repo, base.commit, snap.commit, work)
        ours = [p.path for p in read_series(ROOT / "patches" / "v0.20.2rc").patches]
        series = {"ours": ours, "forward": fwd}
        rows = []
        for name, patches in series.items():
            if not patches:
                continue
            project = work / f"proj-{name}"
            make_project(project, f"bench-{name}", patches)
            lines = sum(sum(1 for ln in p.read_text().splitlines() if ln[:1] in "+-") for p in patches)
            am_times, new_times, known_times = [], [], []
            for i in range(args.repeat):
                say(f"{name}: round {i + 1}/{args.repeat}")
                d1, d2, d3 = work / f"am-{name}-{i}", work / f"kv-new-{name}-{i}", work / f"kv-known-{name}-{i}"
                am_times.append(time_git_am(base.repo, base.commit, patches, d1))
                cleanup(d1)
                forget_stacks(base.repo)
                new_times.append(time_kvforge(project, cache.root, f"bench-{name}", d2, "kvforge/bench"))
                cleanup(d2)
                known_times.append(time_kvforge(project, cache.root, f"bench-{name}", d3, "kvforge/bench"))
                cleanup(d3)
            am, new, known = (statistics.median(t) for t in (am_times, new_times, known_times))
            rows.append([name, len(patches), lines, f"{am:.3f}", f"{new:.3f}", f"{new / am:.2f}x", f"{known:.3f}",
                         f"{known / am:.2f}x"])
        cold = ("already cached (use an empty --cache-dir to measure the cold import)" if base.cached
                else f"cold {base_cold:.2f}s (download + import)")
        print(f"vLLM v0.20.2 base ({base.commit[:12]}): {cold}, warm {base_warm * 1000:.1f}ms; "
              f"median of {args.repeat} runs")
        print(table(["series", "patches", "+/- lines", "git init+fetch+am (s)", "kvforge new series (s)", "ratio",
                     "kvforge known series (s)", "ratio"], rows))
        print("goal: ratio <= 1.30x")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
