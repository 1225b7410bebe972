"""A pick's result (its rows, verdicts and exit code; table and JSON) and the state a stopped pick resumes from
(<cache>/pick/<project>/state.json: written atomically, type-checked on load, one line naming the file when
unusable)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvforge.core.cache import Cache
from kvforge.core.errors import EXIT_APPLY, EXIT_TESTS, EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import atomic_write_text
from kvforge.core.render import table
from kvforge.flow.pickwrite import STOPS, WRITTEN, Row


# ---------------------------------------------------------------- the result


@dataclass
class PickResult:
    """An Outcome: 0 when every row is present, carried or picked (and proven with --verify)."""

    fix_id: str
    source: str
    subject: str
    upstream: dict[str, Any]
    rows: list[Row]
    status: str  # written | dry-run | stopped | nothing to write | verify failed | aborted
    written: list[str] = field(default_factory=list)
    verify: bool = False
    seconds: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    next_steps: list[str] = field(default_factory=list)
    digests: dict[str, str] = field(default_factory=dict)  # what was read: series dirs and target files

    @property
    def exit_code(self) -> int:
        if self.status == "aborted":
            return 0
        if any(r.verdict in STOPS for r in self.rows):
            return EXIT_APPLY
        if self.verify and any(r.verdict in WRITTEN and r.proof != "proven" for r in self.rows):
            return EXIT_TESTS
        return 0

    @property
    def error(self) -> str | None:
        if self.exit_code == 0:
            return None
        stopped = [f"{r.label} {r.verdict}" for r in self.rows if r.verdict in STOPS]
        if stopped:
            return f"{', '.join(stopped)}: nothing written; resolve (or --exclude) and `kvforge pick --continue`"
        bad = [r.label for r in self.rows if r.verdict in WRITTEN and r.proof != "proven"]
        return f"not proven on {', '.join(bad)}: nothing written"

    def to_json(self) -> dict[str, Any]:
        return {"fix_id": self.fix_id, "source": self.source, "subject": self.subject, "upstream": self.upstream,
                "status": self.status, "rows": [r.public() for r in self.rows], "written": self.written,
                "markdown": self.markdown(), "seconds": self.seconds, "notes": self.notes,
                "next_steps": self.next_steps}

    def markdown(self) -> str:
        out = [f"Backport status of {self.upstream.get('pr') or self.subject} (`{self.fix_id}`, kvforge pick):", "",
               "| target | verdict | proof | detail |", "|---|---|---|---|"]
        for r in self.rows:
            detail = r.patch or r.detail
            out.append(f"| {r.label} | {r.verdict} | {r.proof} | {detail.replace('|', '/')} |")
        return "\n".join(out) + "\n"

    def render(self) -> str:
        def sig(r: Row) -> str:
            fired = [s["name"] + ("+" if s["fired"] else "-") + ("" if s["strong"] else "(weak)")
                     for s in r.signals if s["fired"] is not None]
            return ", ".join(fired) or "-"

        head = [f"{self.fix_id}: {self.subject}", f"source: {self.source}"
                + (f"; upstream {self.upstream.get('pr') or ''} {self.upstream.get('commit') or ''}".rstrip()),
                f"first release containing it: {self.upstream.get('first_release') or 'unknown'}", ""]
        rows = [(r.label, r.verdict, sig(r), r.proof, r.patch or "-") for r in self.rows]
        out = head + [table(["target", "verdict", "signals", "proof", "patch"], rows), ""]
        for r in self.rows:
            if r.detail:
                out.append(f"{r.label}: {r.detail}")
            if r.tree:
                out.append(f"  tree: {r.tree}" + (f" (conflicts: {', '.join(r.conflicts)})" if r.conflicts else ""))
            for c in r.prerequisites[:10]:
                out.append(f"  needs: {c}")
            if r.evidence:
                e, reg = r.evidence, r.evidence["regression"]
                for c in e["checks"]:
                    out.append(f"  check {c['node'].split('::')[-1]}: before {c['before']}"
                               + (f" ({c['before_kind']}: {c['before_message']})" if c["before_kind"] else "")
                               + f", after {c['after']}")
                out.append(f"  regression: {reg['passed']} passed, {reg['failed']} failed, {reg['new_failures']} new "
                           f"failures, {reg['pre_existing_failures']} pre-existing ({e['seconds']}s)")
        out += ["", f"status: {self.status}"] + [f"wrote: {w}" for w in self.written]
        out += [f"  next: {s}" for s in self.next_steps]
        return "\n".join(out)


# ---------------------------------------------------------------- state (a stopped pick)


def state_path(cache: Cache, root: Path) -> Path:
    key = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]
    return cache.root / "pick" / key / "state.json"


def save_state(path: Path, result: PickResult, rows: list[Row], digests: dict[str, str]) -> None:
    data = {"fix_id": result.fix_id, "source": result.source, "subject": result.subject,
            "upstream": result.upstream, "verify": result.verify, "digests": digests,
            "rows": [asdict(r) for r in rows]}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


STATE_KEYS: dict[str, type] = {"fix_id": str, "source": str, "subject": str, "upstream": dict, "digests": dict,
                              "rows": list}
OPT_STR = (str, type(None))
ROW_TYPES: dict[str, Any] = {"target": str, "component": str, "verdict": str, "detail": str, "signals": list,
                             "patch": OPT_STR, "commit": OPT_STR, "repo": OPT_STR, "tree": OPT_STR,
                             "tree_head": OPT_STR,
                             "conflicts": list, "prerequisites": list, "checks": list, "proof": str,
                             "evidence": (dict, type(None)), "position": (int, type(None)), "rewrites": dict,
                             "seconds": (int, float), "data": OPT_STR}


def unusable_state(path: Path, why: str) -> KvforgeError:
    return KvforgeError(f"{path}: unusable pick state ({why}); `kvforge pick --abort` forgets it (your trees "
                        "stay)", EXIT_USAGE)


def check_state(data: Any) -> str | None:
    """What is wrong with a pick state's shape, None when nothing: every key its readers use, typed."""
    if not isinstance(data, dict):
        return "not a JSON object"
    for k, tp in STATE_KEYS.items():
        if not isinstance(data.get(k), tp):
            return f"{k!r} is missing or not a {tp.__name__}"
    if not re.match(r"^[a-z0-9][a-z0-9-]*$", data["fix_id"]):
        return f"fix_id {data['fix_id']!r} is not a Fix-Id"
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in data["digests"].items()):
        return "'digests' is not an object of strings"
    if "verify" in data and not isinstance(data["verify"], bool):
        return "'verify' is not a boolean"
    writing = data.get("writing")
    if writing is not None:
        summary = writing.get("summary") if isinstance(writing, dict) else None
        if not isinstance(summary, dict) or not isinstance(writing.get("after"), dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in writing["after"].items()):
            return "'writing' is not an object of paths and digests with a summary"
        if "rows" in summary:
            why = check_state({**data, "rows": summary["rows"], "writing": None})
            if why is not None:
                return f"writing.summary: {why}"
    for i, r in enumerate(data["rows"]):
        if not isinstance(r, dict) or set(r) - set(ROW_TYPES) or {"target", "component", "verdict"} - set(r):
            return f"rows[{i}] is not a row"
        for k, v in r.items():
            if isinstance(v, bool) or not isinstance(v, ROW_TYPES[k]):
                return f"rows[{i}].{k} has the wrong type"
        for k in ("tree", "repo"):
            if r.get(k) is not None and not Path(r[k]).is_absolute():
                return f"rows[{i}].{k} {r[k]!r} is not an absolute path"
        names = ([r["patch"]] if r.get("patch") is not None else []) + list(r.get("rewrites", {}))
        for name in names:  # file names in a series directory: nothing leads out of it
            if not isinstance(name, str) or not re.match(r"^[0-9]{4}-[A-Za-z0-9][A-Za-z0-9._-]*\.patch$", name):
                return f"rows[{i}] names the patch file {name!r}, not a file name in a series directory"
    return None


def load_state(path: Path, forgiving: bool = False) -> dict[str, Any] | None:
    """The stopped pick's state, type-checked (one line naming the file and `--abort`, exit 2); `forgiving`
    (--abort): an unusable state is returned as an empty one, so the user can always get out."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        why = check_state(data)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        why = str(exc)
    if why is None:
        return data
    if forgiving:
        return {"fix_id": "?", "source": "?", "subject": "", "upstream": {}, "digests": {}, "rows": [],
                "unusable": why}
    raise unusable_state(path, why) from None
