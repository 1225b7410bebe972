"""`kvforge port FIX --to TARGET`: start a variant of one fix for another target, from an existing variant.

The target's patched tree (its base plus its series, made exactly as `kvforge apply --into` makes it:
a standalone repository of the user's, branch kvforge/<target>) gets the source variant applied
three-way on top (`git am -3`; the preimage blobs are read from the source base's cached
repository and copied in, so the tree never depends on the cache). The commit message, so the
whole header, is carried over and the Fix-Id kept. A clean apply leaves one new commit; a conflict
leaves `git am` stopped with conflict markers for the user to resolve (`git am --continue`). Then
`kvforge verify -t TARGET --from DIR` and `kvforge export -t TARGET --from DIR` add it.

Nothing in patches/ or targets/ is written here; the user's tree appears whole or not at all (the
apply step is apply.py's transaction).
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvforge.git import gitutil
from kvforge.flow.apply import apply_target
from kvforge.flow.behaviour import copy_preimages
from kvforge.git.context import Context
from kvforge.git.engine import am_in_progress, am_one, diagnose
from kvforge.core.errors import EXIT_APPLY, EXIT_USAGE, KvforgeError
from kvforge.flow.rebase.steps import drop_depends_on
from kvforge.project.series import Patch, read_series
from kvforge.project.targets import Target, display_path, known_targets, load_target
from kvforge.git.trees import open_stack


@dataclass
class PortResult:
    """An Outcome (kvforge.core.outcome): exit code 3 when the variant conflicts (the tree is left at the conflict)."""

    fix_id: str
    source_target: str
    source_patch: str
    target: str
    tree: str
    branch: str
    status: str  # applied | applied (3-way) | conflict | in base
    commit: str | None = None
    detail: str = ""
    conflicts: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    next_steps: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return EXIT_APPLY if self.status == "conflict" else 0

    @property
    def error(self) -> str | None:
        if self.status != "conflict":
            return None
        return f"{self.source_patch} conflicts on {self.target}: {self.detail}; resolve it in {self.tree}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def render(self) -> str:
        out = [f"{self.fix_id}: {self.source_patch} from {self.source_target} onto {self.target}: {self.status}"
               + (f" ({self.detail})" if self.detail else ""),
               f"tree: {self.tree} (branch {self.branch})"]
        if self.conflicts:
            out.append("conflicts: " + ", ".join(self.conflicts))
        out += [f"note: {note}" for note in self.notes]
        out += [f"  next: {step}" for step in self.next_steps]
        return "\n".join(out)


def find_variant(fix_id: str, to: Target, component: str, from_target: str | None) -> tuple[str, Patch]:
    """The variant to start from: --from-target's, else the newest other target that carries the fix, in a
    series of the same component (a vllm-ascend fix is no variant of a vLLM one: bad input, exit 2)."""
    names = [from_target] if from_target else [n for n in reversed(known_targets()) if n != to.name]
    elsewhere: list[tuple[str, str, Path]] = []  # (target, component, patch) carrying it in another component
    for name in names:
        t = load_target(name)
        for comp in t.components:
            for p in read_series(comp.series_dir).patches:
                if p.fix_id != fix_id:
                    continue
                if comp.name == component:
                    return name, p
                elsewhere.append((name, comp.name, p.path))
    if elsewhere:
        name, other, path = elsewhere[0]
        has = other in {c.name for c in to.components}
        hint = f"port it with --component {other}" if has else f"{to.name} has no {other} component"
        raise KvforgeError(f"{fix_id} is a {other} fix ({name}'s {other} series: {display_path(path)}), not a "
                           f"{component} one: a fix is ported between series of one component, and this port is "
                           f"onto {to.name} ({component}); {hint}", EXIT_USAGE)
    where = f"target {from_target}" if from_target else "no other target"
    raise KvforgeError(f"{where} carries a patch with Fix-Id {fix_id!r}", EXIT_USAGE)


def port(ctx: Context, fix_id: str, from_target: str | None = None, into: Path | None = None) -> PortResult:
    if not re.match(r"^[a-z0-9][a-z0-9-]*$", fix_id):
        raise KvforgeError(f"{fix_id!r} is not a Fix-Id", EXIT_USAGE)
    if from_target == ctx.target.name:
        raise KvforgeError("--from-target names the target being ported to", EXIT_USAGE)
    series = ctx.series()
    if fix_id in series.by_fix_id():
        raise KvforgeError(f"{ctx.label} already carries {fix_id} ({series.by_fix_id()[fix_id].name}); edit it in a "
                           f"tree of `kvforge apply -t {ctx.target.name} --into DIR`", EXIT_USAGE)
    if fix_id in {e.fix_id for e in ctx.component.in_base}:
        raise KvforgeError(f"{ctx.target.path}: {ctx.label} has {fix_id} in its base (in_base); nothing to port",
                           EXIT_USAGE)
    source_name, patch = find_variant(fix_id, ctx.target, ctx.component.name, from_target)
    source_target = load_target(source_name)
    source_comp = source_target.component(ctx.component.name)
    dest = Path(into or Path.cwd() / f"{ctx.component.name}-{ctx.target.name}-{fix_id}").expanduser().absolute()
    if dest.exists() and any(dest.iterdir()):
        raise KvforgeError(f"{dest} exists and is not empty; port into a new directory (--into DIR)", EXIT_USAGE)
    ctx.say(f"porting {patch.name} from {source_name} to {ctx.label}")
    made = apply_target(ctx, into=dest)  # base + the target's series, transactional
    head = made.head
    # The source variant's preimage blobs live in its base's repository (the cache): copied in for the
    # three-way fallback.
    # A patch's preimages are the files as the patches before it left them: they exist in the source
    # target's stack (kvforge.git.trees), built here if the cache does not have it yet.
    source_ctx = Context(ctx.cache, source_target, source_comp, progress=ctx.progress)
    source_stack = open_stack(source_ctx)
    n = copy_preimages(patch, source_stack.base.repo, dest)
    ctx.say(f"copied {n} preimage blob{'s' if n != 1 else ''} of {patch.name} from {source_name}'s base")
    # Depends-On must name an earlier patch of the series (lint): a dependency the target has in its
    # base is satisfied there, so that line goes; one it lacks stays, and is reported.
    in_base = {e.fix_id for e in ctx.component.in_base}
    carried = set(series.by_fix_id())
    with tempfile.TemporaryDirectory(prefix="kvforge-port-") as tmp:
        copy = Path(tmp) / patch.name
        copy.write_bytes(patch.raw)
        dropped = drop_depends_on(copy, in_base)
        how, commit, out = am_one(dest, copy, head)
    missing = [d for d in patch.depends_on if d not in in_base and d not in carried]
    result = PortResult(fix_id, source_name, patch.name, ctx.target.name, str(dest), made.branch, "applied")
    result.notes += [f"Depends-On: {d} removed: {ctx.label} has it in its base (in_base)" for d in dropped]
    result.notes += [f"Depends-On: {d}: {ctx.label} neither carries nor has it in base; port it first" for d in missing]
    t = ctx.target.name
    if how == "no change":
        result.status, result.detail = "in base", "applying it changes nothing: the target already has this change"
        return result
    if how != "conflict":
        result.commit = commit
        result.status = how
        result.next_steps = [f"kvforge verify -t {t} --from {dest}", f"kvforge export -t {t} --from {dest}"]
        return result
    if not am_in_progress(dest):
        raise KvforgeError(f"{patch.name}: git am failed in {dest}: {diagnose(dest, patch, out)}", EXIT_USAGE)
    result.status = "conflict"
    result.detail = diagnose(dest, patch, out)
    result.conflicts = gitutil.run(dest, "diff", "--name-only", "--diff-filter=U", check=False).stdout.split()
    result.next_steps = [f"resolve the conflicts in {dest} against {t}'s own API, `git add` the files",
                         f"git -C {dest} am --continue   (the commit keeps the header and Fix-Id {fix_id})",
                         f"kvforge verify -t {t} --from {dest}", f"kvforge export -t {t} --from {dest}"]
    return result


def render(result: PortResult, echo: Callable[[str], Any]) -> None:
    """The text of `result`, through `echo` (the CLI's; PortResult.render is the same text)."""
    echo(result.render())
