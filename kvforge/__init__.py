"""kvforge: carry, prove and measure downstream vLLM prefix-cache patch series.

Packages, from the top layer down (pyproject's import-linter contracts keep imports flowing down):
cli (the commands) > flow (series through upstream: apply, export, rebase, pick, target add, watch, pr)
> wheels | bench > proof (tests, verify, selection, audit) > env (test environments) > ci (platform jobs,
the CI matrix, init's scaffold) > git (plumbing, bases, stacks) > project (target files, series,
their one transaction) > core (errors, outcomes, files, cache, evidence records, the package index).
"""

from pathlib import Path

__version__ = "0.1.0"

DATA = Path(__file__).resolve().parent / "data"  # package data: templates, stand-ins, plugins, configs
