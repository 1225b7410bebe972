"""`kvforge test`: a component's selected tests on its patched tree (or its base), a verdict and its evidence.

Invariants. The selection is the target's (plus the series' Checks); cpu runs here in the target's test
environment, cuda/npu return the command a runner with the hardware runs. A patched run whose selected tests
fail is judged against the base (kvforge.proof.testrun.baseline): only failures the base does not have count.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvforge.core import evidence
from kvforge.env.components import contexts, describe_layer, run_each
from kvforge.env.venv import target_env
from kvforge.project.platforms import HARDWARE
from kvforge.project.platforms import get as get_platform
from kvforge.core.errors import EXIT_NOT_RUN, EXIT_TESTS, EXIT_USAGE, KvforgeError
from kvforge.core.outcome import Done, Outcome
from kvforge.ci.runner import hardware_command
from kvforge.project.targets import Component
from kvforge.git.trees import open_stack
from kvforge.proof.testrun.baseline import against_base, compare_lines
from kvforge.proof.testrun.pytestrun import RunResult, run_properties, run_pytest, summary_line, unique


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
    compare: dict = field(default_factory=dict)  # cpu, patched, something failed: Comparison.to_json()
    layer: dict | None = None  # built on another component: its tree and the stand-ins (kvforge/env/components.py)

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
                        env=env.key, layer=env.layer.to_json() if env.layer else None)
    n = 0 if on_base else stack.size
    rdir = evidence.attachments(ctx.cache, stack.key, "test", f"{platform}-{state}")
    with stack.lock(say):
        commit = stack.checkout(n)
        if on_base:
            result.skipped_checks = [c for c in checks if c not in comp.tests[platform]
                                     and not (stack.worktree / c.split("::", 1)[0]).exists()]
            nodes = [x for x in nodes if x not in result.skipped_checks]
            for node in result.skipped_checks:
                say(f"skipping {node}: not in the base tree (a patch adds it)")
        say(f"running {len(nodes)} selectors on the {state} tree of {target.name} ({commit[:12]}) with env {env.key}")
        run = run_pytest(env, stack.worktree, nodes, rdir / "junit.xml",
                         run_properties(target, comp, stack, platform, state, commit), state, commit, keyword,
                         sys.stderr if stream else None)
        if not on_base and platform == "cpu" and stack.size and (run.counts()["failed"] or run.counts()["errors"]):
            result.compare = against_base(ctx, stack, env, run, list(comp.tests[platform]), checks, rdir,
                                          platform).to_json()
    result.run = run
    c = run.counts()
    absent = run.not_in_tree + [m for m in run.missing if not keyword]
    failing_checks = [n for n in checks if run.outcome(n) in ("failed", "error")]
    if on_base:  # a Checks test a patch adds to an existing file: not in the base either
        result.skipped_checks += [m for m in absent if m in checks and m not in result.skipped_checks]
        absent = [m for m in absent if m not in checks]
    if run.exit_code is None or run.exit_code == 5 or not run.cases:
        result.reason = "no tests ran"
    elif result.compare and (result.compare["new"] or failing_checks):
        result.reason = (f"{c['failed']} failed, {c['errors']} errors: {result.compare['new_failures']} new (not "
                         f"failing on the base), {len(failing_checks)} of the series' Checks")
    elif (c["failed"] or c["errors"]) and not result.compare:
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


test_target.__test__ = False  # type: ignore[attr-defined]  # pytest's marker: not a test function


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


def render_test_result(result: TestResult) -> str:
    """The text of `kvforge test`: the command a runner would run, or the failures and a summary."""
    if result.command is not None:
        return f"# {result.target} {result.platform} tests: on a runner with {HARDWARE[result.platform]}:\n" \
               + result.command
    run = result.run
    assert run is not None  # no runner command: pytest ran here
    lines = []
    if result.skipped_checks:
        lines.append(f"skipped {len(result.skipped_checks)} Checks tests the base tree does not have (patches add them)")
    lines += [f"FAILED {p}" for p in run.problems()]
    lines += [f"MISSING {m}: not in this tree" for m in run.not_in_tree + run.missing if m not in result.skipped_checks]
    lines += compare_lines(result.compare, True)
    if result.layer:
        lines.append(describe_layer(result.layer))
    lines.append(f"{result.target} {result.state} ({run.commit[:12]}, series {result.series}, {result.patches} "
                 f"patches), {result.platform}: {summary_line(run)}")
    if run.junit:
        lines.append(f"JUnit XML: {run.junit}")
    return "\n".join(lines)


def outcome_of(result: TestResult) -> Done:
    """A test run as `kvforge test` ends: its JSON carries "exit" and "error" (null when it passed)."""
    code, error = test_verdict(result)
    return Done({**result.to_json(), "exit": code, "error": error}, render_test_result(result), code, error)


def run_command(ctx, component: str | None, platform: str, on_base: bool, keyword: str | None) -> Outcome:
    """`kvforge test`: the tests of each component (`--scan` is selection.scan_target's)."""
    return run_each(contexts(ctx, component, platform),
                    lambda c: outcome_of(test_target(c, platform, on_base, keyword)))

