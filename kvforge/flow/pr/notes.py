"""`kvforge notes`: release notes for a patched build (base and series identity, one entry per fix,
its upstream status, evidence and Drop-When, the wheels built, what the base already contains).

Reads the same template data as a PR (kvforge.flow.pr.text) plus the build's own: the upstream
commit the base was released from and the wheels `kvforge build` verified for exactly this series
and base (their reports are read here, never written).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvforge.core.cache import Cache
from kvforge.flow.pr.conventions import UpstreamTemplate
from kvforge.flow.pr.evidence import EvidenceUsed, bench_data, gather, target_flag, verify_data
from kvforge.flow.pr.facts import depends_chain, diffstat, github_ref, upstream_status
from kvforge.flow.pr.sandbox import render_template
from kvforge.flow.pr.text import Text, common_data, home_repo, patch_data, tidy
from kvforge.git import gitutil
from kvforge.git.bases import Base
from kvforge.git.context import Context
from kvforge.git.trees import open_stack
from kvforge.project.targets import Component


def release_notes(ctx: Context, template: Path | None = None, allow_stale: bool = False) -> Text:
    """Release notes for ctx's patched build: identity, one entry per fix, evidence, what the base has."""

    stack = open_stack(ctx)
    target, key = ctx.target.name, stack.key
    repo = ""  # notes are read outside vLLM's repository: its issues and PRs are spelled owner/name#N
    data = common_data(ctx, stack, "notes", "notes", UpstreamTemplate("notes", "", "", ""))
    warnings: list[str] = []
    fixes = []
    for n, p in enumerate(stack.series.patches, 1):
        deps, missing = depends_chain(stack.series, p)
        fixes.append(patch_data(stack, n, repo, deps, missing, home_repo(ctx)))
    data["fixes"] = fixes
    used: list[EvidenceUsed] = []
    rec, state = gather(ctx, key, "verify", allow_stale, used, warnings)
    data["verify"] = verify_data(rec, state, target_flag(ctx), None)
    wanted = tuple(dict.fromkeys(s for f in fixes for s in f["bench_scenarios"]))
    brec, bstate = gather(ctx, key, "bench-prefix-cache", allow_stale, used, warnings)
    data["bench"] = bench_data(brec, bstate, target_flag(ctx), ())
    data["bench_by_scenario"] = {r["scenario"]: r for r in (data["bench"] or {}).get("rows", [])
                                 if r["scenario"] in wanted and r["label"] == r["scenario"]}
    authors: dict[str, list[str]] = {}
    for p in stack.series.patches:
        # A backport names the upstream change it carries (its upstream author is on that PR).
        status, detail = upstream_status(p.upstream_status)
        what = p.subject + (f" (backport of {github_ref(detail, '')})" if status == "Backport" and detail else "")
        authors.setdefault(re.sub(r"\s*<.*>$", "", p.author) or "unknown", []).append(what)
    data["shortlog"] = [{"author": a, "subjects": s} for a, s in authors.items()]
    data["base"]["upstream_commit"], data["base"]["version_file"] = upstream_commit(ctx.component, stack.base)
    data["wheels"] = built_wheels(ctx.cache, target, ctx.component.name, stack.digest, stack.base.commit)
    data["settings"] = [{"fix_id": f["fix_id"], "item": item} for f in fixes for item in f["user_facing"]]
    data["diffstat"] = diffstat(stack, 0) if stack.size else ""
    title = f"{data['base']['name']} + kvforge series {target} ({stack.digest})"
    data["title"] = title
    body, user_title = render_template("notes.md.j2", data, template)
    return Text("notes", target, ctx.component.name, "notes", "notes", " ".join((user_title or title).split()),
                tidy(body), stack.base.commit, stack.base.ref, stack.digest, stack.origin, None,
                str(template) if template is not None else "notes.md.j2", "", used, warnings)


def upstream_commit(comp: Component, base: Base) -> tuple[str, str]:
    """The upstream commit a base was released from, as its sdist records it (setuptools-scm's
    `<package>/_version.py`: `__commit_id__ = commit_id = 'gbc150f502'`): (commit, that file), or
    ('', '') when the base has none (a git base is its upstream commit itself)."""
    if base.source != "sdist":
        return base.commit, ""
    rel = f"{comp.release.package.replace('-', '_')}/_version.py"
    res = gitutil.run(base.repo, "show", f"{base.commit}:{rel}", check=False)
    m = re.search(r"""commit_id\s*(?::[^=]*)?=\s*['"]g?([0-9a-f]{7,40})['"]""", res.stdout) if res.returncode == 0 else None
    return (m.group(1), rel) if m else ("", "")


def built_wheels(cache: Cache, target: str, component: str, digest: str, base_commit: str) -> list[dict]:
    """The wheels `kvforge build` made and verified for exactly this series and base, read from its
    reports (<cache>/builds/<target>/<component>/<digest>/build-<platform>.json, written by
    kvforge/wheels/overlay.py; read here, never written): file name, sha256, size, platform tag."""
    out = []
    for report in sorted((cache.root / "builds" / target / component / digest).glob("build-*.json")):
        try:
            doc = json.loads(report.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not (isinstance(doc, dict) and doc.get("ok") and doc.get("filename") and doc.get("sha256")
                and doc.get("base") == base_commit and doc.get("series") == digest):
            continue
        tag = doc["filename"][:-len(".whl")].rsplit("-", 1)[-1] if doc["filename"].endswith(".whl") else ""
        out.append({"filename": doc["filename"], "sha256": doc["sha256"], "size": doc.get("size", 0),
                    "platform": tag, "verified_on": report.stem.removeprefix("build-")})
    return out
