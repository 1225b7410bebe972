"""Pull-request descriptions and release notes, generated from a series and its evidence.

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
- Evidence is typed (kvforge.evidence records), looked up by the stack's key (target, component,
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
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import stat
import subprocess
import tempfile
import traceback
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from jinja2 import (BaseLoader, ChoiceLoader, FileSystemLoader, StrictUndefined, TemplateError, TemplateNotFound,
                    TemplateSyntaxError)
from jinja2.sandbox import SandboxedEnvironment, SecurityError
from packaging.version import InvalidVersion, Version

from kvforge import DATA
from kvforge.core import evidence
from kvforge.git import gitutil
from kvforge.flow import prpolicy
from kvforge.core.errors import EXIT_APPLY, EXIT_ENV, EXIT_TESTS, EXIT_USAGE, KvforgeError
from kvforge.core.fsutil import atomic_write_text
from kvforge.core.outcome import Done
from kvforge.project.series import author_email, read_series
from kvforge.project.targets import load_all, project_root
from kvforge.git.trees import open_stack

STYLES = ("vllm", "vllm-ascend")
TEMPLATES = DATA / "templates"
UPSTREAM_TEMPLATE = ".github/PULL_REQUEST_TEMPLATE.md"

# vLLM's PR title check (.github/workflows/pr-title.yml in vLLM 0.33.0; bash ERE there).
VLLM_TITLE_RE = re.compile(r"^(\[[^][]+\])+ +\S")
TAGS_RE = re.compile(r"^((?:\[[^][]+\])+)\s*")

# Section headings of each known layout, in order, as the upstream templates spell them.
LAYOUTS = {
    "purpose": ("Purpose", "Test Plan", "Test Result"),  # vLLM v0.20.x
    "overview": ("Overview", "Claims", "Validation", "Details"),  # vLLM 0.33.0 (main)
    "ascend": ("What this PR does / why we need it?", "Does this PR introduce _any_ user-facing change?",
               "How was this patch tested?"),  # vllm-ascend
}
# kvforge's copies of the upstream templates, for a base without the file (and for vllm-ascend,
# which has no base in kvforge yet). Sources: data/templates/upstream/README.md.
UPSTREAM_COPIES = {
    "purpose": ("upstream/vllm-0.20.2.PULL_REQUEST_TEMPLATE.md", "vLLM v0.20.2 (sdist vllm-0.20.2.tar.gz)"),
    "overview": ("upstream/vllm-0.33.0.PULL_REQUEST_TEMPLATE.md", "vLLM 0.33.0 (sdist vllm-0.33.0.tar.gz)"),
    "ascend": ("upstream/vllm-ascend.PULL_REQUEST_TEMPLATE.md",
               "vllm-ascend .gemini/styleguide.md (PR summary format) and .github/PULL_REQUEST_TEMPLATE.md"),
}
# Type tags per layout (docs/contributing/README.md of each version), by the patch's Kind.
VLLM_TYPE_TAGS = {
    "purpose": {"fix": "Bugfix", "refactor": "Misc", "test": "CI/Build"},
    "overview": {"fix": "Bugfix", "refactor": "Refactor", "test": "Test"},
}
# Type tags (what kind of change) as opposed to scope tags ([Core], [KV Offload]: where).
KNOWN_TYPE_TAGS = {"bugfix", "feature", "perf", "refactor", "misc", "ci", "ci/build", "test", "doc", "docs"}
ASCEND_ACTION = {"fix": "BugFix", "refactor": "Misc", "test": "Misc"}
ASCEND_REPO = "vllm-project/vllm-ascend"

# Which `bench prefix-cache` scenarios measure a fix (kvforge/bench/replay/workloads.py documents
# each scenario's bug report). A bench compares the base with the whole series, so its figures are
# reported as the series', never as one patch's alone.
BENCH_SCENARIOS = {
    "two-phase-kv-alloc": {"external-hit": "measures"},  # seed 003 / #43884: block ids in two groups
    "swa-reachable-cache-mask": {"gptoss-eagle": "control"},  # EAGLE lookups must keep their lookahead block
    "swa-retention-queue-split": {"dsv4-resend": "measures", "dsv4-repeat": "measures"},  # seeds 000, 001 / #42948
    "gemma4-dflash-eagle-spiral": {"gemma4-dflash": "measures"},  # seed 002 / #40624
    "eagle-lookahead-block-hashes": {"gemma4-dflash": "measures", "gptoss-eagle": "measures"},  # #50438
}


# ---------------------------------------------------------------- results

@dataclass
class EvidenceUsed:
    """One evidence record a text was made from (or the statement that there is none)."""

    kind: str  # verify | bench-prefix-cache
    state: str  # current | stale | missing
    record: str = ""  # the record file ("" when missing)
    series: str = ""
    base: str = ""
    origin: str = ""
    platform: str = ""
    created: str = ""
    ok: bool | None = None


@dataclass
class Text:
    """A rendered PR description or release notes; the CLI prints, writes or hands it to gh."""

    kind: str  # pr | notes
    target: str
    component: str
    style: str
    layout: str
    title: str
    body: str
    base: str
    base_ref: str
    series: str
    origin: str
    fix_id: str | None = None
    template: str = ""  # the jinja2 template rendered (a package name, or the user's file)
    upstream_template: str = ""  # where the upstream PR template (sections, checklist) came from
    evidence: list[EvidenceUsed] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    repo: str = ""  # the GitHub repository (owner/name) a PR is for
    branch: str = ""  # the upstream branch it is for (prpolicy.route)

    @property
    def text(self) -> str:
        """What `kvforge pr` prints and --out writes: the title, a blank line, the body."""
        return f"{self.title}\n\n{self.body}" if self.kind == "pr" else self.body

    def to_json(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- templates

# What a template may produce and build (the sandbox's limits): a PR body is a few KB; these stop a
# template that would exhaust memory or loop on output before it does.
MAX_OUTPUT = 1 << 20  # characters of rendered text
MAX_VALUE = 1 << 20  # items or characters of one value a `*` builds; digits of a `**` result


class LimitedSandbox(SandboxedEnvironment):
    """jinja2's sandbox with `*` and `**` checked before they run: `'x' * 10**10` and `10**10**10`
    fail as template errors instead of allocating gigabytes or spinning."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and not isinstance(times, bool):
                    if len(seq) * max(times, 0) > MAX_VALUE:
                        raise SecurityError(f"the result of * would have {len(seq) * times} items "
                                            f"(the sandbox allows {MAX_VALUE})")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            digits = right * math.log10(max(abs(left), 2))
            if digits > MAX_VALUE:
                raise SecurityError(f"the result of ** would have about {digits:.3g} digits "
                                    f"(the sandbox allows {MAX_VALUE})")
        return super().call_binop(context, operator, left, right)


def _env(user_template: Path | None = None):
    """The one jinja2 environment: sandboxed (with size limits), StrictUndefined, loads only
    kvforge's templates (and the user's one file)."""

    class OneFile(BaseLoader):
        def __init__(self, path: Path, text: str):
            self.path, self.text = path, text

        def get_source(self, environment, template):
            if template != str(self.path):
                raise TemplateNotFound(template)
            return self.text, str(self.path), lambda: True

    loaders: list[BaseLoader] = [FileSystemLoader(str(TEMPLATES))]
    if user_template is not None:
        try:
            text = Path(user_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise KvforgeError(f"--template {user_template}: cannot read: {why}", EXIT_USAGE) from None
        loaders.insert(0, OneFile(Path(user_template), text))
    env = LimitedSandbox(loader=ChoiceLoader(loaders), undefined=StrictUndefined, autoescape=False,
                         trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters.update(pct=pct, short=lambda c: (c or "")[:12], cell=md_cell, first_line=first_line)
    return env


def render_template(name: str, data: dict, user_template: Path | None = None) -> tuple[str, str | None]:
    """Render a template with `data`: (text, the title it sets with `{% set title = ... %}`, if any).

    Any template problem, at parse time or while rendering (an undefined name, `1/0`, `1+'a'`, a
    recursive macro, a value or an output over the sandbox's limits), is one line
    `template FILE:LINE: message` (EXIT_USAGE); nothing of a failed render is returned."""

    env = _env(user_template)
    label = str(user_template) if user_template is not None else name
    try:
        tmpl = env.get_template(str(user_template) if user_template is not None else name)
        context = tmpl.new_context(data)
        chunks: list[str] = []
        size = 0
        chunks_of = tmpl.root_render_func(context)
        try:
            for chunk in chunks_of:
                size += len(chunk)
                if size > MAX_OUTPUT:  # thrown in at the template's own line, so the error names it
                    chunks_of.throw(SecurityError(f"the rendered text is over {MAX_OUTPUT} characters "
                                                  "(the sandbox's limit)"))
                chunks.append(chunk)
        except Exception:
            env.handle_exception()  # re-raises with the traceback mapped to template lines
        text = "".join(chunks)
        title = context.get_exported().get("title")
    except TemplateSyntaxError as exc:
        where = f"{exc.filename or exc.name or label}:{exc.lineno}"
        raise KvforgeError(f"template {where}: {exc.message}", EXIT_USAGE) from None
    except TemplateNotFound as exc:
        raise KvforgeError(f"template {_where(exc, label)}: no template {exc.name!r} (a template can include or "
                           "import only kvforge's own templates)", EXIT_USAGE) from None
    except TemplateError as exc:
        what = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise KvforgeError(f"template {_where(exc, label)}: {what}", EXIT_USAGE) from None
    except RecursionError as exc:
        raise KvforgeError(f"template {_where(exc, label)}: recursion too deep (a macro or include that calls "
                           "itself without end)", EXIT_USAGE) from None
    except (ArithmeticError, TypeError, ValueError, LookupError, AttributeError, MemoryError) as exc:
        # A Python error raised by an expression of the template (1/0, 1 + 'a', int('x'), ...).
        what = str(exc).splitlines()[0] if str(exc) else ""
        raise KvforgeError(f"template {_where(exc, label)}: {type(exc).__name__}"
                           + (f": {what}" if what else ""), EXIT_USAGE) from None
    return text, (str(title) if title is not None else None)


def _where(exc: BaseException, label: str) -> str:
    """file:line of the innermost template frame of a rendering error (jinja2 maps frames to templates)."""
    templates = str(TEMPLATES)
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename == label or frame.filename.startswith(templates) or frame.filename.endswith(".j2"):
            return f"{frame.filename}:{frame.lineno}"
    return label


def pct(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x * 100:.{digits}f}%"


def md_cell(text) -> str:
    """Text fit for one markdown table cell: one line, pipes escaped."""
    return " ".join(str(text or "").split()).replace("|", "\\|")


def first_line(text, limit: int = 120) -> str:
    line = next((ln.strip() for ln in str(text or "").splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


# ---------------------------------------------------------------- upstream PR templates

@dataclass
class UpstreamTemplate:
    layout: str
    preamble: str  # single-line HTML comments before the first section (e.g. markdownlint-disable)
    tail: str  # from the '---' rule after the last section to the end: the checklist, verbatim
    source: str

    def to_data(self) -> dict:
        return asdict(self)


def parse_upstream_template(text: str, source: str) -> UpstreamTemplate:
    """Split an upstream PR template into its layout (by its section headings), preamble and tail."""
    lines = text.replace("\r\n", "\n").split("\n")
    headings = [re.sub(r"\s*\(必填\)\s*$", "", ln.lstrip("#").strip()) for ln in lines
                if re.match(r"^#{2,3} \S", ln)]
    layout = next((name for name, want in LAYOUTS.items() if tuple(headings) == want), None)
    if layout is None:
        raise KvforgeError(f"{source}: its sections ({', '.join(headings) or 'none'}) match no layout kvforge "
                           "knows; render the description with --template FILE", EXIT_USAGE)
    first = next(i for i, ln in enumerate(lines) if re.match(r"^#{2,3} \S", ln))
    preamble = "\n".join(ln for ln in lines[:first] if re.match(r"^<!--.*-->\s*$", ln.strip()))
    rule = next((i for i in range(first, len(lines)) if lines[i].strip() == "---"), None)
    tail = "\n".join(lines[rule:]).strip("\n") if rule is not None else ""
    return UpstreamTemplate(layout, preamble, tail, source)


def vllm_template(stack, release_version: str) -> tuple[UpstreamTemplate, str | None]:
    """The base's own PR template; kvforge's copy for its version when the base has none (+ a warning)."""
    res = gitutil.run(stack.base.repo, "show", f"{stack.base.commit}:{UPSTREAM_TEMPLATE}", check=False)
    label = f"{stack.base.ref} ({stack.base.commit[:12]})"
    if res.returncode == 0:
        return parse_upstream_template(res.stdout, f"{UPSTREAM_TEMPLATE} of {label}"), None

    try:
        layout = "overview" if Version(release_version) >= Version("0.33.0") else "purpose"
    except InvalidVersion:
        layout = "overview"
    path, source = UPSTREAM_COPIES[layout]
    tmpl = parse_upstream_template((TEMPLATES / path).read_text(encoding="utf-8"), f"kvforge's copy of {source}")
    return tmpl, (f"the base {label} has no {UPSTREAM_TEMPLATE}; used kvforge's copy of {source}'s")


def ascend_template() -> UpstreamTemplate:
    path, source = UPSTREAM_COPIES["ascend"]
    return parse_upstream_template((TEMPLATES / path).read_text(encoding="utf-8"), f"kvforge's copy of {source}")


# ---------------------------------------------------------------- patch facts

def split_tags(subject: str) -> tuple[list[str], str]:
    """'[Core][KV] Do x' -> (['Core', 'KV'], 'Do x')."""
    m = TAGS_RE.match(subject)
    if not m:
        return [], subject.strip()
    return re.findall(r"\[([^][]+)\]", m.group(1)), subject[m.end():].strip()


def vllm_title(subject: str, kind: str, layout: str) -> str:
    """The subject with a type tag for the Kind in front when it has none; checked against vLLM's rule."""
    tags, text = split_tags(subject)
    if not any(t.lower() in KNOWN_TYPE_TAGS for t in tags):
        tags.insert(0, VLLM_TYPE_TAGS[layout if layout in VLLM_TYPE_TAGS else "overview"].get(kind, "Misc"))
    title = "".join(f"[{t}]" for t in tags) + f" {text}"
    check_vllm_title(title)
    return title


def check_vllm_title(title: str) -> None:
    if not VLLM_TITLE_RE.match(title):
        raise KvforgeError(f"title {title!r} fails vLLM's PR title check ^(\\[[^][]+\\])+ +\\S "
                           "(one or more [Tag] prefixes, a space, then the description)", EXIT_USAGE)


# vllm-ascend modules by the package directory a patch touches (vllm_ascend/<dir>/), for a title
# whose subject names none.
ASCEND_MODULES = {"attention": "Attention", "core": "Core", "patch": "Patch", "models": "Model", "ops": "Ops",
                  "worker": "Worker", "distributed": "Distributed", "quantization": "Quantization",
                  "spec_decode": "SpecDecode", "compilation": "Graph", "sample": "Sampler", "eplb": "EPLB",
                  "kv_offload": "KVOffload", "lora": "LoRA", "_310p": "310P"}


def ascend_title(subject: str, kind: str, branch: str | None, touched: list[str]) -> str:
    """[Branch][Module][Action] Title; the branch (e.g. v0.20.2rc of releases/v0.20.2rc) is omitted
    for main. The module: the subject's own scope tags, else the package directory the patch touches
    (vllm/v1/core -> Core, vllm_ascend/attention -> Attention), else Misc."""
    tags, text = split_tags(subject)
    modules = [t for t in tags if t.lower() not in KNOWN_TYPE_TAGS]
    if not modules:
        dirs = [p.split("/")[1] for p in touched if p.startswith("vllm_ascend/") and p.count("/") >= 2]
        if any(p.startswith("vllm/v1/core/") for p in touched):
            modules = ["Core"]
        elif dirs:
            top = max(dict.fromkeys(dirs), key=dirs.count)
            modules = [ASCEND_MODULES.get(top, top.strip("_").capitalize())]
        else:
            modules = ["Misc"]
    prefix = [branch] if branch and branch != "main" else []
    return "".join(f"[{t}]" for t in [*prefix, *modules, ASCEND_ACTION.get(kind, "Misc")]) + f" {text}"


def ascend_branch(target_name: str, component) -> str | None:
    """The [Branch] of a vllm-ascend title: the release of the component's own ref when it is a
    vllm-ascend release branch (releases/v0.20.2rc -> v0.20.2rc); None for main; else the target."""
    ref = component.ref
    if ref.startswith("releases/"):
        return ref.removeprefix("releases/")
    if ref == "main" or target_name == "main":
        return None
    return target_name


def message_body(patch) -> str:
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


def user_facing(patch) -> list[str]:
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


def depends_chain(series, patch) -> tuple[list, list[str]]:
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


def check_dco(patches) -> None:
    for p in patches:
        if not any(re.match(r"^.+ <[^<>\s]+@[^<>\s]+>$", v) for v in p.values("Signed-off-by")):
            raise KvforgeError(f"{p.name} ({p.subject}): no Signed-off-by: trailer; vLLM and vllm-ascend require "
                               "a DCO sign-off on every commit (git commit --amend -s, then export)", EXIT_USAGE)
        email = author_email(p.author)
        if email and not any(author_email(v) == email for v in p.values("Signed-off-by")):
            raise KvforgeError(f"{p.name} ({p.subject}): its author {p.author!r} has no Signed-off-by of their own; "
                               "the DCO check compares the author with the sign-offs (the author signs off: "
                               "git commit --amend -s as the author, then export)", EXIT_USAGE)


def diffstat(stack, n: int) -> str:
    """`git diff --stat` of patch n (or of the whole series with n = 0): exact, from the stack."""
    a, b = (stack.commits[n - 1], stack.commits[n]) if n else (stack.commits[0], stack.commits[-1])
    if a == b:
        return ""
    return gitutil.run(stack.base.repo, "diff", "--stat=80", "--find-renames", a, b).stdout.rstrip("\n")


# ---------------------------------------------------------------- evidence

def find_evidence(cache, key, kind: str, allow_stale: bool, target: str) -> tuple[evidence.Record | None, str]:
    """The newest record of `kind` for exactly this key: (record, 'current'); or another series' or
    base's newest, refused (EXIT_TESTS) or, with allow_stale, (record, 'stale'); or (None, 'missing')."""
    rec = evidence.latest(cache, key, kind)
    if rec is not None:
        return rec, "current"
    others = [r for r in evidence.load(cache, key.target, key.component, kind=kind) if r.key != key]
    if not others:
        return None, "missing"
    other = others[-1]
    what = "series" if other.key.series != key.series else "base"
    if not allow_stale:
        command = "verify" if kind == "verify" else "bench prefix-cache"
        raise KvforgeError(
            f"stale evidence: the newest {kind} record of {target} is for {what} "
            f"{(other.key.series if what == 'series' else other.key.base[:12])} but this is {what} "
            f"{(key.series if what == 'series' else key.base[:12])}; run `kvforge {command} -t {target}` "
            "(or pass --allow-stale to use it, said so in the text)", EXIT_TESTS)
    return other, "stale"


def _evidence(ctx, key, kind: str, allow_stale: bool, used: list[EvidenceUsed], warnings: list[str],
              args: str = "") -> tuple[evidence.Record | None, str]:
    """find_evidence, recorded in `used`, with a warning when it is missing or stale."""
    target = target_flag(ctx)
    rec, state = find_evidence(ctx.cache, key, kind, allow_stale, target)
    used.append(_used(kind, rec, state))
    command = "verify" if kind == "verify" else "bench prefix-cache"
    if rec is None:
        warnings.append(f"no {command} evidence for series {key.series} on {key.base[:12]}: the text says so "
                        f"(run `kvforge {command} -t {target}{args}`)")
    elif state == "stale":
        warnings.append(f"using stale {command} evidence of series {rec.key.series} (this series is "
                        f"{key.series}); the text says so")
    return rec, state


def _used(kind: str, rec: evidence.Record | None, state: str) -> EvidenceUsed:
    if rec is None:
        return EvidenceUsed(kind, state)
    return EvidenceUsed(kind, state, str(rec.path or ""), rec.key.series, rec.key.base, rec.origin, rec.platform,
                        rec.created, rec.ok)


def when(created: str) -> str:
    try:
        t = datetime.fromisoformat(created)
    except (TypeError, ValueError):
        return created
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _record_data(rec: evidence.Record, state: str, target: str, command: str) -> dict:
    return {"state": state, "created": rec.created, "date": when(rec.created), "series": rec.key.series,
            "base": rec.key.base, "from_commit": _from_commit(rec.origin), "platform": rec.platform, "ok": rec.ok,
            "command": f"kvforge {command} -t {target}"}


def _from_commit(origin: str) -> str:
    """'--from DIR (sha)' -> 'sha' ('' for the series files): a text never names a directory of this machine."""
    m = re.search(r"\(([0-9a-f]{7,40})\)$", origin or "") if origin != "series" else None
    return m.group(1) if m else ""


def verify_data(rec: evidence.Record | None, state: str, target: str, fix_id: str | None) -> dict | None:
    """What the templates show of a verify record: the fix's checks and the regression suite."""
    if rec is None:
        return None
    d = rec.data
    out = _record_data(rec, state, target, "verify")
    out.update(env=d.get("env", ""), base_ref=d.get("base_ref", ""), patches=len(d.get("patches", [])),
               proven=sum(p.get("status") == "proven" for p in d.get("patches", [])))
    reg = d.get("regression") or {}
    out["regression"] = {"passed": reg.get("passed", 0), "failed": reg.get("failed", 0),
                         "errors": reg.get("errors", 0), "skipped": reg.get("skipped", 0),
                         "selection": list(reg.get("selection", [])), "checks": len(reg.get("checks", [])),
                         "ok": bool(reg.get("ok")), "reason": reg.get("reason", ""),
                         # failures that the base has too are its state, not the series' (testrun.compare)
                         "pre_existing": (reg.get("compare") or {}).get("pre_existing_failures", 0),
                         "new": (reg.get("compare") or {}).get("new_failures", 0)}
    out["by_fix"] = {p.get("fix_id"): _verdict(p) for p in d.get("patches", [])}
    out["patch"] = out["by_fix"].get(fix_id) if fix_id else None
    return out


def _verdict(p: dict) -> dict:
    fb, pa = p.get("fail_before") or [0, 0], p.get("pass_after") or [0, 0]
    return {"n": p.get("n"), "name": p.get("name"), "status": p.get("status"), "reason": p.get("reason", ""),
            "behaviour_before": p.get("behaviour_before"),
            "in_base": bool(p.get("in_base")), "fail_before": list(fb), "pass_after": list(pa),
            "checks": [{"node": c.get("node"), "test": c.get("node", "").rsplit("/", 1)[-1],
                        "before": c.get("before") or "not run", "after": c.get("after") or "not run",
                        "before_how": c.get("before_how", ""), "before_message": first_line(c.get("before_message")),
                        "before_kind": c.get("before_kind") or "",
                        "after_message": first_line(c.get("after_message"))}
                       for c in p.get("checks", [])]}


def bench_data(rec: evidence.Record | None, state: str, target: str, scenarios: tuple[str, ...]) -> dict | None:
    """The rows and goals of a bench record for the given scenarios (all of them when empty)."""
    if rec is None:
        return None
    d = rec.data
    out = _record_data(rec, state, target, "bench prefix-cache")
    wanted = set(scenarios)
    rows = []
    for row in d.get("rows", []):
        if wanted and row.get("scenario") not in wanted:
            continue
        b, p = row.get("base"), row.get("patched")
        rows.append({"label": row.get("label"), "scenario": row.get("scenario"),
                     "base_hit": pct(b["hit_rate"]) if b else "error",
                     "patched_hit": pct(p["hit_rate"]) if p else ("-" if "patched_error" not in row else "error"),
                     "ceiling": pct((p or b or {}).get("ceiling_rate")),
                     "base_violations": b["violations"] if b else "-",
                     "patched_violations": p["violations"] if p else "-",
                     "base": b, "patched": p})
    present = {r["scenario"] for r in rows}
    out.update(scale=d.get("scale"), seed=d.get("seed"), patches=d.get("patches", 0), note=d.get("note", ""),
               rows=rows, missing=[s for s in scenarios if s not in present],
               goals=[g for g in d.get("goals", []) if not wanted or g.get("scenario", "").split("/")[0] in wanted],
               command=f"kvforge bench prefix-cache -t {target}"
                       + (f" --scenario {','.join(scenarios)}" if scenarios else "")
                       + (f" --scale {d.get('scale'):g}" if isinstance(d.get("scale"), (int, float)) else "")
                       + (f" --seed {d.get('seed')}" if d.get("seed") else ""))
    return out


# ---------------------------------------------------------------- data for the templates

def _patch_data(stack, n: int, repo: str, deps: list, missing_deps: list[str],
                home: str = "vllm-project/vllm") -> dict:
    p = stack.series.patches[n - 1]
    tags, text = split_tags(p.subject)
    status, detail = upstream_status(p.upstream_status)
    # A text posted outside the patch's own repository (`home`) spells its '#N' in full.
    local = (lambda t: t) if repo.lower() == home.lower() else (lambda t: vllm_refs(t, home))
    description = message_body(p)
    return {
        "n": n, "name": p.name, "fix_id": p.fix_id, "kind": p.kind, "subject": p.subject, "subject_text": text,
        "tags": tags, "author": p.author, "why": local(p.value("Why") or ""), "description": description,
        "description_md": local(unwrap(description)),
        "upstream_status": p.upstream_status, "status": status, "status_detail": detail,
        "status_ref": github_ref(detail, repo) if detail.startswith("http") else detail,
        "upstream_prs": [{"url": u, "ref": github_ref(u, repo)} for u in p.values("Upstream-PR")],
        "upstream_commits": p.values("Upstream-Commit"),
        "bugs": [{"url": u, "ref": github_ref(u, repo)} for u in p.values("Bug")],
        "drop_when": p.value("Drop-When") or "", "drop_when_text": drop_when_text(p.value("Drop-When") or ""),
        "depends_on": [{"fix_id": d.fix_id, "name": d.name, "subject": d.subject,
                        "upstream_status": d.upstream_status, "status": upstream_status(d.upstream_status)[0],
                        "status_ref": github_ref(upstream_status(d.upstream_status)[1], repo)
                        if upstream_status(d.upstream_status)[1].startswith("http") else ""} for d in deps],
        "depends_missing": missing_deps,
        "checks": p.checks, "signed_off_by": p.values("Signed-off-by"),
        "touched": p.touched_paths, "user_facing": user_facing(p),
        "diffstat": diffstat(stack, n), "in_base": stack.in_base(n), "earlier": n - 1,
        "bench_scenarios": list(BENCH_SCENARIOS.get(p.fix_id, {})),
        "bench_roles": dict(BENCH_SCENARIOS.get(p.fix_id, {})),
    }


def _common(ctx, stack, style: str, layout: str, upstream: UpstreamTemplate) -> dict:
    comp, base = ctx.component, stack.base

    try:
        series_dir = os.path.relpath(comp.series_dir, project_root())
    except (KvforgeError, ValueError):
        series_dir = comp.series_dir.name
    return {
        "style": style, "layout": layout,
        "target": {"name": ctx.target.name, "description": ctx.target.description, "component": comp.name,
                   "flag": target_flag(ctx), "requires": comp.requires, "standins": list(comp.standins),
                   "release": f"{comp.release.package} {comp.release.version}",
                   "branch": ascend_branch(ctx.target.name, comp),
                   "selection": list(comp.tests.get("cpu", ()))},
        "base": {"ref": base.ref, "commit": base.commit, "short": base.commit[:12], "source": base.source,
                 "origin": _base_origin(base),
                 "name": _base_name(comp, base)},
        "series": {"dir": series_dir, "digest": stack.digest, "size": stack.size,
                   "from_commit": _from_commit(stack.origin)},
        "upstream": upstream.to_data(),
        "in_base": [{"fix_id": e.fix_id, "reason": e.reason} for e in comp.in_base],
    }


# ---------------------------------------------------------------- the two products

def pull_request(ctx, fix_id: str, style: str | None = None, template: Path | None = None,
                 allow_stale: bool = False) -> Text:
    """One fix of ctx's series as a PR title and body (see the module docstring)."""

    if style is not None and style not in STYLES:
        raise KvforgeError(f"--style must be one of {', '.join(STYLES)}, not {style!r}", EXIT_USAGE)
    if not ctx.from_rev:  # the series files: a fix with no upstream PR is refused before any tree is built
        early = read_series(ctx.component.series_dir).by_fix_id().get(fix_id)
        way = prpolicy.route(ctx.target, ctx.component, early) if early is not None else None
        if way is not None and way.action != "pr":
            raise KvforgeError(f"{fix_id} ({ctx.target.name}, {ctx.component.name}): no upstream PR: {way.reason}",
                               EXIT_USAGE)
    stack = open_stack(ctx)
    n = next((i for i, p in enumerate(stack.series.patches, 1) if p.fix_id == fix_id), None)
    if n is None:
        raise _no_such_fix(ctx, stack, fix_id)
    patch = stack.series.patches[n - 1]
    way = prpolicy.route(ctx.target, ctx.component, patch)
    if style is not None and style != way.style:
        raise KvforgeError(f"--style {style}: {ctx.component.name}'s fixes go to {way.repo}, whose style is "
                           f"{way.style} (the style follows the component; leave --style out)", EXIT_USAGE)
    if way.action != "pr":
        raise KvforgeError(f"{fix_id} ({ctx.target.name}, {ctx.component.name}): no upstream PR: {way.reason}",
                           EXIT_USAGE)
    style = way.style
    deps, missing_deps = depends_chain(stack.series, patch)
    check_dco([*deps, patch])
    warnings: list[str] = []
    if stack.in_base(n):
        warnings.append(f"{patch.name} changes nothing on {stack.base.ref}: its change is already in the base")
    if missing_deps:
        warnings.append(f"{patch.name} depends on {', '.join(missing_deps)}, which this series does not carry")

    repo = way.repo
    if style == "vllm":
        upstream, warning = vllm_template(stack, ctx.component.release.version)
        if warning:
            warnings.append(warning)
    else:
        upstream = ascend_template()
    layout = upstream.layout
    data = _common(ctx, stack, style, layout, upstream)
    data["fix"] = _patch_data(stack, n, repo, deps, missing_deps, _home(ctx))
    data["repo"] = repo

    key, target = stack.key, ctx.target.name
    used: list[EvidenceUsed] = []
    rec, state = _evidence(ctx, key, "verify", allow_stale, used, warnings)
    data["verify"] = verify_data(rec, state, target_flag(ctx), fix_id)
    verdict = (data["verify"] or {}).get("patch")
    if rec is not None and verdict is None:
        warnings.append(f"the verify record has no verdict for {fix_id}")
    elif verdict and verdict["status"] != "proven" and patch.kind == "fix":
        warnings.append(f"verify found {fix_id} {verdict['status']}: {verdict['reason']}")
    scenarios = tuple(BENCH_SCENARIOS.get(fix_id, {}))
    data["bench"] = None
    if scenarios:
        brec, bstate = _evidence(ctx, key, "bench-prefix-cache", allow_stale, used, warnings,
                                 f" --scenario {','.join(scenarios)}")
        data["bench"] = bench_data(brec, bstate, target_flag(ctx), scenarios)

    if style == "vllm":
        title = vllm_title(patch.subject, patch.kind, layout)
    else:
        title = ascend_title(patch.subject, patch.kind, way.branch.removeprefix("releases/"), patch.touched_paths)
    data["title"] = title
    name = "pr-ascend.md.j2" if style == "vllm-ascend" else f"pr-vllm-{layout}.md.j2"
    body, user_title = render_template(name, data, template)
    if user_title is not None:
        title = " ".join(user_title.split())
        if style == "vllm":
            check_vllm_title(title)
    internal = [i for i, ln in enumerate(f"{title}\n{body}".split("\n"), 1) if "kvforge" in ln.lower()]
    if internal:
        warnings.append(f"the PR text names kvforge on {len(internal)} line(s) (first: line {internal[0]}), "
                        f"which an upstream reader does not know: from the patch ({patch.name}: its message, "
                        "test file names) or the template; rename or reword them there")
    return Text("pr", target, ctx.component.name, style, layout, title, _tidy(body), stack.base.commit,
                stack.base.ref, stack.digest, stack.origin, fix_id,
                str(template) if template is not None else name, upstream.source, used, warnings, repo,
                way.branch)


def release_notes(ctx, template: Path | None = None, allow_stale: bool = False) -> Text:
    """Release notes for ctx's patched build: identity, one entry per fix, evidence, what the base has."""

    stack = open_stack(ctx)
    target, key = ctx.target.name, stack.key
    repo = ""  # notes are read outside vLLM's repository: its issues and PRs are spelled owner/name#N
    data = _common(ctx, stack, "notes", "notes", UpstreamTemplate("notes", "", "", ""))
    warnings: list[str] = []
    fixes = []
    for n, p in enumerate(stack.series.patches, 1):
        deps, missing = depends_chain(stack.series, p)
        fixes.append(_patch_data(stack, n, repo, deps, missing, _home(ctx)))
    data["fixes"] = fixes
    used: list[EvidenceUsed] = []
    rec, state = _evidence(ctx, key, "verify", allow_stale, used, warnings)
    data["verify"] = verify_data(rec, state, target_flag(ctx), None)
    wanted = tuple(dict.fromkeys(s for f in fixes for s in f["bench_scenarios"]))
    brec, bstate = _evidence(ctx, key, "bench-prefix-cache", allow_stale, used, warnings)
    data["bench"] = bench_data(brec, bstate, target_flag(ctx), ())
    data["bench_by_scenario"] = {r["scenario"]: r for r in (data["bench"] or {}).get("rows", [])
                                 if r["scenario"] in wanted and r["label"] == r["scenario"]}
    authors: dict[str, list[str]] = {}
    for p in stack.series.patches:
        # A backport names the upstream change it carries (its upstream author is on that PR).
        status, detail = upstream_status(p.upstream_status)
        what = p.subject + (f" (backport of {github_ref(detail, '')})" if status == "Backport" and detail else "")
        authors.setdefault(re.sub(r"\s*<.*>$", "", p.author) or "unknown", []).append(what)
    data["shortlog"] = [{"author": a, "subjects": s} for a, s in authors.items()]
    data["base"]["upstream_commit"], data["base"]["version_file"] = upstream_commit(ctx.component, stack.base)
    data["wheels"] = built_wheels(ctx.cache, target, ctx.component.name, stack.digest, stack.base.commit)
    data["settings"] = [{"fix_id": f["fix_id"], "item": item} for f in fixes for item in f["user_facing"]]
    data["diffstat"] = diffstat(stack, 0) if stack.size else ""
    title = f"{data['base']['name']} + kvforge series {target} ({stack.digest})"
    data["title"] = title
    body, user_title = render_template("notes.md.j2", data, template)
    return Text("notes", target, ctx.component.name, "notes", "notes", " ".join((user_title or title).split()),
                _tidy(body), stack.base.commit, stack.base.ref, stack.digest, stack.origin, None,
                str(template) if template is not None else "notes.md.j2", "", used, warnings)


def upstream_commit(comp, base) -> tuple[str, str]:
    """The upstream commit a base was released from, as its sdist records it (setuptools-scm's
    `<package>/_version.py`: `__commit_id__ = commit_id = 'gbc150f502'`): (commit, that file), or
    ('', '') when the base has none (a git base is its upstream commit itself)."""
    if base.source != "sdist":
        return base.commit, ""
    rel = f"{comp.release.package.replace('-', '_')}/_version.py"
    res = gitutil.run(base.repo, "show", f"{base.commit}:{rel}", check=False)
    m = re.search(r"""commit_id\s*(?::[^=]*)?=\s*['"]g?([0-9a-f]{7,40})['"]""", res.stdout) if res.returncode == 0 else None
    return (m.group(1), rel) if m else ("", "")


def built_wheels(cache, target: str, component: str, digest: str, base_commit: str) -> list[dict]:
    """The wheels `kvforge build` made and verified for exactly this series and base, read from its
    reports (<cache>/builds/<target>/<component>/<digest>/build-<platform>.json, written by
    kvforge/wheels/build.py; read here, never written): file name, sha256, size, platform tag."""
    out = []
    for report in sorted((cache.root / "builds" / target / component / digest).glob("build-*.json")):
        try:
            doc = json.loads(report.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not (isinstance(doc, dict) and doc.get("ok") and doc.get("filename") and doc.get("sha256")
                and doc.get("base") == base_commit and doc.get("series") == digest):
            continue
        tag = doc["filename"][:-len(".whl")].rsplit("-", 1)[-1] if doc["filename"].endswith(".whl") else ""
        out.append({"filename": doc["filename"], "sha256": doc["sha256"], "size": doc.get("size", 0),
                    "platform": tag, "verified_on": report.stem.removeprefix("build-")})
    return out


def _home(ctx) -> str:
    """The GitHub repository a component's patches were written for (their bare '#N' refer to it)."""
    return _github_repo(ctx.component.repo) or "vllm-project/vllm"


def target_flag(ctx) -> str:
    """What follows `-t` in the commands a text names: the target, and --component when it has several."""
    if len(ctx.target.components) > 1:
        return f"{ctx.target.name} --component {ctx.component.name}"
    return ctx.target.name


def _base_name(comp, base) -> str:
    """How a text names the base: vLLM v0.20.2, vLLM main (0.33.0 snapshot), vllm-ascend releases/v0.20.2rc
    (0.20.2rc1 from PyPI when it is the sdist)."""
    if comp.requires:
        how = f" ({comp.release.version} from PyPI)" if base.source == "sdist" else ""
        return f"{comp.name} {base.ref}{how}"
    return f"vLLM {base.ref}" if base.ref != "main" else f"vLLM main ({comp.release.version} snapshot)"


def _tidy(body: str) -> str:
    """At most one blank line in a row, no trailing spaces, one final newline."""
    lines = [ln.rstrip() for ln in body.split("\n")]
    out: list[str] = []
    for ln in lines:
        if ln == "" and out and out[-1] == "":
            continue
        out.append(ln)
    return "\n".join(out).strip("\n") + "\n"


def _base_origin(base) -> str:
    """Where the base came from, as a text may say it: the sdist and its sha256, or a git URL (never a
    directory of this machine)."""
    if base.source == "git" and not re.match(r"^[a-z][a-z0-9+.-]*://|^git@", base.origin or ""):
        return f"a local git clone ({base.ref})"
    return base.origin


def _github_repo(url: str) -> str | None:
    m = re.match(r"^(?:https?://|git@)github\.com[/:]([^/]+/[^/]+?)(?:\.git)?/?$", url or "")
    return m.group(1) if m else None


def _no_such_fix(ctx, stack, fix_id: str) -> KvforgeError:
    name = ctx.target.name
    entry = next((e for e in ctx.component.in_base if e.fix_id == fix_id), None)
    if entry is not None:
        return KvforgeError(f"{name}: {fix_id} is already in the base ({entry.reason}); {name} carries no patch "
                            "for it, so there is no PR to describe", EXIT_USAGE)
    carried = []
    try:
        for t in load_all():
            if t.name != name and any(p.fix_id == fix_id for c in t.components
                                      for p in read_series(c.series_dir).patches):
                carried.append(t.name)
    except KvforgeError:
        pass
    have = f"it has: {', '.join(p.fix_id for p in stack.series.patches)}" if stack.series.patches else "it is empty"
    where = f"; carried by {', '.join(carried)}" if carried else ""
    return KvforgeError(f"{name}: no patch with Fix-Id {fix_id!r} in its series ({have}), and "
                        f"targets/{name}.toml lists no in_base entry for it{where}", EXIT_USAGE)


# ---------------------------------------------------------------- gh

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


def history_refusal(ctx, fix_id: str) -> KvforgeError | None:
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


def push_fix(clone: Path, patch, branch: str, push_to: str, name: str, say=None) -> Pushed:
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


def publish(result: Text, out: Path | None, gh: str | None = None, push=None) -> Done:
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


def pr_command(ctx, fix_id: str, style: str | None, template: Path | None, allow_stale: bool, out: Path | None,
               gh: str | None, push_to: str | None = None) -> Done:
    """`kvforge pr`: the fix's pull request description, published; with gh (--open), first the fix
    re-applied onto the upstream branch of the --repo clone and pushed to --push-to."""
    if gh:
        refusal = history_refusal(ctx, fix_id)
        if refusal is not None:
            raise refusal
        if not push_to:
            raise KvforgeError("--open needs --push-to FORK: the remote (of the --repo clone) or URL of your fork, "
                               "where the PR's branch is pushed", EXIT_USAGE)
    text = pull_request(ctx, fix_id, style, template, allow_stale)
    push = None
    if gh and push_to:
        stack = open_stack(ctx)
        if stack.base.source != "git":
            raise KvforgeError(f"--open: the base came from {stack.base.source}, not from --repo's history", EXIT_USAGE)
        patch = stack.series.by_fix_id()[fix_id]
        clone = Path(str(ctx.repo_url))
        push = lambda: push_fix(clone, patch, text.branch, push_to, f"fix/{fix_id}", ctx.say)  # noqa: E731
    return publish(text, out, gh, push)


def notes_command(ctx, template: Path | None, allow_stale: bool, out: Path | None) -> Done:
    """`kvforge notes`: the release notes, published."""
    return publish(release_notes(ctx, template, allow_stale), out)
