"""A text's shape (`Text`), the data every template gets (target, base, series, one patch), and the
PR description of one fix (`pull_request`), whose user-facing line also names the changes the
patch's header acknowledges making on purpose (release notes list only the user-facing ones).

Invariants: a PR is described only for a fix the upstream policy routes to a PR (kvforge.flow.prpolicy),
in the style of the component's upstream (never the user's choice), with every commit it carries
signed off; a rendered body is tidied (at most one blank line in a row, no trailing spaces, one final
newline). A text never names a directory of this machine. Builds and renders; writes nothing.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.flow import prpolicy
from kvforge.flow.pr.conventions import (STYLES, UpstreamTemplate, ascend_branch, ascend_template, ascend_title,
                                         check_vllm_title, split_tags, vllm_template, vllm_title)
from kvforge.flow.pr.evidence import (BENCH_SCENARIOS, EvidenceUsed, bench_data, from_commit, gather, target_flag,
                                      verify_data)
from kvforge.flow.pr.facts import (acknowledged, check_dco, depends_chain, diffstat, drop_when_text, github_ref, message_body,
                                   unwrap, upstream_status, user_facing, vllm_refs)
from kvforge.flow.pr.sandbox import render_template
from kvforge.git.bases import Base
from kvforge.git.context import Context
from kvforge.git.trees import Stack, open_stack
from kvforge.project.series import Patch, Series, read_series
from kvforge.project.targets import Component, load_all, project_root


@dataclass
class Text:
    """A rendered PR description or release notes; the CLI prints, writes or hands it to gh."""

    kind: str  # pr | notes
    target: str
    component: str
    style: str
    layout: str
    title: str
    body: str
    base: str
    base_ref: str
    series: str
    origin: str
    fix_id: str | None = None
    template: str = ""  # the jinja2 template rendered (a package name, or the user's file)
    upstream_template: str = ""  # where the upstream PR template (sections, checklist) came from
    evidence: list[EvidenceUsed] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    repo: str = ""  # the GitHub repository (owner/name) a PR is for
    branch: str = ""  # the upstream branch it is for (prpolicy.route)

    @property
    def text(self) -> str:
        """What `kvforge pr` prints and --out writes: the title, a blank line, the body."""
        return f"{self.title}\n\n{self.body}" if self.kind == "pr" else self.body

    def to_json(self) -> dict:
        return asdict(self)


def patch_data(stack: Stack, n: int, repo: str, deps: list[Patch], missing_deps: list[str],
                home: str = "vllm-project/vllm") -> dict:
    p = stack.series.patches[n - 1]
    tags, text = split_tags(p.subject)
    status, detail = upstream_status(p.upstream_status)
    # A text posted outside the patch's own repository (`home`) spells its '#N' in full.
    local = (lambda t: t) if repo.lower() == home.lower() else (lambda t: vllm_refs(t, home))
    description = message_body(p)
    return {
        "n": n, "name": p.name, "fix_id": p.fix_id, "kind": p.kind, "subject": p.subject, "subject_text": text,
        "tags": tags, "author": p.author, "why": local(p.value("Why") or ""), "description": description,
        "description_md": local(unwrap(description)),
        "upstream_status": p.upstream_status, "status": status, "status_detail": detail,
        "status_ref": github_ref(detail, repo) if detail.startswith("http") else detail,
        "upstream_prs": [{"url": u, "ref": github_ref(u, repo)} for u in p.values("Upstream-PR")],
        "upstream_commits": p.values("Upstream-Commit"),
        "bugs": [{"url": u, "ref": github_ref(u, repo)} for u in p.values("Bug")],
        "drop_when": p.value("Drop-When") or "", "drop_when_text": drop_when_text(p.value("Drop-When") or ""),
        "depends_on": [{"fix_id": d.fix_id, "name": d.name, "subject": d.subject,
                        "upstream_status": d.upstream_status, "status": upstream_status(d.upstream_status)[0],
                        "status_ref": github_ref(upstream_status(d.upstream_status)[1], repo)
                        if upstream_status(d.upstream_status)[1].startswith("http") else ""} for d in deps],
        "depends_missing": missing_deps,
        "checks": p.checks, "signed_off_by": p.values("Signed-off-by"),
        "touched": p.touched_paths, "user_facing": user_facing(p), "acknowledged": acknowledged(p),
        "diffstat": diffstat(stack, n), "in_base": stack.in_base(n), "earlier": n - 1,
        "bench_scenarios": list(BENCH_SCENARIOS.get(p.fix_id, {})),
        "bench_roles": dict(BENCH_SCENARIOS.get(p.fix_id, {})),
    }


def common_data(ctx: Context, stack: Stack, style: str, layout: str, upstream: UpstreamTemplate) -> dict:
    comp, base = ctx.component, stack.base

    try:
        series_dir = os.path.relpath(comp.series_dir, project_root())
    except (KvforgeError, ValueError):
        series_dir = comp.series_dir.name
    return {
        "style": style, "layout": layout,
        "target": {"name": ctx.target.name, "description": ctx.target.description, "component": comp.name,
                   "flag": target_flag(ctx), "requires": comp.requires, "standins": list(comp.standins),
                   "release": f"{comp.release.package} {comp.release.version}",
                   "branch": ascend_branch(ctx.target.name, comp),
                   "selection": list(comp.tests.get("cpu", ()))},
        "base": {"ref": base.ref, "commit": base.commit, "short": base.commit[:12], "source": base.source,
                 "origin": _base_origin(base),
                 "name": _base_name(comp, base)},
        "series": {"dir": series_dir, "digest": stack.digest, "size": stack.size,
                   "from_commit": from_commit(stack.origin)},
        "upstream": upstream.to_data(),
        "in_base": [{"fix_id": e.fix_id, "reason": e.reason} for e in comp.in_base],
    }


def pull_request(ctx: Context, fix_id: str, style: str | None = None, template: Path | None = None,
                 allow_stale: bool = False) -> Text:
    """One fix of ctx's series as a PR title and body (see the module docstring)."""

    if style is not None and style not in STYLES:
        raise KvforgeError(f"--style must be one of {', '.join(STYLES)}, not {style!r}", EXIT_USAGE)
    if not ctx.from_rev:  # the series files: a fix with no upstream PR is refused before any tree is built
        files = read_series(ctx.component.series_dir)
        early = files.by_fix_id().get(fix_id)
        if early is None:  # an unknown fix needs no base to be refused (offline, nothing cached)
            raise _no_such_fix(ctx, files, fix_id)
        way = prpolicy.route(ctx.target, ctx.component, early)
        if way is not None and way.action != "pr":
            raise KvforgeError(f"{fix_id} ({ctx.target.name}, {ctx.component.name}): no upstream PR: {way.reason}",
                               EXIT_USAGE)
    stack = open_stack(ctx)
    n = next((i for i, p in enumerate(stack.series.patches, 1) if p.fix_id == fix_id), None)
    if n is None:
        raise _no_such_fix(ctx, stack.series, fix_id)
    patch = stack.series.patches[n - 1]
    way = prpolicy.route(ctx.target, ctx.component, patch)
    if style is not None and style != way.style:
        raise KvforgeError(f"--style {style}: {ctx.component.name}'s fixes go to {way.repo}, whose style is "
                           f"{way.style} (the style follows the component; leave --style out)", EXIT_USAGE)
    if way.action != "pr":
        raise KvforgeError(f"{fix_id} ({ctx.target.name}, {ctx.component.name}): no upstream PR: {way.reason}",
                           EXIT_USAGE)
    style = way.style
    deps, missing_deps = depends_chain(stack.series, patch)
    check_dco([*deps, patch])
    warnings: list[str] = []
    if stack.in_base(n):
        warnings.append(f"{patch.name} changes nothing on {stack.base.ref}: its change is already in the base")
    if missing_deps:
        warnings.append(f"{patch.name} depends on {', '.join(missing_deps)}, which this series does not carry")

    repo = way.repo
    if style == "vllm":
        upstream, warning = vllm_template(stack, ctx.component.release.version)
        if warning:
            warnings.append(warning)
    else:
        upstream = ascend_template()
    layout = upstream.layout
    data = common_data(ctx, stack, style, layout, upstream)
    data["fix"] = patch_data(stack, n, repo, deps, missing_deps, home_repo(ctx))
    # What the header acknowledges changing on purpose goes where reviewers look for interface changes:
    # beside the user-facing ones (vllm-ascend's "user-facing change" section; vLLM's Purpose).
    data["fix"]["user_facing"] = data["fix"]["user_facing"] + data["fix"]["acknowledged"]
    data["repo"] = repo

    key, target = stack.key, ctx.target.name
    used: list[EvidenceUsed] = []
    rec, state = gather(ctx, key, "verify", allow_stale, used, warnings)
    data["verify"] = verify_data(rec, state, target_flag(ctx), fix_id)
    verdict = (data["verify"] or {}).get("patch")
    if rec is not None and verdict is None:
        warnings.append(f"the verify record has no verdict for {fix_id}")
    elif verdict and verdict["status"] != "proven" and patch.kind == "fix":
        warnings.append(f"verify found {fix_id} {verdict['status']}: {verdict['reason']}")
    scenarios = tuple(BENCH_SCENARIOS.get(fix_id, {}))
    data["bench"] = None
    if scenarios:
        brec, bstate = gather(ctx, key, "bench-prefix-cache", allow_stale, used, warnings,
                                 f" --scenario {','.join(scenarios)}")
        data["bench"] = bench_data(brec, bstate, target_flag(ctx), scenarios)

    if style == "vllm":
        title = vllm_title(patch.subject, patch.kind, layout)
    else:
        title = ascend_title(patch.subject, patch.kind, way.branch.removeprefix("releases/"), patch.touched_paths)
    data["title"] = title
    name = "pr-ascend.md.j2" if style == "vllm-ascend" else f"pr-vllm-{layout}.md.j2"
    body, user_title = render_template(name, data, template)
    if user_title is not None:
        title = " ".join(user_title.split())
        if style == "vllm":
            check_vllm_title(title)
    internal = [i for i, ln in enumerate(f"{title}\n{body}".split("\n"), 1) if "kvforge" in ln.lower()]
    if internal:
        warnings.append(f"the PR text names kvforge on {len(internal)} line(s) (first: line {internal[0]}), "
                        f"which an upstream reader does not know: from the patch ({patch.name}: its message, "
                        "test file names) or the template; rename or reword them there")
    return Text("pr", target, ctx.component.name, style, layout, title, tidy(body), stack.base.commit,
                stack.base.ref, stack.digest, stack.origin, fix_id,
                str(template) if template is not None else name, upstream.source, used, warnings, repo,
                way.branch)


def home_repo(ctx: Context) -> str:
    """The GitHub repository a component's patches were written for (their bare '#N' refer to it)."""
    return _github_repo(ctx.component.repo) or "vllm-project/vllm"


def _base_name(comp: Component, base: Base) -> str:
    """How a text names the base: vLLM v0.20.2, vLLM main (0.33.0 snapshot), vllm-ascend releases/v0.20.2rc
    (0.20.2rc1 from PyPI when it is the sdist)."""
    if comp.requires:
        how = f" ({comp.release.version} from PyPI)" if base.source == "sdist" else ""
        return f"{comp.name} {base.ref}{how}"
    return f"vLLM {base.ref}" if base.ref != "main" else f"vLLM main ({comp.release.version} snapshot)"


def tidy(body: str) -> str:
    """At most one blank line in a row, no trailing spaces, one final newline."""
    lines = [ln.rstrip() for ln in body.split("\n")]
    out: list[str] = []
    for ln in lines:
        if ln == "" and out and out[-1] == "":
            continue
        out.append(ln)
    return "\n".join(out).strip("\n") + "\n"


def _base_origin(base: Base) -> str:
    """Where the base came from, as a text may say it: the sdist and its sha256, or a git URL (never a
    directory of this machine)."""
    if base.source == "git" and not re.match(r"^[a-z][a-z0-9+.-]*://|^git@", base.origin or ""):
        return f"a local git clone ({base.ref})"
    return base.origin


def _github_repo(url: str) -> str | None:
    m = re.match(r"^(?:https?://|git@)github\.com[/:]([^/]+/[^/]+?)(?:\.git)?/?$", url or "")
    return m.group(1) if m else None


def _no_such_fix(ctx: Context, series: Series, fix_id: str) -> KvforgeError:
    name = ctx.target.name
    entry = next((e for e in ctx.component.in_base if e.fix_id == fix_id), None)
    if entry is not None:
        return KvforgeError(f"{name}: {fix_id} is already in the base ({entry.reason}); {name} carries no patch "
                            "for it, so there is no PR to describe", EXIT_USAGE)
    carried = []
    try:
        for t in load_all():
            if t.name != name and any(p.fix_id == fix_id for c in t.components
                                      for p in read_series(c.series_dir).patches):
                carried.append(t.name)
    except KvforgeError:
        pass
    have = f"it has: {', '.join(p.fix_id for p in series.patches)}" if series.patches else "it is empty"
    where = f"; carried by {', '.join(carried)}" if carried else ""
    return KvforgeError(f"{name}: no patch with Fix-Id {fix_id!r} in its series ({have}), and "
                        f"targets/{name}.toml lists no in_base entry for it{where}", EXIT_USAGE)
