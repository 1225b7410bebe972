"""Where a fix can go upstream: the policy of each upstream repository, as data, and the route of one fix.

The policy is kvforge/data/upstream-policy.toml (one table per upstream: its GitHub repository, PR
style, main branch, how it treats release branches, what its release branches already hold). This
module owns the decision `kvforge pr` acts on; it renders nothing and writes nothing. Rules:
- A patch whose Upstream-Status is Inappropriate gets no PR (its reason is quoted).
- vLLM (release branches "in-flight"): a Backport of a vLLM PR gets no PR (it is merged on main;
  a released version takes no cherry-picks); a new fix goes to main, from the main target's
  variant, so on a release target it is refused with the command for that variant (or for
  `kvforge port` when main carries none).
- vllm-ascend (release branches "maintained"): a fix goes to the branch of the component's ref
  (releases/vX or main); a Backport of a vllm-ascend PR the branch already holds gets no PR; a
  patch that carries a vLLM PR (not vllm-ascend's own) gets no vllm-ascend PR.
- The style, repository and base branch come from the component's upstream, never from the user.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvforge import DATA
from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.project.series import read_series
from kvforge.project.targets import load_all

POLICY_FILE = DATA / "upstream-policy.toml"


@dataclass(frozen=True)
class OnBranch:
    branch: str
    pr: int
    commit: str
    checked: str


@dataclass(frozen=True)
class Upstream:
    """One upstream repository's policy (a table of upstream-policy.toml)."""

    name: str
    repo: str  # owner/name on GitHub
    style: str  # vllm | vllm-ascend
    main: str
    release_branches: str  # in-flight | maintained
    release_prefix: str = ""
    source: str = ""
    on_branch: tuple[OnBranch, ...] = ()
    display: str = ""  # how a text names it (vLLM)


@dataclass
class Route:
    """What `kvforge pr` does with one fix of one (target, component): a PR (repo, branch, style) or none."""

    target: str
    component: str
    fix_id: str
    patch: str
    action: str  # pr | none
    repo: str
    branch: str = ""
    style: str = ""
    reason: str = ""  # why there is no PR (action none); or a note on where the PR goes
    upstream: list[str] = field(default_factory=list)  # the upstream PRs the patch names (#N or owner/name#N)

    def to_json(self) -> dict:
        return asdict(self)


def load_policy(path: Path | None = None) -> dict[str, Upstream]:
    path = path if path is not None else POLICY_FILE
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise KvforgeError(f"{path}: cannot read the upstream policy: {exc}", EXIT_USAGE) from None
    out = {}
    for name, t in raw.get("upstreams", {}).items():
        if t.get("release_branches") not in ("in-flight", "maintained") or t.get("style") not in ("vllm", "vllm-ascend"):
            raise KvforgeError(f"{path}: upstreams.{name}: release_branches must be in-flight|maintained and "
                               "style vllm|vllm-ascend", EXIT_USAGE)
        out[name] = Upstream(name, t["repo"], t["style"], t.get("main", "main"), t["release_branches"],
                             t.get("release_prefix", ""), t.get("source", ""),
                             tuple(OnBranch(b["branch"], int(b["pr"]), b["commit"], b.get("checked", ""))
                                   for b in t.get("on_branch", [])), t.get("display", name))
    return out


def github_repo(url: str) -> str | None:
    m = re.match(r"^(?:https?://|git@)github\.com[/:]([^/]+/[^/]+?)(?:\.git)?/?$", url or "")
    return m.group(1) if m else None


def upstream_of(component, policy: dict[str, Upstream] | None = None) -> Upstream:
    """The upstream of a component: by its GitHub repository, else by its name (vllm, vllm-ascend)."""
    policy = policy if policy is not None else load_policy()
    repo = (github_repo(component.repo) or "").lower()
    for up in policy.values():
        if up.repo.lower() == repo:
            return up
    if component.name in policy:
        return policy[component.name]
    raise KvforgeError(f"component {component.name} ({component.repo}): no upstream in {POLICY_FILE.name} "
                       f"(known: {', '.join(u.repo for u in policy.values())})", EXIT_USAGE)


def pr_ref(url: str, home: str) -> tuple[str, int] | None:
    """(owner/name, N) of a GitHub PR or issue URL."""
    m = re.match(r"^https?://github\.com/([^/]+/[^/]+)/(?:pull|issues)/(\d+)/?$", url.strip())
    return (m.group(1), int(m.group(2))) if m else None


def short_ref(url: str, home: str) -> str:
    ref = pr_ref(url, home)
    if ref is None:
        return url
    return f"#{ref[1]}" if ref[0].lower() == home.lower() else f"{ref[0]}#{ref[1]}"


def _status(patch) -> tuple[str, str]:
    m = re.match(r"^([A-Za-z-]+)(?:\s+\[(.*)\])?\s*$", patch.upstream_status or "")
    return (m.group(1), (m.group(2) or "").strip()) if m else (patch.upstream_status or "", "")


def _main_target(up: Upstream, targets) -> tuple[Any, Any] | None:
    """(target, component) whose component follows `up`'s main branch (vLLM's main target)."""
    for t in targets:
        for c in t.components:
            if (github_repo(c.repo) or "").lower() == up.repo.lower() and c.ref == up.main:
                return t, c
    return None


def release_branch(up: Upstream, component) -> str | None:
    """The upstream branch a component's ref is on: main, or a maintained release branch."""
    if component.ref == up.main:
        return up.main
    if up.release_branches == "maintained" and up.release_prefix and component.ref.startswith(up.release_prefix):
        return component.ref
    return None


def route(target, component, patch, targets=None, policy: dict[str, Upstream] | None = None) -> Route:
    """Where `patch` (of `component` of `target`) goes upstream, or why nowhere (see the module rules)."""
    up = upstream_of(component, policy)
    status, detail = _status(patch)
    prs = patch.values("Upstream-PR")
    named = [short_ref(u, up.repo) for u in prs]
    r = Route(target.name, component.name, patch.fix_id, patch.name, "none", up.repo, style=up.style, upstream=named)
    if status == "Inappropriate":
        r.reason = f"Upstream-Status Inappropriate: {detail or 'not meant for upstream'}"
        return r
    if status == "Accepted":
        r.reason = f"accepted upstream{' as ' + ', '.join(named) if named else ''}"
        return r
    if status == "Submitted":
        r.reason = f"already submitted upstream as {short_ref(detail, up.repo) if detail else ', '.join(named)}: " \
                   "update that PR"
        return r
    backport_of = pr_ref(detail, up.repo) if status == "Backport" and detail else None
    if status == "Backport" and backport_of is not None and backport_of[0].lower() != up.repo.lower():
        r.reason = (f"a backport of {backport_of[0]}#{backport_of[1]}, a {backport_of[0]} change: "
                    f"{up.repo} takes no PR for it")
        return r
    if up.release_branches == "in-flight":
        return _route_in_flight(r, up, target, component, patch, status, detail, targets)
    branch = release_branch(up, component)
    if branch is None:
        r.reason = f"{component.ref} is neither {up.main} nor a maintained {up.release_prefix}* branch of {up.repo}"
        return r
    if status == "Backport" and backport_of is not None:
        commits = patch.values("Upstream-Commit")
        held = next((b for b in up.on_branch if b.branch == branch
                     and (b.pr == backport_of[1] or any(b.commit.startswith(c) for c in commits if len(c) >= 7))), None)
        if held is not None:
            r.reason = (f"already on {branch} as #{held.pr} ({held.commit[:10]}), "
                        f"which the offline base {component.release.package} {component.release.version} predates")
            return r
    r.action, r.branch = "pr", branch
    return r


def _route_in_flight(r: Route, up: Upstream, target, component, patch, status: str, detail: str, targets) -> Route:
    targets = list(targets) if targets is not None else load_all()
    main = _main_target(up, targets)
    if status == "Backport":
        merged = ", ".join(r.upstream) or (short_ref(detail, up.repo) if detail else "an upstream PR")
        commits = patch.values("Upstream-Commit")
        where = ""
        if main is not None:
            entry = next((e for e in main[1].in_base if e.fix_id == patch.fix_id), None)
            if entry is not None:
                where = f", released in {up.display} {main[1].release.version} (target {main[0].name})"
        r.reason = (f"merged upstream as {merged}{' (' + ', '.join(commits) + ')' if commits else ''}"
                    f" on {up.main}{where}; {up.display} takes cherry-picks only into the release in flight "
                    f"({up.display} {component.release.version} is released)")
        return r
    if component.ref == up.main:
        r.action, r.branch = "pr", up.main
        return r
    if main is None:
        r.reason = f"{up.repo} takes new fixes on {up.main} only, and no target follows {up.main}"
        return r
    mt, mc = main
    if any(p.fix_id == patch.fix_id for p in read_series(mc.series_dir).patches):
        r.reason = (f"{up.repo} takes new fixes on {up.main} only: send the {mt.name} variant "
                    f"(kvforge pr -t {mt.name} --fix {patch.fix_id})")
    else:
        r.reason = (f"{up.repo} takes new fixes on {up.main} only, and target {mt.name} carries no variant of it: "
                    f"kvforge port {patch.fix_id} --to {mt.name}, then kvforge pr -t {mt.name} --fix {patch.fix_id}")
    return r


def component_for_pr(target, fix_id: str) -> str | None:
    """`kvforge pr --fix F` without --component: the one component whose patch for F has a PR route;
    else, when none has one, the first component carrying F (pr then states its refusal). None for a
    one-component target or when no component carries F. Several with a route: --component needed."""
    if len(target.components) == 1:
        return None
    routes = []
    targets = load_all()
    for c in target.components:
        p = read_series(c.series_dir).by_fix_id().get(fix_id)
        if p is not None:
            routes.append(route(target, c, p, targets))
    if not routes:
        return None
    open_ = [r for r in routes if r.action == "pr"]
    if len(open_) > 1:
        raise KvforgeError(f"{fix_id} has an upstream PR route in several components of {target.name} "
                           f"({', '.join(f'{r.component} -> {r.repo} {r.branch}' for r in open_)}): "
                           "add --component NAME", EXIT_USAGE)
    return (open_ or routes)[0].component


def plan(targets=None) -> list[Route]:
    """The route of every fix of every (target, component), in target and series order."""
    targets = list(targets) if targets is not None else load_all()
    return [route(t, c, p, targets) for t in targets for c in t.components
            for p in read_series(c.series_dir).patches]
