"""The real thing: build kvforge's test environment and verify a real patch on the real vLLM 0.20.2 base.

The patch is made here (the project's own series may still be in flux): it makes
FreeKVCacheBlockQueue.popleft_n refuse to pop more blocks than are free with the same ValueError as
popleft (0.20.2 only has an `assert`) and adds a CPU test for it. verify must run that test on the
tree before the patch (old code, the patch's test file: it fails), after it (it passes), and a
slice of vLLM's own test_kv_cache_utils.py on the patched tree. A second, Kind refactor patch is
held to the regression suite only.

The environment is built once into ~/.cache/kvforge/envs (the CLI's own default, so CI builds it once) (or $KVFORGE_TEST_ENVS) and reused:
a cold build takes a few minutes (torch from the local CPU wheel, vLLM's requirements from PyPI).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import make_patch, write_series

from kvforge.core.cache import default_cache_dir
from kvforge.cli import main

UTILS = "vllm/v1/core/kv_cache_utils.py"
TEST_FILE = "tests/v1/core/test_kvforge_popleft_n_underflow.py"
CHECK = f"{TEST_FILE}::test_popleft_n_underflow_raises_value_error"
SELECTION = [
    "tests/v1/core/test_kv_cache_utils.py::test_free_kv_cache_block_queue_initialization",
    "tests/v1/core/test_kv_cache_utils.py::test_free_kv_cache_block_queue_operations",
    "tests/v1/core/test_kv_cache_utils.py::test_free_kv_cache_block_queue_popleft_n",
]
TARGET = """\
name = "t"
description = "vLLM 0.20.2 with a patch made by the test"

[[components]]
name = "vllm"
repo = "https://invalid.invalid/vllm.git"
ref = "v0.20.2"
series = "patches/t"
platforms = ["cpu"]

[components.release]
package = "vllm"
version = "0.20.2"
sha256 = "58809377798c5335c6e2fe30092abda54d9200b5b8a717b3735a63f5daa0e383"

[components.tests]
cpu = {selection}
"""
NEW_TEST = '''\
import pytest

from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

pytestmark = pytest.mark.cpu_test


def test_popleft_n_underflow_raises_value_error():
    queue = FreeKVCacheBlockQueue([KVCacheBlock(block_id=i) for i in range(3)])
    with pytest.raises(ValueError, match="No free blocks available"):
        queue.popleft_n(4)
'''
# Resolved at import, before fixtures point $KVFORGE_CACHE at a throw-away cache.
TEST_ENVS = Path(os.environ.get("KVFORGE_TEST_ENVS") or default_cache_dir() / "envs")
FIX = ("        assert self.num_free_blocks >= n\n",
       "        if self.num_free_blocks < n:\n            raise ValueError(\"No free blocks available\")\n")


@pytest.mark.slow
def test_verify_real_patch_on_vllm_0_20_2(project, base_v0202, monkeypatch):
    cache, base = base_v0202
    TEST_ENVS.mkdir(parents=True, exist_ok=True)
    if not (cache.root / "envs").exists():
        (cache.root / "envs").symlink_to(TEST_ENVS, target_is_directory=True)
    monkeypatch.delenv("KVFORGE_TEST_PYTHON", raising=False)
    (project / "targets" / "t.toml").write_text(TARGET.format(selection=json.dumps(SELECTION)))
    d = project / "patches" / "t"
    _, c1 = make_patch(base.repo, base.commit, {UTILS: FIX, TEST_FILE: ("", NEW_TEST)},
                       "[Core] popleft_n: ValueError on underflow", "popleft-n-underflow",
                       d / "0001-popleft-n-underflow.patch", kind="fix", extra=f"Checks: {CHECK}\n")
    make_patch(base.repo, c1, {UTILS: ("class FreeKVCacheBlockQueue:", "class FreeKVCacheBlockQueue:  # kvforge")},
               "[Misc] mark the queue", "mark-queue", d / "0002-mark-queue.patch", kind="refactor")
    write_series(project, "0001-popleft-n-underflow.patch", "0002-mark-queue.patch")

    env = CliRunner().invoke(main, ["env", "--target", "t", "--json"])
    assert env.exit_code == 0, env.output
    info = json.loads(env.stdout)
    assert info["packages"]["torch"].startswith("2.13.0") and "kvforge-cpu-platform" in info["packages"]

    res = CliRunner().invoke(main, ["verify", "--target", "t", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    fix, refactor = report["patches"]
    assert fix["status"] == "proven" and refactor["status"] == "pass-to-pass"
    (check,) = fix["checks"]
    assert (check["node"], check["before"], check["before_how"], check["after"]) == (
        CHECK, "failed", "from the patch", "passed")  # AssertionError from the old `assert`, not ValueError
    assert [r["state"] for r in report["runs"]] == [0, 1, 2]
    reg = report["regression"]
    assert reg["ok"] and reg["passed"] == len(SELECTION) + 1 and reg["failed"] == reg["errors"] == 0
    # Nothing fails on the patched tree: the base is not asked, nothing is new or pre-existing.
    cmp = reg["compare"]
    assert cmp["base_source"] == "not needed" and cmp["new"] == cmp["pre_existing"] == []
    assert report["env"] == info["key"]
