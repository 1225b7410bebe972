"""The ledger of dropped patches: `<series_dir>/dropped.toml`, one entry per patch a rebase dropped.

Written only by `kvforge rebase` (kvforge.flow.rebase), inside the same all-or-nothing step that writes
the new series; read by `kvforge status` through `load`. Entries accumulate: a rebase appends to the
entries the series already had. The file is not a patch and not the series file, so the series lint
and `kvforge export` leave it alone (export keeps files of a series directory it does not manage).

An entry says which file and fix was dropped, why (decision "upstream": the new base already has
the fix, with the signals that said so; "skipped": the user dropped it with `kvforge rebase --skip`),
when, and onto which release (and base commit).
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from kvforge.core.errors import EXIT_USAGE, KvforgeError

FILENAME = "dropped.toml"
DECISIONS = ("upstream", "skipped")
HEADER = ("# Patches dropped from this series by `kvforge rebase`: the base it moved onto already has the fix\n"
          "# (decision \"upstream\", with the signals that said so), or the user dropped it (\"skipped\").\n"
          "# Written by kvforge; `kvforge status` shows it.\n")


@dataclass(frozen=True)
class Entry:
    file: str
    fix_id: str
    decision: str  # upstream | skipped
    signals: list[dict]  # {"name", "fired" (True/False/None), "strong", "detail"}
    dropped_at: str  # UTC, ISO 8601
    onto_version: str | None
    onto_ref: str | None = None
    base_commit: str | None = None  # the new base's commit (in the kvforge cache's import, or upstream's)
    reason: str = ""  # the decision's one-line reason

    def to_json(self) -> dict:
        return {"file": self.file, "fix_id": self.fix_id, "decision": self.decision, "signals": list(self.signals),
                "dropped_at": self.dropped_at, "onto_version": self.onto_version, "onto_ref": self.onto_ref,
                "base_commit": self.base_commit, "reason": self.reason}


def path_of(series_dir: Path) -> Path:
    return Path(series_dir) / FILENAME


def load(series_dir: Path) -> list[Entry]:
    """The series' ledger entries, oldest first ([] when it has none); a malformed file is one error."""
    path = path_of(series_dir)
    if not path.is_file():
        return []
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise KvforgeError(f"{path}: cannot read the ledger of dropped patches: {exc}", EXIT_USAGE) from None
    dropped = data.get("dropped", [])
    if not isinstance(dropped, list):
        raise KvforgeError(f"{path}: `dropped` must be an array of tables ([[dropped]]), not "
                           f"{type(dropped).__name__}", EXIT_USAGE)
    unknown = sorted(set(data) - {"dropped"})
    if unknown:
        raise KvforgeError(f"{path}: unknown key {unknown[0]!r} (the ledger has only [[dropped]] entries)", EXIT_USAGE)
    return [_entry(path, i, e) for i, e in enumerate(dropped)]


def _entry(path: Path, i: int, e: object) -> Entry:
    """dropped[i], type-checked: every problem is one KvforgeError naming the file and the key."""
    where = f"{path}: dropped[{i}]"
    if not isinstance(e, dict):
        raise KvforgeError(f"{where} is not a table", EXIT_USAGE)
    for k in ("file", "fix_id", "decision"):
        if not isinstance(e.get(k), str) or not e[k]:
            raise KvforgeError(f"{where} needs a non-empty string {k}", EXIT_USAGE)
    if e["decision"] not in DECISIONS:
        raise KvforgeError(f"{where}.decision is {e['decision']!r}, not one of {', '.join(DECISIONS)}", EXIT_USAGE)
    for k in ("dropped_at", "onto_version", "onto_ref", "base_commit", "reason"):
        if k in e and not isinstance(e[k], str):
            raise KvforgeError(f"{where}.{k} must be a string, not {type(e[k]).__name__}", EXIT_USAGE)
    unknown = sorted(set(e) - {"file", "fix_id", "decision", "signals", "dropped_at", "onto_version", "onto_ref",
                               "base_commit", "reason"})
    if unknown:
        raise KvforgeError(f"{where} has an unknown key {unknown[0]!r}", EXIT_USAGE)
    raw = e.get("signals", [])
    if not isinstance(raw, list):
        raise KvforgeError(f"{where}.signals must be an array of {{ name, fired, strong, detail }}, not "
                           f"{type(raw).__name__}", EXIT_USAGE)
    signals = []
    for j, s in enumerate(raw):
        if not (isinstance(s, dict) and isinstance(s.get("name"), str) and s.get("fired") in (True, False, None)
                and isinstance(s.get("strong", False), bool) and isinstance(s.get("detail", ""), str)):
            raise KvforgeError(f"{where}.signals[{j}] needs name (string), fired and strong (booleans), detail "
                               "(string)", EXIT_USAGE)
        signals.append({"name": s["name"], "fired": s.get("fired"), "strong": s.get("strong", False),
                        "detail": s.get("detail", "")})
    return Entry(file=e["file"], fix_id=e["fix_id"], decision=e["decision"], signals=signals,
                 dropped_at=e.get("dropped_at", ""), onto_version=e.get("onto_version"),
                 onto_ref=e.get("onto_ref"), base_commit=e.get("base_commit"), reason=e.get("reason", ""))


def _s(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid TOML basic string


def render(entries: list[Entry]) -> str:
    """The ledger file's text (TOML; `fired` is omitted when a signal could not tell)."""
    out = [HEADER]
    for e in entries:
        out.append("\n[[dropped]]\n")
        out.append(f"file = {_s(e.file)}\nfix_id = {_s(e.fix_id)}\ndecision = {_s(e.decision)}\n")
        if e.reason:
            out.append(f"reason = {_s(e.reason)}\n")
        out.append(f"dropped_at = {_s(e.dropped_at)}\n")
        for key in ("onto_version", "onto_ref", "base_commit"):
            value = getattr(e, key)
            if value:
                out.append(f"{key} = {_s(value)}\n")
        if e.signals:
            out.append("signals = [\n")
            for s in e.signals:
                fired = s.get("fired")
                parts = [f"name = {_s(str(s.get('name', '')))}"]
                if fired is not None:
                    parts.append(f"fired = {'true' if fired else 'false'}")
                parts.append(f"strong = {'true' if s.get('strong') else 'false'}")
                parts.append(f"detail = {_s(str(s.get('detail', '')))}")
                out.append("  { " + ", ".join(parts) + " },\n")
            out.append("]\n")
        else:
            out.append("signals = []\n")
    return "".join(out)

