#!/usr/bin/env python3
"""Benchmark: `kvforge pick` of one real upstream change into every target vs `git cherry-pick -x` per target branch.

The change: upstream #41282 (apply_admission_cap), which is exactly what changed in vllm/v1/core and
tests/v1/core between the PyPI sdists of vLLM 0.20.1 and 0.20.2. The source is a clone holding those
paths as the sdists of 0.20.1 and 0.20.2 have them (tags v0.20.1, v0.20.2; made once, not timed).

- kvforge: `kvforge pick --repo SRC <commit> --json` in a copy of the project (its CLI, process start
  included), ending with every verdict decided and the series and target files written (all or nothing);
  the project is restored between runs (not timed). Its breakdown from --json: signals (kvforge.flow.upstream
  on every target's base), decide (signals + git am -3 on each stack), write.
- by hand: a clone with one branch per target (base + series, made once by `kvforge apply`, not timed):
  `git fetch SRC <commit>`, then per target `git checkout -q kvforge/<t>` and `git cherry-pick -x <commit>`
  (a failure is `git cherry-pick --abort`ed and noted; the branches are reset between runs, not timed).
  It says nothing about targets that already have the change (a "blank diff" failure) and writes no series.
Both sides run --repeat times, alternating; medians. Goal: kvforge within 1.5x of by hand.

Usage: python bench/pick_vs_cherry_pick.py [--repeat 3] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvforge.git.bases import download_sdist  # noqa: E402
from kvforge.core.cache import Cache, default_cache_dir  # noqa: E402
from kvforge.core.render import table  # noqa: E402
from kvforge.project.targets import load_target  # noqa: E402

IDENT = {"GIT_AUTHOR_NAME": "vLLM", "GIT_AUTHOR_EMAIL": "noreply@vllm.ai", "GIT_COMMITTER_NAME": "vLLM",
         "GIT_COMMITTER_EMAIL": "noreply@vllm.ai", "GIT_AUTHOR_DATE": "2026-05-08T12:00:00+00:00",
         "GIT_COMMITTER_DATE": "2026-05-08T12:00:00+00:00"}
TARGETS = ("v0.20.1", "v0.20.2rc", "main")


def git(cwd: Path, *args: str, data: bytes | None = None, check: bool = True, env: dict | None = None):
    return subprocess.run(["git", *args], cwd=cwd, input=data, capture_output=True, check=check,
                          env={**os.environ, **IDENT, **(env or {})})


def core_files(sdist: Path) -> dict[str, bytes]:
    out = {}
    with tarfile.open(sdist) as tar:
        for m in tar:
            rel = m.name.split("/", 1)[1] if "/" in m.name else ""
            if m.isfile() and rel.startswith(("vllm/v1/core/", "tests/v1/core/")):
                f = tar.extractfile(m)
                if f is not None:
                    out[rel] = f.read()
    return out


def commit(repo: Path, files: dict[str, bytes], parent: str | None, message: str) -> str:
    env = {"GIT_INDEX_FILE": str(repo / ".git" / "bench-index")}
    (repo / ".git" / "bench-index").unlink(missing_ok=True)
    lines = [f"100644 blob {git(repo, 'hash-object', '-w', '--stdin', data=d).stdout.decode().strip()}\t{r}"
             for r, d in sorted(files.items())]
    git(repo, "update-index", "--index-info", data=("\n".join(lines) + "\n").encode(), env=env)
    tree = git(repo, "write-tree", env=env).stdout.decode().strip()
    return git(repo, "commit-tree", tree, "-m", message, *(["-p", parent] if parent else [])).stdout.decode().strip()


def source_repo(dest: Path, cache: Cache) -> str:
    s1 = download_sdist(load_target("v0.20.1", ROOT).component(), cache, print)
    s2 = download_sdist(load_target("v0.20.2rc", ROOT).component(), cache, print)
    git(dest.parent, "init", "-q", str(dest))
    a = commit(dest, core_files(s1), None, "vllm 0.20.1: vllm/v1/core and tests/v1/core")
    git(dest, "tag", "v0.20.1", a)
    b = commit(dest, core_files(s2), a, "[Core] Apply the SWA admission cap only in the full-sequence admission "
                                        "gate (#41282)\n\nSigned-off-by: vLLM <noreply@vllm.ai>\n")
    git(dest, "tag", "v0.20.2", b)
    return b


def kvforge(env: dict, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from kvforge.cli import main; main()", *args], cwd=cwd, env=env,
                          capture_output=True, text=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cache-dir", type=Path)
    args = ap.parse_args()
    cache = Cache(args.cache_dir or default_cache_dir())
    with tempfile.TemporaryDirectory(prefix="kvforge-bench-pick-") as tmp_s:
        tmp = Path(tmp_s)
        src = tmp / "vllm-src"
        sha = source_repo(src, cache)
        project = tmp / "project"
        project.mkdir()
        archive = subprocess.run(["git", "archive", "HEAD", "targets", "patches"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "x"], cwd=project, input=archive, check=True)
        git(project, "init", "-q")
        git(project, "add", "-A")
        git(project, "commit", "-qm", "project")
        env = {**os.environ, "KVFORGE_ROOT": str(project), "KVFORGE_CACHE": str(cache.root), "KVFORGE_OFFLINE": "1",
               "GIT_CONFIG_COUNT": "2", "GIT_CONFIG_KEY_0": "user.name", "GIT_CONFIG_VALUE_0": "Bench",
               "GIT_CONFIG_KEY_1": "user.email", "GIT_CONFIG_VALUE_1": "bench@example.com"}
        hand = tmp / "hand"
        for n, t in enumerate(TARGETS):  # not timed: the by-hand clone, and kvforge's stacks warm
            how = ["--into", str(hand)] if n == 0 else ["--repo-dir", str(hand)]
            res = kvforge(env, tmp, "apply", "-t", t, "--component", "vllm", *how)
            if res.returncode != 0:
                print(res.stderr, file=sys.stderr)
                return 1
        heads = {t: git(hand, "rev-parse", f"kvforge/{t}").stdout.decode().strip() for t in TARGETS}
        kv_times, hand_times, breakdown = [], [], []
        kv_verdicts: dict[str, str] = {}
        hand_out: dict[str, str] = {}
        for _ in range(args.repeat):
            t0 = time.monotonic()
            res = kvforge(env, tmp, "pick", "--repo", str(src), sha, "--fix-id", "swa-admission-cap", "--json")
            kv_times.append(time.monotonic() - t0)
            if res.returncode != 0:
                print(res.stdout[-2000:], res.stderr[-2000:], file=sys.stderr)
                return 1
            doc = json.loads(res.stdout)
            kv_verdicts = {r["target"]: r["verdict"] for r in doc["rows"]}
            breakdown.append(doc["seconds"])
            git(project, "checkout", "-q", "--", ".")
            git(project, "clean", "-qfd")

            t0 = time.monotonic()
            git(hand, "fetch", "-q", str(src), sha)
            for t in TARGETS:
                git(hand, "checkout", "-q", f"kvforge/{t}")
                r = git(hand, "cherry-pick", "-x", sha, check=False)
                if r.returncode == 0:
                    hand_out[t] = "picked"
                else:
                    text = (r.stdout + r.stderr).decode(errors="replace")
                    hand_out[t] = "empty (already there?)" if "empty" in text else "conflict"
                    git(hand, "cherry-pick", "--abort", check=False)
                    git(hand, "reset", "-q", "--hard", check=False)
            hand_times.append(time.monotonic() - t0)
            for t in TARGETS:
                git(hand, "checkout", "-q", f"kvforge/{t}")
                git(hand, "reset", "-q", "--hard", heads[t])
        kv, by_hand = statistics.median(kv_times), statistics.median(hand_times)

        def med(key: str) -> str:
            vals = [b.get(key) for b in breakdown if b.get(key) is not None]
            return f"{statistics.median(vals):.2f}" if vals else "-"

        print(f"one real upstream change (#41282, {sha[:12]}) into {len(TARGETS)} targets, {args.repeat} runs, medians")
        print(table(["method", "seconds", "signals (s)", "decide (s)", "write (s)"] + list(TARGETS),
                    [["kvforge pick", f"{kv:.2f}", med("signals"), med("decide"), med("write")]
                     + [kv_verdicts.get(t, "-") for t in TARGETS],
                     ["git cherry-pick -x", f"{by_hand:.2f}", "-", "-", "-"] + [hand_out.get(t, "-") for t in TARGETS]]))
        ratio = kv / by_hand if by_hand else float("inf")
        print(f"ratio kvforge/by hand: {ratio:.2f}x (goal <= 1.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
