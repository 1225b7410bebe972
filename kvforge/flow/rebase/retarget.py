"""A component completed on its new base, for kvforge target add: its selections checked against the new base
(kvforge.flow.rebase.targetfile) and its CPU selection rescanned with kvforge test --scan's static scan
(kvforge.proof.selection). The target files themselves are kvforge.flow.rebase.targetfile's (named here too for
target add); a rebase imports that module, never this one."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from kvforge.git import gitutil
from kvforge.proof.selection import GitSource, Hit, covered, package_of, scan, touched_modules
from kvforge.project.targets import Component
from kvforge.flow.rebase import targetfile
from kvforge.flow.rebase.targetfile import check_selections, comment_out_selectors, render_target, retarget_text

__all__ = ["comment_out_selectors", "complete_component", "render_target", "rescan", "retarget_text",
           "selection_comments"]


def rescan(repo: Path, base: str, head: str, comp: Component) -> list[Hit]:
    """kvforge test --scan's static scan: the test modules of `base` that import a module base..head touches."""
    paths = gitutil.run(repo, "diff", "--name-only", base, head).stdout.split()
    return scan(GitSource(repo, base), touched_modules(paths, package_of(comp)))


def complete_component(new: Component, old: Component, repo: Path, new_base: str, head: str, old_base: str,
                       old_head: str, rescan_cpu: bool = True) -> tuple[Component, dict[str, dict[str, Any]]]:
    """`new` with its selections checked against `new_base` (a selector whose path the release does not have is
    dropped: targetfile.check_selections); for a component tested on its own tree the CPU selection is rescanned
    (the static scan of `kvforge test --scan`, new base with the rebased series new_base..head): the modules it
    finds that the selection does not cover and that the old release's scan did not already find (those the old
    target judged not to run on CPU) are reported as `unlisted`, not added: whether they run on CPU is
    `--scan --try`'s to say. The rescan reads every test module of both releases (seconds): `rescan_cpu=False`
    skips it. Returns (the component, per platform {"kept", "dropped"[, "scan", "judged_before", "unlisted"]})."""
    checked, report = check_selections(new, repo, new_base)
    if rescan_cpu and "cpu" in new.tests and not new.requires:
        hits = rescan(repo, new_base, head, new)
        judged = {h.module for h in rescan(repo, old_base, old_head, old)
                  if not covered(h.module, old.tests.get("cpu", ()))}
        report["cpu"]["scan"] = [h.to_json() for h in hits]
        report["cpu"]["judged_before"] = sorted(judged)
        report["cpu"]["unlisted"] = [h.module for h in hits
                                     if not covered(h.module, checked.tests["cpu"]) and h.module not in judged]
    return checked, report


def selection_comments(comp: Component, report: Mapping[str, Mapping[str, Any]], from_target: str, name: str,
                       upstream_commit: str | None) -> dict[str, list[str]]:
    """The comments render_target puts above a completed component's sections (targetfile.selection_comments,
    the release built from `upstream_commit` per the component's package's _version.py)."""
    built_from = (upstream_commit, package_of(comp)) if upstream_commit else None
    return targetfile.selection_comments(comp, report, from_target, name, built_from)
