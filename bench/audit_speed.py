#!/usr/bin/env python3
"""Benchmark: `kvforge audit` of each shipped series beside `git diff --stat` of the same range.

The audit (kvforge.proof.audit.audit_target) is what `kvforge lint` would run for every series: the
stack's refs read back (the series applied once in the cache; the first run of an edited series
applies it, timed apart as "stack"), the blobs of the files each patch names read in one
`git cat-file --batch`, both sides of each Python file parsed and compared, and the patched tree
grepped for every name a patch removes. The baseline is `git diff --stat base..top` of the same
stack in the same repository: what a reviewer runs to see the series' size. Medians of --repeat
runs; the last line is the goal: the largest series (most changed lines) audited in under 2 s (said,
never an exit status: a benchmark measures).

Usage: python bench/audit_speed.py [--repeat 5] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvforge.core.cache import Cache, default_cache_dir  # noqa: E402
from kvforge.core.render import table  # noqa: E402
from kvforge.git.context import Context  # noqa: E402
from kvforge.git.trees import open_stack  # noqa: E402
from kvforge.project.targets import load_all  # noqa: E402
from kvforge.proof.audit import audit_target  # noqa: E402

GOAL = 2.0


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cache-dir", type=Path, default=None)
    args = ap.parse_args()
    os.environ.setdefault("KVFORGE_ROOT", str(ROOT))
    cache = Cache(args.cache_dir or Path(os.environ.get("KVFORGE_CACHE") or default_cache_dir()))
    rows, results = [], []
    for target in load_all(ROOT):
        for comp in target.components:
            ctx = Context.load(cache, target.name, comp.name, source="sdist")
            stack_s, stack = timed(lambda: open_stack(ctx))
            built = stack.built
            repo, a, b = stack.base.repo, stack.commits[0], stack.commits[-1]
            stat = subprocess.run(["git", "diff", "--shortstat", a, b], cwd=repo, capture_output=True, text=True,
                                  check=True).stdout.split()
            added = int(stat[stat.index("insertions(+),") - 1]) if "insertions(+)," in stat else 0
            removed = int(stat[stat.index("deletions(-)") - 1]) if "deletions(-)" in stat else 0
            audits, diffs = [], []
            report = None
            for _ in range(args.repeat):
                s, report = timed(lambda: audit_target(ctx))
                audits.append(s)
                d, _ = timed(lambda: subprocess.run(["git", "diff", "--stat", a, b], cwd=repo, check=True,
                                                    capture_output=True))
                diffs.append(d)
            assert report is not None
            changes = sum(len(p.findings) for p in report.patches)
            audit_s, diff_s = statistics.median(audits), statistics.median(diffs)
            label = f"{target.name}/{comp.name}"
            rows.append([label, stack.size, f"+{added} -{removed}", changes, len(report.problems()),
                         f"{stack_s:.2f}" + (" (applied)" if built else ""), f"{audit_s:.3f}", f"{diff_s:.3f}",
                         f"{audit_s / diff_s:.0f}x" if diff_s else "-"])
            results.append((added + removed, label, stack.size, audit_s, diff_s))
    print(table(["series", "patches", "lines", "changes listed", "problems", "stack (s)", "audit (s)",
                 "git diff --stat (s)", "audit / diff"], rows))
    lines, label, size, audit_s, diff_s = max(results)
    verdict = "met" if audit_s < GOAL else "MISSED"
    print(f"largest series {label} ({size} patches, {lines} lines changed): audit {audit_s:.3f} s, "
          f"git diff --stat {diff_s:.3f} s (goal < {GOAL:.0f} s: {verdict}); median of {args.repeat}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
