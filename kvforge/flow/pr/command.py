"""How `kvforge pr` and `kvforge notes` run and end: the text built, then printed or written to --out
(atomically, keeping an existing file's mode), and for `--open` pushed and handed to gh.

Invariants: the evidence warnings reach stderr also when publishing fails; --open is refused before
any text is built when the base has no upstream history (no --repo clone), --repo is not a git repository or
there is no --push-to. --open reads its base from the --repo clone for this run only: the cache's git base of the
component (its tag and origin) is put back as it was when the command ends, whatever the outcome, so later
commands keep the base they had (the sdist's, or the one another --repo fetched).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path

from kvforge.core.errors import EXIT_ENV, EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import atomic_write_text, file_lock
from kvforge.core.outcome import Done
from kvforge.flow.pr.notes import release_notes
from kvforge.flow.pr.open import Pushed, history_refusal, open_pr, push_fix
from kvforge.flow.pr.text import Text, pull_request
from kvforge.git import gitutil
from kvforge.git.context import Context
from kvforge.git.trees import open_stack


def write_out(path: Path, text: str) -> None:
    """Write --out atomically (a temporary file renamed over it). An existing file keeps its
    permission bits (a 0644 file stays 0644, not the temporary file's 0600); a new one gets the
    mode the umask allows, as `>` in a shell would. A symlink is followed: its target is replaced."""
    path = Path(os.path.realpath(path))
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    atomic_write_text(path, text, mode)


def publish(result: Text, out: Path | None, gh: str | None = None,
            push: Callable[[], Pushed] | None = None) -> Done:
    """How `kvforge pr` and `kvforge notes` end: the text on stdout or written to --out (atomically),
    handed to gh when asked (after `push()` pushed the branch; its URL printed); the evidence warnings
    on stderr, also when this fails."""
    pushed = None
    try:
        if out is not None:
            try:
                write_out(out, result.text)
            except OSError as exc:
                raise KvforgeError(f"--out {out}: cannot write: {exc.strerror or exc}", EXIT_ENV) from None
        if gh and push is not None:
            pushed = push()
        url = open_pr(result, gh, pushed) if gh else None
    except KvforgeError as exc:
        exc.notes = result.warnings + exc.notes
        raise
    data = {**result.to_json(), "text": result.text, "out": str(out) if out else None, "opened": url,
            "pushed": asdict(pushed) if pushed else None}
    text = (result.text if out is None else "") + (f"{url}\n" if url else "")
    return Done(data, text, notes=list(result.warnings), aside=f"kvforge: wrote {out}" if out is not None else "")


def clone_refusal(repo_url: str) -> KvforgeError | None:
    """--open's --repo must be a git repository itself (not a directory inside another one): else one line, exit 2."""
    clone = Path(repo_url).expanduser()
    res = gitutil.run(clone, "rev-parse", "--git-dir", check=False,
                      env={"GIT_CEILING_DIRECTORIES": str(clone.resolve().parent)})
    if res.returncode == 0:
        return None
    why = (res.stderr.strip().splitlines() or ["not a git repository"])[-1].removeprefix("fatal: ")
    return KvforgeError(f"--repo {repo_url}: not a git clone ({why}); --open needs your clone of the upstream "
                        "repository", EXIT_USAGE)


def _git_base(ctx: Context) -> tuple[Path, str]:
    """The cache's git base repository of ctx's component and its base tag (kvforge.git.bases' layout)."""
    return ctx.cache.repos / f"{ctx.component.name}-git.git", f"refs/tags/{ctx.component.ref}"


def _base_git(repo: Path, *args: str) -> gitutil.Result:
    return gitutil.run(repo.parent, *args, check=False, env={"GIT_DIR": str(repo)})


@contextlib.contextmanager
def cached_base_kept(ctx: Context) -> Iterator[None]:
    """Put the cache's git base of ctx's component (tag and origin) back as it was when the block ends."""
    repo, tag = _git_base(ctx)
    before: tuple[str, str] | None = None
    if repo.is_dir():
        before = (_base_git(repo, "rev-parse", "--verify", "-q", tag).stdout.strip(),
                  _base_git(repo, "config", "--get", "kvforge.origin").stdout.strip())
    try:
        yield
    finally:
        if repo.is_dir():
            with file_lock(repo.parent / f".{repo.name}.lock"):
                commit, origin = before or ("", "")
                if commit:
                    _base_git(repo, "update-ref", tag, commit)
                else:
                    _base_git(repo, "update-ref", "-d", tag)
                if origin:
                    _base_git(repo, "config", "kvforge.origin", origin)
                else:
                    _base_git(repo, "config", "--unset", "kvforge.origin")


def pr_command(ctx: Context, fix_id: str, style: str | None, template: Path | None, allow_stale: bool, out: Path | None,
               gh: str | None, push_to: str | None = None) -> Done:
    """`kvforge pr`: the fix's pull request description, published; with gh (--open), first the fix
    re-applied onto the upstream branch of the --repo clone and pushed to --push-to."""
    if not gh:
        return publish(pull_request(ctx, fix_id, style, template, allow_stale), out)
    refusal = history_refusal(ctx, fix_id) or clone_refusal(str(ctx.repo_url))
    if refusal is not None:
        raise refusal
    if not push_to:
        raise KvforgeError("--open needs --push-to FORK: the remote (of the --repo clone) or URL of your fork, "
                           "where the PR's branch is pushed", EXIT_USAGE)
    with cached_base_kept(ctx):
        text = pull_request(ctx, fix_id, style, template, allow_stale)
        stack = open_stack(ctx)
        if stack.base.source != "git":
            raise KvforgeError(f"--open: the base came from {stack.base.source}, not from --repo's history", EXIT_USAGE)
        patch = stack.series.by_fix_id()[fix_id]
        clone = Path(str(ctx.repo_url))
        push = lambda: push_fix(clone, patch, text.branch, push_to, f"fix/{fix_id}", ctx.say)  # noqa: E731
        return publish(text, out, gh, push)


def notes_command(ctx: Context, template: Path | None, allow_stale: bool, out: Path | None) -> Done:
    """`kvforge notes`: the release notes, published."""
    return publish(release_notes(ctx, template, allow_stale), out)
