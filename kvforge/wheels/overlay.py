"""The overlay: a new wheel written member by member from the release wheel (kvforge.core.wheel), and the
name, version and identity it carries.

Every member the series does not touch (compiled .so files, third_party, data, dist-info) is copied as
stored, without recompressing; the files the series changes are replaced by the patched tree's, new
vllm/**/*.py files are added and deleted ones dropped; RECORD is rewritten (sha256 and size of every file).
ReleaseWheel checks the release wheel before anything is copied (one .dist-info, RECORD against the archive).

Identity. The distribution version gets a local label (`local_version`: `0.20.2+kvforge.<target>.<digest>`,
what pip freeze/show and lock files show); `vllm.__version__` (vllm/_version.py) stays the release's, so
vllm-ascend's `vllm_version_is("0.20.2")` holds. The series is also recorded as
- a wheel build tag, `<upstream build + 1>_kvforge_<series digest>` (in the file name and as
  `Build:` in WHEEL): pip prefers it to the upstream wheel of the same version and tags;
- `<dist-info>/kvforge.json` (identity_record): target, component, base (ref, commit), series (digest,
  origin, patches with Fix-Id, Kind and sha256), the upstream wheel and the files replaced, added and
  removed. pip installs it with the dist-info, so `importlib.metadata.distribution("vllm")
  .read_text("kvforge.json")` reads it.
The platform tags of the file name are upstream's (vLLM's WHEEL says `linux_x86_64`, its file name
`manylinux_2_35_x86_64`; pip goes by the file name).

Reproducible: same upstream wheel, base and series -> same bytes. Unchanged members are upstream's
bytes; new members are STORED with the newest upstream member's timestamp; entries are sorted
(package files by name, then dist-info, RECORD last); nothing depends on the clock, the machine,
the user or the zlib in use.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from packaging.utils import parse_wheel_filename

from kvforge.core.errors import EXIT_INTERNAL, KvforgeError
from kvforge.core.wheel import (Member, RawZipWriter, WheelError, date_time_of, format_record, local_spans,
                                parse_record, read_member, read_members, record_hash, wheel_sort_key)
from kvforge.git.context import Context
from kvforge.git.trees import Stack
from kvforge.project.targets import WheelPin
from kvforge.wheels.result import Change

RECIPE = 1  # bump when the overlay's output bytes change for the same inputs
IDENTITY_FILE = "kvforge.json"


def build_tag_for(upstream_filename: str, digest: str) -> str:
    """`<upstream build + 1>_kvforge_<series digest>`: pip prefers it to the upstream wheel of the same tags."""
    _n, _v, build, _t = parse_wheel_filename(upstream_filename)
    number = build[0] if build else 0
    return f"{number + 1}_kvforge_{digest}"


def output_filename(upstream_filename: str, build_tag: str, version: str | None = None) -> str:
    """Upstream's name with the build tag (replacing upstream's) and, when given, the local version:
    name-version-BUILD-py-abi-platform.whl."""
    parts = upstream_filename[:-len(".whl")].split("-")
    name, tags = parts[0], parts[-3:]
    return "-".join([name, version or parts[1], build_tag, *tags]) + ".whl"


def _wheel_text(text: str, build_tag: str) -> bytes:
    lines = [ln for ln in text.splitlines() if not ln.startswith("Build:")]
    while lines and not lines[-1].strip():
        lines.pop()
    return ("\n".join(lines) + f"\nBuild: {build_tag}\n\n").encode()


def local_version(release: str, target: str, digest: str) -> str:
    """The patched wheel's version: the release's with a PEP 440 local label naming kvforge, the target and
    the series digest (`0.20.2+kvforge.v0.20.2rc.3ade4a00e47759bf`): what pip freeze, pip show, lock files
    and importlib.metadata show. Characters a local label cannot hold become '.'. A version that has a
    local label already (vLLM's own `0.20.2+empty`) keeps it first and gets kvforge's after a '.', the way
    vLLM's setup.py appends its device to a local version: `0.20.2+empty.kvforge.v0.20.2rc.<digest>`."""
    label = re.sub(r"[^A-Za-z0-9.]+", ".", target).strip(".").lower()
    ours = f"kvforge.{label}.{digest}" if label else f"kvforge.{digest}"
    return f"{release}{'.' if '+' in release else '+'}{ours}"


def _metadata_text(text: str, version: str) -> bytes:
    """METADATA with its Version: header set to `version` (nothing else changes)."""
    head, sep, body = text.partition("\n\n")
    lines = [f"Version: {version}" if ln.startswith("Version:") else ln for ln in head.split("\n")]
    return ("\n".join(lines) + sep + body).encode()


@dataclass
class ReleaseWheel:
    """A release wheel's directory, checked, and what an overlay reads of it. index(): one .dist-info
    directory with RECORD and WHEEL, every local header agreeing with the central directory (enough to start
    copying); check(): RECORD lists exactly the archive's files, each with its size, and the dist-info's files
    are read. prepare_wheel starts the copies between the two, while git reads the changed files."""

    path: Path
    members: list[Member]
    by_name: dict[str, Member]
    info: str  # the .dist-info directory
    present: set[str]  # the archive's files but RECORD and its signatures
    spans: dict[str, tuple[int, int]]  # each member's local header + data, checked (wheel.local_spans)
    record: dict[str, tuple[str, str]] = field(default_factory=dict)  # check()'s
    texts: dict[str, bytes] = field(default_factory=dict)  # the dist-info's files (check()'s)
    checked: bool = False

    @classmethod
    def read(cls, path: Path, members: list[Member] | None = None) -> ReleaseWheel:
        return cls.index(path, members).check()

    @classmethod
    def index(cls, path: Path, members: list[Member] | None = None) -> ReleaseWheel:
        members = members if members is not None else read_members(path)
        by_name = {m.name: m for m in members}
        infos = {m.name.split("/", 1)[0] for m in members if m.name.split("/", 1)[0].endswith(".dist-info")}
        if len(infos) != 1:
            raise WheelError(f"{path.name}: expected one .dist-info directory, found {sorted(infos) or 'none'}")
        info = infos.pop()
        record_name = f"{info}/RECORD"
        if record_name not in by_name or f"{info}/WHEEL" not in by_name:
            raise WheelError(f"{path.name}: {info} lacks RECORD or WHEEL")
        present = {m.name for m in members if not m.is_dir} - {record_name, f"{info}/RECORD.jws", f"{info}/RECORD.p7s"}
        return cls(path, members, by_name, info, present, local_spans(path, members))

    def check(self) -> ReleaseWheel:
        if self.checked:
            return self
        path, info, by_name, present = self.path, self.info, self.by_name, self.present
        texts = {m.name: read_member(path, m) for m in self.members if m.name.startswith(info + "/") and not m.is_dir}
        record_name = f"{info}/RECORD"
        record = parse_record(texts[record_name].decode("utf-8"), path.name)
        listed = set(record) - {record_name}
        if listed != present:
            extra, missing = sorted(listed - present)[:3], sorted(present - listed)[:3]
            raise WheelError(f"{path.name}: RECORD and the archive disagree (listed, not in the zip: {extra}; "
                             f"in the zip, not listed: {missing})")
        for name in present:
            if record[name][1] != str(by_name[name].file_size):
                raise WheelError(f"{path.name}: RECORD gives {name} {record[name][1]} bytes, the zip "
                                 f"{by_name[name].file_size}")
        self.record, self.texts, self.checked = record, texts, True
        return self


class Overlay:
    """An overlay being written to `out_path`: opened on the release wheel, with the package files that sort
    before the first path the series may change (`changed`: any changed path in the wheel or in its import
    packages) copied at once, since their places depend on nothing else (prepare_wheel does it while git
    reads the changed files); finish() writes the rest. abort() closes the files (the caller removes them)."""

    def __init__(self, release: ReleaseWheel, out_path: Path, changed: set[str]):
        self.release, self.out_path = release, out_path
        t = time.monotonic()
        first = min(changed, default=None)
        info = release.info + "/"
        self.prefix = sorted(n for n in release.present if not n.startswith(info) and (first is None or n < first))
        self.src = open(release.path, "rb")
        try:
            self.dst = open(out_path, "wb")
        except BaseException:
            self.src.close()
            raise
        self.w = RawZipWriter(self.dst)
        try:
            for name in self.prefix:
                self.w.copy(self.src, release.by_name[name], release.path.name, release.spans[name])
            self.w.flush()
        except BaseException:
            self.abort()
            raise
        self.seconds = time.monotonic() - t

    def abort(self) -> None:
        self.w.abort()
        self.dst.close()
        self.src.close()

    def finish(self, replace: dict[str, bytes], add: dict[str, bytes], remove: set[str], identity: dict,
               build_tag: str, version: str | None = None) -> dict:
        """Write the rest and close; return {"members", "copied", "written", "dist_info"}. See overlay()."""
        try:
            return self._finish(replace, add, remove, identity, build_tag, version)
        finally:
            self.abort()

    def _finish(self, replace: dict[str, bytes], add: dict[str, bytes], remove: set[str], identity: dict,
                build_tag: str, version: str | None) -> dict:
        release, w, upstream = self.release.check(), self.w, self.release.path
        members, by_name, info, record, present = (release.members, release.by_name, release.info, release.record,
                                                   release.present)
        record_name, wheel_name, meta_name = f"{info}/RECORD", f"{info}/WHEEL", f"{info}/METADATA"
        for name in add:
            if name in by_name:
                raise WheelError(f"{upstream.name}: {name} is added by the series but already in the wheel")
        new: dict[str, bytes] = {**replace, **add}
        generated = {wheel_name, f"{info}/{IDENTITY_FILE}"} | (
            {meta_name} if version is not None and meta_name in by_name else set())
        names = (present | set(new) | generated) - remove
        final_info, moved = info, {}
        if version is not None:  # the dist-info directory is named after the version: every member moves
            final_info = f"{info[:-len('.dist-info')].rsplit('-', 1)[0]}-{version}.dist-info"
            moved = {n: final_info + n[len(info):] for n in names if n.startswith(info + "/")}
            names = (names - set(moved)) | set(moved.values())
        final_record = f"{final_info}/RECORD"
        order = sorted(names, key=lambda n: wheel_sort_key(n, final_info)) + [final_record]
        done = len(self.prefix)
        if order[:done] != self.prefix:  # the series changed a path before the first one it was said to change
            raise KvforgeError(f"{upstream.name}: the overlay's first {done} members are not the wheel's; a "
                               "kvforge bug", EXIT_INTERNAL)
        stamp = max(date_time_of(m) for m in members)
        new[wheel_name] = _wheel_text(release.texts[wheel_name].decode("utf-8"), build_tag)
        new[f"{info}/{IDENTITY_FILE}"] = (json.dumps(identity, indent=2, sort_keys=True) + "\n").encode()
        if version is not None and meta_name in generated:
            new[meta_name] = _metadata_text(release.texts[meta_name].decode("utf-8"), version)
        source = {new_name: old_name for old_name, new_name in moved.items()}
        for old_name, new_name in moved.items():
            new[new_name] = new.pop(old_name) if old_name in new else release.texts[old_name]
        rows = []
        for name in order[:-1]:
            if name in new:
                rows.append((name, record_hash(new[name]), str(len(new[name]))))
            else:
                rows.append((name, *record[source.get(name, name)]))
        rows.append((final_record, "", ""))
        new[final_record] = format_record(rows)
        copied, written = done, 0
        for name in order[done:]:
            if name in new:
                old = source.get(name, name)
                w.add(name, new[name], stamp, (by_name[old].mode & 0o7777 if old in by_name else 0o644) or 0o644)
                written += 1
            else:
                w.copy(self.src, by_name[name], upstream.name, release.spans[name])
                copied += 1
        w.close()
        self.dst.flush()
        return {"members": len(order), "copied": copied, "written": written, "dist_info": final_info}


def overlay(upstream: Path, out_path: Path, replace: dict[str, bytes], add: dict[str, bytes], remove: set[str],
            identity: dict, build_tag: str, members: list[Member] | None = None, version: str | None = None,
            release: ReleaseWheel | None = None) -> dict:
    """Write the new wheel to `out_path`; return {"members", "copied", "written"}. With `version`, the
    dist-info says that version (its directory renamed, METADATA's Version:), the package files are unchanged.
    `release`: upstream's ReleaseWheel, when the caller has read it. Members in wheel order: package files by
    name, then the dist-info, RECORD last; unchanged ones copied as stored, new ones STORED."""
    release = release or ReleaseWheel.read(upstream, members)
    return Overlay(release, out_path, set(replace) | set(add) | set(remove)).finish(
        replace, add, remove, identity, build_tag, version)


def identity_record(ctx: Context, stack: Stack, upstream_pin: WheelPin | None, changes: list[Change], build_tag: str,
                    version: str | None = None, device: str = "") -> dict:
    """<dist-info>/kvforge.json: what the wheel was built from (target, base, series, the release wheel or, for
    --device, the device) and the files the series replaced, added and removed."""
    pats = stack.series.patches
    ident = {
        "schema": 1,
        "recipe": RECIPE,
        "target": ctx.target.name,
        "component": ctx.component.name,
        "version": ctx.component.release.version,
        "local_version": version or local_version(ctx.component.release.version, ctx.target.name, stack.digest),
        "build_tag": build_tag,
        "base": {"ref": stack.base.ref, "commit": stack.base.commit, "source": stack.base.source},
        "series": {"digest": stack.digest, "origin": "series" if stack.origin == "series" else "commits",
                   "patches": [{"name": p.name, "fix_id": p.fix_id, "kind": p.kind,
                                "upstream_status": p.upstream_status, "sha256": p.sha256} for p in pats]},
        "fix_ids": [p.fix_id for p in pats],
        "upstream_wheel": {"filename": upstream_pin.filename, "sha256": upstream_pin.sha256} if upstream_pin else None,
        "files": {a: [c.path for c in changes if c.action == a] for a in ("replace", "add", "remove")},
    }
    if device:  # built from the patched tree by the package's own build, not overlaid on a release wheel
        ident["device"] = device
    return ident
