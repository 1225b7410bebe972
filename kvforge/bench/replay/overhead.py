"""The scheduler-overhead replay: how long vLLM's own scheduler works per step and per request.

Runs in the replay's two places (see __init__.py). In kvforge's process only the pure part is
used: the case list (CASES, cases()) and the workloads (overhead_workload). In a target
environment, `python <replay dir> overhead` (cwd = a vLLM tree root) is a server that
kvforge.bench.overhead drives: one JSON command per stdin line, one JSON reply per stdout line
(everything vLLM prints goes to stderr, progress lines start "replay: "), so that one process
per tree imports vLLM once and the parent can interleave the two trees' repetitions.

    {"op": "hello"}                         -> {vllm_version, has_cache_mask, import_seconds}
    {"op": "start", "case": {...}, "scale": F, "seed": S, "steps": N[, "profile": true]}
                                             -> the case's scheduler, built (profiled: see _Profiler)
    {"op": "begin"}                          -> a repetition starts (the scheduler reset after the first)
    {"op": "advance", "steps": n}            -> up to n more steps: {steps, done}
    {"op": "end"}                            -> the repetition's timings and counts
    {"op": "close"}                          -> the case's scheduler dropped
    {"op": "run", ...as start}               -> start, begin, advance to the end, end, close
    {"op": "profile", ...as start}           -> run, plus per KV cache group the time in cache_blocks,
                                               remove_skipped_blocks and the cache mask (if any)
    {"op": "mask", "chunk_tokens": T, "repeat": R} -> the cache mask's cost per chunk, DSv4 groups
    {"op": "quit"}
    reply: {"ok": true, "result": ...} or {"ok": false, "error": "...", "traceback": "..."}

What is timed (nothing else inside the timed calls): Scheduler.schedule() and
Scheduler.update_from_output() with the replay's synthetic model output (sampler.py), as the
engine core calls them, in CPU time of the calling thread (thread_time_ns: time the process
waits for a CPU that other processes hold is not the scheduler's) and in wall time. Request construction (the block hasher), add_request and
update_draft_token_ids are timed separately and not part of the scheduler's time. Each step's
time is returned, so that the parent can take, step by step, the least of the repetitions (the
time the step needs when nothing else runs). The scheduler is built once per case and reset
between repetitions (see Run). The garbage collector is frozen once the scheduler is built, as
vLLM's engine core does (freeze_gc_heap), until the case is closed. Invariants: a case's workload is a function of (case, scale, seed)
only (the pool and the step budget are set here, whatever the scenario's own); the sampled
tokens and drafts are the same in every tree, so where prefix sharing cannot help (the "unique"
workloads: no two prompts share a block) base and patched do the same scheduling work.
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import time
import traceback
from collections import Counter

from . import stats
from .compat import Features
from .driver import ClosedLoopClient
from .sampler import Sampler
from .scheduler import build
from .workloads import random_tokens, scaled, workload

# Step budget (max_num_batched_tokens) of each topology's deployment, whatever --scale is: the
# per-step cost is the one of a real deployment (DSv4: 4096-token chunks; Gemma4: 8192).
BUDGET = {"dsv4": 4096, "gemma4": 8192}

# topology -> [(workload, kind, scenario it mirrors, variant)]. kind "unique": no two prompts share
# a block, so prefix caching cannot change the work; kind "seed": the bug report's workload.
CASES = {
    "dsv4": [("unique-resend", "unique", "dsv4-resend", ""), ("unique-repeat", "unique", "dsv4-repeat", ""),
             ("dsv4-resend", "seed", "dsv4-resend", ""), ("dsv4-repeat", "seed", "dsv4-repeat", "")],
    "gemma4": [("unique-dflash", "unique", "gemma4-dflash", ""), ("gemma4-dflash", "seed", "gemma4-dflash", "")],
}
KINDS = ("unique", "seed")
DEFAULT_POOLS = (50_000, 500_000)


def cases(topologies: list[str], kinds: list[str], pools: list[int]) -> list[dict]:
    """The case list, in table order: topology, workload, pool. Unknown names raise ValueError."""
    for t in topologies:
        if t not in CASES:
            raise ValueError(f"unknown topology {t!r}; known: {', '.join(CASES)}")
    for k in kinds:
        if k not in KINDS:
            raise ValueError(f"unknown workload kind {k!r}; known: {', '.join(KINDS)}")
    for p in pools:
        if p < 1024:
            raise ValueError(f"pool of {p} blocks: at least 1024 blocks")
    out: list[dict] = []
    for t in topologies:
        for name, kind, scenario, variant in CASES[t]:
            if kind in kinds:
                out.extend(dict(topology=t, workload=name, kind=kind, scenario=scenario, variant=variant,
                                pool=p) for p in pools)
    return out


def case_label(case: dict) -> str:
    return f"{case['topology']}/{case['workload']}/{case['pool']}"


def overhead_workload(case: dict, scale: float, seed: int) -> dict:
    """The workload of a case: {groups, config, requests, notes}, pool and budget set (pure)."""
    return with_pool(case_requests(case, scale, seed), case)


def with_pool(wl: dict, case: dict) -> dict:
    """The workload with the case's pool and its topology's step budget (a new dict; requests shared)."""
    budget = BUDGET[case["topology"]]
    cfg = dict(wl["config"], num_blocks=case["pool"], max_num_batched_tokens=budget,
               max_num_seqs=min(wl["config"]["max_num_seqs"], budget))
    return dict(wl, config=cfg)


def case_requests(case: dict, scale: float, seed: int) -> dict:
    """The case's workload as its scenario configures it (pool and budget not yet set)."""
    base = workload(case["scenario"], case["variant"], scale, seed)
    if case["kind"] == "seed":
        wl = dict(base)
    else:
        wl = dict(base, requests=_UNIQUE[case["workload"]](base, scale, seed))
        for i, r in enumerate(wl["requests"]):
            r["id"] = f"{i:04d}-{r['label']}"
            r.setdefault("after", None)
        wl["notes"] = [f"{case['scenario']} with no prompt sharing a block with another"]
    return wl


def _unique_like(base: dict, scale: float, seed: int, tag: str) -> list[dict]:
    """The seed's requests with every prompt replaced by fresh tokens of the same length."""
    rng = random.Random(f"overhead:{tag}:{seed}:{scale!r}")
    return [dict(label=f"u{i}", prompt=random_tokens(rng, len(r["prompt"])), output=list(r["output"]))
            for i, r in enumerate(base["requests"])]


def _unique_dflash(base: dict, scale: float, seed: int) -> list[dict]:
    return _unique_like(base, scale, seed, "gemma4-dflash")


def _unique_resend(base: dict, scale: float, seed: int) -> list[dict]:
    return _unique_like(base, scale, seed, "dsv4-resend")


def _unique_repeat(base: dict, scale: float, seed: int) -> list[dict]:
    # dsv4-repeat's shape (8K in x 1K out, 32 in flight, 512 requests), every prompt new. Built
    # directly rather than from the seed's 512 requests: those re-send ~46 prompts.
    rng = random.Random(f"overhead:dsv4-repeat:{seed}:{scale!r}")
    in_len, out_len = scaled(8192, scale, 512), scaled(1024, scale, 8)
    return [dict(label=f"u{i}", prompt=random_tokens(rng, in_len), output=random_tokens(rng, out_len))
            for i in range(512)]


_UNIQUE = {"unique-resend": _unique_resend, "unique-repeat": _unique_repeat, "unique-dflash": _unique_dflash}


# ---------------------------------------------------------------- in the target environment (vLLM)

class Server:
    """One tree's side of the bench: workloads built once per (case, scale, seed); one scheduler
    per case (at most one at a time), run once per repetition."""

    def __init__(self) -> None:
        self.workloads: dict[tuple, dict] = {}
        self.current: Run | None = None

    def workload(self, case: dict, scale: float, seed: int) -> dict:
        key = (case["topology"], case["workload"], scale, seed)
        if key not in self.workloads:
            self.workloads[key] = case_requests(case, scale, seed)
        return with_pool(self.workloads[key], case)

    def hello(self) -> dict:
        t0 = time.perf_counter()
        import vllm
        from vllm.v1.core import single_type_kv_cache_manager as stm
        from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401 (the import is what is timed)

        return dict(vllm_version=getattr(vllm, "__version__", "?"), vllm_file=vllm.__file__,
                    has_cache_mask=hasattr(stm.SingleTypeKVCacheManager, "get_cache_block_mask"),
                    import_seconds=round(time.perf_counter() - t0, 3), pid=os.getpid())

    def start(self, case: dict, scale: float, seed: int, steps: int, profile: bool = False) -> dict:
        self.close()
        self.current = Run(self.workload(case, scale, seed), case, seed, steps, profile)
        return dict(setup_seconds=round(self.current.setup, 3))

    def _run(self) -> "Run":
        if self.current is None:
            raise RuntimeError("no case started")
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
        self.current = None

    def run(self, case: dict, scale: float, seed: int, steps: int, profile: bool = False) -> dict:
        """start + one repetition to the end, in one command."""
        self.start(case, scale, seed, steps, profile)
        run = self._run()
        run.begin()
        run.advance(steps)
        try:
            return run.end()
        finally:
            self.close()


class Run:
    """One case on one scheduler: the engine core's loop with a closed-loop client and the
    synthetic model runner, stepped by `advance` until the workload is done or `steps` steps ran.

    The scheduler is built once (building it costs far more than the steps measured); each
    repetition (`begin`) starts it from the same state: every request of the previous one
    aborted and the prefix cache reset, so every block is free and uncached, as after start-up.
    Request ids carry the repetition number. The garbage collector is frozen while the case runs
    (as after vLLM's engine start-up) and collected before each repetition."""

    def __init__(self, wl: dict, case: dict, seed: int, steps: int, profile: bool = False) -> None:
        from vllm.v1.outputs import ModelRunnerOutput
        try:
            from vllm.v1.outputs import DraftTokenIds
        except ImportError:  # pragma: no cover
            DraftTokenIds = None

        t0 = time.perf_counter()
        self.wl, self.case, self.seed, self.max_steps = wl, case, seed, steps
        self.ModelRunnerOutput, self.DraftTokenIds = ModelRunnerOutput, DraftTokenIds
        self.feats = Features()
        self.scheduler, self.block_hasher, _ = build(wl, self.feats)
        self.cfg = wl["config"]
        self.spec = self.cfg.get("spec")
        self.prof = _Profiler(self.scheduler) if profile else None
        self.reps = 0
        self.client: ClosedLoopClient | None = None  # set by begin()
        gc.collect()
        gc.freeze()
        self.frozen = True
        self.setup = time.perf_counter() - t0

    def begin(self) -> dict:
        """Start a repetition: reset the scheduler (after the first), fresh client and counters."""
        t0 = time.perf_counter()
        sched = self.scheduler
        if self.reps:
            from vllm.v1.request import RequestStatus

            live = list(sched.requests)
            if live:
                sched.finish_requests(live, RequestStatus.FINISHED_ABORTED)
            if not sched.kv_cache_manager.reset_prefix_cache():
                raise RuntimeError("the prefix cache could not be reset between repetitions")
        tag = f"r{self.reps}."
        reqs = [dict(r, id=tag + r["id"]) for r in self.wl["requests"]]
        self.reps += 1
        self.sampler = Sampler({r["id"]: r["output"] for r in reqs}, self.spec, self.seed)
        self.client = ClosedLoopClient(reqs, self.cfg["concurrency"], self.block_hasher)
        if self.prof is not None:
            self.prof.clear()
        self.t: Counter[str] = Counter()  # ns: schedule, update, submit, draft
        self.step_ns: list[int] = []  # wall time of schedule() + update_from_output(), per step
        self.step_cpu_ns: list[int] = []  # the same calls' CPU time (this thread), per step
        self.totals: Counter[str] = Counter()
        self.conn: Counter[str] = Counter()
        self.admitted = self.tokens = self.preempted = self.step = 0
        self.loop_seconds = 0.0
        gc.collect()
        gc.freeze()
        return dict(reset_seconds=round(time.perf_counter() - t0, 3))

    @property
    def done(self) -> bool:
        assert self.client is not None, "begin() comes first"
        return not self.client.busy or self.step >= self.max_steps

    def advance(self, n: int) -> dict:
        """Run up to n more steps; the timed calls are schedule() and update_from_output()."""
        if self.client is None:
            raise RuntimeError("advance before begin")
        ns, cpu = time.perf_counter_ns, time.thread_time_ns
        sched, client, sampler, t = self.scheduler, self.client, self.sampler, self.t
        t_begin = time.perf_counter()
        end = min(self.max_steps, self.step + max(0, n))
        while client.busy and self.step < end:
            a = ns()
            client.submit(sched, self.step)
            b = ns()
            b_cpu = cpu()
            so = sched.schedule()
            c_cpu = cpu()
            c = ns()
            self.step += 1
            sched_ids = list(so.num_scheduled_tokens.keys())
            spec_sched = getattr(so, "scheduled_spec_decode_tokens", {}) or {}
            sampled = []
            for rid in sched_ids:
                req = sched.requests[rid]
                sampled.append(sampler.sampled(req, spec_sched.get(rid, []))
                               if req.num_computed_tokens >= req.num_tokens else [])
            mro = self.ModelRunnerOutput(req_ids=sched_ids, req_id_to_index={r: i for i, r in enumerate(sched_ids)},
                                         sampled_token_ids=sampled)
            d = ns()
            d_cpu = cpu()
            outs = sched.update_from_output(so, mro)
            e_cpu = cpu()
            e = ns()
            f = g = 0
            if self.spec and self.DraftTokenIds is not None:
                d_ids, d_tok = [], []
                for rid in sched_ids:
                    req = sched.requests.get(rid)
                    if req is not None and not req.is_finished():
                        d_ids.append(rid)
                        d_tok.append(sampler.drafts(req))
                if d_ids:
                    f = ns()
                    sched.update_draft_token_ids(self.DraftTokenIds(d_ids, d_tok))
                    g = ns()
            t["submit"] += b - a
            t["schedule"] += c - b
            t["update"] += e - d
            t["draft"] += g - f
            t["schedule_cpu"] += c_cpu - b_cpu
            t["update_cpu"] += e_cpu - d_cpu
            self.step_ns.append((c - b) + (e - d))
            self.step_cpu_ns.append((c_cpu - b_cpu) + (e_cpu - d_cpu))
            self.admitted += len(so.scheduled_new_reqs)
            self.tokens += so.total_num_scheduled_tokens
            self.preempted += len(getattr(so, "preempted_req_ids", ()) or ())
            stats.add_step_stats(outs, self.totals, self.conn)
            client.collect(sched, self.step)
        self.loop_seconds += time.perf_counter() - t_begin
        return dict(steps=self.step, done=self.done)

    def end(self) -> dict:
        """The repetition's result: counts, time per call kind, and every step's time (ns)."""
        assert self.client is not None, "begin() comes first"
        res = dict(
            case=self.case, rep=self.reps - 1, steps=self.step, done=not self.client.busy, admitted=self.admitted,
            finished=len(self.client.finished), scheduled_tokens=self.tokens, preempted=self.preempted,
            hits=self.totals.get("hits", 0), queries=self.totals.get("queries", 0),
            ns=dict(schedule=self.t["schedule"], update=self.t["update"], submit=self.t["submit"],
                    draft=self.t["draft"], schedule_cpu=self.t["schedule_cpu"], update_cpu=self.t["update_cpu"]),
            step_ns=list(self.step_ns), step_cpu_ns=list(self.step_cpu_ns),
            seconds=dict(setup=round(self.setup, 3), loop=round(self.loop_seconds, 3)),
            features=dict(vllm_version=self.feats.get("vllm_version"), managers=self.feats.get("managers"),
                          scheduler_block_size=self.feats.get("scheduler_block_size"),
                          hash_block_size=self.feats.get("hash_block_size")),
            config=dict(self.cfg),
        )
        if self.prof is not None:
            res["profile"] = self.prof.result()
        return res

    def close(self) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False


class _Profiler:
    """Times each KV cache group manager's cache_blocks, remove_skipped_blocks and (where the tree
    has it) get_cache_block_mask, by wrapping them on the instances, in CPU time of the thread
    (the wrappers cost the same in both trees). Calls nest: the patched SlidingWindowManager's
    remove_skipped_blocks may call cache_blocks, which calls the mask."""

    METHODS = ("cache_blocks", "remove_skipped_blocks", "get_cache_block_mask")

    def __init__(self, scheduler) -> None:
        coord = scheduler.kv_cache_manager.coordinator
        self.managers = list(coord.single_type_managers)
        self.ns: list[Counter] = [Counter() for _ in self.managers]
        self.calls: list[Counter] = [Counter() for _ in self.managers]
        self.blocks: list[Counter] = [Counter() for _ in self.managers]
        for gid, m in enumerate(self.managers):
            for name in self.METHODS:
                orig = getattr(m, name, None)
                if orig is not None:
                    setattr(m, name, self._wrap(gid, name, orig))

    def clear(self) -> None:
        for counters in (self.ns, self.calls, self.blocks):
            for c in counters:
                c.clear()

    def _wrap(self, gid: int, name: str, orig):
        ns, calls, blocks = self.ns[gid], self.calls[gid], self.blocks[gid]
        clock = time.thread_time_ns

        def wrapper(*args, **kwargs):
            t = clock()
            out = orig(*args, **kwargs)
            ns[name] += clock() - t
            calls[name] += 1
            if name == "get_cache_block_mask" and len(args) >= 2:
                blocks[name] += args[1] - args[0]
            return out

        return wrapper

    def result(self) -> list[dict]:
        out = []
        for gid, m in enumerate(self.managers):
            spec = m.kv_cache_spec
            out.append(dict(group=gid, manager=type(m).__name__, block_size=spec.block_size,
                            window=getattr(spec, "sliding_window", None), ns=dict(self.ns[gid]),
                            calls=dict(self.calls[gid]), mask_blocks=self.blocks[gid].get("get_cache_block_mask", 0)))
        return out


def mask_cost(chunk_tokens: int, repeat: int, seed: int) -> dict:
    """The cache mask's cost for one prefill chunk of `chunk_tokens`, per DSv4 KV cache group.

    A DSv4 scheduler is built as the engine core builds it (the coordinator sets each manager's hit
    alignment); each sliding-window manager's get_cache_block_mask is called for consecutive
    chunks [k*n, (k+1)*n) blocks, k = 0..7, `repeat` times each; the median and the minimum per
    call are reported, with the share of blocks the mask keeps. {"present": False} when the tree
    has no mask."""
    case = dict(topology="dsv4", workload="unique-resend", kind="unique", scenario="dsv4-resend", variant="",
                pool=DEFAULT_POOLS[0])
    wl = overhead_workload(case, 0.01, seed)
    scheduler, _, _ = build(wl, Features())
    groups = []
    present = False
    clock = time.perf_counter_ns
    for gid, m in enumerate(scheduler.kv_cache_manager.coordinator.single_type_managers):
        spec = m.kv_cache_spec
        fn = getattr(m, "get_cache_block_mask", None)
        window = getattr(spec, "sliding_window", None)
        if fn is None:
            continue
        present = True
        n = chunk_tokens // spec.block_size
        times, kept, masked = [], 0, False
        for k in range(8):
            for _ in range(repeat):
                t = clock()
                mask = fn(k * n, (k + 1) * n)
                times.append(clock() - t)
            if mask is not None:
                masked = True
                kept += sum(mask)
            else:
                kept += n
        times.sort()
        groups.append(dict(group=gid, manager=type(m).__name__, block_size=spec.block_size, window=window,
                           blocks_per_chunk=n, masked=masked, kept_share=round(kept / (8 * n), 4),
                           us_median=round(times[len(times) // 2] / 1000, 2), us_min=round(times[0] / 1000, 2)))
    return dict(present=present, chunk_tokens=chunk_tokens, repeat=repeat, groups=groups,
                alignment=getattr(scheduler.kv_cache_manager.coordinator, "lcm_block_size", None))


def main(argv=None) -> int:
    """The command loop: `python <replay dir> overhead`, cwd = a vLLM tree root."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    os.environ.setdefault("VLLM_USAGE_STATS_DISABLED", "1")
    sys.path.insert(0, os.getcwd())
    real_stdout, sys.stdout = sys.stdout, sys.stderr
    server = Server()
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            cmd = json.loads(line)
            op = cmd.get("op")
            if op == "quit":
                break
            if op == "hello":
                result = server.hello()
            elif op in ("run", "profile"):
                result = server.run(cmd["case"], float(cmd["scale"]), int(cmd["seed"]), int(cmd["steps"]),
                                    profile=op == "profile")
            elif op == "start":
                result = server.start(cmd["case"], float(cmd["scale"]), int(cmd["seed"]), int(cmd["steps"]),
                                      profile=bool(cmd.get("profile")))
            elif op == "begin":
                result = server._run().begin()
            elif op == "advance":
                result = server._run().advance(int(cmd["steps"]))
            elif op == "end":
                result = server._run().end()
            elif op == "close":
                server.close()
                result = {}
            elif op == "mask":
                result = mask_cost(int(cmd["chunk_tokens"]), int(cmd["repeat"]), int(cmd.get("seed", 0)))
            else:
                raise ValueError(f"unknown op {op!r}")
            reply = dict(ok=True, result=result)
        except Exception as exc:  # reported to the parent; the server keeps serving
            reply = dict(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(limit=8))
        real_stdout.write(json.dumps(reply, sort_keys=True, default=str) + "\n")
        real_stdout.flush()
    return 0
