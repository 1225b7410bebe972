"""`kvforge pr` and `kvforge notes`: pull-request descriptions and release notes, generated from a series
and its evidence.

`pull_request(ctx, fix_id, style)` describes one fix of ctx's series (the series files, or the
commits of --from) for upstream review: a title that follows the upstream's title convention and a
body in the upstream's PR template, filled from the patch header (Why, upstream links, Bug,
Depends-On chain), its diffstat, the newest `kvforge verify` record of exactly this series (each
Checks test failing before the patch and passing after it, the regression suite, the platform) and
the newest `kvforge bench prefix-cache` record where the fix has a scenario. `release_notes(ctx)`
describes a whole patched build: base and series identity, one entry per fix with its upstream
status, evidence and Drop-When, and what the base already contains.

Both return a `Text` (title, body, style, the evidence used, warnings); the CLI prints or writes it
and sets the exit code. Rules:
- Evidence is typed (kvforge.core.evidence records), looked up by the stack's key (target, component,
  base commit, series digest). A record of another series or base is *stale*: refused with
  EXIT_TESTS, or used with `allow_stale` and then said so in the text. No record at all is stated in
  the text ("no evidence"), never invented.
- Every commit a PR carries (the fix and its Depends-On chain) must have a Signed-off-by trailer
  (the DCO both upstreams require); otherwise a one-line error.
- Templates are jinja2 files in kvforge/data/templates, or the user's own (--template), rendered in
  jinja2's SandboxedEnvironment with StrictUndefined: an undefined name, a syntax error or an unsafe
  attribute is a one-line error naming the template file and line. A user template sees plain data
  (dicts, lists, strings, numbers), the few filters below, and no file but itself and kvforge's
  own templates.
- vLLM's body follows the PR template of the base itself (.github/PULL_REQUEST_TEMPLATE.md of the
  base commit: `## Purpose` / `## Test Plan` / `## Test Result` on v0.20.x, `## Overview` /
  `## Claims` / `## Validation` / `## Details` on 0.33.0), its checklist kept verbatim. A base
  without that file falls back to kvforge's copy for its version (a warning says so). vllm-ascend's
  template is kvforge's copy (its sdist has no .github/); see data/templates/upstream/README.md. A
  vllm-ascend title's [Branch] is the release of the component's ref (releases/v0.20.2rc ->
  v0.20.2rc), and `--open` targets that branch.

Modules, top first (each imports only those below it): command (`pr_command`, `notes_command`,
`publish`: the CLI's calls) > open (`--open`: the fix re-applied onto the upstream branch of the
user's clone, pushed to a fork, `gh pr create`) | notes (the release notes) > text (`Text`, the data
every template gets, the PR description) > conventions (each upstream's title rule and PR template)
| facts (what a patch's header, message and diff say) | evidence (the records a text reads, and
staleness) > sandbox (the jinja2 environment, its limits and filters). Where a fix may go upstream at
all is kvforge.flow.prpolicy's decision, not this package's.
"""

from kvforge.flow.pr.command import notes_command, pr_command, publish
from kvforge.flow.pr.notes import release_notes
from kvforge.flow.pr.open import find_gh
from kvforge.flow.pr.text import Text, pull_request

__all__ = ["Text", "find_gh", "notes_command", "pr_command", "publish", "pull_request", "release_notes"]
