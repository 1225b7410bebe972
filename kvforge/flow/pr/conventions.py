"""Each upstream's PR conventions, as data and checks: its title rule and tags, and the layout of its
PR template (the base's own, or kvforge's copy for its version).

Invariants: a vLLM title always passes vLLM's own title check (`check_vllm_title`, else EXIT_USAGE);
a vllm-ascend title is [Branch][Module][Action] with the branch left out for main; an upstream PR
template parses into one of LAYOUTS or is refused (EXIT_USAGE). Reads the base's template through
git; writes nothing.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from packaging.version import InvalidVersion, Version

from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.flow.pr.sandbox import TEMPLATES
from kvforge.git import gitutil
from kvforge.git.trees import Stack
from kvforge.project.targets import Component

STYLES = ("vllm", "vllm-ascend")
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


def vllm_template(stack: Stack, release_version: str) -> tuple[UpstreamTemplate, str | None]:
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


def ascend_branch(target_name: str, component: Component) -> str | None:
    """The [Branch] of a vllm-ascend title: the release of the component's own ref when it is a
    vllm-ascend release branch (releases/v0.20.2rc -> v0.20.2rc); None for main; else the target."""
    ref = component.ref
    if ref.startswith("releases/"):
        return ref.removeprefix("releases/")
    if ref == "main" or target_name == "main":
        return None
    return target_name
