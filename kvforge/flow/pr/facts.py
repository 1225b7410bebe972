"""What a patch says, as a text shows it: its message (unwrapped for markdown), its links and
upstream status, Drop-When in words, what it changes that a user can set or see, the changes its
header acknowledges making on purpose (Acknowledges:, kvforge audit's risky kinds), its Depends-On
chain, its DCO sign-offs and its diffstat.

Pure functions of a patch (and, for the diffstat, of the stack it is applied in): nothing here
renders or decides where a text goes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.git import gitutil
from kvforge.git.trees import Stack
from kvforge.project.series import Patch, Series, author_email


def message_body(patch: Patch) -> str:
    """The commit message between the subject and the trailer block (free text)."""
    text = patch.raw.decode("utf-8", errors="replace")
    lines = text.split("\n")
    i = 1
    while i < len(lines) and lines[i] != "":
        i += 1
    end = i + 1
    while end < len(lines) and lines[end] != "---" and not lines[end].startswith("diff --git "):
        end += 1
    body = lines[i + 1:end]
    while body and not body[-1].strip():
        body.pop()
    k = len(body)  # drop the last paragraph: the trailers
    while k > 0 and body[k - 1].strip():
        k -= 1
    return "\n".join(body[:k]).strip("\n")


def unwrap(text: str) -> str:
    """A hard-wrapped commit message as markdown (GitHub renders every newline of a PR body as a
    break): paragraph and bullet lines are joined; a paragraph with other indented lines (a table,
    code) becomes a fenced text block, unchanged."""
    out: list[str] = []
    for para in re.split(r"\n\s*\n", text.strip("\n")):
        lines = para.split("\n")
        items: list[str] = []
        preformatted = False
        for ln in lines:
            if re.match(r"^\s*([-*]|\d{1,2}\.)\s", ln) and not ln.startswith("    "):
                items.append(ln.strip() if not ln.startswith(" ") else ln.rstrip())
            elif ln[:1].isspace():
                if items and re.match(r"^\s*([-*]|\d{1,2}\.)\s", items[-1]):
                    items[-1] += " " + ln.strip()
                else:
                    preformatted = True
                    break
            elif items and not re.match(r"^\s*([-*]|\d{1,2}\.)\s", items[-1]):
                items[-1] += " " + ln.strip()
            else:
                if items:  # a plain line right after a bullet list starts a new paragraph
                    items.append("")
                items.append(ln.strip())
        out.append("```text\n" + para + "\n```" if preformatted else "\n".join(items))
    return "\n\n".join(out)


def vllm_refs(text: str, home: str = "vllm-project/vllm") -> str:
    """Bare '#N' (the issues and PRs of the repository the commit message was written for: vLLM's,
    or vllm-ascend's for its component) as 'owner/name#N', for a text posted in another repository."""
    return re.sub(r"(?<![\w/#&])#(\d{3,})\b", home + r"#\1", text)


def github_ref(url: str, repo: str) -> str:
    """'#N' for an issue or PR of `repo`, 'owner/name#N' for another repository's, else the URL."""
    m = re.match(r"^https?://github\.com/([^/]+/[^/]+)/(?:pull|issues)/(\d+)/?$", url)
    if not m:
        return url
    return f"#{m.group(2)}" if m.group(1).lower() == repo.lower() else f"{m.group(1)}#{m.group(2)}"


def upstream_status(value: str) -> tuple[str, str]:
    m = re.match(r"^([A-Za-z-]+)(?:\s+\[(.*)\])?\s*$", value or "")
    return (m.group(1), (m.group(2) or "").strip()) if m else (value, "")


def drop_when_text(value: str) -> str:
    if value.startswith("base-contains "):
        return f"the base contains upstream commit {value.split(' ', 1)[1]}"
    if value.startswith("version >= "):
        return f"the base is vLLM {value.split('>= ', 1)[1]} or newer"
    if value.startswith("upstream-pr-merged "):
        return f"{value.split(' ', 1)[1]} is merged"
    if value.startswith("never"):
        reason = value[len("never"):].strip().strip("[]")
        return "never" + (f" ({reason})" if reason else "")
    return value


def user_facing(patch: Patch) -> list[str]:
    """What a patch changes that a user can set or see, found in its diff (test files aside):
    environment variables (a vllm/envs.py or vllm_ascend/envs.py entry, os.getenv / os.environ),
    config fields (dataclass fields in vllm/config/), engine arguments (new in vllm/engine/arg_utils.py,
    or CLI options whose handling the code now changes, named in its added lines) and new errors
    (`raise X(...)` with their message)."""
    out: list[str] = []

    def add(item: str) -> None:
        if item not in out:
            out.append(item)

    options: list[str] = []
    for f in patch.files:
        path = f.path
        if path.startswith("tests/") or "/tests/" in path or not path.endswith(".py"):
            continue
        for hunk in f:
            cls = re.match(r"^\s*class (\w+)", hunk.section_header or "")
            added = [ln.value.rstrip("\n") for ln in hunk if ln.is_added]
            for i, text in enumerate(added):
                if path in ("vllm/envs.py", "vllm_ascend/envs.py"):
                    m = re.match(r'^\s*"(VLLM_[A-Z0-9_]+)"\s*:', text)
                    if m:
                        add(f"environment variable `{m.group(1)}`")
                for m in re.finditer(r'(?:getenv|environ\.get|environ\[)\(?\s*"(VLLM_[A-Z0-9_]+)"', text):
                    add(f"environment variable `{m.group(1)}`")
                if path.startswith("vllm/config/") and cls:
                    m = re.match(r"^    ([a-z][a-z0-9_]*)\s*:\s*[^=]+=", text)
                    if m:
                        add(f"config field `{cls.group(1)}.{m.group(1)}`")
                if path == "vllm/engine/arg_utils.py":
                    for m in re.finditer(r'"(--[a-z0-9][a-z0-9-]+)"', text):
                        add(f"engine argument `{m.group(1)}`")
                else:
                    options += re.findall(r"(?<![\w-])(--[a-z][a-z0-9]*(?:-[a-z0-9]+)+|--[a-z]{3,})\b", text)
                m = re.match(r"^\s*raise (\w+(?:Error|Exception))\(\s*(.*)$", text)
                if m:
                    parts = [m.group(2)]
                    for more in added[i + 1:i + 4]:
                        if parts[-1].rstrip().endswith(")"):
                            break
                        parts.append(more)
                    pieces = re.findall(r'f?"((?:[^"\\]|\\.)*)"', " ".join(parts))
                    msg = " ".join("".join(pieces).split())
                    add(f"a new error, `{m.group(1)}: {msg}`" if msg else f"a new error (`{m.group(1)}`)")
    for opt in dict.fromkeys(options):
        if f"engine argument `{opt}`" not in out:
            add(f"the handling of `{opt}` (the patch's own code reads or checks it)")
    return out


ACKNOWLEDGED = {
    "signature": "the signature of `{name}` changes",
    "removed": "`{name}` is removed",
    "renamed": "`{name}` is renamed",
    "decorator-moved": "a decorator moves off `{name}`",
    "decorator-removed": "a decorator is removed from `{name}`",
    "call-added": "a call to `{name}` runs at import",
}


def acknowledged(patch: Patch) -> list[str]:
    """The API changes the patch's header says it makes on purpose (its Acknowledges: trailers), one
    phrase each for a reviewer: what changes and, in parentheses, the header's reason."""
    out = []
    for a in patch.acknowledgements:
        what = ACKNOWLEDGED[a.kind].format(name=a.name) + (f" in `{a.path}`" if a.path else "")
        out.append(f"{what} on purpose" + (f" ({a.reason})" if a.reason else ""))
    return out


def depends_chain(series: Series, patch: Patch) -> tuple[list[Patch], list[str]]:
    """The patches `patch` depends on, transitively, in series order; and Fix-Ids not in the series."""
    by_id = series.by_fix_id()
    seen: set[str] = set()
    missing: list[str] = []
    todo = list(patch.depends_on)
    while todo:
        fid = todo.pop()
        if fid in seen:
            continue
        seen.add(fid)
        dep = by_id.get(fid)
        if dep is None:
            missing.append(fid)
            continue
        todo.extend(dep.depends_on)
    return [p for p in series.patches if p.fix_id in seen], sorted(missing)


def check_dco(patches: Iterable[Patch]) -> None:
    for p in patches:
        if not any(re.match(r"^.+ <[^<>\s]+@[^<>\s]+>$", v) for v in p.values("Signed-off-by")):
            raise KvforgeError(f"{p.name} ({p.subject}): no Signed-off-by: trailer; vLLM and vllm-ascend require "
                               "a DCO sign-off on every commit (git commit --amend -s, then export)", EXIT_USAGE)
        email = author_email(p.author)
        if email and not any(author_email(v) == email for v in p.values("Signed-off-by")):
            raise KvforgeError(f"{p.name} ({p.subject}): its author {p.author!r} has no Signed-off-by of their own; "
                               "the DCO check compares the author with the sign-offs (the author signs off: "
                               "git commit --amend -s as the author, then export)", EXIT_USAGE)


def diffstat(stack: Stack, n: int) -> str:
    """`git diff --stat` of patch n (or of the whole series with n = 0): exact, from the stack."""
    a, b = (stack.commits[n - 1], stack.commits[n]) if n else (stack.commits[0], stack.commits[-1])
    if a == b:
        return ""
    return gitutil.run(stack.base.repo, "diff", "--stat=80", "--find-renames", a, b).stdout.rstrip("\n")
