"""Behaviour decides watch's conflict rows (kvforge.flow.behaviour): the Checks without the fix on a release say
"upstream (by behaviour)", "needed" (the failing test and its line) or "needed?" (cannot run there), cached by
content and bounded by a budget; a needed fix's nearest variant is ported (`git am -3`) and proven (fails
without, passes with), or the conflict is reported with the release's change of that region. On the `fake`
upstream (real git, a real pytest run by this interpreter); the real releases are in the slow test at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CORE, git, make_patch
from test_watch import files_of, project_copy, serve_index

from kvforge.core.cache import Cache, default_cache_dir
from kvforge.core.errors import KvforgeError
from kvforge.flow import behaviour
from kvforge.flow.behaviour import Budget, Variant
from kvforge.flow.upstream import NewBase
from kvforge.flow.watch import checks_budget, upstream_clone
from kvforge.git.context import Context
from kvforge.project.series import parse_patch

FIX = {CORE: ("return max(lo, x)", "return min(max(lo, x), hi)")}
FIX_TEST = "tests/test_clamp.py"
TEST_TEXT = ("from vllm_like.core import clamp\n\n\ndef test_clamp_high():\n    assert clamp(9, 0, 5) == 5\n\n\n"
             "def test_clamp_low():\n    assert clamp(-1, 0, 5) == 0\n")
CHECKS = (f"{FIX_TEST}::test_clamp_high", f"{FIX_TEST}::test_clamp_low")


def _patch(fake, start: str, name: str = "0001-clamp-high"):
    extra = "".join(f"Checks: {c}\n" for c in CHECKS)
    (fake.root / "variants" / start[:8]).mkdir(parents=True, exist_ok=True)
    path, _commit = make_patch(fake.upstream, start, {**FIX, FIX_TEST: ("", TEST_TEXT)}, "[Core] clamp the high end",
                               "clamp-high", fake.root / "variants" / start[:8] / f"{name}.patch", kind="fix",
                               extra=extra)
    return parse_patch(path)


def _release(fake, edits: dict, message: str) -> str:
    git(fake.upstream, "checkout", "-q", "--detach", fake.base)
    for rel, (old, new) in edits.items():
        path = fake.upstream / rel
        path.write_text(path.read_text().replace(old, new, 1))
    git(fake.upstream, "commit", "-qam", message)
    return git(fake.upstream, "rev-parse", "HEAD").strip()


def _nb(fake, commit: str) -> NewBase:
    return NewBase(fake.upstream / ".git", commit, None, commit, True)


def _ctx(fake) -> Context:
    return Context.load(Cache(fake.cache), "fake")


def test_checks_without_the_fix_decide_and_are_cached(fake):
    """upstream (by behaviour) where the release has the fix, needed (the test and its line) where it does not,
    needed? where the Checks cannot run; a second watch takes every result from the cache (no run, even with a
    budget of 0), and a release not yet checked with no budget left says so."""
    patch = _patch(fake, fake.base)
    ctx = _ctx(fake)
    has = _release(fake, FIX, "upstream clamps too")
    renamed = _release(fake, {CORE: ("def clamp(x, lo, hi):", "def clip(x, lo, hi):")}, "rename clamp")
    budget = Budget(None)
    up = behaviour.without_fix(ctx, _nb(fake, has), patch, budget)
    assert up.state == behaviour.UPSTREAM and "all 2 Checks pass" in up.detail, up.detail
    assert up.evidence and Path(up.evidence).is_file() and "2 passed" in Path(up.evidence).read_text()
    needed = behaviour.without_fix(ctx, _nb(fake, fake.base), patch, budget)
    assert needed.state == behaviour.NEEDED, needed.detail
    assert f"{FIX_TEST}::test_clamp_high at {FIX_TEST}:5: " in needed.detail
    unsure = behaviour.without_fix(ctx, _nb(fake, renamed), patch, budget)
    assert unsure.state == behaviour.UNSURE and unsure.detail.startswith("cannot tell: 2 of 2 Checks cannot run")
    assert budget.used == 3
    none_left = Budget(0)
    again = [behaviour.without_fix(ctx, _nb(fake, c), patch, none_left) for c in (has, fake.base, renamed)]
    assert [(v.state, v.cached) for v in again] == [(behaviour.UPSTREAM, True), (behaviour.NEEDED, True),
                                                    (behaviour.UNSURE, True)]
    other = _release(fake, {CORE: ("def double(x):", "def double(x):  # unchanged")}, "another release")
    assert behaviour.without_fix(ctx, _nb(fake, other), patch, none_left).state == behaviour.BUDGET
    assert not list((Path(fake.cache) / "trees" / ".work").glob(".upstream-checks.*"))  # nothing left behind


def test_a_needed_fix_is_ported_from_its_nearest_variant_and_proven(fake):
    """The release moved the lines around the fix (a comment above its line): the series' own patch conflicts
    (reported: the file, the hunk, and the release's change of that region since the old base); a variant made
    on the release applies, its Checks fail without it and pass with it: port proven, the patch kept ready."""
    own = _patch(fake, fake.base)
    release = _release(fake, {CORE: ("    return max(lo, x)", "    # the low end only\n    return max(lo, x)")},
                       "upstream comments clamp")
    near = _patch(fake, release)
    ctx = _ctx(fake)
    nb = _nb(fake, release)
    stuck = behaviour.port(ctx, nb, fake.base, [Variant("fake", "0.0.1", own, None)], Budget(None))
    assert stuck.state == "needs a person", stuck.detail
    assert stuck.conflict["file"] == CORE, stuck.conflict
    assert f"git diff {fake.base[:12]} {release[:12]} -- {CORE}" in stuck.conflict["upstream"]
    assert "1 hunk in vllm_like/core.py" in stuck.detail
    proven = behaviour.port(ctx, nb, fake.base, [Variant("newer", "0.0.2", near, None),
                                                 Variant("fake", "0.0.1", own, None)], Budget(None))
    assert proven.state == "port proven", proven.detail
    assert proven.source == "newer" and "1 of its 2 Checks fail without it, all pass with it" in proven.detail
    ready = Path(proven.patch_file or "")
    assert b"return min(max(lo, x), hi)" in ready.read_bytes() and b"Fix-Id: clamp-high" in ready.read_bytes()
    # The repository the release lives in is not touched (the port runs in a temporary shared clone).
    assert git(fake.upstream, "rev-parse", "HEAD").strip() == release
    cached = behaviour.port(ctx, nb, fake.base, [Variant("newer", "0.0.2", near, None)], Budget(0))
    assert (cached.state, cached.patch_file) == ("port proven", proven.patch_file)


KNOB_TEST = ("from vllm_like.core import clamp\n\n\ndef test_clamp_high():\n    assert clamp(9, 0, 5) == 5\n\n\n"
             "def test_clamp_empty_range_is_hi():\n    assert clamp(3, 5, 1) == 1\n")
KNOB_CHECKS = (f"{FIX_TEST}::test_clamp_high", f"{FIX_TEST}::test_clamp_empty_range_is_hi")


def test_only_the_bug_checks_say_whether_the_release_has_the_bug(fake):
    """Upstream fixed the high end in another shape (max(lo, min(x, hi))): the bug's Check passes there, the
    variant's Check of its own choice (an empty range gives hi) fails for a behavioural reason. Without
    Bug-Checks that failure reads `needed` (what watch said of swa-retention-queue-split on vLLM 0.27-0.31);
    with `Bug-Checks: ...::test_clamp_high` the release is upstream (by behaviour) and the other Check is
    reported, not counted. On the old base the bug's Check fails: needed either way."""
    ctx = _ctx(fake)
    start = fake.base
    (fake.root / "variants" / "knob").mkdir(parents=True, exist_ok=True)
    patches = {}
    for name, extra in (("all", ""), ("bug", f"Bug-Checks: {KNOB_CHECKS[0]}\n")):
        path, _ = make_patch(fake.upstream, start, {**FIX, FIX_TEST: ("", KNOB_TEST)}, "[Core] clamp the high end",
                             "clamp-high", fake.root / "variants" / "knob" / f"0001-{name}.patch", kind="fix",
                             extra="".join(f"Checks: {c}\n" for c in KNOB_CHECKS) + extra)
        patches[name] = parse_patch(path)
        assert patches[name].problems == [], patches[name].problems
    other_shape = _release(fake, {CORE: ("return max(lo, x)", "return max(lo, min(x, hi))")}, "upstream: another shape")
    nb = _nb(fake, other_shape)
    wrong = behaviour.without_fix(ctx, nb, patches["all"], Budget(None))
    assert wrong.state == behaviour.NEEDED and "test_clamp_empty_range_is_hi" in wrong.detail, wrong.detail
    right = behaviour.without_fix(ctx, nb, patches["bug"], Budget(None))
    assert right.state == behaviour.UPSTREAM, right.detail
    assert "all 1 Bug-Checks pass" in right.detail and "1 other Check (what the variant adds) 1 failed" in right.detail
    assert behaviour.without_fix(ctx, _nb(fake, fake.base), patches["bug"], Budget(None)).state == behaviour.NEEDED
    # The rebase's checks signal judges the same nodes.
    sig = behaviour.judge_checks({KNOB_CHECKS[0]: ("passed", ""), KNOB_CHECKS[1]: ("failed", "AssertionError")},
                                 patches["bug"].bug_checks)
    assert (sig.fired, sig.strong) == (True, True), sig.detail


def test_a_releases_rows_share_one_pytest_run(fake):
    """prefetch runs the Checks of two patches with disjoint test files in one pytest (one run from the budget),
    and each patch's verdict read afterwards from the cache is the one a run of its own gives; a patch that
    checks a test file another one adds goes in a batch of its own."""
    ctx = _ctx(fake)
    high = _patch(fake, fake.base)
    low_test = "tests/test_clamp_low.py"
    (fake.root / "variants" / "low").mkdir(parents=True, exist_ok=True)
    path, _ = make_patch(fake.upstream, fake.base, {**FIX, low_test: ("", "from vllm_like.core import clamp\n\n\n"
                         "def test_low():\n    assert clamp(-3, 0, 5) == 0\n")}, "[Core] clamp the low end", "clamp-low",
                         fake.root / "variants" / "low" / "0002-clamp-low.patch", kind="fix",
                         extra=f"Checks: {low_test}::test_low\n")
    low = parse_patch(path)
    path, _ = make_patch(fake.upstream, fake.base, FIX, "[Core] also checks clamp", "clamp-again",
                         fake.root / "variants" / "low" / "0003-clamp-again.patch", kind="fix",
                         extra=f"Checks: {CHECKS[0]}\n")
    again = parse_patch(path)
    assert [[p.fix_id for p in g] for g in behaviour.batches([high, low, again])] == \
        [["clamp-high", "clamp-low"], ["clamp-again"]]
    nb = _nb(fake, fake.base)
    budget = Budget(None)
    assert behaviour.prefetch(ctx, nb, [high, low], budget) == 1 and budget.used == 1
    none_left = Budget(0)
    got = {p.fix_id: behaviour.without_fix(ctx, nb, p, none_left) for p in (high, low)}
    assert got["clamp-high"].state == behaviour.NEEDED and got["clamp-high"].cached, got["clamp-high"].detail
    assert f"{FIX_TEST}::test_clamp_high at {FIX_TEST}:5: " in got["clamp-high"].detail
    assert got["clamp-low"].state == behaviour.UPSTREAM and got["clamp-low"].cached, got["clamp-low"].detail
    assert "all 1 Checks pass" in got["clamp-low"].detail
    assert got["clamp-high"].evidence == got["clamp-low"].evidence  # one run, one log
    assert behaviour.prefetch(ctx, nb, [high, low], Budget(0)) == 0  # both cached: nothing to run


def test_a_port_is_proven_on_the_patches_carried_before_it(fake):
    """The variant of clamp-high calls hi_of(), which the patch before it in the series adds. On the bare release
    its Checks cannot import hi_of (nothing proven); on the release with that patch carried (what watch's
    `_under` gives a row: the last carried commit of the dry run before it) they fail without the port and pass
    with it: port proven there, and the ready patch applies in series order."""
    ctx = _ctx(fake)
    release = _release(fake, {CORE: ("def double(x):", "def double(x):  # a release")}, "a release")
    out = fake.root / "variants" / "under"
    out.mkdir(parents=True)
    first, first_commit = make_patch(fake.upstream, release, {CORE: ("def double(x):", "def hi_of(hi):\n    return hi"
                                                                     "\n\n\ndef double(x):")},
                                     "[Core] hi_of", "hi-of", out / "0001-hi-of.patch")
    test = ("from vllm_like.core import clamp, hi_of\n\n\ndef test_clamp_high():\n    assert clamp(9, 0, hi_of(5)) == 5\n")
    path, _ = make_patch(fake.upstream, first_commit, {CORE: ("return max(lo, x)", "return min(max(lo, x), hi_of(hi))"),
                                                       FIX_TEST: ("", test)}, "[Core] clamp the high end",
                         "clamp-high", out / "0002-clamp-high.patch", kind="fix",
                         extra=f"Checks: {FIX_TEST}::test_clamp_high\nDepends-On: hi-of\n")
    variant = [Variant("newer", "0.0.2", parse_patch(path), None)]
    bare = behaviour.port(ctx, _nb(fake, release), fake.base, variant, Budget(None))
    assert bare.state == "needs a person" and "nothing proven" in bare.detail, bare.detail
    under = behaviour.port(ctx, _nb(fake, first_commit), fake.base, variant, Budget(None), release=release)
    assert under.state == "port proven", under.detail
    assert parse_patch(Path(first)).fix_id == "hi-of"


def test_under_is_the_last_carried_commit_before_each_patch():
    from kvforge.flow.rebase.state import Step, Verdict
    from kvforge.flow.watch import carried_under as _under

    class Result:
        patches = [Step("1", "a", Verdict.CARRIED, commit="c1"), Step("2", "b", Verdict.CONFLICT),
                   Step("3", "c", Verdict.UPSTREAM), Step("4", "d", Verdict.CARRIED, commit="c4"),
                   Step("5", "e", Verdict.CONFLICT)]

    assert _under(Result()) == [(None, 0), ("c1", 1), ("c1", 1), ("c1", 1), ("c4", 2)]  # type: ignore[arg-type]


def test_pytest_that_cannot_start_on_a_release_is_each_rows_cannot_tell(fake):
    """The release's tests/conftest.py does not import in the environment (vllm-ascend's on a vLLM it was not
    made for): pytest exits 4 before any test. Batched or alone, each row says "cannot tell" with the reason,
    cached (the same tree and environment fail again), and no exception ends the release's check."""
    ctx = _ctx(fake)
    high = _patch(fake, fake.base)
    low_test = "tests/test_clamp_low.py"
    (fake.root / "variants" / "nostart").mkdir(parents=True, exist_ok=True)
    path, _ = make_patch(fake.upstream, fake.base, {**FIX, low_test: ("", "def test_low():\n    assert True\n")},
                         "[Core] clamp the low end", "clamp-low", fake.root / "variants" / "nostart" / "0002-low.patch",
                         kind="fix", extra=f"Checks: {low_test}::test_low\n")
    low = parse_patch(path)
    git(fake.upstream, "checkout", "-q", "--detach", fake.base)
    (fake.upstream / "tests" / "conftest.py").write_text("import vllm_like.not_in_this_release\n")
    git(fake.upstream, "add", "tests/conftest.py")
    git(fake.upstream, "commit", "-qm", "a conftest this environment cannot import")
    broken = _nb(fake, git(fake.upstream, "rev-parse", "HEAD").strip())
    assert behaviour.prefetch(ctx, broken, [high, low], Budget(None)) == 1
    for p in (high, low):
        v = behaviour.without_fix(ctx, broken, p, Budget(0))
        assert v.state == behaviour.UNSURE and v.cached, v.detail
        assert v.detail.startswith("cannot tell: pytest could not run on the release (exit 4, usage error): ")
        assert "not_in_this_release" in v.detail and str(fake.cache) not in v.detail, v.detail
    alone = behaviour.run_without_fix(ctx, broken, high)
    assert alone.error and alone.error.startswith("pytest could not run on the release") and behaviour.kept(alone)


def test_the_checks_budget_is_a_count(monkeypatch):
    monkeypatch.delenv("KVFORGE_WATCH_CHECKS", raising=False)
    assert checks_budget(None) is None and checks_budget(3) == 3
    monkeypatch.setenv("KVFORGE_WATCH_CHECKS", "0")
    assert checks_budget(None) == 0
    monkeypatch.setenv("KVFORGE_WATCH_CHECKS", "many")
    with pytest.raises(KvforgeError, match=r"^\$KVFORGE_WATCH_CHECKS 'many': not a number") as exc:
        checks_budget(None)
    assert exc.value.exit_code == 2
    with pytest.raises(KvforgeError, match=r"^--checks -1: "):
        checks_budget(-1)


# ---------------------------------------------------------------- slow: a real conflict, ported and proven


REAL_INDEX = json.loads((Path(__file__).resolve().parent / "data" / "pypi_watch_index.json").read_text())
# Resolved at import, before a test points $KVFORGE_CACHE elsewhere: the user's built CPU environments and releases.
USER_CACHE = Cache(default_cache_dir())


@pytest.mark.slow
def test_a_real_conflict_becomes_a_proven_port(tmp_path):
    """v0.20.2rc onto the real vLLM 0.33.0 (a local index serving the real sdist): kv-events-token-ids conflicts
    there (docs/upstream-truth.md: 0.33.0 still slices BlockStored.token_ids over the whole range). Its Checks
    fail on 0.33.0 without the fix (needed, the failing test and its line), main's variant (the nearest: main is
    0.33.0) applies with `git am -3` and its Checks fail without it and pass with it: port proven, the ready patch
    kept in the cache. The rows 0.33.0 has upstream stay "upstream"; the release's cost is 0; nothing in the
    project is written. A second watch takes every result from the cache (no Checks run). Cost: 0.33.0's CPU
    environment (key 61a91e4ae2116172, the same as target main's) is linked from the user cache; on a fresh
    machine it is built once (several minutes) for this test and target main's own tests."""
    for name in ("vllm-0.33.0.tar.gz",):
        assert (USER_CACHE.downloads / name).is_file(), f"{name} is not in the user cache (run tests/test_watch.py)"
    root = project_copy(tmp_path / "project")
    before = files_of(root)
    cache = tmp_path / "cache"
    (cache / "downloads").mkdir(parents=True)
    (cache / "downloads" / "vllm-0.33.0.tar.gz").symlink_to(USER_CACHE.downloads / "vllm-0.33.0.tar.gz")
    USER_CACHE.envs.mkdir(parents=True, exist_ok=True)
    (cache / "envs").symlink_to(USER_CACHE.envs, target_is_directory=True)
    env = {**os.environ, "KVFORGE_ROOT": str(root), "KVFORGE_CACHE": str(cache)}
    for k in ("KVFORGE_OFFLINE", "KVFORGE_VLLM_REPO", "KVFORGE_CRASH_AT", "KVFORGE_TEST_PYTHON", "KVFORGE_WATCH_CHECKS"):
        env.pop(k, None)
    argv = [sys.executable, "-m", "kvforge.cli", "watch", "-t", "v0.20.2rc", "--since", "0.22.0"]
    with serve_index(REAL_INDEX, USER_CACHE.downloads) as url:
        env["KVFORGE_PYPI_URL"] = url
        res = subprocess.run([*argv, "--json"], env=env, capture_output=True, text=True, timeout=1200)
        again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1200)
    assert res.returncode == 3, res.stderr[-3000:]
    doc = json.loads(res.stdout)
    (rel,) = doc["releases"]
    rows = {p["fix_id"]: p for p in rel["checks"][0]["patches"]}
    assert {f: (p["verdict"], p["decision"]) for f, p in rows.items()} == {
        "two-phase-kv-alloc": ("upstream", "upstream"), "swa-reachable-cache-mask": ("upstream", "upstream"),
        "kv-events-token-ids": ("conflict", "port proven"), "swa-retention-queue-split": ("upstream", "upstream"),
        "eagle-lookahead-block-hashes": ("upstream", "upstream")}
    kv = rows["kv-events-token-ids"]
    # The series' own Checks cannot run on 0.33.0 (KVCacheManager's signature changed): main's variant's Checks,
    # failing without it and passing with it there, prove the fix needed and the port.
    assert kv["behaviour"] == "needed?" and "cannot run on the release" in kv["why"], kv["why"]
    assert "main's variant applies" in kv["why"] and "Checks fail without it, all pass with it" in kv["why"]
    assert kv["port"]["source"] == "main" and kv["port"]["state"] == "port proven", kv["port"]
    ready = Path(kv["port"]["patch_file"]).read_bytes()
    assert b"Fix-Id: kv-events-token-ids" in ready and b"vllm/v1/core/block_pool.py" in ready
    assert Path(kv["evidence"]).is_file()
    assert rel["cost"] == 0 and doc["cost"] == 0 and doc["checks_run"] >= 1
    assert files_of(root) == before  # nothing written in the project
    assert again.returncode == 3, again.stderr[-3000:]
    line = next(ln for ln in again.stdout.splitlines() if ln.startswith("  kv-events-token-ids: port proven: "))
    print(line)
    assert "main's variant applies" in line and "ready: " in line
    assert "0 rows need a person" in again.stdout
    assert "its Checks without the fix" in again.stderr and "pytest" not in again.stderr  # all from the cache


def test_history_answers_first_with_a_clone(fake, monkeypatch):
    """--source git: a clone of upstream says "upstream" by ancestry (the recorded Upstream-Commit is an ancestor
    of the release's tag) or by patch-id (a commit since the old base has the patch's); a commit that is not an
    ancestor, or no match, is no answer (None: the Checks decide). Only with --source git and a local clone."""
    patch = _patch(fake, fake.base)
    landed = _release(fake, FIX, "upstream lands the clamp fix")
    git(fake.upstream, "tag", "v2", landed)
    elsewhere = _release(fake, {CORE: ("def double(x):", "def double(x):  # a release branch")}, "elsewhere")
    git(fake.upstream, "tag", "v3", elsewhere)
    with_commit = parse_patch(Path(patch.path), patch.raw.replace(b"Fix-Id:", f"Upstream-Commit: {landed[:10]}\n"
                                                                              f"Fix-Id:".encode()))
    assert behaviour.by_history(fake.upstream, "v2", None, with_commit) == \
        f"Upstream-Commit {landed[:10]} is an ancestor of v2"
    assert behaviour.by_history(fake.upstream, "v3", "v1", with_commit) is None  # not an ancestor: no answer
    same = git(fake.upstream, "commit-tree", git(fake.upstream, "rev-parse", f"{_commit_of(fake, patch)}^{{tree}}").strip(),
               "-p", fake.base, "-m", "upstream's own commit of the same change").strip()
    git(fake.upstream, "tag", "v4", same)
    found = behaviour.by_history(fake.upstream, "v4", "v1", patch)
    assert found == f"commit {same[:12]} since v1 has the patch's git patch-id --stable", found
    assert behaviour.by_history(fake.upstream, "v9", "v1", patch) is None  # no such tag
    ctx = _ctx(fake)
    assert upstream_clone(ctx) is None  # --source sdist/auto: no history asked
    assert upstream_clone(Context(ctx.cache, ctx.target, ctx.component, "git")) == fake.upstream


def _commit_of(fake, patch) -> str:
    """The patch applied on the fake base, committed (the same change as the patch, another commit)."""
    tree = fake.root / "am"
    git(fake.upstream, "worktree", "add", "-q", "--detach", str(tree), fake.base)
    git(tree, "am", "-q", str(patch.path))
    return git(tree, "rev-parse", "HEAD").strip()


def test_the_environment_of_a_component_on_vllm_is_keyed_by_vllms_series(tmp_path, fake):
    """vllm-ascend's Checks run in an environment holding vLLM's patched tree: a change of one vLLM patch is
    another environment key (no result made with the old series is read); the same series is the same key."""
    from types import SimpleNamespace

    from conftest import REPO_ROOT

    series = tmp_path / "vllm-series"
    series.mkdir()
    for f in (REPO_ROOT / "patches" / "v0.20.2rc").iterdir():
        (series / f.name).write_bytes(f.read_bytes())
    vllm = SimpleNamespace(release=SimpleNamespace(version="0.20.2", sha256="ab"), series_dir=series)
    ctx_like = SimpleNamespace(component=SimpleNamespace(requires="vllm"),
                               target=SimpleNamespace(component=lambda _name: vllm))
    nb = _nb(fake, fake.base)
    key = behaviour.env_fingerprint(ctx_like, nb)
    assert key == behaviour.env_fingerprint(ctx_like, nb) and key.startswith("vllm-0.20.2-ab-")
    patch = sorted(series.glob("0004-*.patch"))[0]
    patch.write_bytes(patch.read_bytes().replace(b"Bug-Checks:", b"Checks:", 1))
    assert behaviour.env_fingerprint(ctx_like, nb) != key
