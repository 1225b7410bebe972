"""The evidence a text reads: the newest verify and bench records of a stack's key, and the rules
for records of another series or base (stale).

Invariants: a record is used only when its key (target, component, base commit, series digest) is
exactly the stack's ("current"); another series' or base's newest record is refused (EXIT_TESTS)
unless the caller allows stale evidence, and is then marked "stale"; no record is "missing", stated,
never invented. Every lookup is recorded as an EvidenceUsed. Records are kvforge.core.evidence's;
this module only reads them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone

from kvforge.core import evidence as records
from kvforge.core.cache import Cache
from kvforge.core.errors import EXIT_TESTS, KvforgeError
from kvforge.core.evidence import Key
from kvforge.flow.pr.sandbox import first_line, pct
from kvforge.git.context import Context

# Which `bench prefix-cache` scenarios measure a fix (kvforge/bench/replay/workloads.py documents
# each scenario's bug report). A bench compares the base with the whole series, so its figures are
# reported as the series', never as one patch's alone.
BENCH_SCENARIOS = {
    "two-phase-kv-alloc": {"external-hit": "measures"},  # seed 003 / #43884: block ids in two groups
    "swa-reachable-cache-mask": {"gptoss-eagle": "control"},  # EAGLE lookups must keep their lookahead block
    "swa-retention-queue-split": {"dsv4-resend": "measures", "dsv4-repeat": "measures"},  # seeds 000, 001 / #42948
    "gemma4-dflash-eagle-spiral": {"gemma4-dflash": "measures"},  # seed 002 / #40624
    "eagle-lookahead-block-hashes": {"gemma4-dflash": "measures", "gptoss-eagle": "measures"},  # #50438
}


@dataclass
class EvidenceUsed:
    """One evidence record a text was made from (or the statement that there is none)."""

    kind: str  # verify | bench-prefix-cache
    state: str  # current | stale | missing
    record: str = ""  # the record file ("" when missing)
    series: str = ""
    base: str = ""
    origin: str = ""
    platform: str = ""
    created: str = ""
    ok: bool | None = None


def find_evidence(cache: Cache, key: Key, kind: str, allow_stale: bool,
                  target: str) -> tuple[records.Record | None, str]:
    """The newest record of `kind` for exactly this key: (record, 'current'); or another series' or
    base's newest, refused (EXIT_TESTS) or, with allow_stale, (record, 'stale'); or (None, 'missing')."""
    rec = records.latest(cache, key, kind)
    if rec is not None:
        return rec, "current"
    others = [r for r in records.load(cache, key.target, key.component, kind=kind) if r.key != key]
    if not others:
        return None, "missing"
    other = others[-1]
    what = "series" if other.key.series != key.series else "base"
    if not allow_stale:
        command = "verify" if kind == "verify" else "bench prefix-cache"
        raise KvforgeError(
            f"stale evidence: the newest {kind} record of {target} is for {what} "
            f"{(other.key.series if what == 'series' else other.key.base[:12])} but this is {what} "
            f"{(key.series if what == 'series' else key.base[:12])}; run `kvforge {command} -t {target}` "
            "(or pass --allow-stale to use it, said so in the text)", EXIT_TESTS)
    return other, "stale"


def gather(ctx: Context, key: Key, kind: str, allow_stale: bool, used: list[EvidenceUsed], warnings: list[str],
              args: str = "") -> tuple[records.Record | None, str]:
    """find_evidence, recorded in `used`, with a warning when it is missing or stale."""
    target = target_flag(ctx)
    rec, state = find_evidence(ctx.cache, key, kind, allow_stale, target)
    used.append(_used(kind, rec, state))
    command = "verify" if kind == "verify" else "bench prefix-cache"
    if rec is None:
        warnings.append(f"no {command} evidence for series {key.series} on {key.base[:12]}: the text says so "
                        f"(run `kvforge {command} -t {target}{args}`)")
    elif state == "stale":
        warnings.append(f"using stale {command} evidence of series {rec.key.series} (this series is "
                        f"{key.series}); the text says so")
    return rec, state


def _used(kind: str, rec: records.Record | None, state: str) -> EvidenceUsed:
    if rec is None:
        return EvidenceUsed(kind, state)
    return EvidenceUsed(kind, state, str(rec.path or ""), rec.key.series, rec.key.base, rec.origin, rec.platform,
                        rec.created, rec.ok)


def when(created: str) -> str:
    try:
        t = datetime.fromisoformat(created)
    except (TypeError, ValueError):
        return created
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _record_data(rec: records.Record, state: str, target: str, command: str) -> dict:
    return {"state": state, "created": rec.created, "date": when(rec.created), "series": rec.key.series,
            "base": rec.key.base, "from_commit": from_commit(rec.origin), "platform": rec.platform, "ok": rec.ok,
            "command": f"kvforge {command} -t {target}"}


def from_commit(origin: str) -> str:
    """'--from DIR (sha)' -> 'sha' ('' for the series files): a text never names a directory of this machine."""
    m = re.search(r"\(([0-9a-f]{7,40})\)$", origin or "") if origin != "series" else None
    return m.group(1) if m else ""


def verify_data(rec: records.Record | None, state: str, target: str, fix_id: str | None) -> dict | None:
    """What the templates show of a verify record: the fix's checks and the regression suite."""
    if rec is None:
        return None
    d = rec.data
    out = _record_data(rec, state, target, "verify")
    out.update(env=d.get("env", ""), base_ref=d.get("base_ref", ""), patches=len(d.get("patches", [])),
               proven=sum(p.get("status") == "proven" for p in d.get("patches", [])))
    reg = d.get("regression") or {}
    out["regression"] = {"passed": reg.get("passed", 0), "failed": reg.get("failed", 0),
                         "errors": reg.get("errors", 0), "skipped": reg.get("skipped", 0),
                         "selection": list(reg.get("selection", [])), "checks": len(reg.get("checks", [])),
                         "ok": bool(reg.get("ok")), "reason": reg.get("reason", ""),
                         # failures that the base has too are its state, not the series' (testrun.compare)
                         "pre_existing": (reg.get("compare") or {}).get("pre_existing_failures", 0),
                         "new": (reg.get("compare") or {}).get("new_failures", 0)}
    out["by_fix"] = {p.get("fix_id"): _verdict(p) for p in d.get("patches", [])}
    out["patch"] = out["by_fix"].get(fix_id) if fix_id else None
    return out


def _verdict(p: dict) -> dict:
    fb, pa = p.get("fail_before") or [0, 0], p.get("pass_after") or [0, 0]
    return {"n": p.get("n"), "name": p.get("name"), "status": p.get("status"), "reason": p.get("reason", ""),
            "behaviour_before": p.get("behaviour_before"),
            "in_base": bool(p.get("in_base")), "fail_before": list(fb), "pass_after": list(pa),
            "checks": [{"node": c.get("node"), "test": c.get("node", "").rsplit("/", 1)[-1],
                        "before": c.get("before") or "not run", "after": c.get("after") or "not run",
                        "before_how": c.get("before_how", ""), "before_message": first_line(c.get("before_message")),
                        "before_kind": c.get("before_kind") or "",
                        "after_message": first_line(c.get("after_message"))}
                       for c in p.get("checks", [])]}


def bench_data(rec: records.Record | None, state: str, target: str, scenarios: tuple[str, ...]) -> dict | None:
    """The rows and goals of a bench record for the given scenarios (all of them when empty)."""
    if rec is None:
        return None
    d = rec.data
    out = _record_data(rec, state, target, "bench prefix-cache")
    wanted = set(scenarios)
    rows = []
    for row in d.get("rows", []):
        if wanted and row.get("scenario") not in wanted:
            continue
        b, p = row.get("base"), row.get("patched")
        rows.append({"label": row.get("label"), "scenario": row.get("scenario"),
                     "base_hit": pct(b["hit_rate"]) if b else "error",
                     "patched_hit": pct(p["hit_rate"]) if p else ("-" if "patched_error" not in row else "error"),
                     "ceiling": pct((p or b or {}).get("ceiling_rate")),
                     "base_violations": b["violations"] if b else "-",
                     "patched_violations": p["violations"] if p else "-",
                     "base": b, "patched": p})
    present = {r["scenario"] for r in rows}
    out.update(scale=d.get("scale"), seed=d.get("seed"), patches=d.get("patches", 0), note=d.get("note", ""),
               rows=rows, missing=[s for s in scenarios if s not in present],
               goals=[g for g in d.get("goals", []) if not wanted or g.get("scenario", "").split("/")[0] in wanted],
               command=f"kvforge bench prefix-cache -t {target}"
                       + (f" --scenario {','.join(scenarios)}" if scenarios else "")
                       + (f" --scale {d.get('scale'):g}" if isinstance(d.get("scale"), (int, float)) else "")
                       + (f" --seed {d.get('seed')}" if d.get("seed") else ""))
    return out


def target_flag(ctx: Context) -> str:
    """What follows `-t` in the commands a text names: the target, and --component when it has several."""
    if len(ctx.target.components) > 1:
        return f"{ctx.target.name} --component {ctx.component.name}"
    return ctx.target.name
