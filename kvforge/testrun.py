"""Running vLLM's own tests on a tree: one pytest process, JUnit XML out, per-node outcomes back.

pytest runs with the test environment's python from the root of a base or patched tree, with
kvforge's small plugin (kvforge/data/pytest-plugin) loaded: it keeps only the selected nodes,
records target, base, series and platform as JUnit properties on every testcase, and notes
selectors that name nothing in this tree. Outcomes are read back from the JUnit XML, never from
pytest's console output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TextIO

from . import evidence
from .env import Env
from .platforms import HARDWARE, hardware_command
from .platforms import get as get_platform
from .errors import EXIT_ENV, EXIT_NOT_RUN, EXIT_TESTS, EXIT_USAGE, KvforgeError
from .targets import Component, Target

FAILING = ("failed", "error", "missing")
PYTEST_EXIT = {0: "all passed", 1: "tests failed", 2: "interrupted", 3: "internal error", 4: "usage error",
               5: "no tests ran"}


@dataclass
class Case:
    nodeid: str
    outcome: str  # passed | failed | error | skipped
    seconds: float
    message: str = ""


@dataclass
class RunResult:
    """One pytest process on one tree state."""

    label: str
    commit: str
    selectors: list[str]
    junit: Path | None = None
    log: Path | None = None
    exit_code: int | None = None  # None: nothing to run in this tree
    seconds: float = 0.0
    cases: list[Case] = field(default_factory=list)
    not_in_tree: list[str] = field(default_factory=list)  # selectors whose file is absent: not passed to pytest
    missing: list[str] = field(default_factory=list)  # selectors pytest found nothing for
    collect_errors: list[str] = field(default_factory=list)
    properties: dict[str, list[str]] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        out = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
        for c in self.cases:
            out[{"error": "errors"}.get(c.outcome, c.outcome)] += 1
        return out

    def matching(self, selector: str) -> list[Case]:
        return [c for c in self.cases if node_matches(c.nodeid, selector)]

    def outcome(self, selector: str) -> str:
        """passed | failed | error | skipped | missing, for a file, directory or node selector."""
        path = selector.split("::", 1)[0].rstrip("/")
        if selector in self.not_in_tree:
            return "missing"
        if any(ce == path or ce.startswith(path + "/") for ce in self.collect_errors):
            return "error"
        cases = self.matching(selector)
        if not cases:
            return "missing"
        kinds = {c.outcome for c in cases}
        for worst in ("error", "failed"):
            if worst in kinds:
                return worst
        return "passed" if "passed" in kinds else "skipped"

    def message_of(self, selector: str) -> str:
        """Why a selector did not pass: the first failure message, or why it did not run."""
        if self.outcome(selector) == "missing":
            return "not in this tree"
        path = selector.split("::", 1)[0].rstrip("/")
        ce = next((ce for ce in self.collect_errors if ce == path or ce.startswith(path + "/")), None)
        if ce:
            case = next((c for c in self.cases if c.nodeid == ce), None)
            return "collection error" + (f": {case.message}" if case and case.message else "")
        return next((c.message for c in self.matching(selector) if c.outcome != "passed" and c.message), "")

    def seconds_of(self, selector: str) -> float:
        return sum(c.seconds for c in self.matching(selector))

    def problems(self, limit: int = 20) -> list[str]:
        out = [f"{ce}: collection error" for ce in self.collect_errors]
        out += [f"{c.nodeid}: {c.outcome}" + (f" ({c.message})" if c.message else "")
                for c in self.cases if c.outcome in ("failed", "error") and c.nodeid not in self.collect_errors]
        return out[:limit] + ([f"... and {len(out) - limit} more"] if len(out) > limit else [])

    def to_json(self) -> dict:
        return {"label": self.label, "commit": self.commit, "selectors": self.selectors,
                "junit": str(self.junit) if self.junit else None, "log": str(self.log) if self.log else None,
                "pytest_exit": self.exit_code, "seconds": round(self.seconds, 2), **self.counts(),
                "not_in_tree": self.not_in_tree, "missing": self.missing, "collect_errors": self.collect_errors,
                "problems": self.problems(50)}


def node_matches(nodeid: str, selector: str) -> bool:
    """The same rule as the pytest plugin: a path selects everything under it, a node its variants."""
    selector = selector.rstrip("/")
    if "::" not in selector:
        path = nodeid.split("::", 1)[0]
        return path == selector or path.startswith(selector + "/")
    return nodeid == selector or nodeid.startswith(selector + "[") or nodeid.startswith(selector + "::")


def unique(items) -> list[str]:
    seen: dict[str, None] = {}
    for i in items:
        seen.setdefault(i, None)
    return list(seen)


def path_args(selectors: list[str]) -> list[str]:
    """The files and directories to hand pytest: each once, none inside another."""
    paths = unique(s.split("::", 1)[0].rstrip("/") for s in selectors)
    return [p for p in paths if not any(q != p and p.startswith(q + "/") for q in paths)]


def run_pytest(env: Env, tree: Path, selectors: list[str], junit: Path, properties: dict[str, str], label: str,
               commit: str, keyword: str | None = None, echo: TextIO | None = None) -> RunResult:
    """Run the selectors that exist in `tree` in one pytest process; parse its JUnit XML."""
    result = RunResult(label=label, commit=commit, selectors=list(selectors))
    present = []
    for s in selectors:
        (present if (tree / s.split("::", 1)[0]).exists() else result.not_in_tree).append(s)
    if not present:
        return result
    junit.parent.mkdir(parents=True, exist_ok=True)
    junit.unlink(missing_ok=True)
    config = junit.with_suffix(".select.json")
    config.write_text(json.dumps({"select": present, "properties": properties}, indent=1), encoding="utf-8")
    log = junit.with_suffix(".log")
    cmd = [str(env.python), "-m", "pytest", "-p", "kvforge_pytest", "-p", "no:cacheprovider", "-q", "-rfE",
           "--color=no", "--rootdir", str(tree), "--junitxml", str(junit), "-o", "junit_family=xunit2",
           "-o", "junit_suite_name=kvforge", "--continue-on-collection-errors", *path_args(present)]
    if keyword:
        cmd += ["-k", keyword]
    timeout = float(os.environ.get("KVFORGE_TEST_TIMEOUT", "3600"))
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        out.write("$ " + " ".join(cmd) + f"\n(in {tree})\n")
        out.flush()
        try:
            proc = subprocess.Popen(cmd, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    errors="replace", env=env.environ({"KVFORGE_PYTEST_CONFIG": str(config)}))
        except OSError as exc:
            raise KvforgeError(f"{env.python}: cannot start the test environment's python: {exc.strerror}",
                               EXIT_ENV) from None
        try:
            for line in proc.stdout:
                out.write(line)
                if echo is not None:
                    echo.write(line)
                    echo.flush()
                if time.monotonic() - start > timeout:
                    proc.kill()
                    raise KvforgeError(f"pytest in {tree} ran past {timeout:.0f}s ($KVFORGE_TEST_TIMEOUT); "
                                       f"log: {log}", EXIT_TESTS)
            proc.wait()
        except BaseException:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            raise
    result.seconds = time.monotonic() - start
    result.exit_code = proc.returncode
    result.log = log
    if junit.is_file():
        result.junit = junit
        parse_junit_into(result, junit)
    if proc.returncode not in (0, 1, 5) and not result.cases:
        raise KvforgeError(f"pytest could not run in {tree} (exit {proc.returncode}, "
                           f"{PYTEST_EXIT.get(proc.returncode, '?')}): {startup_failure(log)}; log: {log}", EXIT_ENV)
    return result


def startup_failure(log: Path) -> str:
    """The one line of a pytest log that says why nothing ran (a conftest ImportError, a bad option)."""
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()[2:]
    head = next((ln.strip() for ln in lines if "while loading conftest" in ln or ln.startswith("ERROR:")), None)
    err = next((ln[1:].strip() for ln in lines if ln.startswith("E ") and "Error" in ln), None)
    if not err:
        err = next((ln.strip() for ln in reversed(lines) if "Error" in ln or "error" in ln), None)
    parts = [p for p in (head, err) if p]
    return " ".join(parts) if parts else (lines[-1].strip() if lines else "no output")


def parse_junit(path: Path) -> tuple[list[Case], dict[str, list[str]]]:
    """Testcases (nodeid from kvforge's property; outcome from the child elements) and suite properties."""
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        raise KvforgeError(f"{path}: not valid JUnit XML ({exc})", EXIT_ENV) from None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    cases: list[Case] = []
    props: dict[str, list[str]] = {}
    for suite in suites:
        for p in suite.findall("properties/property"):
            props.setdefault(p.get("name", ""), []).append(p.get("value", ""))
        for tc in suite.findall("testcase"):
            tprops = {p.get("name"): p.get("value") for p in tc.findall("properties/property")}
            nodeid = tprops.get("nodeid")
            if not nodeid:  # a collection error: pytest names it by the module's dotted path
                cls, name = tc.get("classname", ""), tc.get("name", "")
                nodeid = f"{cls}.{name}" if cls else name
            outcome, message = "passed", ""
            for kind, label in (("error", "error"), ("failure", "failed"), ("skipped", "skipped")):
                el = tc.find(kind)
                if el is not None:
                    outcome, message = label, first_line(el)
                    break
            cases.append(Case(nodeid, outcome, float(tc.get("time") or 0.0), message))
    return cases, props


def first_line(el: ET.Element) -> str:
    """The one line that says why: the message, or for pytest's generic "collection failure" the last
    `E   ` line of the report (e.g. the ImportError a test module raised)."""
    message = (el.get("message") or "").strip().splitlines()[:1]
    message = message[0] if message else ""
    if message in ("", "collection failure"):
        errs = [ln[1:].strip() for ln in (el.text or "").splitlines() if ln.startswith("E ")]
        message = errs[-1] if errs else message
    return message[:200]


def parse_junit_into(result: RunResult, path: Path) -> None:
    cases, props = parse_junit(path)
    result.properties = props
    result.missing = props.get("kvforge.missing", [])
    result.collect_errors = props.get("kvforge.collect_error", [])
    dotted = {ce.removesuffix(".py").replace("/", "."): ce for ce in result.collect_errors}
    for c in cases:
        if c.nodeid in dotted:  # map a collection-error testcase back to its file
            c.nodeid = dotted[c.nodeid]
    result.cases = cases


def run_properties(target: Target, comp: Component, stack, platform: str, state: str, commit: str) -> dict[str, str]:
    return {"target": target.name, "component": comp.name, "base": stack.base.commit, "base_ref": stack.base.ref,
            "series": stack.digest, "platform": platform, "state": state, "tree": commit}


# ---------------------------------------------------------------- kvforge test

@dataclass
class TestResult:
    __test__ = False  # not a pytest test class
    target: str
    component: str
    platform: str
    state: str  # base | patched
    base: str
    series: str
    patches: int
    env: str | None = None
    run: RunResult | None = None
    skipped_checks: list[str] = field(default_factory=list)  # --base: Checks the base tree does not have
    command: str | None = None  # cuda/npu: what a runner with the hardware runs
    reason: str = ""
    ok: bool = False
    origin: str = "series"
    record: str | None = None  # the evidence record saved for this run

    def to_json(self) -> dict:
        data = {k: v for k, v in self.__dict__.items() if k != "run"}
        data["ran"] = self.run is not None and self.run.exit_code is not None
        if self.run is not None:
            data["run"] = self.run.to_json()
        return data


def selection(comp: Component, platform: str, checks: list[str], where: Path) -> list[str]:
    if platform not in comp.platforms or platform not in comp.tests:
        raise KvforgeError(f"{where}: component {comp.name} has no {platform} tests "
                           f"(platforms: {', '.join(comp.platforms)}; tests: {', '.join(comp.tests) or 'none'})",
                           EXIT_USAGE)
    return unique([*comp.tests[platform], *checks])


def test_target(ctx, platform: str, on_base: bool, keyword: str | None, stream: bool = True) -> TestResult:
    from .env import target_env
    from .trees import open_stack

    target, comp, say = ctx.target, ctx.component, ctx.progress
    series = ctx.series() if platform != "cpu" or not ctx.from_rev else None
    if series is None:
        stack = open_stack(ctx)
        series = stack.series
    checks = unique(c for p in series.patches for c in p.checks)
    nodes = selection(comp, platform, checks, target.path)
    state = "base" if on_base else "patched"
    if platform != "cpu":
        ok, why = (get_platform(platform).available(ctx.python) if ctx.python
                   else (False, "no --python names the interpreter set up for it"))
        if not ok:
            return TestResult(target.name, comp.name, platform, state, "", series.digest, len(series.patches),
                              command=hardware_command(target, comp, platform,
                                                       list(comp.tests[platform]) if on_base else nodes,
                                                       on_base, python=ctx.python),
                              reason=f"{platform} tests need {HARDWARE[platform]}; {why}")
    stack = open_stack(ctx) if not ctx.from_rev else stack
    env = target_env(ctx, base=stack.base, platform=platform)
    env.check()
    result = TestResult(target.name, comp.name, platform, state, stack.base.commit, stack.digest, stack.size,
                        env=env.key)
    n = 0 if on_base else stack.size
    rdir = evidence.attachments(ctx.cache, stack.key, "test", f"{platform}-{state}")
    with stack.lock(say):
        commit = stack.checkout(n)
        if on_base:
            result.skipped_checks = [c for c in checks if c not in comp.tests[platform]
                                     and not (stack.worktree / c.split("::", 1)[0]).exists()]
            nodes = [x for x in nodes if x not in result.skipped_checks]
            for c in result.skipped_checks:
                say(f"skipping {c}: not in the base tree (a patch adds it)")
        say(f"running {len(nodes)} selectors on the {state} tree of {target.name} ({commit[:12]}) with env {env.key}")
        run = run_pytest(env, stack.worktree, nodes, rdir / "junit.xml",
                         run_properties(target, comp, stack, platform, state, commit), state, commit, keyword,
                         sys.stderr if stream else None)
    result.run = run
    c = run.counts()
    absent = run.not_in_tree + [m for m in run.missing if not keyword]
    if on_base:  # a Checks test a patch adds to an existing file: not in the base either
        result.skipped_checks += [m for m in absent if m in checks and m not in result.skipped_checks]
        absent = [m for m in absent if m not in checks]
    if run.exit_code is None or run.exit_code == 5 or not run.cases:
        result.reason = "no tests ran"
    elif c["failed"] or c["errors"]:
        result.reason = f"{c['failed']} failed, {c['errors']} errors"
    elif absent:
        result.reason = f"{len(absent)} selected tests are not in the tree: {', '.join(absent[:5])}"
    else:
        result.ok = True
    result.origin = stack.origin
    result.record = str(evidence.save(ctx.cache, evidence.Record("test", stack.key, f"{platform}-{state}",
                                                               stack.origin, platform, result.ok,
                                                               data=result.to_json())))
    return result


test_target.__test__ = False  # not a pytest test function


def summary_line(run: RunResult) -> str:
    c = run.counts()
    absent = len(run.not_in_tree) + len(run.missing)
    return (f"{c['passed']} passed, {c['failed']} failed, {c['errors']} errors, {c['skipped']} skipped in "
            f"{run.seconds:.1f}s" + (f" ({absent} selected not in this tree)" if absent else ""))


def test_verdict(result: TestResult) -> tuple[int, str | None]:
    """The exit code and, when not 0, the one-line reason."""
    if result.command is not None:
        return EXIT_NOT_RUN, (f"not run: {result.reason} (nothing was tested; the command above is for a "
                              f"{result.platform} runner)")
    if not result.ok:
        run = result.run
        return EXIT_TESTS, (f"{result.target} {result.state}: {result.reason}"
                            + (f" (log: {run.log})" if run and run.log else ""))
    return 0, None


def print_test_result(result: TestResult, as_json: bool, out: Callable[[str], None] | None = None) -> None:
    import click

    echo = out or click.echo
    code, error = test_verdict(result)
    if as_json:
        from .report import emit_json

        emit_json({**result.to_json(), "exit": code, "error": error})
    elif result.command is not None:
        echo(f"# {result.target} {result.platform} tests: on a runner with {HARDWARE[result.platform]}:")
        echo(result.command)
    else:
        run = result.run
        if result.skipped_checks:
            echo(f"skipped {len(result.skipped_checks)} Checks tests the base tree does not have (patches add them)")
        for p in run.problems():
            echo(f"FAILED {p}")
        for m in run.not_in_tree + run.missing:
            if m not in result.skipped_checks:
                echo(f"MISSING {m}: not in this tree")
        echo(f"{result.target} {result.state} ({run.commit[:12]}, series {result.series}, {result.patches} patches), "
             f"{result.platform}: {summary_line(run)}")
        if run.junit:
            echo(f"JUnit XML: {run.junit}")
    if error:
        raise KvforgeError(error, code, emitted=as_json)
