"""The real thing: `kvforge bench prefix-cache` on vLLM 0.20.1's base tree and on the tree patched
with the project's own series (patches/v0.20.1), in kvforge's test environment, at small scale.

The base must show both bugs (DSv4 A,A,B,A: the re-sent A.3 misses entirely; a local prefix hit
plus external tokens hands the same block to two KV cache groups) and the patched tree must not.
One bench run (both trees) is shared by the tests of this module; each tree's replay is the package
kvforge/bench/replay/ run by that environment's python, exactly as the CLI runs it.

The environment comes from $KVFORGE_TEST_PYTHON when set, else it is built once into
~/.cache/kvforge/envs (the CLI's own default, so CI builds it once) (or $KVFORGE_TEST_ENVS) and reused; the sdist comes from the user's
kvforge cache (downloaded there once).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvforge.core.cache import Cache, default_cache_dir
from kvforge.cli import main

REPO_ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = "dsv4-resend,external-hit,gemma4-dflash,gptoss-eagle"
SCALE = "0.05"


@pytest.fixture(scope="module")
def bench_v0201(tmp_path_factory) -> dict:
    cache = Cache(tmp_path_factory.mktemp("kvforge-bench-cache"))
    src = default_cache_dir() / "downloads" / "vllm-0.20.1.tar.gz"
    if not src.is_file():
        from kvforge.git.bases import download_sdist
        from kvforge.project.targets import load_target

        download_sdist(load_target("v0.20.1", REPO_ROOT).component(), Cache(default_cache_dir()), print)
    shutil.copy2(src, cache.downloads / src.name)
    if not os.environ.get("KVFORGE_TEST_PYTHON"):
        envs = Path(os.environ.get("KVFORGE_TEST_ENVS") or default_cache_dir() / "envs")
        envs.mkdir(parents=True, exist_ok=True)
        (cache.root / "envs").symlink_to(envs, target_is_directory=True)
    res = CliRunner().invoke(main, ["--cache-dir", str(cache.root), "bench", "prefix-cache", "--target", "v0.20.1",
                                    "--scenario", SCENARIOS, "--scale", SCALE, "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert set(doc["trees"]) == {"base", "patched"}, doc.get("note")
    return doc


def row(doc: dict, label: str) -> dict:
    return next(r for r in doc["rows"] if r["label"] == label)


def hit_rate(summary: dict, label: str) -> float:
    r = next(r for r in summary["per_request"] if r["label"] == label)
    return r["hit"] / r["prompt"]


@pytest.mark.slow
def test_base_dsv4_resend_misses_the_third_a(bench_v0201):
    base = row(bench_v0201, "dsv4-resend")["base"]
    assert base["vllm"] == "0.20.1"
    assert hit_rate(base, "A.2") > 0.99  # the immediate re-send hits
    assert hit_rate(base, "A.3") == 0.0  # after B, A's cache keys are gone: the reported 0%
    assert base["violations"] == 0


@pytest.mark.slow
def test_base_external_hit_shares_blocks_between_groups(bench_v0201):
    base = row(bench_v0201, "external-hit")["base"]
    assert base["trigger_held"] > 0
    assert base["block_ids_in_two_groups"] > 0


@pytest.mark.slow
def test_patched_dsv4_resend_hits_the_third_a(bench_v0201):
    patched = row(bench_v0201, "dsv4-resend")["patched"]
    assert hit_rate(patched, "A.3") >= 0.99
    assert patched["violations"] == 0


@pytest.mark.slow
def test_patched_external_hit_keeps_groups_apart(bench_v0201):
    patched = row(bench_v0201, "external-hit")["patched"]
    assert patched["trigger_held"] > 0  # the triggering condition still occurs: the fix is what changed
    assert patched["block_ids_in_two_groups"] == 0
    assert patched["violations"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["gemma4-dflash", "gptoss-eagle"])
def test_drafters_keep_their_last_hit_block_when_patched(bench_v0201, scenario):
    """Base drops one block per request for the EAGLE-style drafter; patched (lookahead block
    hashes) serves everything that is sound for it: the lookahead bound, which is the no-spec
    rate wherever a request does not leave a cached sequence exactly at a block boundary."""
    spec, nospec = row(bench_v0201, scenario), row(bench_v0201, f"{scenario}/nospec")
    bound = spec["patched"]["lookahead_ceiling_hits"]
    assert spec["base"]["admitted_hits"] < bound
    assert spec["patched"]["admitted_hits"] == bound
    assert spec["patched"]["violations"] == 0
    assert nospec["patched"]["admitted_hits"] == nospec["base"]["admitted_hits"]
    assert nospec["patched"]["admitted_hits"] >= spec["patched"]["admitted_hits"]
    if scenario == "gemma4-dflash":  # no request leaves at a 64-token boundary
        assert spec["patched"]["admitted_hits"] == nospec["patched"]["admitted_hits"]


@pytest.mark.slow
def test_bench_json_names_the_evidence(bench_v0201):
    """Target, component, base, series digest and origin: what `kvforge pr` matches evidence against."""
    from kvforge.project.series import load_clean_series
    from kvforge.project.targets import load_target

    comp = load_target("v0.20.1", REPO_ROOT).component()
    series = load_clean_series(comp)
    doc = bench_v0201
    assert (doc["target"], doc["component"], doc["base_ref"]) == ("v0.20.1", "vllm", "v0.20.1")
    assert doc["origin"] == "series"
    assert doc["base"] == doc["trees"]["base"]["commit"]
    assert doc["series"] == series.digest and doc["patches"] == len(series.patches)
    for state, tree in doc["trees"].items():
        replay_doc = json.loads(Path(tree["result_file"]).read_text())
        assert replay_doc["errors"] == [] and {r["scenario"] for r in replay_doc["results"]} == set(SCENARIOS.split(","))
