"""`kvforge pr --open`: the fix re-applied onto the upstream branch of the user's clone, pushed to
their fork, and handed to `gh pr create --draft`.

Invariants: the user's clone is only read (the fix is applied with `git am -3` in a scratch
repository); nothing is pushed when the fix does not apply or changes nothing; an existing branch of
the fork is never overwritten; what the fork holds after the push is checked (the pushed commit,
descending from the upstream head). The base branch is the one prpolicy routed (`Text.branch`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvforge.core.errors import EXIT_APPLY, EXIT_ENV, EXIT_USAGE, KvforgeError
from kvforge.flow.pr.evidence import target_flag
from kvforge.flow.pr.text import Text
from kvforge.git import gitutil
from kvforge.git.context import Context
from kvforge.project.series import Patch


def find_gh() -> str:
    """The gh executable, or a one-line environment error."""
    gh = shutil.which("gh")
    if not gh:
        raise KvforgeError("--open needs the GitHub CLI `gh`, which is not installed (not on PATH); "
                           "the description is printed or written with --out instead", EXIT_ENV)
    return gh


def gh_argv(gh: str, pr: Text, body_file: Path, base_branch: str | None) -> list[str]:
    argv = [gh, "pr", "create", "--repo", pr.repo or "vllm-project/vllm", "--draft", "--title", pr.title, "--body-file", str(body_file)]
    if base_branch:
        argv += ["--base", base_branch]
    return argv


def base_branch(pr: Text) -> str | None:
    """The upstream branch a PR targets, as the upstream policy routed it (prpolicy.route)."""
    return pr.branch or None


@dataclass
class Pushed:
    """The branch `--open` pushed: the fix re-applied on the upstream branch head."""

    remote: str  # where it was pushed (a remote name of the clone, or a URL/path)
    branch: str  # the branch name there
    commit: str  # its head
    upstream_head: str  # the upstream branch head it was applied onto
    head: str  # what gh's --head gets: owner:branch for a GitHub fork, else the branch


def history_refusal(ctx: Context, fix_id: str) -> KvforgeError | None:
    """--open needs a base with upstream history (a git base); an sdist import commit shares none."""
    comp = ctx.component
    if ctx.repo_url and Path(ctx.repo_url).expanduser().is_dir():
        return None
    return KvforgeError(
        f"--open needs your clone of {comp.repo} (--repo CLONE): without it the base is "
        f"{comp.release.package} {comp.release.version}'s sdist (or a fetch), an import commit with no upstream "
        "history in a clone of yours, so a branch made on it cannot become a PR; run "
        f"`kvforge pr -t {target_flag(ctx)} --fix {fix_id} --repo CLONE --push-to FORK --open` with CLONE a clone "
        f"of {comp.repo} and FORK the remote of your fork in it", EXIT_USAGE)


def push_fix(clone: Path, patch: Patch, branch: str, push_to: str, name: str,
             say: Callable[[str], None] | None = None) -> Pushed:
    """Re-apply `patch` (its format-patch bytes) onto `branch` of the user's clone of the upstream
    repository with `git am -3`, in a scratch repository (the clone is only read), push the result to
    `push_to` as `name`, and check what was pushed: it descends from the upstream branch head and holds
    the fix's change. A conflict is one line naming the files (EXIT_APPLY); nothing is pushed then."""
    clone = Path(clone).expanduser()
    head = None
    for ref in (f"refs/remotes/origin/{branch}", f"refs/remotes/upstream/{branch}", f"refs/heads/{branch}"):
        res = gitutil.run(clone, "rev-parse", "--verify", "-q", f"{ref}^{{commit}}", check=False)
        if res.returncode == 0:
            head = res.stdout.strip()
            break
    if head is None:
        raise KvforgeError(f"--repo {clone}: no branch {branch} (as origin/{branch}, upstream/{branch} or a local "
                           f"branch); fetch it: git -C {clone} fetch origin {branch}", EXIT_USAGE)
    remote_url = gitutil.run(clone, "remote", "get-url", push_to, check=False)
    url = remote_url.stdout.strip() if remote_url.returncode == 0 else push_to
    with tempfile.TemporaryDirectory(prefix="kvforge-open-") as tmp:
        work = Path(tmp) / "w"
        gitutil.run(Path(tmp), "init", "-q", str(work))
        gitutil.run(work, "fetch", "-q", str(clone), head)
        gitutil.run(work, "checkout", "-q", "--detach", head)
        if say:
            say(f"applying {patch.name} onto {branch} ({head[:12]}) with git am -3")
        # Committer date = author date: the same fix on the same head is the same commit, so a re-run
        # pushes nothing new.
        res = gitutil.run(work, "am", "-3", "--keep-cr", "--committer-date-is-author-date", stdin=patch.raw,
                          check=False)
        if res.returncode != 0:
            conflicts = gitutil.run(work, "diff", "--name-only", "--diff-filter=U", check=False).stdout.split()
            raise KvforgeError(f"{patch.name} does not apply onto {branch} ({head[:12]}) three-way"
                               + (f": conflicts in {', '.join(conflicts)}" if conflicts else
                                  f": {(res.stderr.strip().splitlines() or ['git am failed'])[-1]}")
                               + f"; port it first (kvforge port {patch.fix_id} ...) and export", EXIT_APPLY)
        commit = gitutil.run(work, "rev-parse", "HEAD").stdout.strip()
        changed = gitutil.run(work, "diff", "--name-only", head, commit).stdout.split()
        if not changed:
            raise KvforgeError(f"{patch.name} changes nothing on {branch} ({head[:12]}): upstream already has it; "
                               "no PR to open", EXIT_USAGE)
        there = gitutil.run(work, "ls-remote", url, f"refs/heads/{name}", check=False).stdout.split()
        if there and there[0] != commit:
            raise KvforgeError(f"{push_to}: branch {name} exists at {there[0][:12]}, which is not this fix on "
                               f"{branch} ({commit[:12]}); kvforge does not overwrite it: rename that branch or "
                               "push to another fork", EXIT_USAGE)
        if say:
            say(f"pushing {commit[:12]} to {push_to} as {name}")
        gitutil.run(work, "push", "-q", url, f"{commit}:refs/heads/{name}")
        # What the fork now holds: the pushed commit, on top of the upstream head, with the fix in it.
        got = gitutil.run(work, "ls-remote", url, f"refs/heads/{name}").stdout.split()
        if not got or got[0] != commit:
            raise KvforgeError(f"{push_to}: after the push, {name} is {got[0][:12] if got else 'missing'}, "
                               f"not {commit[:12]}", EXIT_ENV)
        if gitutil.run(work, "merge-base", "--is-ancestor", head, commit, check=False).returncode != 0:
            raise KvforgeError(f"{name} does not descend from {branch} ({head[:12]})", EXIT_ENV)
    owner = None
    m = re.match(r"^(?:https?://|git@)github\.com[/:]([^/]+)/", url)
    if m:
        owner = m.group(1)
    return Pushed(push_to, name, commit, head, f"{owner}:{name}" if owner else name)


def open_pr(pr: Text, gh: str, pushed: Pushed | None = None) -> str:
    """`gh pr create --draft` with the title and body (and --head, the branch pushed); returns what
    gh prints (the PR's URL)."""
    with tempfile.TemporaryDirectory(prefix="kvforge-pr-") as tmp:
        body = Path(tmp) / "body.md"
        body.write_text(pr.body, encoding="utf-8")
        argv = gh_argv(gh, pr, body, base_branch(pr))
        if pushed is not None:
            argv += ["--head", pushed.head]
        try:
            res = subprocess.run(argv, stdout=subprocess.PIPE, text=True)
        except OSError as exc:
            raise KvforgeError(f"cannot run {gh}: {exc.strerror or exc}", EXIT_ENV) from None
    if res.returncode != 0:
        raise KvforgeError(f"gh pr create failed (exit {res.returncode}); its message is above", EXIT_ENV)
    return res.stdout.strip()
