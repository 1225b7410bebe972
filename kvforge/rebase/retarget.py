"""Target files: the one a rebase writes (a text edit of the old one, every comment kept) and a whole new
one (`render_target`, kvforge target add and `rebase --as`); both checked by the target parser before they
are ever written."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

from ..context import Context
from ..targets import Target, parse_target
from .state import Plan

HEADER_RE = re.compile(r"^\s*(\[\[?)\s*([A-Za-z0-9_.-]+)\s*\]\]?\s*(#.*)?$")
STRING_RE = re.compile(r'^(\s*)([A-Za-z0-9_-]+)(\s*=\s*)"((?:[^"\\]|\\.)*)"(.*)$')


def new_target_text(plan: Plan, ctx: Context) -> str:
    """The target file after the rebase: a text edit of the old one that keeps every comment."""
    comp_index = [c.name for c in ctx.target.components].index(plan.component)
    text = plan.old_target_file.read_text(encoding="utf-8")
    as_new = plan.new_target != plan.target
    out = retarget_text(
        text, comp_index, ref=plan.onto_ref, version=plan.onto_version, sha256=plan.sha256,
        wheel=plan.wheel, old_version=ctx.component.release.version,
        name=plan.new_target if as_new else None,
        series=os.path.relpath(plan.series_dir, plan.root) if as_new else None)
    with tempfile.TemporaryDirectory(prefix="kvforge-rebase-") as d:
        probe = Path(d) / f"{plan.new_target}.toml"
        probe.write_text(out, encoding="utf-8")
        parse_target(probe, plan.root)  # a target file kvforge would refuse is never written
    return out


def retarget_text(text: str, comp_index: int, *, ref: str, version: str | None, sha256: str | None,
                  wheel: tuple[str, str] | None, old_version: str, name: str | None = None,
                  series: str | None = None) -> str:
    """Edit a target file's text: component `comp_index` moves to `ref` (and release `version`/`sha256`;
    its wheel pin becomes `wheel` or is removed), optionally renamed (`name`, `series`). Comments stay;
    the description's old version becomes the new one."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    section, comp = "", -1
    dropping = False
    release_has_sha = False
    new_version = version if version is not None and version != old_version else None
    version_changes = new_version is not None

    def put(line: str, key: str, value: str) -> str:
        m = STRING_RE.match(line.rstrip("\n"))
        return f"{m.group(1)}{key}{m.group(3)}{json.dumps(value)}{m.group(5)}\n" if m else line

    other_refs = _other_refs(lines, comp_index)  # kept as they are in the description (their ref stays)
    for line in lines:
        h = HEADER_RE.match(line.rstrip("\n"))
        if h:
            if section == "components.release" and comp == comp_index and version_changes and sha256 \
                    and not release_has_sha:
                out.append(f"sha256 = {json.dumps(sha256)}\n")
            section = h.group(2)
            if section == "components" and h.group(1) == "[[":
                comp += 1
            dropping = section == "components.wheel" and comp == comp_index and version_changes and wheel is None
            if dropping:
                while out and out[-1].strip() == "" and len(out) > 1 and out[-2].strip() == "":
                    out.pop()
                continue
        elif dropping:
            continue
        m = STRING_RE.match(line.rstrip("\n"))
        key = m.group(2) if m else None
        if section == "" and key == "name" and name:
            line = put(line, "name", name)
        elif section == "" and key == "description" and new_version is not None and m is not None:
            line = put(line, "description", _replace_outside(m.group(4), old_version, new_version, other_refs))
        elif section == "components" and comp == comp_index and key == "ref":
            line = put(line, "ref", ref)
        elif section == "components" and comp == comp_index and key == "series" and series:
            line = put(line, "series", series)
        elif section == "components.release" and comp == comp_index and version_changes:
            if key == "version" and new_version is not None:
                line = put(line, "version", new_version)
            elif key == "sha256":
                release_has_sha = True
                if sha256:
                    line = put(line, "sha256", sha256)
                else:
                    continue
        elif section == "components.wheel" and comp == comp_index and version_changes and wheel:
            if line.lstrip().startswith("#"):
                continue  # comments about the old wheel
            if key == "filename":
                line = put(line, "filename", wheel[0])
            elif key == "sha256":
                line = put(line, "sha256", wheel[1])
        out.append(line)
    if section == "components.release" and comp == comp_index and version_changes and sha256 and not release_has_sha:
        out.append(f"sha256 = {json.dumps(sha256)}\n")
    result = "".join(out)
    while result.endswith("\n\n"):
        result = result[:-1]
    return result


def _other_refs(lines: list[str], comp_index: int) -> list[str]:
    """The `ref` of every component but `comp_index` (v0.20.2rc's "releases/v0.20.2rc" for vllm-ascend)."""
    refs, section, comp = [], "", -1
    for line in lines:
        h = HEADER_RE.match(line.rstrip("\n"))
        if h:
            section = h.group(2)
            comp += section == "components" and h.group(1) == "[["
            continue
        m = STRING_RE.match(line.rstrip("\n"))
        if m and section == "components" and comp != comp_index and m.group(2) == "ref" and m.group(4):
            refs.append(m.group(4))
    return refs


def _replace_outside(text: str, old: str, new: str, protected: list[str]) -> str:
    """`text` with `old` replaced by `new` except inside the `protected` strings."""
    if not protected:
        return text.replace(old, new)
    parts = re.split("(" + "|".join(re.escape(p) for p in sorted(protected, key=len, reverse=True)) + ")", text)
    return "".join(part if part in protected else part.replace(old, new) for part in parts)


# ---------------------------------------------------------------- a whole target file (kvforge target add)


def render_target(target: Target, root: Path, header: Sequence[str] = (),
                  comments: Mapping[str, Mapping[str, Sequence[str]]] | None = None) -> str:
    """A complete target file for `target` (every key parse_target reads; [[components.wheels]] per pinned
    wheel; `lifecycle`), with `header` comment lines on top and, per component, comment lines above a
    section ("component", "release", "wheels", "tests" and a platform name inside tests). Checked by
    parse_target before it is returned: a file kvforge would refuse is never produced."""
    notes = comments or {}

    def q(value: str) -> str:
        return json.dumps(value, ensure_ascii=False)

    def put_comments(comp: str, section: str, indent: str = "") -> list[str]:
        return [f"{indent}# {line}" if line else f"{indent}#" for line in notes.get(comp, {}).get(section, ())]

    out = [f"# {line}" if line else "#" for line in header]
    out += [f"name = {q(target.name)}", f"description = {q(target.description)}", f"lifecycle = {q(target.lifecycle)}"]
    for c in target.components:
        out += ["", "[[components]]", *put_comments(c.name, "component"), f"name = {q(c.name)}", f"repo = {q(c.repo)}",
                f"ref = {q(c.ref)}", f"series = {q(os.path.relpath(c.series_dir, root))}",
                f"platforms = [{', '.join(q(p) for p in c.platforms)}]"]
        if c.requires:
            out.append(f"requires = {q(c.requires)}")
        out += ["", "[components.release]", *put_comments(c.name, "release"), f"package = {q(c.release.package)}",
                f"version = {q(c.release.version)}"]
        if c.release.sha256:
            out.append(f"sha256 = {q(c.release.sha256)}")
        for k, w in enumerate(c.wheels):
            out += ["", "[[components.wheels]]", *(put_comments(c.name, "wheels") if k == 0 else []),
                    f"filename = {q(w.filename)}", f"sha256 = {q(w.sha256)}"]
        out += ["", "[components.tests]", *put_comments(c.name, "tests")]
        if c.standins:
            out.append(f"standins = [{', '.join(q(s) for s in c.standins)}]")
        for plat in c.platforms:
            sel = c.tests.get(plat)
            if sel is None:
                continue
            body = put_comments(c.name, plat, "    ") + [f"    {q(s)}," for s in sel]
            out += [f"{plat} = [", *body, "]"] if body else [f"{plat} = []"]
        for ib in c.in_base:
            out += ["", "[[components.in_base]]", f"fix_id = {q(ib.fix_id)}", f"reason = {q(ib.reason)}"]
    text = "\n".join(out) + "\n"
    with tempfile.TemporaryDirectory(prefix="kvforge-target-") as d:
        probe = Path(d) / f"{target.name}.toml"
        probe.write_text(text, encoding="utf-8")
        parse_target(probe, root)
    return text
