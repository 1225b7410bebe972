#!/usr/bin/env python3
"""Benchmark: `kvforge rebase` against a plain `git rebase` (and `git am -3`) of the same commits onto the same base.

Two real series:
- ours:    the v0.20.1 series shipped in patches/v0.20.1, moved onto vLLM 0.20.2 (4 patches, all carried);
- forward: real upstream changes, one patch per vllm/v1/core file changed between v0.20.2 and 0.33.0
           (bench/apply_vs_git_am.py's forward_series, 15 patches) on a v0.20.2 target, moved onto 0.33.0
           (all already upstream: every one is dropped).
Bases come from the same cache (imported once before timing; offline, so the sha256 of the new sdist is
the cached archive's). The baselines run in a user's clone that already holds the old series' commits
and the new base, checked out on the old series (made once, not timed): `git rebase --onto NEW OLD
work`, or `git checkout NEW` + `git am -3` of the series' patch files. kvforge is run
as its CLI (process start included), `kvforge rebase -t T --onto V --as NEW` in a copy of the project,
ending with the new series and target written (all or nothing). kvforge's own breakdown (from --json):
plan = the per-patch signals (kvforge.upstream; the Checks signal is not run, it runs tests), apply,
write (export, range-diff, target file). Each side runs --repeat times, alternating; medians.

Usage: python bench/rebase_vs_git_rebase.py [--repeat 5] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from apply_vs_git_am import IDENT_ENV, forward_series  # noqa: E402

from kvforge.bases import ensure_base  # noqa: E402
from kvforge.cache import Cache  # noqa: E402
from kvforge.context import Context  # noqa: E402
from kvforge.report import table  # noqa: E402
from kvforge.series import read_series  # noqa: E402
from kvforge.targets import Release, load_target  # noqa: E402
from kvforge.trees import open_stack  # noqa: E402


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env={**os.environ, **IDENT_ENV}).stdout


def user_clone(repo: Path, commits: list[str], dest: Path) -> Path:
    """A user's clone holding the old series and the new base (made once, outside the timing)."""
    git(dest.parent, "init", "-q", str(dest))
    git(dest, "fetch", "-q", "--no-tags", str(repo), *commits)
    return dest


def time_git_rebase(clone: Path, old_base: str, old_head: str, new_base: str) -> float:
    git(clone, "checkout", "-q", "-f", "-B", "work", old_head)  # the user is on their branch
    start = time.perf_counter()
    git(clone, "rebase", "-q", "--onto", new_base, old_base, "work")
    return time.perf_counter() - start


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


def time_kvforge(project: Path, cache: Path, target: str, onto: str, as_name: str) -> tuple[float, dict]:
    env = {**os.environ, "KVFORGE_ROOT": str(project), "KVFORGE_CACHE": str(cache), "KVFORGE_OFFLINE": "1"}
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "kvforge.cli", "rebase", "-t", target, "--onto", onto, "--as",
                          as_name, "--source", "sdist", "--json"], capture_output=True, text=True, env=env)
    took = time.perf_counter() - start
    if res.returncode != 0:
        raise SystemExit(f"kvforge rebase failed ({res.returncode}): {res.stderr.strip()[-400:]}")
    data = json.loads(res.stdout)
    shutil.rmtree(project / "patches" / as_name)
    (project / "targets" / f"{as_name}.toml").unlink()
    return took, data


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cache-dir", type=Path, default=None)
    args = ap.parse_args()
    cache = Cache(args.cache_dir)

    def say(msg):
        print(f"bench: {msg}", file=sys.stderr)

    os.environ["KVFORGE_OFFLINE"] = "1"
    comp_0201 = load_target("v0.20.1").component()
    comp_0202 = load_target("v0.20.2rc").component()
    sha_0330 = load_target("main").component().release.sha256
    base_0201 = ensure_base(comp_0201, cache, "sdist", progress=say)
    base_0202 = ensure_base(replace(comp_0202, wheel=None), cache, "sdist", progress=say)
    base_0330 = ensure_base(replace(comp_0202, ref="v0.33.0", wheel=None,
                                    release=Release("vllm", "0.33.0", sha_0330)), cache, "sdist", progress=say)

    work = Path(tempfile.mkdtemp(prefix="kvforge-bench-rebase-"))
    try:
        fwd_dir = work / "fwd"
        fwd_dir.mkdir()
        fwd = forward_series(base_0202.repo, base_0202.commit, base_0330.commit, fwd_dir)
        ours = [p.path for p in read_series(ROOT / "patches" / "v0.20.1").patches]
        cases = [("ours", "v0.20.1", ours, "0.20.2", base_0201, base_0202),
                 ("forward", "v0.20.2rc", fwd, "0.33.0", base_0202, base_0330)]
        rows = []
        for name, template, patches, onto, old, new in cases:
            project = work / f"proj-{name}"
            target = f"bench-{name}"
            make_project(project, target, template, patches)
            os.environ["KVFORGE_ROOT"] = str(project)
            ctx = Context.load(cache, target, source="sdist")
            stack = open_stack(ctx)  # the old series as commits (kvforge also reuses it: warm)
            old_head = stack.commits[-1]
            say(f"{name}: warm-up")
            time_kvforge(project, cache.root, target, onto, "warmup")
            if old.repo.resolve() != new.repo.resolve():
                raise SystemExit("both bases must be in one cache repository (sdist imports)")
            clone = user_clone(new.repo, [old_head, new.commit], work / f"clone-{name}")
            rb, am, kv, parts = [], [], [], []
            for i in range(args.repeat):
                say(f"{name}: round {i + 1}/{args.repeat}")
                rb.append(time_git_rebase(clone, old.commit, old_head, new.commit))
                am.append(time_git_am(clone, new.commit, old_head, patches))
                took, data = time_kvforge(project, cache.root, target, onto, f"r{i}")
                kv.append(took)
                parts.append(data["seconds"])
            verdicts = {}
            for p in data["patches"]:
                verdicts[p["verdict"]] = verdicts.get(p["verdict"], 0) + 1
            med = {k: statistics.median(s.get(k, 0.0) for s in parts) for k in ("base", "plan", "apply", "write")}
            r, a, k = (statistics.median(t) for t in (rb, am, kv))
            rows.append([name, len(patches), onto, ", ".join(f"{v} {n}" for n, v in verdicts.items()),
                         f"{r:.2f}", f"{a:.2f}", f"{k:.2f}", f"{k / r:.2f}x",
                         f"{med['plan']:.2f}", f"{k - med['plan']:.2f}", f"{(k - med['plan']) / r:.2f}x",
                         f"{med['apply']:.2f}", f"{med['write']:.2f}"])
        print(f"median of {args.repeat} runs; bases cached; offline")
        print(table(["series", "patches", "onto", "verdicts", "git rebase (s)", "git am -3 (s)", "kvforge (s)",
                     "ratio", "signals (s)", "kvforge w/o signals (s)", "ratio", "apply (s)", "write (s)"], rows))
        print("goal: ratio <= 1.5x; signals = reverse-apply, patch-id, upstream-commit, drop-when (checks not run)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
