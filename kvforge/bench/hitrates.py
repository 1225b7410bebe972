"""Prefix-cache replay results as numbers: each result summarized, base and patched rows side by side, the goals
checked on them, the table and the optional plot. Pure: reads the replay's documents (and matplotlib for the
plot), runs nothing, writes only the plot file it is given.

Invariants. A row is one (scenario, variant) with one summary per tree state, or that state's error; a rate
whose denominator is 0 is None (shown as "-"), never 0; the goals never change an exit code.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.core.render import table

# Goals from the issue; checked on the patched tree.
RESEND_MIN = 0.99  # dsv4-resend: A.3 hit rate
REPEAT_MAX_GAP = 0.005  # dsv4-repeat: within 0.5 points of the ceiling
NO_REGRESSION_GAP = 0.001  # controls: patched >= base - 0.1 points
# Speculative-decoding scenarios (EAGLE-style drafters), each with a "nospec" variant: the spec
# row should reach the nospec row's rate, and at least the lookahead bound (ceilings.py).
SPEC_SCENARIOS = ("gemma4-dflash", "gptoss-eagle")


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
            add(f"A.3 hit rate >= {RESEND_MIN:.0%}", a3 is not None and a3 >= RESEND_MIN, pct(a3))
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
                f"{pct(s['admitted_rate'])} vs {pct(nospec['admitted_rate'])} without speculative decoding")
        if row["scenario"] in SPEC_SCENARIOS and s.get("lookahead_ceiling_hits") is not None:
            bound = s["lookahead_ceiling_hits"]
            add("at the lookahead bound (a block also needs the token after it)",
                s["admitted_hits"] >= bound,
                f"{s['admitted_hits']:,} of {bound:,} tokens; no-spec ceiling {s['ceiling_hits']:,}")
        if b is not None and state != "base" and row["scenario"] in SPEC_SCENARIOS:
            drop = (b["admitted_rate"] or 0) - (s["admitted_rate"] or 0)
            add("no regression against base", drop <= NO_REGRESSION_GAP,
                f"{pct(s['admitted_rate'])} vs {pct(b['admitted_rate'])}")
        add("no invariant violations", s["violations"] == 0,
            ", ".join(f"{k} {v}" for k, v in s["violation_kinds"].items()) or "none")
    return out


def pct(x: float | None, digits: int = 2) -> str:
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
            body.append([first, state, pct(s["hit_rate"]), pct(s["admitted_rate"]), pct(s["ceiling_rate"]),
                         pct(s["of_ceiling"], 1), _viol(s), f"{s['replay_seconds']:.1f}"])
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
                cells.append(f"{pr['hit']:,} ({pct(_rate(pr['hit'], pr['prompt']))})")
            cells.append(f"{r['ceiling']:,} ({pct(_rate(r['ceiling'], r['prompt']))})")
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
                        label=f"{state} ({pct(s['admitted_rate'], 1)})", **styles.get(state, {}))
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

