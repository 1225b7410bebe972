"""A component that builds on another one of its target (`requires = "vllm"` in targets/*.toml), and
the declared stand-ins its CPU tests may use.

vllm-ascend is not a program of its own: it plugs into vLLM and replaces parts of it at run time.
So its tests need vLLM importable, and for a target that carries a vLLM series, the *patched* vLLM
of the same target: that is what a user of both series runs. On CPU its test environment is:

- the environment of the required component (kvforge/env/venv.py: the target's vLLM env, built once);
- that component's patched tree, the tree after the last patch of its series (its stack in the
  cache, kvforge/git/trees.py): its Python package (`vllm/`) is exported once per commit into
  `<cache>/trees/.requires/<target>-<component>/<commit>/` and put on PYTHONPATH. Only the package
  is exported, so the tree's `tests/` never shadows the component's own;
- the component's own tree (the base or patched vllm-ascend), from whose root pytest runs;
- the stand-ins the component declares (`[components.tests] standins`), shipped with kvforge in
  kvforge/data/standins/<module>/, loaded by a finder that answers for exactly those names
  (standins/_loader/sitecustomize.py) and raise when the code under test uses them;
- the PyPI requirements the component's CPU tests import and the required component's environment
  lacks (`[components.tests] requirements`, e.g. vllm-ascend's scipy, numba and pandas), installed by
  kvforge/env/venv.py into a directory of their own (`Layer.site`), keyed by that environment and the
  list, so a changed list gives a new one;
- VLLM_PLUGINS=kvforge_cpu: the tree's own entry points (vllm_ascend.egg-info in the sdist)
  register its NPU platform, which would otherwise compete with kvforge's CPU platform plugin.

This is `Layer`: the env records it, test and verify print it and keep it in their evidence. On a
platform with the hardware (npu) nothing is layered: the runner installs both patched trees itself
(kvforge matrix's npu job). Invariant: the required tree is always the series files' stack of the
required component (never a --from tree), in its patched state, for every state of this
component's own series, so a verify of vllm-ascend varies only vllm-ascend.

Also here: `kvforge lint --component` (lint_selected).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from kvforge.git import gitutil
from kvforge.core.errors import EXIT_ENV, EXIT_LINT, EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import file_lock
from kvforge.core.outcome import Done, Outcome
from kvforge.ci.runner import tree_name
from kvforge.project.series import read_series
from kvforge.project.targets import STANDINS_DIR, Component, Target, load_all, load_target
from kvforge.git.trees import open_stack, read_stack_refs, ref_prefix

LOADER = STANDINS_DIR / "_loader"  # holds sitecustomize.py: on PYTHONPATH only when stand-ins are declared
CPU_PLUGIN = "kvforge_cpu"  # kvforge's CPU platform plugin's entry point name (data/cpu-platform-plugin)
KEEP_SECONDS = 7 * 24 * 3600  # exported required trees unused this long are removed when a new one is made


@dataclass(frozen=True)
class StandIn:
    """One declared stand-in: the module it replaces and what its docstring says about it."""

    module: str
    path: Path
    summary: str

    def to_json(self) -> dict:
        return {"module": self.module, "summary": self.summary}


@dataclass
class Layer:
    """What a component that builds on another adds to that one's environment (cpu only)."""

    requires: str  # the required component
    state: str  # its tree: "patched" (the tree after its whole series)
    commit: str  # that tree's commit
    series: str  # its series digest
    path: Path  # the directory on PYTHONPATH holding its package
    packages: list[str]
    standins: list[StandIn] = field(default_factory=list)
    environ: dict[str, str] = field(default_factory=dict)
    requirements: list[str] = field(default_factory=list)  # [components.tests] requirements
    site: Path | None = None  # where they are installed (kvforge/env/venv.py); None while there are none

    def pythonpath(self) -> list[str]:
        return ([str(self.path)] + ([str(self.site)] if self.site else [])
                + ([str(LOADER)] if self.standins else []))

    def to_json(self) -> dict:
        data = asdict(self)
        data["path"] = str(self.path)
        data["site"] = str(self.site) if self.site else None
        data["standins"] = [s.to_json() for s in self.standins]
        return data


def describe_layer(data: dict) -> str:
    """Layer.to_json() for people (test and verify output): what the tests ran on, and every stand-in."""
    lines = [f"built on {data['requires']} {data['state']} ({data['commit'][:12]}, series {data['series']}): "
             f"its {', '.join(p + '/' for p in data['packages'])} on the path"]
    if data.get("requirements"):
        lines.append(f"with the component's test requirements {', '.join(data['requirements'])} "
                     f"({data.get('site')})")
    if data["standins"]:
        lines.append(f"stood in for ({len(data['standins'])} declared modules; they raise if the code under test "
                     "uses them):")
        lines += [f"  {s['module']}: {s['summary']}" for s in data["standins"]]
    return "\n".join(lines)


def standins(names) -> list[StandIn]:
    """The declared stand-ins, each shipped in kvforge/data/standins/<module>/__init__.py."""
    out = []
    for name in names:
        init = STANDINS_DIR / name / "__init__.py"
        if not init.is_file():
            raise KvforgeError(f"stand-in {name!r} is not shipped with kvforge ({init})", EXIT_USAGE)
        out.append(StandIn(name, init.parent, _summary(init.read_text(encoding="utf-8"))))
    return out


def _summary(source: str) -> str:
    m = re.match(r'\s*(?:"""|\'\'\')(.*?)(?:\n\s*\n|"""|\'\'\')', source, re.S)
    return " ".join(m.group(1).split()) if m else ""


def package_names(comp: Component) -> list[str]:
    """The importable package of a required component: its release name as a module (vllm)."""
    return [re.sub(r"[-.]+", "_", comp.release.package).lower()]


def layer(ctx) -> Layer:
    """The Layer for ctx's component (which `requires` another): the required component's patched
    tree exported, the declared stand-ins, the environment variables."""
    comp = ctx.component
    if not comp.requires:
        raise AssertionError(f"{comp.name} requires no other component")
    dep = ctx.for_component(comp.requires)
    commit, digest, repo = _patched_commit(dep)
    names = package_names(dep.component)
    path = export_packages(ctx.cache, dep.target.name, dep.component.name, repo, commit, names, ctx.progress)
    stand = standins(comp.standins)
    environ = {"VLLM_PLUGINS": CPU_PLUGIN}
    if stand:
        environ.update(KVFORGE_STANDINS=",".join(s.module for s in stand), KVFORGE_STANDINS_DIR=str(STANDINS_DIR))
    return Layer(dep.component.name, "patched", commit, digest, path, names, stand, environ,
                 requirements=list(comp.requirements))


def _patched_commit(dep) -> tuple[str, str, Path]:
    """(commit after the required component's last patch, its series digest, the repository holding it).

    The stack's refs are read without its worktree's lock (another kvforge may be running tests
    in that worktree for an hour); only a stack that was never built is built (under the lock)."""
    series = dep.series()
    base = dep.base()
    commits = read_stack_refs(base.repo, ref_prefix(dep.target.name, dep.component.name, series.digest),
                              len(series.patches))
    if commits and commits[0] == base.commit:
        return commits[-1], series.digest, base.repo
    stack = open_stack(dep)
    return stack.commits[-1], stack.digest, base.repo


def export_packages(cache, target: str, component: str, repo: Path, commit: str, packages: list[str],
                    say=None) -> Path:
    """`<cache>/trees/.requires/<target>-<component>/<commit>/` holding `packages` of that commit.

    Made once per commit, in a temporary directory renamed into place (a directory of that name is
    always complete); exports unused for a week are removed when a new one is made."""
    root = cache.trees / ".requires" / f"{target}-{component}"
    final = root / commit
    if final.is_dir():
        os.utime(final)
        return final
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root.parent / f"{target}-{component}.lock", say, f"the export of {component} {commit[:12]}"):
        if final.is_dir():
            return final
        if say:
            say(f"exporting {', '.join(p + '/' for p in packages)} of {component} {commit[:12]} for the tests "
                f"of the components built on it")
        tmp = root / f".{commit}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            gitutil.export(repo, commit, tmp, packages)
            os.rename(tmp, final)
        except gitutil.GitError as exc:
            raise KvforgeError(f"{component} {commit[:12]} has no {', '.join(packages)} to put on the path of the "
                               f"components built on it: {exc.stderr.strip()[:200]}",
                               EXIT_ENV) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        now = time.time()
        for old in root.iterdir():
            stale = now - old.stat().st_mtime > KEEP_SECONDS
            if old != final and old.is_dir() and not old.name.startswith(".") and stale:
                shutil.rmtree(old, ignore_errors=True)
    return final


# ---------------------------------------------------------------- kvforge lint --component

def lint_selected(target_names=(), component: str | None = None):
    """Lint the series of the named targets (all when none), only `component`'s when given:
    (patches checked, series checked, problems). A component no selected target has is an error."""
    targets = [load_target(n) for n in target_names] if target_names else load_all()
    comps = [c for t in targets for c in t.components if component is None or c.name == component]
    if component is not None and not comps:
        known = sorted({c.name for t in targets for c in t.components})
        raise KvforgeError(f"--component {component}: no selected target has it (components: {', '.join(known)})",
                           EXIT_USAGE)
    problems = []
    checked = 0
    for c in comps:
        s = read_series(c.series_dir)
        checked += len(s.patches)
        problems.extend(s.all_problems())
    return checked, len(comps), problems


def lint_command(target_names=(), component: str | None = None) -> Done:
    """`kvforge lint`: exit 1 when there are problems; the problems and the summary say why (on
    stderr, the summary, when there are problems)."""
    checked, nseries, problems = lint_selected(target_names, component)
    summary = f"{checked} patches in {nseries} series: " + (
        f"{len(problems)} problem{'s' if len(problems) > 1 else ''}" if problems else "clean")
    data = {"patches": checked, "problems": [{"file": str(p.path), "line": p.line, "message": p.message}
                                             for p in problems]}
    if problems:
        return Done(data, "\n".join(str(p) for p in problems), EXIT_LINT, aside=summary)
    return Done(data, summary)


# ---------------------------------------------------------------- commands over every component

def contexts(ctx, component: str | None, platform: str | None = None) -> list:
    """The contexts a command runs for: ctx alone when --component was given (or the target has one
    component); else one per component, in the target file's order (a required component before the
    ones built on it), those without `platform` left out. --from and --repo name one tree: with
    several components they need --component."""
    if component is not None or len(ctx.target.components) == 1:
        return [ctx]
    given = [opt for opt, v in (("--from", ctx.from_rev), ("--repo", ctx.repo_url)) if v]
    if given:
        raise KvforgeError(f"{given[0]} names one component's tree, and target {ctx.target.name} has "
                           f"{len(ctx.target.components)} ({', '.join(c.name for c in ctx.target.components)}): "
                           f"add --component NAME", EXIT_USAGE)
    comps = [c for c in ctx.target.components if platform is None or platform in c.platforms]
    if not comps:
        raise KvforgeError(f"no component of {ctx.target.name} is tested on {platform}", EXIT_USAGE)
    return [ctx if c.name == ctx.component.name else ctx.for_component(c.name) for c in comps]


def run_each(ctxs: list, run: Callable[[Any], Outcome]) -> Outcome:
    """Run `run(ctx)` for each context in order: one context gives exactly its outcome. Several: every
    one runs whatever the others gave; the text is each one's in turn, the JSON one object
    {target, ok, components: [...]}; the exit code and error are the first failure's (in the JSON
    "error" names its component: "<target>/<component>: <error>")."""
    if len(ctxs) == 1:
        return run(ctxs[0])
    outcomes = [run(c) for c in ctxs]
    failed = next(((c, o) for c, o in zip(ctxs, outcomes) if o.exit_code), None)
    data: dict[str, Any] = {"target": ctxs[0].target.name, "ok": failed is None,
                            "components": [o.to_json() for o in outcomes]}
    if failed is not None:
        data.update(error=f"{failed[0].label}: {failed[1].error}", exit=failed[1].exit_code)
    texts = [t for t in (o.render() for o in outcomes) if t]
    return Done(data, "".join(t if t.endswith("\n") else t + "\n" for t in texts),
                failed[1].exit_code if failed else 0, failed[1].error if failed else None,
                [n for o in outcomes for n in getattr(o, "notes", [])])


def component_of_tree(target: Target, from_rev: str | None) -> str | None:
    """For a command that reads one tree (export) on a target with several components and no
    --component: the component recorded in that tree by `kvforge apply` (git config
    kvforge.component) of --from DIR, else of the repository at the current directory, else the one
    component whose ./<component>-<target> is here. A single component target needs no answer (None)."""
    if len(target.components) == 1:
        return None
    where = Path.cwd()
    if from_rev:
        head = from_rev.split(":", 1)[0]
        if Path(head).expanduser().is_dir():
            where = Path(head).expanduser()
    res = gitutil.run(where, "config", "--get", "kvforge.component", check=False)
    name = res.stdout.strip() if res.returncode == 0 else ""
    if name in {c.name for c in target.components}:
        return name
    beside = [c.name for c in target.components if (where / tree_name(target, c)).is_dir()]
    if not from_rev and len(beside) == 1:  # export's default tree ./<component>-<target>: only one is here
        return beside[0]
    raise KvforgeError(f"target {target.name} has {len(target.components)} components "
                       f"({', '.join(c.name for c in target.components)}) and "
                       f"{'--from ' + from_rev if from_rev else 'the current directory'} is not a tree `kvforge apply` "
                       "made for one of them: add --component NAME", EXIT_USAGE)


def component_of_fix(target: Target, fix_id: str) -> str | None:
    """For `kvforge pr --fix F` on a target with several components and no --component: the one
    component whose series carries F (None when the target has one component, or none carries it:
    the first component then reports the missing fix as before)."""
    if len(target.components) == 1:
        return None
    having = [c.name for c in target.components if any(p.fix_id == fix_id for p in read_series(c.series_dir).patches)]
    if len(having) > 1:
        raise KvforgeError(f"{fix_id} is carried by several components of {target.name} ({', '.join(having)}): "
                           "add --component NAME", EXIT_USAGE)
    return having[0] if having else None
