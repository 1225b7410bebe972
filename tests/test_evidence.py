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
