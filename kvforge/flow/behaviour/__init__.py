"""Behaviour decides: a patch's Checks run on a new base, without the fix (is it upstream?) and with a
variant of the fix ported onto it (is the port proven?), in that base's CPU environment.

- checks (kvforge.flow.behaviour.checks): the Checks without the fix. `checks_signal` is the rebase's "checks"
  signal (kvforge.flow.upstream.gather); `without_fix` the verdict `kvforge watch` acts on: "upstream (by
  behaviour)", "needed" (a behavioural failure: the test and its line), "needed?" (cannot tell, and why);
  never "upstream" on a partial pass. Both decide on the patch's Bug-Checks (Patch.bug_checks: every Check
  unless the patch names the ones that show the bug): a Check of what the variant adds (its knob, its API)
  failing on a release that fixed the bug in another shape says nothing about the bug; every Check still
  runs and is reported. Results cached by content; a release's rows share a pytest run (`prefetch`).
- port (kvforge.flow.behaviour.port): the nearest variant of the fix (`git am -3` onto the new base, its
  preimages copied in), then its Checks with the fix: "port proven" (a Bug-Check failed without it, all pass
  with it), else where it stops (the file, the hunk, and the release's change of that region).
- history (kvforge.flow.behaviour.history): with a git clone of upstream, ancestry and patch-id answer first.

Writes only the cache (<cache>/results/watch/) and temporary trees under <cache>/trees/.work.
"""

from kvforge.flow.behaviour.checks import (BUDGET, NEEDED, UNSURE, UPSTREAM, Budget, Run, Verdict, batches, kept,
                                           cached_run, checks_signal, env_fingerprint, failure_kind, judge_checks,
                                           prefetch, result_key, run_without_fix, without_fix)
from kvforge.flow.behaviour.history import by_history
from kvforge.flow.behaviour.port import Port, Variant, copy_preimages, port

__all__ = ["BUDGET", "NEEDED", "UNSURE", "UPSTREAM", "Budget", "Port", "Run", "Variant", "Verdict", "batches",
           "by_history", "cached_run", "checks_signal", "copy_preimages", "env_fingerprint", "failure_kind",
           "judge_checks", "kept", "port", "prefetch", "result_key", "run_without_fix", "without_fix"]
