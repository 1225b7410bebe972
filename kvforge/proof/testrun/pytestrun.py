"""Running vLLM's own tests on a tree: one pytest process, JUnit XML out, per-node outcomes back.

pytest runs with the test environment's python from the root of a base or patched tree, with
kvforge's small plugin (kvforge/data/pytest-plugin) loaded: it keeps only the selected nodes,
records target, base, series and platform as JUnit properties on every testcase, and notes
selectors that name nothing in this tree. Outcomes are read back from the JUnit XML, never from
pytest's console output. Owns RunResult (what one run found) and the run's process group (ended on
an interrupt); writes only the JUnit file and log it is given.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from kvforge.env.venv import Env
from kvforge.core.errors import EXIT_ENV, EXIT_TESTS, KvforgeError
from kvforge.project.targets import Component, Target

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
               commit: str, keyword: str | None = None, echo: TextIO | None = None,
               timeout: float | None = None) -> RunResult:
    """Run the selectors that exist in `tree` in one pytest process; parse its JUnit XML."""
    result = RunResult(label=label, commit=commit, selectors=list(selectors))
    present: list[str] = []
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
    timeout = timeout or float(os.environ.get("KVFORGE_TEST_TIMEOUT", "3600"))
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as out:
        out.write("$ " + " ".join(cmd) + f"\n(in {tree})\n")
        out.flush()
        try:  # its own process group: a timeout or an interrupt ends pytest and every process it started
            proc = subprocess.Popen(cmd, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    errors="replace", env=env.environ({"KVFORGE_PYTEST_CONFIG": str(config)}),
                                    start_new_session=True)
        except OSError as exc:
            raise KvforgeError(f"{env.python}: cannot start the test environment's python: {exc.strerror}",
                               EXIT_ENV) from None
        fired = threading.Event()

        def kill_group() -> None:
            fired.set()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

        watchdog = threading.Timer(timeout, kill_group)  # also when pytest hangs without printing
        watchdog.daemon = True
        watchdog.start()
        try:
            assert proc.stdout is not None  # stdout=PIPE
            for line in proc.stdout:
                out.write(line)
                if echo is not None:
                    echo.write(line)
                    echo.flush()
            proc.wait()
        except BaseException:
            kill_group()
            proc.wait()
            raise
        finally:
            watchdog.cancel()
        if fired.is_set():
            raise KvforgeError(f"pytest in {tree} ran past {timeout:.0f}s ($KVFORGE_TEST_TIMEOUT); log: {log}",
                               EXIT_TESTS)
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
    lines = (el.get("message") or "").strip().splitlines()[:1]
    message = lines[0] if lines else ""
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


def summary_line(run: RunResult) -> str:
    c = run.counts()
    absent = len(run.not_in_tree) + len(run.missing)
    return (f"{c['passed']} passed, {c['failed']} failed, {c['errors']} errors, {c['skipped']} skipped in "
            f"{run.seconds:.1f}s" + (f" ({absent} selected not in this tree)" if absent else ""))

