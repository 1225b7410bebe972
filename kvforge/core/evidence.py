"""Evidence: typed, loadable records of what ran, on which tree, with what result.

Every command that produces evidence (verify, test, bench) saves one Record through `save`; later
commands (pr, notes, rebase) find it with `load`/`latest` and can refuse evidence that belongs to
another series. A record names its Key (target, component, base commit, series digest), its
origin (the series files, or --from REV), platform, ok and when it was made; `data` is the
command's own JSON document.

This module owns the layout under <cache>/results (nothing else writes there):
  <target>/<component>/<series digest>/
      <kind>[-<name>].json       records (kind: verify | test | bench-prefix-cache | bench-scheduler-overhead)
      <kind>[-<name>]/           their attachments: JUnit XML, pytest logs, replay documents
Records are written atomically: a reader sees a whole record or none.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvforge.core.cache import Cache
from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import atomic_write_text

SCHEMA = 1
RECORD_KINDS = ("verify", "test", "bench-prefix-cache", "bench-scheduler-overhead")


@dataclass(frozen=True)
class Key:
    """Which tree the evidence is about: the base commit and the series on it."""

    target: str
    component: str
    base: str
    series: str  # the series digest (trees.Stack.digest)

    def directory(self, cache: Cache) -> Path:
        return cache.results / self.target / self.component / self.series


@dataclass
class Record:
    kind: str
    key: Key
    name: str = ""  # distinguishes records of one kind: test-cpu-patched, bench-...-s0.25-seed0
    origin: str = "series"
    platform: str = "cpu"
    ok: bool = False
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="microseconds"))
    data: dict = field(default_factory=dict)
    path: Path | None = None

    @property
    def stem(self) -> str:
        return self.kind + (f"-{self.name}" if self.name else "")

    def to_json(self) -> dict:
        out = asdict(self)
        out["schema"] = SCHEMA
        out["path"] = str(self.path) if self.path else None
        return out


def attachments(cache: Cache, key: Key, kind: str, name: str = "") -> Path:
    """The directory a record's attachments (JUnit XML, logs, replay documents) go into."""
    if kind not in RECORD_KINDS:
        raise ValueError(kind)
    path = key.directory(cache) / (kind + (f"-{name}" if name else ""))
    path.mkdir(parents=True, exist_ok=True)
    return path


def save(cache: Cache, record: Record) -> Path:
    if record.kind not in RECORD_KINDS:
        raise ValueError(record.kind)
    path = record.key.directory(cache) / f"{record.stem}.json"
    record.path = path
    atomic_write_text(path, json.dumps(record.to_json(), indent=2, sort_keys=True, default=str) + "\n")
    return path


KEY_FIELDS = ("target", "component", "base", "series")
TEXT_FIELDS = {"name": "", "origin": "series", "platform": "cpu", "created": ""}


def read(path: Path) -> Record:
    """One record file, type-checked (every field as `save` writes it): a file that is not a kvforge record, or
    whose fields have the wrong types, is a one-line error naming it (EXIT_USAGE)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        return _typed(doc, Path(path))
    except (OSError, ValueError) as exc:
        raise KvforgeError(f"{path}: not a kvforge evidence record ({exc})", EXIT_USAGE) from None


def _typed(doc: object, path: Path) -> Record:
    """A Record from a loaded JSON document; ValueError naming the first field of the wrong type."""
    if not isinstance(doc, dict):
        raise ValueError(f"a JSON {type(doc).__name__}, not an object")
    if doc.get("schema") != SCHEMA or doc.get("kind") not in RECORD_KINDS:
        raise ValueError(f"schema {doc.get('schema')!r}, kind {doc.get('kind')!r}")
    key = doc.get("key")
    if not isinstance(key, dict) or sorted(key) != sorted(KEY_FIELDS) \
            or not all(isinstance(key[k], str) for k in KEY_FIELDS):
        raise ValueError(f"key must be an object of the strings {', '.join(KEY_FIELDS)}, not {key!r}"[:200])
    text = {}
    for name, default in TEXT_FIELDS.items():
        value = doc.get(name, default)
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a string, not {type(value).__name__}")
        text[name] = value
    ok, data = doc.get("ok", False), doc.get("data", {})
    if not isinstance(ok, bool):
        raise ValueError(f"ok must be true or false, not {type(ok).__name__}")
    if not isinstance(data, dict):
        raise ValueError(f"data must be an object, not {type(data).__name__}")
    return Record(kind=doc["kind"], key=Key(**{k: key[k] for k in KEY_FIELDS}), ok=ok, data=data, path=path, **text)


def load(cache: Cache, target: str, component: str, series: str | None = None,
         kind: str | None = None) -> list[Record]:
    """Records of a target's component (one series, or all), oldest first."""
    root = cache.results / target / component
    dirs = [root / series] if series else sorted(p for p in root.glob("*") if p.is_dir())
    out = []
    for d in dirs:
        for f in sorted(d.glob("*.json")):
            rec = read(f)
            if kind is None or rec.kind == kind:
                out.append(rec)
    return sorted(out, key=lambda r: r.created)


def latest(cache: Cache, key: Key, kind: str, name: str | None = None) -> Record | None:
    """The newest record of `kind` for exactly this base and series (None when there is none)."""
    recs = [r for r in load(cache, key.target, key.component, key.series, kind)
            if r.key == key and (name is None or r.name == name)]
    return recs[-1] if recs else None
