#!/usr/bin/env python3
"""Benchmark: `kvforge watch` over every release after v0.20.2 for every maintained target, from real PyPI.

`kvforge watch --since 0.20.2 --json` (the CLI, process start included) in a cache of its own:
- cold: an empty cache (every sdist downloaded from the index and imported as a base), or with
  --downloads-from DIR the release files linked in first (then only the imports are cold);
- warm: the same command again in the same cache (downloads and imported bases cached);
- the obvious alternative, in the same (warm) cache: a loop of `kvforge rebase -t T --component C --onto V
  --dry-run --json`, one process per (target, component, release) row the watch reported (--no-loop skips it).
Behaviour decides the conflict rows (the Checks without the fix, a port of the nearest variant proven): the cold run
runs them (--envs-from DIR links built test environments in first; an environment it lacks is built there), the
warm run takes every result from the cache; --checks N is the budget ($KVFORGE_WATCH_CHECKS; default: none with
--envs-from, else 0: an empty cache would build every release's environment first), --checks 0 the watch without
the Checks. Prints the totals, the verdicts and decisions, "needs a person" before (every row the rebase
does not settle) and after (the rows behaviour does not settle either), and the warm run's time per release.
With a budget, the warm run runs no more Checks (it
takes the cold run's results). Each run's progress goes to <cache>/bench-<run>.log as it runs, its JSON to
<cache>/bench-<run>.json. vllm-ascend's releases newer than
--since count too (that component's base is 0.20.2rc1); --since 0.32.0 is the small variant (0.33.0 only).

Usage: python bench/watch_all_releases.py [--since 0.20.2] [--cache-dir DIR] [--downloads-from DIR] [--envs-from DIR]
                                        [--checks N] [--no-loop]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvforge.core.render import table  # noqa: E402

KVFORGE = [sys.executable, "-c", "from kvforge.cli import main; main()"]


def kvforge(cache: Path, *args: str, checks: str | None = None, log: Path | None = None) -> tuple[int, str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("KVFORGE_OFFLINE", "KVFORGE_CRASH_AT", "KVFORGE_WATCH_CHECKS")}
    env.update({"KVFORGE_CACHE": str(cache), "KVFORGE_ROOT": str(ROOT)})
    if checks is not None:
        env["KVFORGE_WATCH_CHECKS"] = checks
    t = time.monotonic()
    with open(log or os.devnull, "w") as err:
        res = subprocess.run([*KVFORGE, *args], env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                             timeout=8 * 3600)
    took = time.monotonic() - t
    if res.returncode not in (0, 3):
        tail = log.read_text()[-3000:] if log else ""
        sys.exit(f"kvforge {' '.join(args)}: exit {res.returncode}\n{res.stdout[-2000:]}\n{tail}")
    return res.returncode, res.stdout, took


def verdicts(doc: dict) -> Counter:
    """The rebase's verdicts, the decisions ("d:" + decision), and "before": the rows the rebase does not settle."""
    c: Counter = Counter()
    for r in doc["releases"]:
        for chk in r["checks"]:
            if chk["error"]:
                c["error"] += 1
            for p in chk["patches"]:
                c[p["verdict"]] += 1
                c["d:" + p.get("decision", "")] += 1
                c["before"] += p["verdict"] not in ("carried", "upstream")
    return c


def row(name: str, doc: dict, seconds: float, code: int) -> list:
    rows = sum(len(r["checks"]) for r in doc["releases"])
    v = verdicts(doc)
    return [name, len(doc["releases"]), rows, v["carried"], v["upstream"], v["conflict"], v["disagree"], v["error"],
            v["d:upstream (by behaviour)"], v["d:port proven"], f"{v['before']} -> {doc.get('cost', '?')}",
            doc.get("checks_run", "-"), f"{seconds:.1f}", f"{seconds / rows:.1f}" if rows else "-", code]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--since", default="0.20.2")
    ap.add_argument("--cache-dir", type=Path, help="the cache to use (must be empty or absent) [default: a temp dir]")
    ap.add_argument("--downloads-from", type=Path, help="link these release files into the cache before the cold run")
    ap.add_argument("--envs-from", type=Path, help="link this directory of built test environments in as the cache's envs")
    ap.add_argument("--checks", default=None, help="the watch's Checks budget (0: no Checks) [default: no limit with "
                                                   "--envs-from, else 0]")
    ap.add_argument("--no-loop", action="store_true", help="skip the kvforge rebase --dry-run loop")
    a = ap.parse_args()
    tmp = None
    if a.cache_dir is None:
        tmp = Path(tempfile.mkdtemp(prefix="kvforge-watch-bench-"))
        cache = tmp / "cache"
    else:
        cache = a.cache_dir
        if cache.exists() and any(cache.iterdir()):
            sys.exit(f"{cache} is not empty: the cold run needs an empty cache")
    (cache / "downloads").mkdir(parents=True, exist_ok=True)
    cold = "cold (empty cache"
    if a.downloads_from:
        for f in sorted(a.downloads_from.glob("*.tar.gz")):
            os.symlink(f, cache / "downloads" / f.name)
        cold = f"cold (release files linked from {a.downloads_from}"
    if a.envs_from:
        os.symlink(a.envs_from.absolute(), cache / "envs", target_is_directory=True)
        cold += "; test environments linked"
    if a.checks is None and a.envs_from is None:  # an empty cache would build every release's environment first
        a.checks = "0"
    cold += "; Checks off)" if a.checks == "0" else f"; Checks budget {a.checks or 'none'})"
    try:
        results = []
        print(f"kvforge watch --since {a.since}: {cold} ...", file=sys.stderr, flush=True)
        code, out, t_cold = kvforge(cache, "watch", "--since", a.since, "--json", checks=a.checks,
                                    log=cache / "bench-cold.log")
        cold_doc = json.loads(out)
        (cache / "bench-cold.json").write_text(out)
        results.append(row(f"kvforge watch, {cold}", cold_doc, t_cold, code))
        print("kvforge watch: warm ...", file=sys.stderr, flush=True)
        # With a budget the cold run left rows unchecked: the warm run takes its results and runs no more Checks.
        code, out, t_warm = kvforge(cache, "watch", "--since", a.since, "--json",
                                    checks=a.checks if a.checks is None else "0", log=cache / "bench-warm.log")
        warm_doc = json.loads(out)
        (cache / "bench-warm.json").write_text(out)
        results.append(row("kvforge watch, warm (downloads and bases cached)", warm_doc, t_warm, code))
        if not a.no_loop:
            t_loop, loop_verdicts = 0.0, Counter()
            for r in warm_doc["releases"]:
                for chk in r["checks"]:
                    print(f"kvforge rebase -t {chk['target']} --component {chk['component']} --onto {r['version']} "
                          "--dry-run ...", file=sys.stderr, flush=True)
                    _c, out, took = kvforge(cache, "rebase", "-t", chk["target"], "--component", chk["component"],
                                            "--onto", r["version"], "--dry-run", "--json", "--source", "sdist")
                    t_loop += took
                    for p in json.loads(out).get("patches", []):
                        loop_verdicts[p["verdict"]] += 1
            n = sum(len(r["checks"]) for r in warm_doc["releases"])
            results.append(["kvforge rebase --dry-run loop, warm (one process per row)", len(warm_doc["releases"]), n,
                            loop_verdicts["carried"], loop_verdicts["upstream"], loop_verdicts["conflict"],
                            loop_verdicts["disagree"], 0, "-", "-", "-", "-", f"{t_loop:.1f}",
                            f"{t_loop / n:.1f}" if n else "-", "-"])
        print(table(["run", "releases", "rows", "carried", "upstream", "conflict", "disagree", "errors",
                     "upstream (by behaviour)", "port proven", "needs a person (before -> after)", "Checks runs",
                     "total s", "s/row", "exit"], results))
        if not a.no_loop and t_loop:
            print(f"\nwarm watch vs the loop: {t_warm:.1f}s vs {t_loop:.1f}s ({t_warm / t_loop:.2f}x)")
        print("\nwarm run, per release (target/component: verdicts, seconds):")
        per = []
        for r in warm_doc["releases"]:
            for chk in r["checks"]:
                per.append([f"{r['package']} {r['version']}", f"{chk['target']}/{chk['component']}", chk["summary"],
                            chk["status"], f"{chk['seconds']:.1f}", chk.get("cost", "-"), chk.get("decisions", "-")])
        print(table(["release", "target/component", "patches", "status", "s", "need a person", "decisions"], per))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
