"""pytest plugin that kvforge loads (`-p kvforge_pytest`) inside its test environment.

It runs in the environment's Python, not kvforge's, so it uses nothing but pytest. It reads a JSON
file named by $KVFORGE_PYTEST_CONFIG:

    {"select": ["tests/a.py", "tests/b.py::test_x", ...] or null,
     "properties": {"target": ..., "base": ..., "series": ..., "platform": ...}}

- `select` keeps only the collected items that a selector names (a file, a directory, a test, a
  parametrised test's base name, a class); selectors that match nothing are written to the JUnit
  report as testsuite properties `kvforge.missing`, so a test that does not exist in this tree is
  told apart from one that fails. Filtering here, not on the command line, keeps pytest from
  stopping with "not found" when one node of many is absent.
- every testcase gets the `properties` plus its own `nodeid` as JUnit properties; the testsuite
  gets them too. A file that fails to import is written as `kvforge.collect_error`.
"""

from __future__ import annotations

import json
import os

import pytest

_state: dict = {"config": None, "cfg": None}


def _cfg() -> dict:
    if _state["cfg"] is None:
        path = os.environ.get("KVFORGE_PYTEST_CONFIG")
        if path:
            with open(path, encoding="utf-8") as fh:
                _state["cfg"] = json.load(fh)
        else:
            _state["cfg"] = {}
    return _state["cfg"]


def _xml(config):
    try:
        from _pytest.junitxml import xml_key
    except ImportError:  # pragma: no cover - very old pytest
        return None
    return config.stash.get(xml_key, None)


def _matches(nodeid: str, selector: str) -> bool:
    selector = selector.rstrip("/")
    if "::" not in selector:
        path = nodeid.split("::", 1)[0]
        return path == selector or path.startswith(selector + "/")
    return nodeid == selector or nodeid.startswith(selector + "[") or nodeid.startswith(selector + "::")


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    _state["config"] = config
    xml = _xml(config)
    if xml is not None:
        for name, value in _cfg().get("properties", {}).items():
            xml.add_global_property(name, str(value))


def pytest_collectreport(report):
    if report.failed and _state["config"] is not None:
        xml = _xml(_state["config"])
        if xml is not None:
            xml.add_global_property("kvforge.collect_error", report.nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    cfg = _cfg()
    select = cfg.get("select")
    if select is not None:
        keep, drop, hit = [], [], set()
        for item in items:
            matched = [s for s in select if _matches(item.nodeid, s)]
            (keep if matched else drop).append(item)
            hit.update(matched)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
        xml = _xml(config)
        if xml is not None:
            for s in select:
                if s not in hit:
                    xml.add_global_property("kvforge.missing", s)
    props = list(cfg.get("properties", {}).items())
    for item in items:
        for name, value in props:
            item.user_properties.append((name, str(value)))
        item.user_properties.append(("nodeid", item.nodeid))
