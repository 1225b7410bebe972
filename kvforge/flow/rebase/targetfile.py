"""Target files: the one a rebase writes (a text edit of the old one, every comment kept) and a whole new
one (`render_target`, kvforge target add and `rebase --as`); both checked by the target parser before they
are ever written. A component's selections checked against its new base (`check_selections`) are here too;
rescanning the CPU selection (kvforge.proof.selection's static scan, target add's) is kvforge.flow.rebase.retarget's,
so that a rebase imports nothing that proves or runs tests."""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from kvforge.git import gitutil
from kvforge.wheels.choose import choose_wheels
from kvforge.git.context import Context
from kvforge.core.errors import KvforgeError
from kvforge.project.targets import Component, Release, Target, WheelPin, parse_target
from kvforge.flow.rebase.state import Plan, State

HEADER_RE = re.compile(r"^\s*(\[\[?)\s*([A-Za-z0-9_.-]+)\s*\]\]?\s*(#.*)?$")
STRING_RE = re.compile(r'^(\s*)([A-Za-z0-9_-]+)(\s*=\s*)"((?:[^"\\]|\\.)*)"(.*)$')
SELECTOR_RE = re.compile(r'^(\s*)("(?:[^"\\]|\\.)*"),?\s*(#.*)?$')  # one array element on its own line


def new_target_text(plan: Plan, ctx: Context, st: State | None = None) -> str:
    """The target file after the rebase. In place: a text edit of the old one that keeps every comment, the
    release's wheels re-pinned (`onto.new_wheels`). With --as: a whole new target file made by target add's code
    (`check_selections`, `render_target`): pins, selections checked against the new base (the CPU selection is not
    rescanned: `kvforge test --scan --try` does it), `lifecycle = "maintained"`."""
    notes = st.notes if st is not None else []
    wheels = new_wheels(ctx.component.release.package, plan.onto_version, notes)
    if plan.new_target != plan.target:
        return _as_target_text(plan, ctx, st, wheels, notes)
    comp_index = [c.name for c in ctx.target.components].index(plan.component)
    text = plan.old_target_file.read_text(encoding="utf-8")
    out = retarget_text(
        text, comp_index, ref=plan.onto_ref, version=plan.onto_version, sha256=plan.sha256,
        wheel=plan.wheel, old_version=ctx.component.release.version,
        wheels=[(w.filename, w.sha256) for w in wheels] if wheels else None)
    have = tree_paths(plan.repo, plan.new_base)
    missing = sorted({s for sel in ctx.component.tests.values() for s in sel
                      if s.split("::", 1)[0].rstrip("/") not in have})
    if missing:
        out = comment_out_selectors(out, comp_index, missing, plan.onto_ref)
        notes.append(f"tests: dropped (not in {plan.onto_ref}; left as comments in the target file): "
                     f"{', '.join(missing)}")
    with tempfile.TemporaryDirectory(prefix="kvforge-rebase-") as d:
        probe = Path(d) / f"{plan.new_target}.toml"
        probe.write_text(out, encoding="utf-8")
        parse_target(probe, plan.root)  # a target file kvforge would refuse is never written
    return out


def _as_target_text(plan: Plan, ctx: Context, st: State | None, wheels: tuple[WheelPin, ...] | None,
                    notes: list[str]) -> str:
    """`rebase --as NEW` of a one-component target: the complete new target file (see new_target_text)."""
    comp = ctx.component
    if plan.onto_version is not None:
        release = Release(comp.release.package, plan.onto_version, plan.sha256)
        pins = wheels if wheels is not None else ((WheelPin(*plan.wheel),) if plan.wheel else ())
    else:  # a git ref: the offline source stays the old release (resolve_onto said so)
        release, pins = comp.release, comp.wheels
    new = replace(comp, ref=plan.onto_ref, release=release, wheels=pins, series_dir=plan.series_dir)
    new, report = check_selections(new, plan.repo, plan.new_base)
    for plat, r in report.items():
        if r.get("dropped"):
            notes.append(f"tests {plat}: dropped (not in {plan.onto_ref}): {', '.join(r['dropped'])}")
    notes.append(f"the CPU selection is not rescanned here: `kvforge test -t {plan.new_target} --scan --try` does it "
                 "(kvforge target add does it as it writes the target)")
    description = _replace_outside(ctx.target.description, comp.release.version, release.version, [])
    target = Target(plan.new_target, description, plan.target_file, (new,), "maintained")
    header = [f"Made by `kvforge rebase -t {plan.target} --onto {plan.onto} --as {plan.new_target}` ({plan.started}):",
              "the release pinned from the package index, the series rebased, the selections checked against the",
              "new base (kvforge target add's code)." if plan.onto_version is not None else
              f"the series rebased onto the git ref {plan.onto_ref}, the selections checked against it; the offline "
              f"source stays {release.package} {release.version} (not a release: edit it by hand if it should move)."]
    return render_target(target, plan.root, header,
                         {comp.name: selection_comments(new, report, plan.target, plan.new_target, None)})


def new_wheels(package: str, version: str | None, notes: list[str]) -> tuple[WheelPin, ...] | None:
    """The release wheels of `package`==`version` per architecture (kvforge.wheels.choose.choose_wheels), or None when
    they cannot be known (no release version, offline, the index unreachable: said in `notes`)."""
    if version is None:
        return None
    if os.environ.get("KVFORGE_OFFLINE"):
        notes.append(f"offline: the release wheels of {package} {version} are not pinned (only what --onto found)")
        return None
    try:
        return tuple(pin for _arch, pin in sorted(choose_wheels(package, version).items()))
    except KvforgeError as exc:
        notes.append(f"the release wheels of {package} {version} are not pinned: {exc}")
        return None


# ---------------------------------------------------------------- a component's selections on its new base


def tree_paths(repo: Path, commit: str) -> set[str]:
    """Every file and directory under tests/ of `commit` (one git process)."""
    out = gitutil.run(repo, "ls-tree", "-r", "-t", "--name-only", commit, "--", "tests").stdout
    return set(out.splitlines())


def check_selections(new: Component, repo: Path, new_base: str) -> tuple[Component, dict[str, dict[str, Any]]]:
    """`new` with every selector whose path `new_base` does not have dropped. Returns (the component, per
    platform {"kept", "dropped"})."""
    have = tree_paths(repo, new_base)
    tests: dict[str, tuple[str, ...]] = {}
    report: dict[str, dict[str, Any]] = {}
    for plat, sel in new.tests.items():
        kept = [s for s in sel if s.split("::", 1)[0].rstrip("/") in have]
        tests[plat] = tuple(kept)
        report[plat] = {"kept": kept, "dropped": [s for s in sel if s not in kept]}
    return replace(new, tests=tests), report


def selection_comments(comp: Component, report: Mapping[str, Mapping[str, Any]], from_target: str, name: str,
                       built_from: tuple[str, str] | None) -> dict[str, list[str]]:
    """The comments render_target puts above a completed component's sections (what check_selections and the
    rescan did); `built_from`: (the upstream commit, the package whose _version.py names it), when known."""
    out: dict[str, list[str]] = {
        "release": ["The PyPI sdist, pinned by the sha256 the package index lists"
                    + (f"; built from upstream commit {built_from[0]} (its {built_from[1]}/_version.py)."
                       if built_from else ".")],
        "wheels": ["The release wheels `kvforge build` overlays, one per architecture (the first upload on the",
                   "package index, built from the sdist's commit), pinned by sha256."]}
    for plat, r in report.items():
        lines = [f"From {from_target}, kept where the path exists in {comp.release.version}."]
        if r.get("dropped"):
            lines.append(f"Dropped (not in {comp.release.version}): {', '.join(r['dropped'])}.")
        if r.get("added"):
            lines.append("Rescanned and tried on CPU (--try): new in this release, reached by the series, runs on CPU "
                         "(added at the end):")
            lines += [f"  {m}" for m in r["added"]]
        if r.get("unlisted"):
            tried = {t["module"]: t for t in r.get("tried", [])}
            lines.append("Rescanned: also reached by the series, new in this release, " + (
                "tried on CPU, does not run there:" if tried else
                f"not tried on CPU (`kvforge test -t {name} --scan --try`):"))
            lines += [f"  {m}" + (f": {tried[m]['why'][:80]}" if m in tried and tried[m].get("why") else "")
                      for m in r["unlisted"]]
        elif "scan" in r and not r.get("added"):
            lines.append("Rescanned on the new base: nothing new the series reaches is left out.")
        out[plat] = lines
    if comp.requires:
        out["component"] = [f"{comp.release.package} {comp.release.version} (its branch {comp.ref}), built on "
                            f"{comp.requires} of this target."]
    return out


def comment_out_selectors(text: str, comp_index: int, missing: Sequence[str], ref: str) -> str:
    """The target file with each selector line of component `comp_index`'s [components.tests] that names one of
    `missing` (one quoted path per line, as kvforge writes them) turned into a comment saying why; every other
    line as it was."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    section, comp = "", -1
    for line in lines:
        h = HEADER_RE.match(line.rstrip("\n"))
        if h:
            section = h.group(2)
            comp += section == "components" and h.group(1) == "[["
        m = SELECTOR_RE.match(line)
        if m and comp == comp_index and section == "components.tests" and json.loads(m.group(2)) in missing:
            line = f"{m.group(1)}# not in {ref} (kvforge rebase dropped it): {m.group(2)}\n"
        out.append(line)
    return "".join(out)


def retarget_text(text: str, comp_index: int, *, ref: str, version: str | None, sha256: str | None,
                  wheel: tuple[str, str] | None, old_version: str, name: str | None = None,
                  series: str | None = None, wheels: Sequence[tuple[str, str]] | None = None) -> str:
    """Edit a target file's text: component `comp_index` moves to `ref` (and release `version`/`sha256`;
    when the version changes, every [components.wheel] and [[components.wheels]] of the component (the old
    release's files) is replaced by one [[components.wheels]] per pin of `wheels` (or the single `wheel`), after
    its release table, or removed when neither is known), optionally renamed (`name`, `series`). Comments stay;
    the description's old version becomes the new one."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    section, comp = "", -1
    dropping = False
    release_has_sha = False
    new_version = version if version is not None and version != old_version else None
    version_changes = new_version is not None
    pins = wheels if wheels is not None else ([wheel] if wheel else None)

    def put(line: str, key: str, value: str) -> str:
        m = STRING_RE.match(line.rstrip("\n"))
        return f"{m.group(1)}{key}{m.group(3)}{json.dumps(value)}{m.group(5)}\n" if m else line

    other_refs = _other_refs(lines, comp_index)  # kept as they are in the description (their ref stays)
    for line in lines:
        h = HEADER_RE.match(line.rstrip("\n"))
        if h:
            if section == "components.release" and comp == comp_index and version_changes:
                if sha256 and not release_has_sha:
                    out.append(f"sha256 = {json.dumps(sha256)}\n")
                out.extend(_wheel_tables(pins, out))
            section = h.group(2)
            if section == "components" and h.group(1) == "[[":
                comp += 1
            dropping = comp == comp_index and version_changes and section in ("components.wheel", "components.wheels")
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
        out.append(line)
    if section == "components.release" and comp == comp_index and version_changes:
        if sha256 and not release_has_sha:
            out.append(f"sha256 = {json.dumps(sha256)}\n")
        out.extend(_wheel_tables(pins, out))
    result = "".join(out)
    while result.endswith("\n\n"):
        result = result[:-1]
    return result


def _wheel_tables(wheels: Sequence[tuple[str, str]] | None, before: list[str]) -> list[str]:
    """[[components.wheels]] tables for `wheels` (a blank line between them and what comes before and after)."""
    if not wheels:
        return []
    lines = [] if before and before[-1].strip() == "" else ["\n"]
    for filename, sha in wheels:
        lines += ["[[components.wheels]]\n", f"filename = {json.dumps(filename)}\n", f"sha256 = {json.dumps(sha)}\n",
                  "\n"]
    return lines


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
        if c.requirements:
            out.append(f"requirements = [{', '.join(q(r) for r in c.requirements)}]")
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
