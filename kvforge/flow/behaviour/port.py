"""A port, proven: the nearest variant of a fix `git am -3` onto a new base (the release with the patches carried
before it), its Bug-Checks failing without it and all its Checks passing with it; else where it stops. Cached
as kvforge.flow.behaviour.checks caches its runs (kind "port")."""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvforge.core.errors import KvforgeError
from kvforge.flow.behaviour.checks import (BUDGET, Budget, remove_tree, release_env, pytest_run, results_dir, scratch_tree,
                                           cached_run, env_fingerprint, failure_kind, result_key)
from kvforge.flow.upstream import NewBase
from kvforge.git import gitutil
from kvforge.git.engine import am_one, diagnose
from kvforge.project.series import Patch

INDEX_RE = re.compile(rb"^index ([0-9a-f]{40,64})\.\.[0-9a-f]{40,64}", re.M)


def copy_preimages(patch: Patch, source: Path, dest: Path) -> int:
    """Copy the blobs the patch was made against (its full-index preimages) from the bare repository `source`
    into the repository of the worktree `dest`, so `git am -3` can merge. Returns how many."""
    wanted = [m.group(1).decode() for m in INDEX_RE.finditer(patch.raw) if set(m.group(1)) != {ord("0")}]
    copied = 0
    for blob in dict.fromkeys(wanted):
        if gitutil.run(dest, "cat-file", "-e", blob, check=False).returncode == 0:
            continue
        data = gitutil.run(source.parent, "cat-file", "blob", blob, check=False, binary=True,
                           env={"GIT_DIR": str(source)})
        if data.returncode != 0:
            continue  # not there either: git am says which preimage it lacks
        gitutil.run(dest, "hash-object", "-w", "--stdin", stdin=data.stdout)
        copied += 1
    return copied


@dataclass(frozen=True)
class Variant:
    """A variant of a fix to port from: the target whose series carries it, its release, and the patch."""

    target: str
    release: str
    patch: Patch
    base_repo: Path | None  # the bare repository its preimages are in (None: not imported yet)


@dataclass
class Port:
    state: str  # "port proven" | "needs a person"
    detail: str
    source: str | None = None  # the variant's target
    patch_file: str | None = None  # the ported patch, ready (port proven)
    conflict: dict[str, Any] = field(default_factory=dict)  # file, hunk, the release's change of that region
    final: bool = True  # kept in the cache (False: no budget or no environment left it undecided)


def port(ctx_like, nb: NewBase, old_commit: str | None, variants: list[Variant], budget: Budget,
         release: str | None = None) -> Port:
    """Try each variant, nearest first: `git am -3` onto nb, then its Checks without it (at least one must fail
    for a behavioural reason) and with it (all must pass): "port proven". The first variant that applies
    decides; when none applies, the nearest one's conflict is reported, with the change of that region between
    `old_commit` and `release` (the release itself when nb.commit is the release with earlier patches on it;
    default nb.commit)."""
    if not variants:
        return Port("needs a person", "no variant of the fix to port from")
    first_conflict: Port | None = None
    for v in variants:
        path = results_dir(ctx_like.cache) / f"{result_key('port', nb, v.patch.sha256, env_fingerprint(ctx_like, nb))}.json"
        got = _load_port(path)
        if got is None:
            got = _try(ctx_like, nb, old_commit, v, path.with_suffix(""), budget, release or nb.commit)
            if got.final:
                _save_port(path, got)
        if not got.conflict:
            return got
        first_conflict = first_conflict or got
    assert first_conflict is not None
    return first_conflict


def _load_port(path: Path) -> Port | None:
    try:
        return Port(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None


def _save_port(path: Path, got: Port) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(got), indent=1), encoding="utf-8")
    os.replace(tmp, path)


def _try(ctx_like, nb: NewBase, old_commit: str | None, v: Variant, keep: Path, budget: Budget,
         release: str) -> Port:
    tree = scratch_tree(ctx_like.cache)
    try:
        gitutil.run(tree.parent, "clone", "-q", "--shared", "--no-checkout", str(nb.repo), str(tree))
        gitutil.run(tree, "checkout", "-q", "--detach", nb.commit)
        if v.base_repo is not None:
            copy_preimages(v.patch, v.base_repo, tree)
        copy = tree.parent / f"{tree.name}.patch"
        copy.write_bytes(v.patch.raw)
        how, commit, out = am_one(tree, copy, nb.commit)
        if how == "no change":
            return Port("needs a person", f"{v.target}'s variant changes nothing on the release", v.target)
        if how == "conflict":
            detail = diagnose(tree, v.patch, out)
            conflict = _region(nb, release, old_commit, v.patch, detail)
            moved = f"; the release's change there since the old base: {conflict['upstream']}" \
                if conflict.get("upstream") else ""
            return Port("needs a person", f"{v.target}'s variant does not apply: {detail}{moved}", v.target,
                        conflict=conflict)
        before = cached_run(ctx_like, nb, v.patch, budget)
        if before is None:
            return Port("needs a person", f"{v.target}'s variant applies ({how}); {BUDGET} (--checks)", v.target,
                        final=False)
        if before.error:
            return Port("needs a person", f"{v.target}'s variant applies ({how}); its Checks cannot run on the "
                                          f"release: {before.error}", v.target, final=False)
        failing = [n for n, (o, m) in before.outcomes.items()
                   if n in v.patch.bug_checks and failure_kind(o, m) == "behaviour"]
        if not failing:
            return Port("needs a person", f"{v.target}'s variant applies ({how}) but none of its Checks that "
                                          "show the bug fails without it on the release: nothing proven",
                        v.target)
        if not budget.take():
            return Port("needs a person", f"{v.target}'s variant applies ({how}); {BUDGET} (--checks) for its "
                                          "Checks with it", v.target, final=False)
        try:
            env = release_env(ctx_like, nb)
        except KvforgeError as exc:
            return Port("needs a person", f"{v.target}'s variant applies ({how}) but there is no test "
                                          f"environment for the release: {exc}", v.target, final=False)
        try:
            run = pytest_run(env, tree, list(v.patch.checks), "release with the ported fix", commit or nb.commit, keep)
        except KvforgeError as exc:  # pytest cannot start with the port in (its conftest), or ran out of time
            return Port("needs a person", f"{v.target}'s variant applies ({how}) but its Checks cannot run with it: "
                                          f"{str(exc).replace(f'{tree}/', '').split('; log: ')[0]}", v.target)
        bad = [n for n, (o, _m) in run.outcomes.items() if o != "passed"]
        if not run.outcomes:
            return Port("needs a person", f"{v.target}'s variant applies ({how}) but has no Checks", v.target)
        if bad:
            n = bad[0]
            return Port("needs a person", f"{v.target}'s variant applies ({how}) but {len(bad)} of "
                                          f"{len(run.outcomes)} Checks fail with it: {n}: "
                                          f"{run.outcomes[n][1][:160]} (evidence: {run.log})", v.target)
        ready = keep.with_suffix(".patch")
        made = gitutil.run(tree, "format-patch", "-1", "--stdout", "--full-index", "--no-signature", "HEAD",
                           binary=True)
        ready.write_bytes(made.stdout)
        bug = v.patch.bug_checks
        shown = (f"{len(failing)} of its {len(run.outcomes)} Checks fail without it, all pass with it"
                 if len(bug) == len(v.patch.checks) else
                 f"{len(failing)} of its {len(bug)} Bug-Checks fail without it, all {len(run.outcomes)} Checks "
                 "pass with it")
        return Port("port proven", f"{v.target}'s variant applies ({how}); {shown} "
                                   f"(evidence: {run.log})", v.target, str(ready))
    finally:
        remove_tree(tree)
        with contextlib.suppress(OSError):
            (tree.parent / f"{tree.name}.patch").unlink()


def _region(nb: NewBase, release: str, old_commit: str | None, patch: Patch, detail: str) -> dict[str, Any]:
    """The conflicting file and hunk (from `detail`, git am's diagnosis), and the release's diff of that file
    since the old base: its hunks near the patch's hunk, and the command that shows them."""
    m = re.search(r"hunk (\d+) of (\S+) does not apply at line (\d+)", detail)
    files = re.findall(r"3-way merge conflict in (.+)$", detail)
    path = m.group(2) if m else (files[0].split(", ")[0] if files else None)
    out: dict[str, Any] = {"file": path, "hunk": int(m.group(1)) if m else None,
                           "line": int(m.group(3)) if m else None, "upstream": ""}
    if not path or not old_commit:
        return out
    res = gitutil.run(nb.repo.parent, "diff", "-U0", old_commit, release, "--", path, check=False,
                      env={"GIT_DIR": str(nb.repo)})
    heads = re.findall(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", res.stdout, re.M)
    near = heads
    if out["line"]:
        line = out["line"]
        near = [h for h in heads if int(h[0]) - 40 <= line <= int(h[0]) + int(h[1] or 1) + 40] or heads
    if not heads:
        out["upstream"] = f"{path} unchanged between the bases" if res.returncode == 0 else ""
        return out
    shown = ", ".join(f"-{h[0]},{h[1] or 1} +{h[2]},{h[3] or 1}" for h in near[:3])
    out["upstream"] = (f"{len(heads)} hunk{'s' if len(heads) != 1 else ''} in {path} "
                       f"({'near it: ' if near is not heads else ''}{shown}); "
                       f"git diff {old_commit[:12]} {release[:12]} -- {path}")
    return out
