"""Running a tree's own tests and judging the outcomes.

Modules: pytestrun (one pytest process on a tree, JUnit XML back as a RunResult), baseline (the base's outcomes
for the patched tree's failures, kept in the cache, and the node-by-node comparison), command (`kvforge test`:
its selection, verdict and evidence). The names below are what the rest of kvforge uses.
"""

from kvforge.proof.testrun.baseline import Comparison, against_base, compare, compare_lines
from kvforge.proof.testrun.command import run_command, selection
from kvforge.proof.testrun.pytestrun import RunResult, parse_junit, run_properties, run_pytest, summary_line, unique

__all__ = ["Comparison", "RunResult", "against_base", "compare", "compare_lines", "parse_junit",
           "run_command", "run_properties", "run_pytest", "selection", "summary_line", "unique"]
