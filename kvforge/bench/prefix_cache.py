"""`kvforge bench prefix-cache`: prefix-cache hit rates of the base and the patched tree.

Each tree's real vLLM scheduler replays the scenarios: the package kvforge/bench/replay/, run
by the target's test environment as `python <replay dir>` with cwd = the tree root, so
`import vllm` is that tree (it imports only vLLM and the standard library, never kvforge). The
hit rates are vLLM's own PrefixCacheStats counters; the ceiling is what the workload allows (an
unbounded cache); the replay also checks block-table invariants. This module runs the replays
(one subprocess per tree), aggregates, and renders the table, the JSON document and the optional
plot. It uses only the replay's pure modules in-process (scenario names).

A BenchResult names the evidence it is: target, component, base commit, series digest and where
the stack came from (the series files, or --from); every result file is under a directory keyed
by base, digest, scale and seed.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvforge.bench import DEFAULT_SCALE
from kvforge.bench.prepare import prepare
from kvforge.bench.replay import workloads
from kvforge.core import evidence
from kvforge.env.venv import target_env
from kvforge.core.errors import EXIT_ENV, EXIT_TESTS, EXIT_USAGE, KvforgeError
from kvforge.core.render import table
from kvforge.project.targets import STANDINS_DIR
from kvforge.git.trees import open_stack

Progress = Callable[[str], None]
REPLAY = Path(__file__).resolve().with_name("replay")  # run as `python REPLAY`: see replay/__main__.py
STATES = ("base", "patched")

# Goals from the issue; checked on the patched tree.
RESEND_MIN = 0.99  # dsv4-resend: A.3 hit rate
REPEAT_MAX_GAP = 0.005  # dsv4-repeat: within 0.5 points of the ceiling
NO_REGRESSION_GAP = 0.001  # controls: patched >= base - 0.1 points
# Speculative-decoding scenarios (EAGLE-style drafters), each with a "nospec" variant: the spec
# row should reach the nospec row's rate, and at least the lookahead bound (ceilings.py).
SPEC_SCENARIOS = ("gemma4-dflash", "gptoss-eagle")


def parse_scenarios(spec: str) -> list[tuple[str, str]]:
    try:
        return workloads.parse_runs(spec)
    except ValueError as exc:
        raise KvforgeError(f"--scenario: {exc}", EXIT_USAGE) from None


def run_label(name: str, variant: str) -> str:
    return name + (f"/{variant}" if variant else "")


# ---------------------------------------------------------------- aggregation (pure)

def _rate(num: float, den: float) -> float | None:
    return num / den if den else None


def summarize(res: dict) -> dict:
    """The numbers one replay result contributes to the table."""
    reqs = res["requests"]
    prompt = sum(r["prompt_tokens"] for r in reqs)
    admitted = sum(r["hit_tokens"] for r in reqs)
    ceiling = res["ceiling"]["hits"]
    overall = res["overall"]
    v = res["violations"]
    ext = res.get("external") or None
    return {
        "scenario": res["scenario"],
        "variant": res["variant"],
        "vllm": res["features"].get("vllm_version"),
        "requests": len(reqs),
        "steps": res["steps"],
        "hits": overall.get("hits", 0),
        "queries": overall.get("queries", 0),
        "hit_rate": _rate(overall.get("hits", 0), overall.get("queries", 0)),
        "admitted_hits": admitted,
        "prompt_tokens": prompt,
        "admitted_rate": _rate(admitted, prompt),
        "ceiling_hits": ceiling,
        "ceiling_rate": _rate(ceiling, prompt),
        # With a drafter: the ceiling when a block also needs the token after it (None without).
        "lookahead_ceiling_hits": (res.get("ceiling_lookahead") or {}).get("hits"),
        "of_ceiling": _rate(admitted, ceiling),
        "violations": sum(v["counts"].values()),
        "violation_kinds": dict(v["counts"]),
        "block_ids_in_two_groups": v["block_ids_in_two_groups"],
        "trigger_held": ext.get("trigger_held") if ext else None,
        "external_allocations": ext.get("allocations_with_external_tokens") if ext else None,
        "probe_errors": list(ext.get("probe_errors", [])) if ext else [],
        "points": len(res.get("points") or []) or None,
        "replay_seconds": res["seconds"]["replay"],
        "per_request": [
            {"label": r["label"], "hit": r["hit_tokens"], "prompt": r["prompt_tokens"],
             "ceiling": r["ceiling_tokens"], **({"point": r["point"]} if "point" in r else {})}
            for r in reqs
        ],
    }


def aggregate(docs: dict[str, dict]) -> list[dict]:
    """{state: replay document} -> one row per scenario/variant with a summary per state."""
    order: list[tuple[str, str]] = []
    by_state: dict[str, dict[tuple[str, str], dict]] = {}
    errors: dict[str, dict[tuple[str, str], str]] = {}
    for state, doc in docs.items():
        by_state[state] = {}
        for res in doc.get("results", []):
            key = (res["scenario"], res["variant"])
            by_state[state][key] = summarize(res)
            if key not in order:
                order.append(key)
        errors[state] = {}
        for err in doc.get("errors", []):
            key = (err["scenario"], err["variant"])
            errors[state][key] = err["error"]
            if key not in order:
                order.append(key)
    rows = []
    for key in order:
        row: dict[str, Any] = {"scenario": key[0], "variant": key[1], "label": run_label(*key)}
        for state in docs:
            row[state] = by_state[state].get(key)
            if key in errors[state]:
                row[f"{state}_error"] = errors[state][key]
        rows.append(row)
    return rows


def request_rate(summary: dict | None, label: str) -> float | None:
    if not summary:
        return None
    for r in summary["per_request"]:
        if r["label"] == label:
            return _rate(r["hit"], r["prompt"])
    return None


def goals(rows: list[dict], state: str = "patched") -> list[dict]:
    """The issue's goals, judged on one tree (the patched one unless it has no patches)."""
    out = []
    by_label = {row["label"]: row for row in rows}
    for row in rows:
        s, b = row.get(state), row.get("base")
        if s is None:
            continue
        name = row["label"]

        def add(goal: str, ok: bool, value: str) -> None:
            out.append({"scenario": name, "goal": goal, "ok": bool(ok), "value": value})

        if row["scenario"] == "dsv4-resend":
            a3 = request_rate(s, "A.3")
            add(f"A.3 hit rate >= {RESEND_MIN:.0%}", a3 is not None and a3 >= RESEND_MIN, _pct(a3))
        elif row["scenario"] == "dsv4-repeat":
            gap = (s["ceiling_rate"] or 0) - (s["admitted_rate"] or 0)
            add(f"within {REPEAT_MAX_GAP * 100:.1f} points of the ceiling", gap <= REPEAT_MAX_GAP,
                f"{gap * 100:.2f} points below")
        elif row["scenario"] == "external-hit":
            held = s["trigger_held"]
            add("no block id in two groups", s["block_ids_in_two_groups"] == 0,
                f"{s['block_ids_in_two_groups']} ids; trigger held for {held} requests"
                + ("" if held else " (not exercised)"))
        nospec = by_label.get(f"{row['scenario']}/nospec", {}).get(state)
        if row["scenario"] in SPEC_SCENARIOS and not row["variant"] and nospec is not None:
            gap = (nospec["admitted_rate"] or 0) - (s["admitted_rate"] or 0)
            add("at the no-spec rate", gap <= NO_REGRESSION_GAP,
                f"{_pct(s['admitted_rate'])} vs {_pct(nospec['admitted_rate'])} without speculative decoding")
        if row["scenario"] in SPEC_SCENARIOS and s.get("lookahead_ceiling_hits") is not None:
            bound = s["lookahead_ceiling_hits"]
            add("at the lookahead bound (a block also needs the token after it)",
                s["admitted_hits"] >= bound,
                f"{s['admitted_hits']:,} of {bound:,} tokens; no-spec ceiling {s['ceiling_hits']:,}")
        if b is not None and state != "base" and row["scenario"] in SPEC_SCENARIOS:
            drop = (b["admitted_rate"] or 0) - (s["admitted_rate"] or 0)
            add("no regression against base", drop <= NO_REGRESSION_GAP,
                f"{_pct(s['admitted_rate'])} vs {_pct(b['admitted_rate'])}")
        add("no invariant violations", s["violations"] == 0,
            ", ".join(f"{k} {v}" for k, v in s["violation_kinds"].items()) or "none")
    return out


def _pct(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x * 100:.{digits}f}%"


def _viol(s: dict) -> str:
    if not s["violations"]:
        text = "0"
    else:
        kinds = s["violation_kinds"]
        parts = []
        if s["block_ids_in_two_groups"]:
            parts.append(f"{s['block_ids_in_two_groups']} ids in 2 groups")
        parts += [f"{v} {k.replace('_', ' ')}" for k, v in kinds.items() if k != "block_in_two_groups"]
        text = ", ".join(parts)
    if s["trigger_held"] is not None:
        text += f" (trigger {s['trigger_held']}/{s['external_allocations']})"
    if s.get("probe_errors"):
        text += " (trigger probe failed)"
    return text


def render(rows: list[dict], states: list[str]) -> str:
    """The scenario x tree table, then per-request detail for small scenarios."""
    body = []
    for row in rows:
        shown = 0
        for state in states:
            s = row.get(state)
            if s is None and f"{state}_error" not in row:
                continue  # this tree does not run this scenario (vllm-ascend's states differ)
            first = row["label"] if shown == 0 else ""
            shown += 1
            if s is None:
                body.append([first, state, "error", "", "", "", row.get(f"{state}_error", "missing"), ""])
                continue
            body.append([first, state, _pct(s["hit_rate"]), _pct(s["admitted_rate"]), _pct(s["ceiling_rate"]),
                         _pct(s["of_ceiling"], 1), _viol(s), f"{s['replay_seconds']:.1f}"])
    out = [table(["scenario", "tree", "hit (vLLM)", "per-request", "ceiling", "of ceiling", "violations",
                  "wall s"], body)]
    for row in rows:
        found = [row.get(st) for st in states]
        summaries = [s for s in found if s]
        if len(summaries) < len(found) or summaries[0]["requests"] > 8 or summaries[0]["points"]:
            continue
        detail = []
        for i, r in enumerate(summaries[0]["per_request"]):
            cells = [r["label"], f"{r['prompt']:,}"]
            for s in summaries:
                pr = s["per_request"][i]
                cells.append(f"{pr['hit']:,} ({_pct(_rate(pr['hit'], pr['prompt']))})")
            cells.append(f"{r['ceiling']:,} ({_pct(_rate(r['ceiling'], r['prompt']))})")
            detail.append(cells)
        out.append(f"\n{row['label']}, per request (hit tokens):\n"
                   + table(["request", "tokens", *states, "ceiling"], detail))
    return "\n".join(out)


# ---------------------------------------------------------------- plot

def check_plot_available() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise KvforgeError("--plot needs matplotlib, which is not installed; "
                           "install kvforge's plot extra: pip install 'kvforge[plot]'", EXIT_USAGE)


def write_plot(rows: list[dict], states: list[str], path: Path, title: str) -> None:
    """Per-request hit rate, base vs patched, with the ceiling: one panel per scenario."""
    # The one import inside a function: matplotlib is the optional plot extra, loaded only for --plot.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if any(r.get(s) for s in states)]
    if not rows:
        raise KvforgeError("nothing to plot: no scenario produced results", EXIT_USAGE)
    cols = 2 if len(rows) > 1 else 1
    nrows = (len(rows) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 3.2 * nrows), squeeze=False)
    styles = {"base": dict(marker="o", linestyle="none", markersize=3, color="tab:red"),
              "patched": dict(marker="x", linestyle="none", markersize=3, color="tab:blue")}
    for ax, row in zip(axes.flat, rows):
        ref = next(row[s] for s in states if row.get(s))
        xs = list(range(len(ref["per_request"])))
        ax.plot(xs, [100 * (_rate(r["ceiling"], r["prompt"]) or 0) for r in ref["per_request"]],
                color="0.55", marker="_", markersize=7, linestyle="none", label="ceiling")
        for state in states:
            s = row.get(state)
            if s:
                ax.plot(xs, [100 * (_rate(r["hit"], r["prompt"]) or 0) for r in s["per_request"]],
                        label=f"{state} ({_pct(s['admitted_rate'], 1)})", **styles.get(state, {}))
        ax.set_title(row["label"], fontsize=10)
        ax.set_xlabel("request (submission order)", fontsize=8)
        ax.set_ylabel("prefix-cache hit %", fontsize=8)
        ax.set_ylim(-5, 105)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=7, loc="lower right")
    for ax in list(axes.flat)[len(rows):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


# ---------------------------------------------------------------- running

@dataclass
class TreeRun:
    state: str
    commit: str
    doc: dict
    seconds: float
    out: Path


@dataclass
class BenchResult:
    """One bench run. target, component, base, series and origin say exactly which series on which
    base the numbers belong to (what `kvforge pr` checks evidence against), as in test/verify results."""

    target: str
    component: str
    base: str  # the base commit (trees["base"].commit)
    base_ref: str  # e.g. v0.20.2
    series: str  # the series digest (Stack.digest): of the series files, or of the --from commits
    patches: int  # how many patches the series has
    origin: str  # where the stack came from: "series" (the files) or "--from REV (sha)"
    scale: float
    seed: int
    scenarios: list[str]
    env: str
    trees: list[TreeRun] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    goals: list[dict] = field(default_factory=list)
    note: str = ""
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0
    vllm_settings: dict[str, str] = field(default_factory=dict)  # VLLM_* variables the replays ran with

    @property
    def states(self) -> list[str]:
        return [t.state for t in self.trees]

    @property
    def errors(self) -> list[tuple[str, str, str]]:
        """(scenario, tree, error) for every scenario that could not run."""
        return [(r["label"], st, r[f"{st}_error"]) for r in self.rows for st in self.states if f"{st}_error" in r]

    @property
    def exit_code(self) -> int:
        """4 when a scenario could not run on a tree; the goals never change it."""
        return EXIT_TESTS if self.errors else 0

    @property
    def error(self) -> None:
        return None  # the table and its "error" lines say why (kvforge.core.outcome: no error line)

    def render(self) -> str:
        states = self.states
        lines = [f"{self.target}/{self.component}: prefix-cache replay, scale {self.scale:g}, seed {self.seed}; "
                 + ", ".join(f"{t.state} {t.commit[:12]} ({t.seconds:.0f}s)" for t in self.trees)]
        if self.origin != "series":
            lines.append(f"series: {self.origin}, {self.patches} commit(s), digest {self.series}")
        if self.vllm_settings:
            lines.append("vLLM settings: " + " ".join(f"{k}={v}" for k, v in self.vllm_settings.items()))
        if self.note:
            lines.append(self.note)
        lines += ["", render(self.rows, states), ""]
        judged = states[-1]
        lines += [f"{'ok  ' if g['ok'] else 'MISS'} {g['scenario']} ({judged}): {g['goal']}: {g['value']}"
                  for g in self.goals]
        lines += [f"error {label} ({st}): {err}" for label, st, err in self.errors]
        lines += ["", "hit (vLLM): prefix_cache_hits / prefix_cache_queries summed over the run (every lookup, as the "
                  "log line and the metrics count them); per-request: the admitted lookup of each request over its "
                  "prompt tokens; ceiling: what an unbounded cache could serve; of ceiling: per-request hits / "
                  "ceiling hits.",
                  "results: " + ", ".join(self.files)]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "target": self.target, "component": self.component, "base": self.base, "base_ref": self.base_ref,
            "series": self.series, "patches": self.patches, "origin": self.origin,
            "scale": self.scale, "seed": self.seed,
            "scenarios": self.scenarios, "env": self.env, "note": self.note, "seconds": round(self.seconds, 1),
            "vllm_settings": self.vllm_settings,
            "trees": {t.state: {"commit": t.commit, "seconds": round(t.seconds, 1), "result_file": str(t.out),
                                "vllm": next((r["features"].get("vllm_version") for r in t.doc.get("results", [])),
                                             None)}
                      for t in self.trees},
            "rows": self.rows, "goals": self.goals, "files": self.files,
            "errors": [{"scenario": s, "tree": t, "error": e} for s, t, e in self.errors],
        }


def run_replay(python: Path, environ: dict[str, str], tree: Path, runs: list[tuple[str, str]], scale: float,
               seed: int, out: Path, label: str, progress: Progress, mode: list[str] | None = None) -> dict:
    """Run the replay in `tree` with the environment's python; stream its progress; return its document.

    `python REPLAY` (a directory): its __main__.py loads the files next to it, and only them, under a
    private package name, with kvforge blocked; the environment's PYTHONPATH is left as it is.
    """
    cmd = [str(python), str(REPLAY), *(mode or ["--scenario", ",".join(run_label(*r) for r in runs)]),
           "--scale", repr(scale), "--seed", str(seed), "--out", str(out)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    log = out.with_suffix(".log")
    tail: collections.deque[str] = collections.deque(maxlen=40)
    try:
        proc = subprocess.Popen(cmd, cwd=tree, env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, errors="replace")
    except OSError as exc:
        raise KvforgeError(f"{python}: cannot run the target's python: {exc.strerror}", EXIT_ENV) from None
    with open(log, "w", encoding="utf-8") as fh:
        assert proc.stderr is not None
        for line in proc.stderr:
            fh.write(line)
            line = line.rstrip("\n")
            if line.startswith("replay: "):
                progress(f"[{label}] {line[len('replay: '):]}")
            elif line.strip():
                tail.append(line)
    rc = proc.wait()
    if rc != 0 or not out.is_file():
        last = next((ln for ln in reversed(tail) if ln.strip()), f"exit status {rc}")
        raise KvforgeError(f"replay on the {label} tree failed: {last.strip()} (log: {log})", EXIT_ENV)
    return json.loads(out.read_text(encoding="utf-8"))


def bench_prefix_cache(ctx, scenario_spec: str = "all", scale: float = DEFAULT_SCALE, seed: int = 0,
                       num_blocks: tuple[int, ...] = (), retention_interval: int | None = None,
                       seed_workload: bool = False) -> BenchResult:
    """Replay the scenarios on ctx's base and patched trees (series files or --from); aggregate.
    num_blocks, retention_interval and seed_workload are vllm-ascend's (bench_ascend); the vLLM
    component refuses them."""
    say, target, cache = ctx.progress, ctx.target, ctx.cache
    if not scale > 0:
        raise KvforgeError(f"--scale must be > 0 (got {scale})", EXIT_USAGE)
    if ctx.component.name == "vllm-ascend":  # seed 001 through vllm-ascend's coordinator (below)
        return bench_ascend(ctx, scenario_spec, scale, seed, num_blocks, retention_interval, seed_workload)
    if num_blocks or retention_interval is not None or seed_workload:
        raise KvforgeError("the pool size, retention interval and seed workload options are vllm-ascend's "
                           "(--component vllm-ascend)", EXIT_USAGE)
    runs = parse_scenarios(scenario_spec)
    start = time.monotonic()
    comp = ctx.component
    prep = prepare(ctx, "bench-prefix-cache", f"s{scale:g}-seed{seed}",
                   lambda stack: f"{comp.series_dir.name}: no patch changes the base; the base tree is the patched "
                                 "tree" if stack.size else
                                 f"{comp.series_dir.name}: empty series; the base tree is the patched tree")
    stack, env, name, outdir = prep.stack, prep.env, prep.name, prep.outdir
    result = BenchResult(target.name, comp.name, stack.base.commit, stack.base.ref, stack.digest, stack.size,
                         stack.origin, scale, seed, [run_label(*r) for r in runs], env.key)
    states = [("base", 0), ("patched", stack.size)] if prep.changes else [("base", 0)]
    result.note, result.vllm_settings = prep.note, prep.settings
    environ = env.environ()
    with stack.lock(say):
        for state, n in states:
            commit = stack.checkout(n)
            say(f"replaying {len(runs)} scenario(s) on the {state} tree of {target.name} ({commit[:12]}), "
                f"scale {scale:g}")
            t0 = time.monotonic()
            doc = run_replay(env.python, environ, stack.worktree, runs, scale, seed, outdir / f"{state}.json",
                             state, say)
            result.trees.append(TreeRun(state, commit, doc, time.monotonic() - t0, outdir / f"{state}.json"))
            result.files.append(str(outdir / f"{state}.json"))
    docs = {t.state: t.doc for t in result.trees}
    result.rows = aggregate(docs)
    result.goals = goals(result.rows, result.states[-1])
    result.seconds = time.monotonic() - start
    record = evidence.Record("bench-prefix-cache", stack.key, name, stack.origin, "cpu", not result.errors,
                             data=result.to_json())
    result.files.append(str(evidence.save(cache, record)))
    return result


def bench_command(ctx, scenario_spec: str, scale: float, seed: int, plot_path: Path | None,
                  num_blocks: tuple[int, ...] = (), retention_interval: int | None = None,
                  seed_workload: bool = False) -> BenchResult:
    """`kvforge bench prefix-cache`: the run, and its plot when asked (check_plot_available first)."""
    result = bench_prefix_cache(ctx, scenario_spec, scale, seed, num_blocks, retention_interval, seed_workload)
    if plot_path is not None:
        write_plot(result.rows, result.states, plot_path,
                   f"{result.target}: prefix-cache hit rate per request (scale {result.scale:g})")
        result.files.append(str(plot_path))
    return result


# ---------------------------------------------------------------- vllm-ascend: seed 001 (replay/ascend.py)

ASCEND_SCENARIO = "ascend-dsv4-repeat"
ASCEND_SHARED = "ascend-dsv4-shared-prefix"
ASCEND_BLOCK_SIZES = (128, 64, 32)
# (vllm-ascend tree, vLLM tree, state, replay arguments). base: both release trees, what a user runs
# today (the block size is forced to 128 whatever is asked, so one block size shows it); patched: both
# series (vllm-ascend's series carries the vLLM fixes into its coordinator copies and needs the vLLM
# series), whole-block hits at every block size, and the second workload at 32; partial-hits: the
# patched trees with VLLM_ASCEND_ENABLE_PARTIAL_HASH_HITS=1 (ascend-dsv4-partial-hash-hits) at block
# size 32, both workloads. The mixed states do not start: vllm-ascend's base on the patched vLLM fails
# with a TypeError (the vllm-ascend swa-retention-queue-split patch's Check), its patched tree on the
# base vLLM lacks the vLLM series' API.
ASCEND_STATES: tuple[tuple[str, str, str, tuple[tuple[str, ...], ...]], ...] = (
    ("base", "base", "base", (("--block-sizes", "32"),)),
    ("patched", "patched", "patched", (("--block-sizes", ",".join(map(str, ASCEND_BLOCK_SIZES))),
                                       ("--block-sizes", "32", "--workloads", "shared-prefix"))),
    ("patched", "patched", "partial-hits", (("--block-sizes", "32", "--workloads", "repeat,shared-prefix",
                                             "--partial-hits"),)),
)


def ascend_environ(env, comp, vllm_tree: Path) -> dict[str, str]:
    """The replay's environment for a vllm-ascend tree: the vLLM test environment, `vllm_tree`
    importable, the component's declared stand-ins, and only kvforge's CPU platform plugin (a
    vllm-ascend tree root also registers vllm_ascend's NPU platform through its egg-info)."""
    environ = env.environ()
    path = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    standins = tuple(getattr(comp, "standins", ()))
    if standins:
        path.insert(0, str(STANDINS_DIR / "_loader"))
        environ.update(KVFORGE_STANDINS=",".join(standins), KVFORGE_STANDINS_DIR=str(STANDINS_DIR))
    environ["PYTHONPATH"] = os.pathsep.join([*path, str(vllm_tree)])
    environ["VLLM_PLUGINS"] = "kvforge_cpu"
    return environ


def ascend_run_args(args: tuple[str, ...], num_blocks: tuple[int, ...] = (), retention_interval: int | None = None,
                    seed_workload: bool = False) -> tuple[str, ...]:
    """One replay run's arguments with the bench's options: --num-blocks (pool sizes, one run each;
    none: unbounded), --retention-interval, and the seed's own workload beside the run's."""
    out = list(args)
    if seed_workload:
        if "--workloads" in out:
            i = out.index("--workloads") + 1
            out[i] = ",".join(dict.fromkeys([*out[i].split(","), "seed"]))
        else:
            out += ["--workloads", "repeat,seed"]
    if num_blocks:
        out += ["--num-blocks", ",".join(str(n) for n in num_blocks)]
    if retention_interval is not None:
        out += ["--retention-interval", str(retention_interval)]
    return tuple(out)


def bench_ascend(ctx, scenario_spec: str, scale: float, seed: int, num_blocks: tuple[int, ...] = (),
                 retention_interval: int | None = None, seed_workload: bool = False) -> BenchResult:
    """Seed 001 per --block-size on the base (vllm-ascend and vLLM release trees) and the patched
    trees (both series); vLLM's scheduler with vllm-ascend's coordinator, managers and DeepSeek-V4
    specs (replay/ascend.py). num_blocks bounds the pool (one run per size; () unbounded, the
    default), retention_interval sets prefix_cache_retention_interval (None: unset), seed_workload
    adds the seed's own run (32 requests, one wave, 90% shared) to every state's runs."""
    say = ctx.progress
    if scenario_spec not in ("all", ASCEND_SCENARIO):
        raise KvforgeError(f"--scenario: vllm-ascend has one scenario, {ASCEND_SCENARIO} (got {scenario_spec})",
                           EXIT_USAGE)
    start = time.monotonic()
    comp = ctx.component
    vctx = ctx.for_component(comp.requires or ctx.target.components[0].name)
    astack, vstack = open_stack(ctx), open_stack(vctx)
    env = target_env(vctx, base=vstack.base)
    env.check()
    result = BenchResult(ctx.target.name, comp.name, astack.base.commit, astack.base.ref, astack.digest, astack.size,
                         astack.origin, scale, seed,
                         [f"{ASCEND_SCENARIO}/bs{b}" for b in ASCEND_BLOCK_SIZES] + [f"{ASCEND_SHARED}/bs32"],
                         env.key)
    result.note = (f"vLLM trees: base {vstack.base.commit[:12]}, patched = {vstack.size} patches of "
                   f"{vctx.component.series_dir.name} (digest {vstack.digest}); base: both release trees, "
                   "patched: both series")
    name = f"s{scale:g}-seed{seed}-vllm{vstack.digest[:8]}"
    outdir = evidence.attachments(ctx.cache, astack.key, "bench-prefix-cache", name)
    with vstack.lock(say), astack.lock(say):
        for a_state, v_state, state, runs in ASCEND_STATES:
            vstack.checkout(vstack.size if v_state == "patched" else 0)
            commit = astack.checkout(astack.size if a_state == "patched" else 0)
            say(f"replaying seed 001 ({state}) on the {a_state} vllm-ascend tree ({commit[:12]}) with the {v_state} "
                f"vLLM tree, scale {scale:g}")
            t0 = time.monotonic()
            doc: dict = {}
            for i, args in enumerate(runs):
                out = outdir / f"{state}{'-' + str(i) if i else ''}.json"
                part = run_replay(env.python, ascend_environ(env, comp, vstack.worktree), astack.worktree, [], scale,
                                  seed, out, state, say,
                                  mode=["ascend", *ascend_run_args(args, num_blocks, retention_interval,
                                                                   seed_workload)])
                doc = part if not doc else {**doc, "results": doc["results"] + part["results"],
                                            "errors": doc["errors"] + part["errors"]}
                result.files.append(str(out))
            result.trees.append(TreeRun(state, commit, doc, time.monotonic() - t0, out))
    result.rows = aggregate({t.state: t.doc for t in result.trees})
    # Rows are keyed by scenario and block size: the partial-hits run of bs32 joins the bs32 row.
    for t in result.trees:
        for res in t.doc.get("results", []):
            variant = res["variant"].removesuffix("+partial")
            row = next(r for r in result.rows if r["scenario"] == res["scenario"] and r["variant"] in
                       (variant, res["variant"]))
            row[t.state] = {**(row.get(t.state) or summarize(res)), **copy_stats(res)}
    for r in result.rows:
        if r["variant"].endswith("+partial") and "partial-hits_error" in r:
            row = next((x for x in result.rows if x["scenario"] == r["scenario"]
                        and x["variant"] == r["variant"].removesuffix("+partial")), r)
            row["partial-hits_error"] = r["partial-hits_error"]
    result.rows = [r for r in result.rows if not r["variant"].endswith("+partial")
                   or not any(x["variant"] == r["variant"].removesuffix("+partial") and x["scenario"] == r["scenario"]
                              for x in result.rows)]
    result.goals = ascend_goals(result.rows)
    result.seconds = time.monotonic() - start
    record = evidence.Record("bench-prefix-cache", astack.key, name, astack.origin, "cpu", not result.errors,
                             data=result.to_json())
    result.files.append(str(evidence.save(ctx.cache, record)))
    return result


def copy_stats(res: dict) -> dict:
    """Per request, mean tokens of the hit copied inside the KV cache (partial hits) and recomputed."""
    reqs = res["requests"]
    n = len(reqs) or 1
    return {"copied_per_request": sum(r.get("copied_tokens", 0) for r in reqs) / n,
            "recomputed_per_request": sum(r.get("recomputed_tokens", r["prompt_tokens"] - r["hit_tokens"])
                                          for r in reqs) / n}


def ascend_goals(rows: list[dict]) -> list[dict]:
    """Seed 001's goals per block size and tree: the base (128 forced) hits nothing; the patched tree
    gets what its alignment allows (no more, no less), whole blocks; with partial hits the seed's
    workload at block size 32 reaches its 81.54% bar; never an invariant violation."""
    out = []
    for row in rows:
        b = row.get("base")
        if b is not None:
            out.append({"scenario": f"{row['label']} [base]", "goal": "base: 0% (block size pinned to 128)",
                        "ok": b["admitted_hits"] == 0, "value": _pct(b["admitted_rate"])})
        for state in ("patched", "partial-hits"):
            p = row.get(state)
            if p is None:
                continue
            where = f"{row['label']} [{state}]"
            out.append({"scenario": where, "goal": "hits = ceiling", "ok": p["admitted_hits"] == p["ceiling_hits"],
                        "value": f"{p['admitted_hits']:,} of {p['ceiling_hits']:,} tokens; per request "
                                 f"{p['copied_per_request']:,.0f} copied, {p['recomputed_per_request']:,.0f} "
                                 "recomputed"})
            out.append({"scenario": where, "goal": "no invariant violations", "ok": p["violations"] == 0,
                        "value": ", ".join(f"{k} {v}" for k, v in p["violation_kinds"].items()) or "none"})
            if state == "partial-hits" and row["scenario"] == ASCEND_SCENARIO:
                out.append({"scenario": where, "goal": "seed 001: >= 80% (reported 81.54%)",
                            "ok": (p["admitted_rate"] or 0) >= 0.80, "value": _pct(p["admitted_rate"])})
    return out
