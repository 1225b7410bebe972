"""`kvforge watch`: the upstream releases newer than each maintained target's base, and what moving the
target onto each would do: a dry-run rebase per (target, component, release), each patch's Drop-When
evaluated there, and whether the release's wheels exist.

Owns: the package index's release lists (`index_releases`: PyPI's JSON API at $KVFORGE_PYPI_URL, read
once per package and run), which releases count as new for a component (`new_releases`), the report
(table, markdown, JSON; one markdown body per release for the scheduled workflow's issue) and its status.
Not owned here: the rebase (kvforge.flow.rebase, called with dry_run=True: it writes only the cache, never
patches/ or targets/), the signals and Drop-When (kvforge.flow.upstream, read from the rebase's steps), the
wheel choice (kvforge.wheels.choose.choose_wheels), the downloads (kvforge.core.index: cached, sha256-checked).

`--apply` (`apply=True`): for each new vLLM release that is clean for every target moving to it and that no
target has yet, `kvforge target add VERSION --from T` (kvforge.flow.targetadd; T: the newest watched target it is clean for): the
one write watch makes, all or nothing per target; a target add that stops (a conflict in another component's
series) ends the applying (exit 3), its state resumable with `kvforge target add --continue`.

Behaviour decides (kvforge.flow.behaviour): a conflict or disagreement row gets the patch's Checks run on the
release with the patches the dry run carried before it, without the fix, in the release's CPU environment (built
once, cached by content; a release's rows on one commit share a pytest run where their test files allow): all
pass (its Bug-Checks) ->
"upstream (by behaviour)"; a behavioural failure -> "needed", and then a port of the nearest variant of the fix
(the same Fix-Id in any target's series of that component, the one whose release is nearest first) onto that
same commit, proven when its Checks fail without it and pass with it ("port proven", the ready patch kept in the
cache); else "needs a person" with why (the Checks cannot run there, or where the port stops and the release's
change of that region). `checks` (--checks N; $KVFORGE_WATCH_CHECKS) bounds the Checks runs of one watch (a
result from the cache is no run); rows beyond it say "not checked: budget". Each row's `decision` is one of
DECISIONS; a release's cost is how many of its rows need a person.

Invariants: without --apply, writes nothing in the project; targets with `lifecycle = "eol"` are never watched; every
(target, component, release) gets a row, and a failure of one (a download, a rebase of that target in
progress) is that row's error, never the end of the run. Status and exit code: "nothing-new" (0), "clean"
(0: every new release carries or drops every patch and has the wheels the target pins), "attention" (3: a
conflict, a disagreement, missing wheels, or a row that failed; a row's network failure makes it 6).
"""

from kvforge.flow.watch.decide import carried_under, checks_budget, upstream_clone, variants
from kvforge.flow.watch.releases import IndexRelease, index_releases, new_releases
from kvforge.flow.watch.report import DECISIONS, FORMATS, LABEL, Check, PatchRow, ReleaseReport, WatchResult
from kvforge.flow.watch.run import apply_clean, watch

__all__ = ["DECISIONS", "FORMATS", "LABEL", "Check", "IndexRelease", "PatchRow", "ReleaseReport", "WatchResult",
           "apply_clean", "carried_under", "checks_budget", "index_releases", "new_releases", "upstream_clone",
           "variants", "watch"]
