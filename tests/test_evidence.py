"""Evidence records: saved by verify/test, loaded back typed, keyed by base and series."""

from __future__ import annotations

import json

import pytest
from test_verify import CLAMP_CHECKS, CLAMP_FIX, kvforge

from kvforge.core import evidence
from kvforge.core.cache import Cache
from kvforge.core.errors import KvforgeError


def test_verify_and_test_save_records_that_load_back(fake):
    fake.patch("0001-clamp-upper", CLAMP_FIX, checks=CLAMP_CHECKS)
    fake.series("0001-clamp-upper")
    res = kvforge("verify", "-t", "fake", "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    cache = Cache(fake.cache)
    key = evidence.Key("fake", "vllm", fake.base, report["series"])
    rec = evidence.latest(cache, key, "verify")
    assert rec is not None and rec.ok and rec.origin == "series" and rec.platform == "cpu"
    assert rec.data["patches"][0]["status"] == "proven" and str(rec.path) == report["report"]
    assert kvforge("test", "-t", "fake").exit_code == 0
    test = evidence.latest(cache, key, "test", "cpu-patched")
    assert test is not None and test.ok and test.data["run"]["passed"] >= 3
    # Another series (or base) has no evidence: nothing is borrowed across series.
    assert evidence.latest(cache, evidence.Key("fake", "vllm", fake.base, "0" * 16), "verify") is None
    assert evidence.latest(cache, evidence.Key("fake", "vllm", "1" * 40, report["series"]), "verify") is None
    assert [r.kind for r in evidence.load(cache, "fake", "vllm")] == ["verify", "test"]


def test_a_file_that_is_not_a_record_is_a_one_line_error(tmp_path):
    bad = tmp_path / "verify.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(KvforgeError, match=r"verify.json: not a kvforge evidence record"):
        evidence.read(bad)


RECORD = {"schema": 1, "kind": "verify", "key": {"target": "t", "component": "vllm", "base": "b" * 40,
                                                 "series": "0" * 16},
          "name": "", "origin": "series", "platform": "cpu", "ok": True, "created": "2026-11-23T10:00:00+00:00",
          "data": {"patches": []}}


@pytest.mark.parametrize("change,why", [
    ({"data": []}, "data must be an object, not list"),
    ({"created": 20261123}, "created must be a string, not int"),
    ({"ok": "yes"}, "ok must be true or false, not str"),
    ({"name": None}, "name must be a string, not NoneType"),
    ({"key": {"target": "t", "component": "vllm", "base": 1, "series": "0"}}, "key must be an object of the strings"),
    ({"key": ["t", "vllm"]}, "key must be an object of the strings"),
])
def test_a_record_with_fields_of_the_wrong_type_is_refused_on_load(tmp_path, change, why):
    """Type-checked on load (as save writes them): before, these loaded and crashed their readers (report's
    AttributeError on data, a sort of str against int on created)."""
    bad = tmp_path / "verify.json"
    bad.write_text(json.dumps({**RECORD, **change}))
    with pytest.raises(KvforgeError, match=r"verify.json: not a kvforge evidence record \(") as exc:
        evidence.read(bad)
    assert why in str(exc.value) and exc.value.exit_code == 2
    bad.write_text(json.dumps(RECORD))
    assert evidence.read(bad).key == evidence.Key("t", "vllm", "b" * 40, "0" * 16)
