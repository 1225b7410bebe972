"""Which of vLLM's own tests a series can break: the test modules that import a file the series touches.

The rule (static, `ast` only, nothing is imported):
- the touched modules are the Python files under the component's package (`vllm/...`) that any
  patch of the series changes (tests/ excluded: a patch's own tests are its Checks);
- a test module (tests/**/test_*.py or *_test.py) is selected when one of its imports, anywhere in
  the file (top level, in a function, under `if TYPE_CHECKING`), names a touched module itself:
  `import vllm.v1.core.block_pool`, `from vllm.v1.core.block_pool import X`,
  `from vllm.v1.core import block_pool`; or when it imports a helper module of its own directory
  (tests/v1/core/utils.py for tests/v1/core/test_*.py; not conftest.py) that does so, through any
  chain of such helpers.
- Not followed: imports through vllm itself (`from vllm.config import CacheConfig` reaches
  vllm/config/cache.py only through vllm/config/__init__.py; following vllm's own imports selects
  nearly every test in the tree) and conftest.py (tests/conftest.py imports half of vLLM, so every
  test would match), nor helpers of other directories: tests/utils.py and tests/models/utils.py
  import vllm.envs and vllm.engine.arg_utils for every end-to-end test, and following them selects
  353 of vLLM 0.20.2's test modules, nearly all of them GPU or model-download tests.

Whether a selected module runs on CPU is decided by trying it (`try_on_cpu`: the module on the base
tree in the target's CPU env; it runs when at least one of its tests passes), not by vLLM's
`cpu_test` mark, which many CPU-capable modules (tests/v1/simple_kv_offload) do not carry. The
result is written by hand into targets/<t>.toml ([components.tests] cpu), where it is reviewable;
tests/test_selection.py fails when the static scan finds a module that is neither listed there nor
recorded as not running on CPU.

Trees are read through `Source`: a directory, a git commit, or a release sdist (tar.gz): scanning
never checks anything out.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import subprocess
import tarfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterable

from kvforge.core import evidence
from kvforge.git import gitutil
from kvforge.env.venv import target_env
from kvforge.env.components import lint_selected
from kvforge.git.context import Context
from kvforge.core.errors import EXIT_ENV, EXIT_LINT, EXIT_TESTS, KvforgeError
from kvforge.core.outcome import Done
from kvforge.project.targets import display_path, load_all, load_target
from kvforge.proof import audit
from kvforge.proof.testrun import run_properties, run_pytest
from kvforge.git.trees import open_stack

TESTS = "tests"


# ---------------------------------------------------------------- reading a tree

class Source:
    """The Python files of a tree: `paths()` lists them (posix, relative to the root), `read` gives text."""

    def paths(self) -> list[str]:
        raise NotImplementedError

    def read(self, path: str) -> str:
        raise NotImplementedError


class DirSource(Source):
    def __init__(self, root: Path):
        self.root = Path(root)

    def paths(self) -> list[str]:
        return sorted(p.relative_to(self.root).as_posix() for p in self.root.rglob("*.py") if p.is_file())

    def read(self, path: str) -> str:
        return (self.root / path).read_text(encoding="utf-8", errors="replace")


class GitSource(Source):
    """A commit of a repository (bare or not), read with one `git archive` of `prefixes`: no worktree is touched."""

    def __init__(self, repo: Path, commit: str, prefixes: tuple[str, ...] = ("tests/",)):
        self._files: dict[str, str] = {}
        with gitutil.archive(repo, commit, prefixes) as tar:
            for m in tar:
                fh = tar.extractfile(m) if m.isfile() and m.name.endswith(".py") else None
                if fh is not None:
                    self._files[m.name] = fh.read().decode("utf-8", errors="replace")

    def paths(self) -> list[str]:
        return sorted(self._files)

    def read(self, path: str) -> str:
        return self._files[path]


class SdistSource(Source):
    """A release sdist (tar.gz with one top directory, as PyPI serves vLLM): its Python files under `prefixes`."""

    def __init__(self, archive: Path, prefixes: tuple[str, ...] = ("tests/",)):
        self._files: dict[str, str] = {}
        with tarfile.open(archive, "r:gz") as tar:
            for m in tar:
                rel = m.name.split("/", 1)[1] if "/" in m.name else ""
                fh = tar.extractfile(m) if m.isfile() and rel.endswith(".py") and rel.startswith(prefixes) else None
                if fh is not None:
                    self._files[rel] = fh.read().decode("utf-8", errors="replace")

    def paths(self) -> list[str]:
        return sorted(self._files)

    def read(self, path: str) -> str:
        return self._files[path]


# ---------------------------------------------------------------- the static scan

def module_name(path: str) -> str:
    """vllm/v1/core/block_pool.py -> vllm.v1.core.block_pool; a package's __init__.py -> the package."""
    parts = list(PurePosixPath(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def touched_modules(paths: Iterable[str], package: str = "vllm") -> list[str]:
    """The modules of `package` among the paths a series changes (non-Python files and tests/ dropped)."""
    return sorted({module_name(p) for p in paths if p.endswith(".py") and p.startswith(package + "/")})


def is_test_module(path: str) -> bool:
    name = PurePosixPath(path).name
    return path.startswith(TESTS + "/") and (fnmatch.fnmatch(name, "test_*.py") or fnmatch.fnmatch(name, "*_test.py"))


def imports_of(text: str, path: str) -> set[str]:
    """Every module name an import statement in the file names (relative imports resolved from `path`).

    `from a.b import c` yields a.b and a.b.c (c may be a module); a file that does not parse yields
    nothing (pytest reports it; the scan does not guess)."""
    try:
        tree = ast.parse(text, filename=path)
    except (SyntaxError, ValueError):
        return set()
    package = module_name(path).split(".")
    if not path.endswith("/__init__.py"):
        package = package[:-1]
    out: set[str] = set()
    for node in statements(tree.body):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                up = package[:len(package) - (node.level - 1)] if node.level - 1 <= len(package) else []
                base = ".".join([*up, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            if base:
                out.add(base)
            out.update(f"{base}.{a.name}" if base else a.name for a in node.names if a.name != "*")
    return out


def statements(body: list[ast.stmt]):
    """Every statement, nested ones included (function, class, if, try, with, loop, match bodies):
    imports are statements, so expressions (most of a big test file's nodes) are never visited."""
    stack = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        for name in ("body", "orelse", "finalbody", "handlers", "cases"):
            sub = getattr(node, name, None)
            if isinstance(sub, list):
                stack.extend(reversed(sub))


@dataclass
class Hit:
    """One selected test module and why: the touched modules it reaches and the helper chain, if any."""

    module: str  # tests/v1/core/test_prefix_caching.py
    reaches: list[str]  # touched modules it imports (directly or through tests' helpers)
    via: list[str] = field(default_factory=list)  # helper modules in between, e.g. tests/v1/core/utils.py

    def to_json(self) -> dict:
        return {"module": self.module, "reaches": self.reaches, "via": self.via}


def scan(source: Source, touched: Iterable[str]) -> list[Hit]:
    """The test modules of `source` that import a touched module, directly or through tests' helpers."""
    touched = set(touched)
    if not touched:
        return []
    paths = [p for p in source.paths() if p.startswith(TESTS + "/")]
    by_module = {module_name(p): p for p in paths if PurePosixPath(p).name != "conftest.py"}
    direct: dict[str, set[str]] = {}
    helpers: dict[str, set[str]] = {}
    # Any import of a module spells its last name: a file that spells none of the touched modules'
    # and none of its directory's other modules cannot reach one, and is not parsed.
    last = {t.rsplit(".", 1)[-1] for t in touched}
    siblings: dict[str, set[str]] = {}
    for p in by_module.values():
        siblings.setdefault(str(PurePosixPath(p).parent), set()).add(PurePosixPath(p).stem)
    for p in paths:
        if PurePosixPath(p).name == "conftest.py":
            continue
        text = source.read(p)
        needles = last | (siblings.get(str(PurePosixPath(p).parent), set()) - {PurePosixPath(p).stem})
        names = imports_of(text, p) if any(n in text for n in needles) else set()
        direct[p] = names & touched
        here = str(PurePosixPath(p).parent)
        helpers[p] = {by_module[n] for n in names
                      if n in by_module and by_module[n] != p and str(PurePosixPath(by_module[n]).parent) == here}

    # What each file reaches through its helpers: a fixpoint over the helper graph (cycles are fine).
    found = {p: set(direct[p]) for p in direct}
    changed = True
    while changed:
        changed = False
        for p in found:
            extra = set().union(*(found[h] for h in helpers[p])) - found[p] if helpers[p] else set()
            if extra:
                found[p] |= extra
                changed = True

    def chain(p: str) -> list[str]:
        """The shortest helper chain from p to a file that imports a touched module itself ([] if p does)."""
        if direct[p]:
            return []
        prev: dict[str, str | None] = {p: None}
        queue = [p]
        while queue:
            q = queue.pop(0)
            for h in sorted(helpers[q]):
                if h not in prev:
                    prev[h] = q
                    if direct[h]:
                        path = [h]
                        while (step := prev[path[-1]]) is not None and step != p:
                            path.append(step)
                        return path[::-1]
                    queue.append(h)
        return []

    return [Hit(p, sorted(found[p]), chain(p)) for p in paths if is_test_module(p) and p in found and found[p]]


def series_touched(series) -> list[str]:
    """Every path any patch of a series changes."""
    return sorted({path for p in series.patches for path in p.touched_paths})


# ---------------------------------------------------------------- trying modules on CPU

@dataclass
class Trial:
    module: str
    runs: bool  # at least one of its tests passed on CPU
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float = 0.0  # the module's tests' own time (pytest's per-test times, without start-up)
    why: str = ""  # when it does not run: the collection error or the first failure

    def to_json(self) -> dict:
        return dict(self.__dict__)


TRIAL_TIMEOUT = 120.0  # seconds per pytest process: a module slower than this on CPU does not belong in verify


def try_on_cpu(env, tree: Path, modules: list[str], junit_dir: Path, properties: dict[str, str],
               timeout: float = TRIAL_TIMEOUT) -> list[Trial]:
    """Run the modules on `tree` with `env`, one pytest process per directory (a conftest that cannot
    load there stops only its own directory, and would stop a whole verify run: such modules do not
    run); a directory that runs past `timeout` is tried module by module. A module runs on CPU when
    at least one of its tests passes."""
    groups: dict[str, list[str]] = {}
    for m in modules:
        groups.setdefault(str(PurePosixPath(m).parent), []).append(m)
    queue = [g for _, g in sorted(groups.items())]
    out = []
    n = 0
    while queue:
        group = queue.pop(0)
        n += 1
        try:
            run = run_pytest(env, tree, group, junit_dir / f"trial-{n}.xml", properties, "trial",
                             properties.get("tree", ""), timeout=timeout)
        except KvforgeError as exc:
            if exc.exit_code == EXIT_TESTS and len(group) > 1:
                queue[:0] = [[m] for m in group]
                continue
            why = f"ran past {timeout:.0f}s on CPU" if exc.exit_code == EXIT_TESTS else str(exc).split("; log:")[0]
            out += [Trial(m, False, why=why) for m in group]
            continue
        for m in group:
            cases = run.matching(m)
            counts = {k: sum(c.outcome == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
            t = Trial(m, counts["passed"] > 0, counts["passed"], counts["failed"], counts["error"], counts["skipped"])
            t.seconds = round(run.seconds_of(m), 1)
            if not t.runs:
                t.why = run.message_of(m) or ("all skipped" if counts["skipped"] else "no tests collected")
            out.append(t)
    return out


# ---------------------------------------------------------------- one target

@dataclass
class ScanReport:
    """A target's static scan against its CPU selection (and, when tried, which modules run on CPU)."""

    target: str
    component: str
    base: str
    touched: list[str]
    hits: list[Hit]
    selection: list[str]
    trials: list[Trial] = field(default_factory=list)
    exit_code = 0  # an Outcome (kvforge.core.outcome): a scan always succeeds
    error = None

    @property
    def unlisted(self) -> list[str]:
        """Modules the scan finds that the selection does not cover."""
        return [h.module for h in self.hits if not covered(h.module, self.selection)]

    def to_json(self) -> dict:
        return {"target": self.target, "component": self.component, "base": self.base, "touched": self.touched,
                "hits": [h.to_json() for h in self.hits], "selection": self.selection, "unlisted": self.unlisted,
                "trials": [t.to_json() for t in self.trials]}

    def render(self) -> str:
        return render_scan_report(self)


def covered(module: str, selection: Iterable[str]) -> bool:
    """A selector (a file or a directory; node ids do not cover a whole module) selects the module."""
    for s in selection:
        if "::" in s:
            continue
        s = s.rstrip("/")
        if module == s or module.startswith(s + "/"):
            return True
    return False


def scan_target(ctx, try_cpu: bool = False) -> ScanReport:
    """ctx's series against its base: the modules it can break; with try_cpu, each unlisted one run on the base."""
    stack = open_stack(ctx)
    source = GitSource(stack.base.repo, stack.base.commit)
    touched = touched_modules(series_touched(stack.series), package_of(ctx.component))
    hits = scan(source, touched)
    report = ScanReport(ctx.target.name, ctx.component.name, stack.base.commit, touched, hits,
                        list(ctx.component.tests.get("cpu", ())))
    if try_cpu and report.unlisted:
        env = target_env(ctx, base=stack.base)
        env.check()
        rdir = evidence.attachments(ctx.cache, stack.key, "test", "cpu-trial")
        with stack.lock(ctx.progress):
            commit = stack.checkout(0)
            ctx.say(f"trying {len(report.unlisted)} modules on the base tree ({commit[:12]}) with env {env.key}")
            report.trials = try_on_cpu(env, stack.worktree, report.unlisted, rdir,
                                       run_properties(ctx.target, ctx.component, stack, "cpu", "base", commit))
    return report


def package_of(component) -> str:
    """The Python package a component's patches change: vllm, vllm_ascend."""
    return component.name.replace("-", "_")


def render_scan_report(report: ScanReport) -> str:
    """The modules the series can break, whether the selection has each, and (when tried) which run on CPU."""
    lines = [f"{report.target}/{report.component} ({report.base[:12]}): the series touches {len(report.touched)} "
             f"modules; {len(report.hits)} test modules import one (directly or through their directory's helpers)"]
    trials = {t.module: t for t in report.trials}
    for h in report.hits:
        listed = covered(h.module, report.selection)
        t = trials.get(h.module)
        state = "selected" if listed else (
            "not selected" if t is None else
            f"not selected, runs on CPU ({t.passed} passed, {t.failed} failed, {t.errors} errors, {t.seconds:.0f}s)"
            if t.runs else f"not selected, does not run on CPU: {t.why}")
        via = f" via {' -> '.join(h.via)}" if h.via else ""
        lines.append(f"  {h.module}: {state} [{', '.join(h.reaches)}{via}]")
    runs = [t.module for t in report.trials if t.runs]
    if runs:
        lines.append("to add to [components.tests] cpu:")
        lines += [f'    "{m}",' for m in runs]
    return "\n".join(lines)


# ---------------------------------------------------------------- kvforge lint --selections

COLLECT_TIMEOUT = 600.0  # seconds per pytest --collect-only process
_ERROR_HEADER = re.compile(r"^_+ ERROR collecting (?P<path>\S+) _+$")
_NOT_FOUND = re.compile(r"(ModuleNotFoundError|ImportError): (?P<why>.*)")


@dataclass
class SelectionEntry:
    """One selector of one platform selection, checked against the component's base (and, with
    collection, collected on CPU in the base and the patched tree)."""

    target: str
    component: str
    platform: str
    selector: str
    exists: bool
    base: str  # the base commit it was checked against
    collected: dict[str, int] = field(default_factory=dict)  # state ("base" | "patched") -> tests collected
    by_path: str = ""  # collection was not possible on CPU: why (the entry is checked by path only)
    partly: str = ""  # a directory that collects, some of whose modules do not import on CPU: why
    problem: str = ""

    def to_json(self) -> dict:
        return dict(self.__dict__)


def parse_collect_output(text: str, paths: list[str]) -> tuple[dict[str, int], dict[str, str]]:
    """`pytest --collect-only -q` output -> ({path: node ids under it}, {path: why it did not collect})."""
    counts = {p: 0 for p in paths}
    errors: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        m = _ERROR_HEADER.match(line.strip())
        if m:
            current = m.group("path")
            errors[current] = "collection error"
            continue
        if current and line.startswith("E   ") and errors[current] == "collection error":
            errors[current] = line[4:].strip()
            continue
        if "::" in line and not line.startswith(" "):
            node = line.strip().split("::", 1)[0]
            for p in paths:
                if covered(node, [p]):
                    counts[p] += 1
    by_path = {}
    for p in paths:
        why = [w for e, w in errors.items() if covered(e, [p]) or covered(p, [e])]
        if why:
            by_path[p] = why[0]
    return counts, by_path


def collect_only(env, tree: Path, paths: list[str]) -> tuple[dict[str, int], dict[str, str]]:
    """pytest --collect-only of `paths` from the root of `tree` in `env` (one process, its own group)."""
    cmd = [str(env.python), "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "--color=no",
           "--rootdir", str(tree), "--continue-on-collection-errors", *paths]
    try:
        res = subprocess.run(cmd, cwd=tree, env=env.environ({}), capture_output=True, text=True, errors="replace",
                             timeout=COLLECT_TIMEOUT, start_new_session=True)
    except subprocess.TimeoutExpired:
        raise KvforgeError(f"pytest --collect-only in {tree} ran past {COLLECT_TIMEOUT:.0f}s", EXIT_TESTS) from None
    except OSError as exc:
        raise KvforgeError(f"{env.python}: cannot start the test environment's python: {exc.strerror}",
                           EXIT_ENV) from None
    return parse_collect_output(res.stdout + "\n" + res.stderr, paths)


def check_selections(ctx, collect: bool = False, platforms: Iterable[str] = ("cpu", "cuda", "npu"),
                     collect_platforms: Iterable[str] = ("cuda",)) -> list[SelectionEntry]:
    """Every selector of ctx's component's platform selections exists in its base (a file or a
    directory); with `collect`, the selections of `collect_platforms` are collected on CPU
    (`pytest --collect-only`) in the base and the patched tree. A module that does not import on CPU
    (a package only a GPU image has) is checked by path and says why; a module that collects on
    the base but not on the patched tree is a problem (the series broke it)."""
    comp = ctx.component
    base = ctx.base()
    out: list[SelectionEntry] = []
    for plat in platforms:
        for sel in comp.tests.get(plat, ()):
            path = sel.split("::", 1)[0].rstrip("/")
            ok = gitutil.run(base.repo, "cat-file", "-e", f"{base.commit}:{path}", check=False).returncode == 0
            e = SelectionEntry(ctx.target.name, comp.name, plat, sel, ok, base.commit)
            if not ok:
                e.problem = (f"{display_path(ctx.target.path)}: [components.tests] {plat} of {comp.name}: {sel} "
                             f"does not exist in its base ({comp.release.package} {base.ref}, {base.commit[:12]})")
            out.append(e)
    wanted = [e for e in out if e.exists and e.platform in set(collect_platforms)]
    if not (collect and wanted):
        return out
    if comp.requires:  # its tree runs on another component's (vllm-ascend): collected only where it is installed
        for e in wanted:
            e.by_path = f"built on {comp.requires}: collected on its own runner only"
        return out
    stack = open_stack(ctx)
    env = target_env(ctx, base=stack.base)
    env.check()
    paths = list(dict.fromkeys(e.selector.split("::", 1)[0].rstrip("/") for e in wanted))
    results = {}
    with stack.lock(ctx.progress):
        for state, n in (("base", 0), ("patched", stack.size)):
            commit = stack.checkout(n)
            ctx.say(f"collecting {len(paths)} {'/'.join(collect_platforms)} selectors of {ctx.target.name}/{comp.name} "
                    f"on CPU in the {state} tree ({commit[:12]})")
            results[state] = collect_only(env, stack.worktree, paths)
    for e in wanted:
        p = e.selector.split("::", 1)[0].rstrip("/")
        (bc, bwhy), (pc, pwhy) = results["base"], results["patched"]
        e.collected = {"base": bc[p], "patched": pc[p]}
        if pwhy.get(p) and not bwhy.get(p):
            e.problem = (f"{display_path(ctx.target.path)}: {e.platform} selector {e.selector} collects on the base "
                         f"but not on the patched tree: {pwhy[p]}")
        elif (pwhy.get(p) or bwhy.get(p)) and not (bc[p] and pc[p]):
            e.by_path = f"does not import on CPU ({pwhy.get(p) or bwhy.get(p)}): checked by path"
        elif pwhy.get(p) or bwhy.get(p):
            e.partly = f"some modules do not import on CPU ({pwhy.get(p) or bwhy.get(p)})"
        elif bc[p] and not pc[p]:
            e.problem = f"{display_path(ctx.target.path)}: {e.platform} selector {e.selector}: no test left after the series"
        elif not bc[p]:
            e.problem = f"{display_path(ctx.target.path)}: {e.platform} selector {e.selector} collects no test on the base"
    return out


def lint_command(cache, target_names=(), component: str | None = None, selections: bool = False,
                 collect: bool = False, progress=None, audit_series: bool = True) -> Done:
    """`kvforge lint`: every series (components.lint_selected) and, with `audit_series`, the audit of every
    series that lints clean (kvforge.proof.audit: a risky change its header does not acknowledge); with
    `selections`, every platform selection's selectors exist in their base; with `collect`, the cuda
    selections also collect on CPU in the base and patched trees (modules that do not import on CPU: by
    path, said so). Exit 1 on a problem."""
    checked, nseries, problems = lint_selected(target_names, component)
    if audit_series:
        problems = [*problems, *audit.lint_problems(cache, target_names, component, progress)]
    lines = [str(p) for p in problems]
    data: dict = {"patches": checked, "problems": [{"file": str(p.path), "line": p.line, "message": p.message}
                                                   for p in problems]}
    entries: list[SelectionEntry] = []
    if selections or collect:
        targets = [load_target(n) for n in target_names] if target_names else load_all()
        for t in targets:
            for c in t.components:
                if component is None or c.name == component:
                    ctx = Context.load(cache, t.name, c.name, progress=progress)
                    entries += check_selections(ctx, collect)
        data["selections"] = [e.to_json() for e in entries]
        for e in entries:
            if e.problem:
                lines.append(e.problem)
                data["problems"].append({"file": display_path(load_target(e.target).path), "line": None,
                                         "message": e.problem})
    nproblems = len(lines)
    summary = f"{checked} patches in {nseries} series" + (
        f", {len(entries)} selectors ({sum(bool(e.collected) for e in entries)} collected on CPU, "
        f"{sum(bool(e.by_path) for e in entries)} by path only)" if entries else "") + ": " + (
        f"{nproblems} problem{'s' if nproblems > 1 else ''}" if nproblems else "clean")
    detail = [f"{e.target}/{e.component} {e.platform} {e.selector}: "
              + (f"collected base {e.collected['base']}, patched {e.collected['patched']}"
                 + (f"; {e.partly}" if e.partly else "") if e.collected and not e.by_path
                 else e.by_path or "exists") for e in entries if not e.problem and (collect or not e.exists)]
    if lines:
        return Done(data, "\n".join(lines), EXIT_LINT, aside=summary)
    return Done(data, "\n".join([*detail, summary]))
