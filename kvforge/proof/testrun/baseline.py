"""Base vs patched: whose failure is it. The base's outcomes for the patched tree's failing tests, asked once per
base, environment and selection and kept as evidence in the cache (`save_baseline`), then compared node by node.

Invariants. The base is the stack's worktree at its base commit (the caller holds the stack's lock); only ids
the cache has not recorded for this base, env and selection are run again; a comparison judges only the
selected nodes (and the series' Checks).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Sequence

from kvforge.core import evidence
from kvforge.proof.testrun.pytestrun import Case, RunResult, node_matches, run_properties, run_pytest, summary_line, \
    unique

BASE_SERIES = hashlib.sha256(b"").hexdigest()[:16]  # the base alone is the empty series on it


def node_outcome(run: RunResult, nodeid: str) -> str:
    """One test id's outcome in a run: its own case, "error" when its file did not
    collect, "collected" for a file id whose tests ran, else "missing"."""
    path = nodeid.split("::", 1)[0]
    if path in run.collect_errors:
        return "error"
    for c in run.cases:
        if c.nodeid == nodeid:
            return c.outcome
    if "::" not in nodeid and any(c.nodeid.startswith(path + "::") for c in run.cases):
        return "collected"  # a file id (a collection error in the other run) whose tests ran here
    return "missing"


@dataclass
class Comparison:
    """The selection's failures on the patched tree judged against the same tests on the base.

    fail (or error) on both = pre-existing (the base's state, not the series'); fail on patched
    only (passed, skipped or absent on the base) = new: the series broke it; a test the base is
    known to fail that passes patched = fixed. The series' own Checks are not compared: they must
    pass on the patched tree whatever the base does. Only the tests that fail on the patched tree
    are run on the base (and recorded, so the next verify in this cache asks only about new ones)."""

    base_source: str  # run (asked the base now) | cached (all known) | not needed (nothing failed) | same tree
    base_commit: str
    base_counts: dict[str, int]
    base_seconds: float = 0.0
    base_record: str | None = None
    new: list[dict] = field(default_factory=list)  # {"node", "base", "patched", "message"}
    pre_existing: list[str] = field(default_factory=list)
    fixed: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"base_source": self.base_source, "base_commit": self.base_commit, "base": self.base_counts,
                "base_seconds": round(self.base_seconds, 2), "base_record": self.base_record,
                "new_failures": len(self.new), "pre_existing_failures": len(self.pre_existing),
                "fixed_count": len(self.fixed), "new": self.new, "pre_existing": self.pre_existing,
                "fixed": self.fixed}


def judged(nodeid: str, selectors: list[str], checks: Sequence[str]) -> bool:
    """A test of the selection that is not one of the series' Checks."""
    return any(node_matches(nodeid, s) for s in selectors) and not any(node_matches(nodeid, c) for c in checks)


def failing_ids(run: RunResult, selectors: list[str], checks: Sequence[str] = ()) -> list[str]:
    """The selection's test ids (files, for a collection error) that fail or error in `run`."""
    return unique(c.nodeid for c in run.cases
                  if c.outcome in ("failed", "error") and judged(c.nodeid, selectors, checks))


def compare(base: RunResult, patched: RunResult, selectors: list[str], checks: Sequence[str] = (),
            base_source: str = "run") -> Comparison:
    """Per test id of the selection (Checks excluded): pre-existing, new or fixed."""
    cmp = Comparison(base_source, base.commit, base.counts(), base.seconds)
    seen = set()
    for c in patched.cases:
        if c.nodeid in seen or not judged(c.nodeid, selectors, checks):
            continue
        seen.add(c.nodeid)
        before = node_outcome(base, c.nodeid)
        if c.outcome in ("failed", "error"):
            if before in ("failed", "error"):
                cmp.pre_existing.append(c.nodeid)
            else:
                cmp.new.append({"node": c.nodeid, "base": before, "patched": c.outcome, "message": c.message})
        elif c.outcome == "passed" and before in ("failed", "error"):
            cmp.fixed.append(c.nodeid)
    return cmp


def merge(known: RunResult | None, run: RunResult) -> RunResult:
    """Base outcomes known so far plus a new base run: `selectors` is every id the base was asked about."""
    if known is None:
        return run
    cases = {c.nodeid: c for c in known.cases}
    cases.update({c.nodeid: c for c in run.cases})
    return RunResult("base", run.commit, unique([*known.selectors, *run.selectors]), run.junit, run.log,
                     run.exit_code, known.seconds + run.seconds, list(cases.values()),
                     unique([*known.not_in_tree, *run.not_in_tree]), unique([*known.missing, *run.missing]),
                     unique([*known.collect_errors, *run.collect_errors]), run.properties)


def baseline_name(platform: str, env_key: str, selectors: list[str]) -> str:
    """The record name of the base's outcomes: the platform, the env and the selection they belong to."""
    digest = hashlib.sha256("\n".join(selectors).encode()).hexdigest()[:12]
    return f"{platform}-base-{env_key}-{digest}"


def baseline_key(stack) -> evidence.Key:
    return evidence.Key(stack.target, stack.component, stack.base.commit, BASE_SERIES)


def load_baseline(cache, stack, name: str) -> tuple[RunResult, str] | None:
    """The base's recorded outcomes for this selection and env (see save_baseline), and the record's path."""
    rec = evidence.latest(cache, baseline_key(stack), "test", name)
    if rec is None or rec.data.get("base") != stack.base.commit or not {"asked", "cases"} <= rec.data.keys():
        return None  # none, another base, or a record of an older layout: ask the base again
    d = rec.data
    run = RunResult("base", d["base"], d["asked"], exit_code=d.get("pytest_exit"), seconds=d.get("seconds", 0.0),
                    cases=[Case(n, o, 0.0, m) for n, (o, m) in d["cases"].items()],
                    not_in_tree=d.get("not_in_tree", []), missing=d.get("missing", []),
                    collect_errors=d.get("collect_errors", []))
    return run, str(rec.path)


def save_baseline(cache, stack, name: str, run: RunResult, env_key: str, platform: str) -> str:
    """Record the base's outcome per test id asked so far (key: target, component, base commit, the
    empty series; name: platform, env, selection): a later verify in this cache asks the base only
    about ids not in it."""
    c = run.counts()
    data = {"base": stack.base.commit, "base_ref": stack.base.ref, "env": env_key, "platform": platform,
            "asked": run.selectors, "pytest_exit": run.exit_code, "seconds": round(run.seconds, 2), **c,
            "junit": str(run.junit) if run.junit else None,
            "cases": {x.nodeid: [x.outcome, x.message if x.outcome != "passed" else ""] for x in run.cases},
            "not_in_tree": run.not_in_tree, "missing": run.missing, "collect_errors": run.collect_errors}
    rec = evidence.Record("test", baseline_key(stack), name, origin="base", platform=platform,
                          ok=not (c["failed"] or c["errors"]), data=data)
    return str(evidence.save(cache, rec))


def compare_lines(cmp: dict, patched: bool, limit: int = 10) -> list[str]:
    """The base-vs-patched comparison, for people: counts, then the pre-existing and new failures by id."""
    if not cmp:
        return []
    how = {"run": f"the failing tests run on the base in {cmp['base_seconds']:.1f}s",
           "cached": f"their base outcomes recorded earlier: {cmp['base_record']}",
           "not needed": "nothing fails on the patched tree", "same tree": ""}[cmp["base_source"]]
    out = [f"against the base ({cmp['base_commit'][:12]}; {how}): {cmp['new_failures']} new failures, "
           f"{cmp['pre_existing_failures']} pre-existing (the base's state), {cmp['fixed_count']} fixed" if patched else
           f"failures on the base ({cmp['base_commit'][:12]}): {cmp['pre_existing_failures']} (the base's state)"]
    for f in cmp["new"][:limit]:
        out.append(f"  NEW {f['node']}: {f['patched']} (on the base: {f['base']})"
                   + (f" ({f['message']})" if f["message"] else ""))
    for kind, ids in (("pre-existing", cmp["pre_existing"]), ("fixed", cmp["fixed"])):
        out += [f"  {kind} {n}" for n in ids[:limit]]
        if len(ids) > limit:
            out.append(f"  ... and {len(ids) - limit} more {kind} (all in --json)")
    return out


def against_base(ctx, stack, env, final: RunResult, selectors: list[str], checks: list[str], rdir: Path,
                 platform: str = "cpu") -> Comparison:
    """Judge the patched tree's failures against the base: ask the base (checked out in the stack's
    worktree; the caller holds its lock) about each failing test id it has not been asked about in
    this cache (same base, env and selection), record the answers, compare."""
    failing = failing_ids(final, selectors, checks)
    name = baseline_name(platform, env.key, selectors)
    cached = load_baseline(ctx.cache, stack, name)
    known, record = (cached if cached else (None, None))
    ask = [i for i in failing if known is None or i not in known.selectors]
    source = "not needed" if not failing else ("cached" if not ask else "run")
    seconds = 0.0
    if ask:
        commit = stack.checkout(0)
        ctx.say(f"[base] the {len(ask)} selected tests that fail on the patched tree, on the base ({commit[:12]})")
        run = run_pytest(env, stack.worktree, ask, rdir / "base-failing.xml",
                         run_properties(ctx.target, ctx.component, stack, platform, "base", commit), "base", commit)
        ctx.say("[base] " + summary_line(run))
        seconds = run.seconds
        known = merge(known, run)
        record = save_baseline(ctx.cache, stack, name, known, env.key, platform)
    cmp = compare(known or RunResult("base", stack.base.commit, []), final, selectors, checks, source)
    cmp.base_commit, cmp.base_record, cmp.base_seconds = stack.base.commit, record, seconds
    return cmp
