"""`kvforge bench scheduler-overhead`: the scheduler's own time per step and per admitted request,
base tree vs patched tree, measured in one run.

Both trees run vLLM's real Scheduler (built as the engine core builds it, kvforge/bench/replay/)
in the target's test environment, one long-lived process per tree (`python <replay dir> overhead`,
replay/overhead.py), each importing its own copy of the tree's `vllm/` exported from the stack's
commits (so the shared stack worktree is neither moved nor held). The parent interleaves the two:
each case gets one scheduler per tree, every repetition replays the same steps from the same
state, the trees take turns every SLICE steps and which tree goes first alternates, so machine
noise (other processes on a small box) falls on both alike. Times are the scheduler thread's CPU
time (wall time is kept in the record too). Per case and tree, each step's time
is the least over the repetitions (step_floor: noise only adds time); us/step and us/request
are sums of those, and the ratio is patched / base of them; the range of the plain
per-repetition ratios shows how noisy the box was. Cases where the two trees did not do the same
work (prefix hits changed the steps or the tokens scheduled) are marked: their ratio includes the
work that sharing saved.

Also measured, once per run: the cost of the sliding-window cache mask per prefill chunk (patch
swa-reachable-cache-mask, where the tree has it) and, for DSv4, the time each KV cache group's
manager spends caching blocks per step in each tree.

This module owns the export directories <cache>/trees/.work/<stack worktree>.overhead.<pid>/
(removed at the end; what a killed run left is swept by the next) and the evidence record
"bench-scheduler-overhead" (one per target, base, series digest, scale, steps, reps and seed).
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvforge.bench.prepare import prepare
from kvforge.bench.replay import overhead as cases_mod
from kvforge.core import evidence
from kvforge.git import gitutil
from kvforge.core.errors import EXIT_ENV, EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import remove_stale
from kvforge.core.render import table

Progress = Callable[[str], None]
REPLAY = Path(__file__).resolve().with_name("replay")
KIND = "bench-scheduler-overhead"
STATES = ("base", "patched")

DEFAULT_SCALE = 0.1  # workload size (prompt lengths, request counts) relative to the bug reports
DEFAULT_STEPS = 40  # scheduler steps per case and repetition (a case stops earlier when its workload is done)
DEFAULT_REPS = 3
SLICE = 5  # steps a tree runs before the other tree's turn
GOAL_RATIO = 1.05  # patched / base per step, where prefix sharing does not change the work
MASK_CHUNK = 4096  # tokens per prefill chunk for the mask's cost (DSv4's step budget)
MASK_REPEAT = 20


# ---------------------------------------------------------------- pure: per run, per case, goals

def per_run(res: dict, clock: str = "cpu") -> dict:
    """One tree's repetition of one case -> its figures (microseconds, plain sums, on `clock`)."""
    suffix = "_cpu" if clock == "cpu" else ""
    sched_ns = res["ns"]["schedule" + suffix] + res["ns"]["update" + suffix]
    steps, admitted = res["steps"], res["admitted"]
    return {
        "steps": steps, "admitted": admitted, "tokens": res["scheduled_tokens"], "hits": res["hits"],
        "done": res["done"], "preempted": res["preempted"],
        "us_step": sched_ns / steps / 1000 if steps else None,
        "us_request": sched_ns / admitted / 1000 if admitted else None,
        "us_schedule": res["ns"]["schedule" + suffix] / steps / 1000 if steps else None,
        "us_update": res["ns"]["update" + suffix] / steps / 1000 if steps else None,
        "us_submit_per_request": res["ns"]["submit"] / admitted / 1000 if admitted else None,
    }


def step_floor(step_lists: list[list[int]]) -> list[int]:
    """Step by step, the least time any repetition took (over the steps every repetition ran).

    A repetition replays the same steps, and noise from other processes only ever adds time, so
    the least is the step's own cost; a sum of these floors is far steadier than a sum of means."""
    lists = [x for x in step_lists if x]
    if not lists:
        return []
    n = min(len(x) for x in lists)
    return [min(x[k] for x in lists) for k in range(n)]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _spread(xs: list) -> list[float] | None:
    xs = [x for x in xs if x is not None]
    return [min(xs), max(xs)] if xs else None


def tree_figures(results: list[dict]) -> dict:
    """One tree's repetitions of a case -> us/step and us/request from the step floor of CPU time
    (the figures the table shows) and of wall time, the plain per-repetition medians, the work."""
    runs = [per_run(r) for r in results]
    admitted = _median([r["admitted"] for r in runs])
    out: dict = {}
    for clock, key in (("", "step_cpu_ns"), ("wall_", "step_ns")):
        floor = step_floor([r[key] for r in results])
        total = sum(floor)
        out[f"{clock}us_step"] = total / len(floor) / 1000 if floor else None
        out[f"{clock}us_request"] = total / admitted / 1000 if floor and admitted else None
    out["floor_steps"] = len(step_floor([r["step_cpu_ns"] for r in results]))
    out.update({f"{k}_median": _median([r[k] for r in runs])
                for k in ("us_step", "us_request", "us_schedule", "us_update", "us_submit_per_request")})
    out.update({k: [r[k] for r in runs] for k in ("steps", "admitted", "tokens", "hits")})
    out["done"] = all(r["done"] for r in runs)
    return out


def aggregate_case(case: dict, reps: list[dict[str, dict]]) -> dict:
    """One case: reps = [{state: replay result of one repetition}] -> the row.

    ratio_step / ratio_request: patched / base of the step-floor figures; *_range: the range of the
    plain per-repetition ratios (how noisy the box was); same_work: every repetition ran the same
    steps, requests, tokens and prefix hits in both trees."""
    row: dict = {"label": cases_mod.case_label(case), **{k: case[k] for k in ("topology", "workload", "kind", "pool")},
                 "reps": len(reps)}
    for st in STATES:
        row[st] = tree_figures([r[st] for r in reps if st in r])
    pairs = [(per_run(r["base"]), per_run(r["patched"])) for r in reps if len(r) == 2]
    row["ratio_step"] = _ratio(row["patched"]["us_step"], row["base"]["us_step"])
    row["ratio_request"] = _ratio(row["patched"]["us_request"], row["base"]["us_request"])
    row["wall_ratio_step"] = _ratio(row["patched"]["wall_us_step"], row["base"]["wall_us_step"])
    row["ratio_step_range"] = _spread([_ratio(p["us_step"], b["us_step"]) for b, p in pairs])
    row["ratio_request_range"] = _spread([_ratio(p["us_request"], b["us_request"]) for b, p in pairs])
    row["same_work"] = bool(pairs) and len(pairs) == len(reps) and all(
        b[k] == p[k] for b, p in pairs for k in ("steps", "admitted", "tokens", "hits"))
    return row


def goals(rows: list[dict], limit: float = GOAL_RATIO) -> list[dict]:
    """patched / base per step <= limit on every row where both trees did the same work (sharing
    could not help); rows where the work differed are listed as not judged."""
    out = []
    for row in rows:
        r = row.get("ratio_step")
        if r is None:
            continue
        if row["same_work"]:
            out.append({"case": row["label"], "goal": f"patched / base per step <= {limit:.2f}", "ok": r <= limit,
                        "value": f"{r:.3f} (range {row['ratio_step_range'][0]:.3f}-{row['ratio_step_range'][1]:.3f})"})
        else:
            out.append({"case": row["label"], "goal": "not judged: prefix hits changed the work", "ok": None,
                        "value": f"{r:.3f}"})
    return out


def mask_summary(mask: dict | None, rows: list[dict]) -> dict | None:
    """The mask's cost per chunk (summed over the sliding-window groups), and its share of a DSv4
    prefill step: the base us/step of the unique-resend rows (every step a full chunk of prompt)."""
    if not mask or not mask.get("present"):
        return None
    total = sum(g["us_median"] for g in mask["groups"] if g["window"])
    prefill = [r["base"]["us_step"] for r in rows if r["topology"] == "dsv4" and r["workload"] == "unique-resend"
               and r["base"]["us_step"]]
    step = _median(prefill)
    return {"chunk_tokens": mask["chunk_tokens"], "us_per_chunk": round(total, 1),
            "groups": mask["groups"], "dsv4_base_us_step": step,
            "share_of_step": total / step if step else None}


def profile_summary(reps: list[dict[str, dict]]) -> list[dict]:
    """[{state: profiled repetition}] -> per KV cache group, microseconds of CPU per step in
    cache_blocks, remove_skipped_blocks and the mask, per tree (the least over the repetitions)."""
    out: dict[int, dict] = {}
    for profiles in reps:
        for st, res in profiles.items():
            steps = res["steps"] or 1
            for g in res.get("profile", []):
                row = out.setdefault(g["group"], {"group": g["group"], "manager": g["manager"],
                                                  "block_size": g["block_size"], "window": g["window"]})
                cell = row.setdefault(st, {})
                for name, ns in g["ns"].items():
                    us = round(ns / steps / 1000, 1)
                    cell[name] = min(cell.get(name, us), us)
    return [out[k] for k in sorted(out)]


# ---------------------------------------------------------------- rendering

def _us(x: float | None) -> str:
    return "-" if x is None else (f"{x:,.0f}" if x >= 100 else f"{x:.1f}")


def _r(x: float | None, rng: list[float] | None = None) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" + (f" ({rng[0]:.2f}-{rng[1]:.2f})" if rng and len(rng) == 2 and rng[0] != rng[1] else "")


def render(result: "OverheadResult") -> str:
    body = []
    for row in result.rows:
        b, p = row["base"], row["patched"]
        work = "same" if row["same_work"] else "differs"
        if not (b["done"] and p["done"]):
            work += ", capped"
        body.append([row["topology"], row["workload"], f"{row['pool'] // 1000}k",
                     _us(b["us_step"]), _us(p["us_step"]), _r(row["ratio_step"], row["ratio_step_range"]),
                     _us(b["us_request"]), _us(p["us_request"]), _r(row["ratio_request"], row["ratio_request_range"]),
                     f"{_median(b['steps']):.0f}" if b["steps"] else "-", work])
    out = [table(["topology", "workload", "pool", "base us/step", "patched us/step", "ratio (range)",
                  "base us/req", "patched us/req", "ratio (range)", "steps", "work"], body)]
    m = result.mask
    if m:
        parts = ", ".join(f"g{g['group']} (block {g['block_size']}, window {g['window']}): {g['us_median']:.0f} us "
                          f"for {g['blocks_per_chunk']} blocks, keeps {g['kept_share']:.1%}"
                          for g in m["groups"] if g["window"])
        share = f" = {m['share_of_step']:.1%} of a DSv4 base prefill step ({_us(m['dsv4_base_us_step'])} us)" \
            if m["share_of_step"] is not None else ""
        out.append(f"\nsliding-window cache mask (patched): {m['us_per_chunk']:.0f} us per {m['chunk_tokens']}-token "
                   f"chunk{share}; {parts}")
    elif result.mask_note:
        out.append(f"\n{result.mask_note}")
    if result.profile:
        prof = []
        for g in result.profile:
            cells = [f"g{g['group']}", g["manager"], g["block_size"], g["window"] or "-"]
            for st in STATES:
                d = g.get(st, {})
                cells += [_us(d.get("cache_blocks")), _us(d.get("remove_skipped_blocks"))]
            cells.append(_us(g.get("patched", {}).get("get_cache_block_mask")))
            prof.append(cells)
        out.append(f"\nDSv4 {result.profile_case}: CPU us per step in each group's manager (cache_blocks; "
                   "remove_skipped_blocks, which in the patched tree may cache deferred blocks; the mask, inside "
                   "cache_blocks):\n" + table(["group", "manager", "block", "window", "base cache", "base remove",
                                                 "patched cache", "patched remove", "patched mask"], prof))
    return "\n".join(out)


# ---------------------------------------------------------------- the two tree processes

class TreeProcess:
    """One tree's replay server: JSON commands in, JSON replies out, stderr to a log file (progress
    lines "replay: " forwarded)."""

    def __init__(self, state: str, python: Path, environ: dict[str, str], tree: Path, log: Path,
                 progress: Progress) -> None:
        self.state, self.log = state, log
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        try:
            self.proc = subprocess.Popen([str(python), str(REPLAY), "overhead"], cwd=tree, env=environ,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, errors="replace", bufsize=1)
        except OSError as exc:
            raise KvforgeError(f"{python}: cannot run the target's python: {exc.strerror}", EXIT_ENV) from None
        self._reader = threading.Thread(target=self._read_stderr, args=(progress,), daemon=True)
        self._reader.start()

    def _read_stderr(self, progress: Progress) -> None:
        assert self.proc.stderr is not None
        with open(self.log, "w", encoding="utf-8") as fh:
            for line in self.proc.stderr:
                fh.write(line)
                line = line.rstrip("\n")
                if line.startswith("replay: "):
                    progress(f"[{self.state}] {line[len('replay: '):]}")
                elif line.strip():
                    self.tail.append(line)

    def send(self, cmd: dict) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died() from None

    def receive(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise self._died()
        reply = json.loads(line)
        if not reply.get("ok"):
            raise KvforgeError(f"scheduler-overhead replay on the {self.state} tree failed: {reply.get('error')} "
                               f"(log: {self.log})", EXIT_ENV)
        return reply["result"]

    def call(self, cmd: dict) -> dict:
        self.send(cmd)
        return self.receive()

    def _died(self) -> KvforgeError:
        rc = self.proc.wait()
        self._reader.join(timeout=5)
        last = next((ln for ln in reversed(self.tail) if ln.strip()), f"exit status {rc}")
        return KvforgeError(f"scheduler-overhead replay on the {self.state} tree stopped: {last.strip()} "
                            f"(log: {self.log})", EXIT_ENV)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"op": "quit"})
                self.proc.wait(timeout=30)
            except (KvforgeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=5)


def _both(procs: dict[str, "TreeProcess"], cmd: dict, order: list[str]) -> dict[str, dict]:
    """Send one command to every tree (they work on it at once), then read the replies."""
    for st in order:
        procs[st].send(cmd)
    return {st: procs[st].receive() for st in order}


def run_case(procs: dict[str, "TreeProcess"], case: dict, scale: float, seed: int, steps: int, reps: int,
             first: int = 0, slice_steps: int = SLICE, profile: bool = False) -> list[dict[str, dict]]:
    """Every repetition of a case in both trees: one scheduler per tree for the case (built at
    once in both), then per repetition the trees take turns every `slice_steps` steps, the first
    turn going to STATES[(first + rep) % 2]; returns [{state: repetition result}]."""
    states = list(procs)
    _both(procs, {"op": "start", "case": case, "scale": scale, "seed": seed, "steps": steps, "profile": profile},
          states)
    out = []
    try:
        for rep in range(reps):
            lead = states[(first + rep) % len(states)]
            order = [lead] + [st for st in states if st != lead]
            _both(procs, {"op": "begin"}, order)
            done = {st: False for st in order}
            while not all(done.values()):
                for st in order:
                    if not done[st]:
                        done[st] = bool(procs[st].call({"op": "advance", "steps": slice_steps})["done"])
            out.append(_both(procs, {"op": "end"}, order))
    finally:
        _both(procs, {"op": "close"}, states)
    return out


# ---------------------------------------------------------------- the bench

@dataclass
class OverheadResult:
    """One scheduler-overhead run: which series on which base (as in BenchResult), the options,
    one row per case, the mask cost and the per-group caching profile."""

    target: str
    component: str
    base: str
    base_ref: str
    series: str
    patches: int
    origin: str
    scale: float
    steps: int
    reps: int
    seed: int
    env: str
    commits: dict[str, str] = field(default_factory=dict)
    vllm: dict[str, str] = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)
    goals: list[dict] = field(default_factory=list)
    mask: dict | None = None
    mask_note: str = ""
    profile: list[dict] = field(default_factory=list)
    profile_case: str = ""
    note: str = ""
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0
    vllm_settings: dict[str, str] = field(default_factory=dict)
    runs: list[dict] = field(default_factory=list)  # every repetition's raw results, for the record
    exit_code = 0  # an Outcome (kvforge.core.outcome): the goals never change the exit status
    error = None

    def render(self) -> str:
        """The text of `kvforge bench scheduler-overhead`: the run's identity, the table, the goals."""
        lines = [f"{self.target}/{self.component}: scheduler overhead, scale {self.scale:g}, up to {self.steps} "
                 f"steps, {self.reps} repetition(s), seed {self.seed}; base {self.commits.get('base', '')[:12]}, "
                 f"patched {self.commits.get('patched', '')[:12]} (series {self.series}, {self.patches} patch(es))"]
        if self.origin != "series":
            lines.append(f"series: {self.origin}")
        if self.vllm_settings:
            lines.append("vLLM settings: " + " ".join(f"{k}={v}" for k, v in self.vllm_settings.items()))
        if self.note:
            lines.append(self.note)
        lines += ["", render(self), ""]
        for g in self.goals:
            mark = "-   " if g["ok"] is None else ("ok  " if g["ok"] else "MISS")
            lines.append(f"{mark} {g['case']}: {g['goal']}: {g['value']}")
        lines += ["", "us/step: CPU time in Scheduler.schedule() + update_from_output() per step (synthetic model "
                  "output), each step counted at the least time any repetition took; us/req: the same time per "
                  "admitted request; ratio: patched / base of these (range: the plain per-repetition ratios, the "
                  f"box's noise); the trees take turns every {SLICE} steps. work: same when both trees ran the same "
                  "steps, requests, tokens and prefix hits; capped when the step limit ended a case before its "
                  "workload.",
                  "results: " + ", ".join(self.files)]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "target": self.target, "component": self.component, "base": self.base, "base_ref": self.base_ref,
            "series": self.series, "patches": self.patches, "origin": self.origin, "scale": self.scale,
            "steps": self.steps, "reps": self.reps, "seed": self.seed, "slice": SLICE, "env": self.env,
            "commits": self.commits, "vllm": self.vllm, "rows": self.rows, "goals": self.goals, "mask": self.mask,
            "mask_note": self.mask_note, "profile": self.profile, "profile_case": self.profile_case,
            "note": self.note, "files": self.files, "seconds": round(self.seconds, 1),
            "vllm_settings": self.vllm_settings,
        }


def parse_list(spec: str, what: str, convert=str) -> list:
    try:
        items = [convert(x.strip()) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise KvforgeError(f"--{what}: not a comma list: {spec!r}", EXIT_USAGE) from None
    if not items:
        raise KvforgeError(f"--{what}: empty", EXIT_USAGE)
    return list(dict.fromkeys(items))


def _pool(x: str) -> int:
    x = x.lower()
    mult = 1000 if x.endswith("k") else 1
    return int(float(x[:-1] if mult > 1 else x) * mult)


def bench_scheduler_overhead(ctx, topologies: str = "dsv4,gemma4", kinds: str = "unique,seed",
                             pools: str = "50k,500k", scale: float = DEFAULT_SCALE, steps: int = DEFAULT_STEPS,
                             reps: int = DEFAULT_REPS, seed: int = 0, mask: bool = True) -> OverheadResult:
    """Time the scheduler of ctx's base and patched trees on every case, interleaved; aggregate."""
    say, cache = ctx.progress, ctx.cache
    if not scale > 0:
        raise KvforgeError(f"--scale must be > 0 (got {scale})", EXIT_USAGE)
    if steps < 1 or reps < 1:
        raise KvforgeError("--steps and --reps must be at least 1", EXIT_USAGE)
    try:
        case_list = cases_mod.cases(parse_list(topologies, "topology"), parse_list(kinds, "workload"),
                                    parse_list(pools, "pools", _pool))
    except ValueError as exc:
        raise KvforgeError(str(exc), EXIT_USAGE) from None
    start = time.monotonic()
    prep = prepare(ctx, KIND, f"s{scale:g}-n{steps}-r{reps}-seed{seed}",
                   lambda _stack: "the series changes nothing in the base: both processes run the base tree "
                                  "(the ratios show the bench's own noise)")
    stack, env, name, outdir = prep.stack, prep.env, prep.name, prep.outdir
    result = OverheadResult(ctx.target.name, ctx.component.name, stack.base.commit, stack.base.ref, stack.digest,
                            stack.size, stack.origin, scale, steps, reps, seed, env.key)
    result.commits = {"base": stack.commits[0], "patched": stack.commits[stack.size]}
    result.note, result.vllm_settings = prep.note, prep.settings
    work = stack.worktree.parent
    prefix = f"{stack.worktree.name}.overhead."
    remove_stale(work, re.escape(prefix) + r"(?P<pid>\d+)$")
    export = work / f"{prefix}{os.getpid()}"
    procs: dict[str, TreeProcess] = {}
    try:
        for st in STATES:
            say(f"exporting the {st} tree ({result.commits[st][:12]})")
            gitutil.export(stack.base.repo, result.commits[st], export / st, ["vllm"])
        environ = env.environ()
        for st in STATES:
            procs[st] = TreeProcess(st, env.python, environ, export / st, outdir / f"{st}.log", say)
        say("importing vLLM in both trees")
        for st in STATES:
            procs[st].send({"op": "hello"})
        for st in STATES:
            hello = procs[st].receive()
            result.vllm[st] = hello["vllm_version"]
        say(f"{len(case_list)} case(s) x {reps} repetition(s), up to {steps} steps each, scale {scale:g}, "
            f"the trees taking turns every {SLICE} steps")
        raw: dict[str, list[dict]] = {}
        for i, case in enumerate(case_list):
            label = cases_mod.case_label(case)
            raw[label] = run_case(procs, case, scale, seed, steps, reps, first=i)
            row = aggregate_case(case, raw[label])
            say(f"{label}: {_us(row['base']['us_step'])} -> {_us(row['patched']['us_step'])} us/step "
                f"({_r(row['ratio_step'], row['ratio_step_range'])}), {_median(row['base']['steps']):.0f} steps")
        result.rows = [aggregate_case(c, raw[cases_mod.case_label(c)]) for c in case_list]
        result.runs = [{"case": cases_mod.case_label(c), "reps": raw[cases_mod.case_label(c)]} for c in case_list]
        if mask:
            say(f"timing the cache mask per {MASK_CHUNK}-token chunk")
            m = procs["patched"].call({"op": "mask", "chunk_tokens": MASK_CHUNK, "repeat": MASK_REPEAT,
                                       "seed": seed})
            result.mask = mask_summary(m, result.rows)
            if result.mask is None:
                result.mask_note = "the patched tree has no sliding-window cache mask (get_cache_block_mask)"
            dsv4 = next((c for c in case_list if c["topology"] == "dsv4" and c["kind"] == "unique"), None)
            if dsv4 is not None:
                say(f"profiling the KV cache groups on {cases_mod.case_label(dsv4)}")
                result.profile = profile_summary(run_case(procs, dsv4, scale, seed, steps, min(reps, 3),
                                                          profile=True))
                result.profile_case = cases_mod.case_label(dsv4)
    finally:
        for proc in procs.values():
            proc.close()
        shutil.rmtree(export, ignore_errors=True)
    result.goals = goals(result.rows)
    result.seconds = time.monotonic() - start
    runs_file = outdir / "runs.json"
    runs_file.write_text(json.dumps(result.runs, sort_keys=True) + "\n", encoding="utf-8")
    result.files.append(str(runs_file))
    record = evidence.Record(KIND, stack.key, name, stack.origin, "cpu", True, data=result.to_json())
    result.files.append(str(evidence.save(cache, record)))
    return result
