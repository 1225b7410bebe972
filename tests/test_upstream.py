"""Is a fix already upstream? Each signal on a real git repository (the `fake` fixture), and decide().

The fake upstream is a tiny vLLM-like tree with real git history, so every signal is exercised on
real `git apply`, `git cherry`, `git merge-base` and a real pytest run; the real vLLM releases are
measured by docs/upstream-truth.md, not here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CORE, git, make_patch

from kvforge.project.series import parse_patch
from kvforge.flow.behaviour import checks_signal, judge_checks
from kvforge.flow.upstream import (NewBase, Signal, decide, evaluate_drop_when, gather, new_base_info, patch_id_signal,
                                   reverse_apply_signal, upstream_commit_signal)

FIX = {CORE: ("return max(lo, x)", "return min(max(lo, x), hi)")}
FIX_TEST = "tests/test_clamp.py"
TEST_TEXT = ("from vllm_like.core import clamp\n\n\ndef test_clamp_high():\n    assert clamp(9, 0, 5) == 5\n\n\n"
             "def test_clamp_low():\n    assert clamp(-1, 0, 5) == 0\n")
CHECKS = (f"{FIX_TEST}::test_clamp_high", f"{FIX_TEST}::test_clamp_low")


def S(name: str, fired, strong: bool) -> Signal:
    return Signal(name, fired, strong, "")


def fs(sig: Signal) -> tuple:
    return sig.fired, sig.strong


def _patch(fake, edits: dict, name: str = "0001-clamp-high", drop_when: str | None = None, extra: str = ""):
    """An annotated fix patch on the fake base (its commit is in the upstream repository)."""
    extra += "".join(f"Checks: {c}\n" for c in CHECKS if FIX_TEST in edits)
    path, commit = make_patch(fake.upstream, fake.base, edits, "[Core] clamp the high end", name.split("-", 1)[1],
                              fake.root / "patches" / "fake" / f"{name}.patch", kind="fix", extra=extra)
    raw = path.read_bytes()
    if drop_when:
        raw = raw.replace(b"Drop-When: never", f"Drop-When: {drop_when}".encode())
        path.write_bytes(raw)
    return parse_patch(path, raw), commit


def _upstream_commit(fake, edits: dict, message: str, start: str | None = None) -> str:
    """A commit of upstream's own on `start` (default: the base), written without a checkout."""
    start = start or fake.base
    git(fake.upstream, "checkout", "-q", "--detach", start)
    for rel, (old, new) in edits.items():
        path = fake.upstream / rel
        text = path.read_text() if old else ""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.replace(old, new, 1) if old else new)
    git(fake.upstream, "add", "-A")
    git(fake.upstream, "commit", "-qm", message)
    return git(fake.upstream, "rev-parse", "HEAD").strip()


def _nb(fake, commit: str, version: str | None = None, upstream: str | None = None, history: bool = True) -> NewBase:
    return NewBase(fake.upstream / ".git", commit, version, upstream or commit, history)


# ---------------------------------------------------------------- decide()

@pytest.mark.parametrize("signals, verdict", [
    ([], "carried"),
    ([S("checks", None, False)], "carried"),
    # never "upstream" on one weak signal
    ([S("checks", True, False)], "carried"),
    ([S("upstream-commit", True, False), S("reverse-apply", None, False)], "carried"),
    # one strong signal for and nothing against
    ([S("reverse-apply", True, True), S("patch-id", None, False)], "upstream"),
    ([S("drop-when", True, True), S("checks", None, False)], "upstream"),
    # two different weak signals for, none against
    ([S("checks", True, False), S("upstream-commit", True, False)], "upstream"),
    ([S("checks", True, False), S("upstream-commit", True, False), S("drop-when", False, False)], "carried"),
    # strong signals on both sides: the rebase stops
    ([S("drop-when", True, True), S("checks", False, True)], "disagree"),
    ([S("reverse-apply", True, True), S("checks", False, True), S("drop-when", True, True)], "disagree"),
    # one strong for, a weak one against: stop and show; two strong for outweigh a weak one
    ([S("drop-when", True, True), S("reverse-apply", False, False)], "disagree"),
    ([S("drop-when", True, True), S("reverse-apply", True, True), S("upstream-commit", False, False)], "upstream"),
    # evidence against only
    ([S("checks", False, True), S("drop-when", False, False)], "carried"),
    ([S("reverse-apply", False, False)], "carried"),
])
def test_decide(signals, verdict):
    got, reason = decide(signals)
    assert got == verdict, reason
    assert reason and "\n" not in reason


def test_decide_never_drops_when_strong_signals_disagree():
    """The worst outcome is dropping a fix the base lacks: Drop-When says the version is reached but the
    Checks fail on the new base, so the verdict is disagree, and the reason names both sides."""
    verdict, reason = decide([S("reverse-apply", None, False), S("patch-id", None, False),
                              S("upstream-commit", None, False), S("drop-when", True, True), S("checks", False, True)])
    assert verdict == "disagree"
    assert "drop-when" in reason and "checks" in reason


# ---------------------------------------------------------------- the signals, on a real repository

def test_reverse_apply(fake):
    patch, _ = _patch(fake, {**FIX, FIX_TEST: ("", TEST_TEXT)})
    # Upstream took the fix but not our test: the non-test hunks apply in reverse.
    has = _upstream_commit(fake, FIX, "upstream clamps too")
    assert reverse_apply_signal(_nb(fake, has), patch) == Signal(
        "reverse-apply", True, True, "the fix's hunks (1 non-test file) apply in reverse: the base has them")
    # The old base: the fix applies forward, not in reverse (weak evidence against).
    sig = reverse_apply_signal(_nb(fake, fake.base), patch)
    assert (sig.fired, sig.strong) == (False, False)
    # Upstream rewrote the function another way: neither direction applies.
    other = _upstream_commit(fake, {CORE: ("return max(lo, x)", "return hi if x > hi else max(lo, x)")}, "other")
    sig = reverse_apply_signal(_nb(fake, other), patch)
    assert sig.fired is None and "neither" in sig.detail
    # A patch of tests only says nothing.
    tests_only, _ = _patch(fake, {FIX_TEST: ("", TEST_TEXT)}, name="0002-clamp-tests")
    assert reverse_apply_signal(_nb(fake, has), tests_only).fired is None


def test_patch_id(fake):
    patch, commit = _patch(fake, FIX)
    # Upstream cherry-picked it (same diff, another commit): same patch-id.
    picked = _upstream_commit(fake, FIX, "[Core] clamp the high end (#1)")
    assert patch_id_signal(_nb(fake, picked), commit) == Signal(
        "patch-id", True, True, "a commit since the old base has the same git patch-id --stable")
    # Squash-merged with another change: another patch-id, which is not evidence either way.
    squashed = _upstream_commit(fake, {**FIX, "vllm_like/extra.py": ("", "X = 1\n")}, "[Core] clamp and more (#2)")
    sig = patch_id_signal(_nb(fake, squashed), commit)
    assert sig.fired is None and "squash" in sig.detail
    # Without history, nothing to compare.
    assert patch_id_signal(_nb(fake, picked, history=False), commit).fired is None
    assert patch_id_signal(_nb(fake, picked), None).fired is None


def test_upstream_commit(fake):
    first = _upstream_commit(fake, FIX, "upstream fix")
    later = _upstream_commit(fake, {"vllm_like/extra.py": ("", "X = 1\n")}, "later", start=first)
    side = _upstream_commit(fake, {"vllm_like/side.py": ("", "Y = 2\n")}, "side branch")
    nb = _nb(fake, later)
    assert upstream_commit_signal(nb, [first[:9]]).fired is True
    sig = upstream_commit_signal(nb, [first[:9], side[:9]])
    assert (sig.fired, sig.strong) == (False, False) and side[:9] in sig.detail
    assert upstream_commit_signal(nb, ["0123456789"]).fired is None
    assert upstream_commit_signal(nb, []).fired is None
    # An sdist base has no history: only its own recorded commit answers.
    sdist = _nb(fake, later, upstream=later[:9], history=False)
    assert upstream_commit_signal(sdist, [later[:10]]).fired is True
    sig = upstream_commit_signal(sdist, [first[:9]])
    assert sig.fired is None and later[:9] in sig.detail


def test_drop_when(fake):
    first = _upstream_commit(fake, FIX, "upstream fix")
    side = _upstream_commit(fake, {"vllm_like/side.py": ("", "Y = 2\n")}, "side branch")
    nb = _nb(fake, first, version="0.22.0")
    assert evaluate_drop_when("version >= 0.22.0", nb) == Signal("drop-when", True, True,
                                                                 "version >= 0.22.0: the base is 0.22.0")
    assert fs(evaluate_drop_when("version >= 0.22.1", nb)) == (False, False)
    assert evaluate_drop_when("version >= 0.9", nb).fired is True  # numeric, not string, comparison
    assert evaluate_drop_when("version >= 0.22.0", _nb(fake, first)).fired is None  # a branch: no version
    assert fs(evaluate_drop_when(f"base-contains {first[:9]}", nb)) == (True, True)
    assert fs(evaluate_drop_when(f"base-contains {side[:9]}", nb)) == (False, False)
    no_history = _nb(fake, side, upstream=side[:9], history=False)
    assert evaluate_drop_when(f"base-contains {first[:9]}", no_history).fired is None
    assert evaluate_drop_when(f"base-contains {side}", no_history).fired is True
    assert evaluate_drop_when("upstream-pr-merged https://github.com/vllm-project/vllm/pull/44488", nb).fired is None
    assert evaluate_drop_when("never [downstream only]", nb).fired is None


def test_new_base_info(fake, base_v0202):
    from kvforge.git.bases import ensure_base
    from kvforge.core.cache import Cache
    from kvforge.project.targets import load_target, parse_target

    comp = load_target("fake").component()
    base = ensure_base(comp, Cache(fake.cache))  # $KVFORGE_VLLM_REPO: a shallow git fetch of v1
    nb = new_base_info(base, comp)
    assert (nb.commit, nb.upstream_commit, nb.version, nb.has_history) == (fake.base, fake.base, None, False)
    cache, sdist = base_v0202
    project = cache.root / "project-for-base"
    nb = new_base_info(sdist, parse_target(project / "targets" / "t.toml", project).component())
    assert (nb.commit, nb.version, nb.upstream_commit, nb.has_history) == (sdist.commit, "0.20.2", "bc150f502", False)


def test_judge_checks_classifies_failures():
    ok = ("passed", "")
    behaviour = ("failed", "AssertionError: assert 9 == 5")
    drift = ("failed", "TypeError: KVCacheManager.__init__() missing 1 required positional argument: 'x'")
    absent = ("error", "collection error: ImportError: cannot import name 'clamp' from 'vllm_like.core'")
    assert fs(judge_checks({"a": ok, "b": ok})) == (True, True)
    assert fs(judge_checks({"a": ok, "b": drift})) == (True, False)
    assert judge_checks({"a": drift, "b": absent}).fired is None
    assert fs(judge_checks({"a": ok, "b": behaviour, "c": drift})) == (False, True)
    assert judge_checks({}).fired is None


def _ctx(fake):
    from kvforge.core.cache import Cache
    from kvforge.git.context import Context

    return Context.load(Cache(fake.cache), "fake")


def test_checks_signal_runs_the_tests_without_the_fix(fake):
    """Only the patch's test file goes onto the new base: it passes where upstream has the fix, fails
    (behaviour) where it does not, and cannot run where the API it imports is gone."""
    patch, _ = _patch(fake, {**FIX, FIX_TEST: ("", TEST_TEXT)})
    ctx = _ctx(fake)
    killed = Path(fake.cache) / "trees" / ".work" / ".upstream-checks.999999999.abc"  # a dead run's tree
    (killed / "tests").mkdir(parents=True)
    has = _upstream_commit(fake, FIX, "upstream clamps too")
    sig = checks_signal(ctx, _nb(fake, has), patch)
    assert (sig.fired, sig.strong) == (True, True), sig.detail
    sig = checks_signal(ctx, _nb(fake, fake.base), patch)
    assert (sig.fired, sig.strong) == (False, True), sig.detail
    assert "test_clamp_high" in sig.detail
    renamed = _upstream_commit(fake, {CORE: ("def clamp(x, lo, hi):", "def clip(x, lo, hi):")}, "rename clamp")
    sig = checks_signal(ctx, _nb(fake, renamed), patch)
    assert sig.fired is None, sig.detail
    assert not list((Path(fake.cache) / "trees" / ".work").glob(".upstream-checks.*"))  # nothing left behind


def test_signals_that_disagree_do_not_drop_the_patch(fake):
    """Drop-When says the base's version is reached, but the patch's own Checks fail on it: the fix is
    not there. gather + decide must say disagree (the rebase stops), never upstream."""
    patch, commit = _patch(fake, {**FIX, FIX_TEST: ("", TEST_TEXT)}, drop_when="version >= 1.0")
    unrelated = _upstream_commit(fake, {"vllm_like/extra.py": ("", "X = 1\n")}, "release 1.0 without the fix")
    nb = _nb(fake, unrelated, version="1.0")
    signals = gather(nb, patch, commit, checks=lambda: checks_signal(_ctx(fake), nb, patch))
    by_name = {s.name: s for s in signals}
    assert [s.name for s in signals] == ["reverse-apply", "patch-id", "upstream-commit", "drop-when", "checks"]
    assert (by_name["drop-when"].fired, by_name["checks"].fired) == (True, False)
    verdict, reason = decide(signals)
    assert verdict == "disagree", reason
    # With the fix really upstream, the same patch is dropped.
    has = _upstream_commit(fake, FIX, "release 1.0 with the fix", start=unrelated)
    nb = _nb(fake, has, version="1.0")
    assert decide(gather(nb, patch, commit, checks=lambda: checks_signal(_ctx(fake), nb, patch)))[0] == "upstream"


def test_the_signals_module_imports_no_environment_or_test_runner():
    """flow/upstream.py (imported by every rebase, status and pick) loads neither the environments (env) nor the
    test runner (proof): the Checks that need them live in flow/behaviour.py."""
    code = ("import sys, kvforge.flow.upstream; "
            "print(sorted(m for m in sys.modules if m.startswith(('kvforge.env', 'kvforge.proof'))))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"
