"""`kvforge matrix`: the CI jobs of every target, as data, for GitHub Actions, Buildkite or any runner.

Jobs are targets x components x kinds (x shards):
- build: `kvforge build` (the patched release wheel, verified on CPU); a component with a
  [components.wheel] pin;
- cpu:   `kvforge verify` (every patch proven with vLLM's CPU tests; what .ci/run runs); runs anywhere;
- cuda:  on a GPU runner, the build job's wheel installed (with its dependencies: CUDA torch) into a
  venv, then `kvforge build --wheel ... --platform cuda --tests all`: the target's cuda selection
  plus every Checks test with vllm imported from that wheel;
- npu:   on vllm-ascend's runner, in the CANN container vllm-ascend's CI uses (both are data in
  kvforge/project/platforms.py). For a component built on vLLM (v0.20.2rc's vllm-ascend): `kvforge apply`
  makes both patched trees, vLLM is installed from its tree with VLLM_TARGET_DEVICE=empty, the
  patched vllm-ascend over it (its kernels build into its tree), and the command is pytest of its
  npu selection and Checks from that tree (kvforge/ci/runner.py hardware_steps). For a vLLM
  component listing npu: the patched tree, the vllm-ascend release branch over it, then
  `kvforge test --platform npu`.
Each job's command is a kvforge command (except that pytest in the installed vllm-ascend tree), so
CI and a developer run the same thing; `setup` lines
prepare a runner (install kvforge, the hardware's interpreter). cuda and npu jobs are generated
for their runners only: `kvforge matrix` never runs a job, and the output marks them
`runs_here: false` with the hardware they need: nothing here reports them as passed.

The kinds of job are one table, kvforge.project.platforms.JOB_KINDS (build, then one per platform), and
every fact a job takes from its platform is data there: runner labels (defaults; `--runs-on
PLATFORM=LABEL` overrides one), container, timeout, Buildkite emoji, vLLM's Buildkite device, the
plugin a "tree" job installs. This module has one function per recipe (RECIPES: build, verify,
wheel, tree) and the output formats.

Formats: json (everything), github (lines for $GITHUB_OUTPUT: one `{"include": [...]}` matrix per
kind, each at most 256 jobs, GitHub's limit), buildkite (a Buildkite pipeline for `buildkite-agent
pipeline upload`, valid against Buildkite's schema: steps with label, key, depends_on, commands,
agents, soft_fail, timeout_in_minutes, artifact_paths and if_changed from the project files each
target depends on), buildkite-vllm (steps in vLLM's own .buildkite/test_areas format, for a vLLM
fork that carries the series as commits: device, num_devices and source_file_dependencies from the
files each series touches), commands / targets (one per line, for shell scripts such as .ci/run).

--changed-since REV: only the targets whose target file or series changed since the merge base of
REV and HEAD (committed, uncommitted and untracked), or all of them when kvforge itself changed.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Collection

from packaging.utils import canonicalize_name

from kvforge.git import gitutil
from kvforge.project import platforms as platforms_mod
from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.ci.runner import minimal
from kvforge.core.outcome import Done
from kvforge.project.platforms import BUILD, JOB_KINDS, JobKind, Platform
from kvforge.core.render import table
from kvforge.ci.runner import hardware_steps, tree_name
from kvforge.project.series import read_series
from kvforge.project.targets import Component, Target, load_all, load_target, project_root

GITHUB_MAX_JOBS = 256  # per matrix (GitHub Actions' limit)
CACHE_DIR = ".kvforge-cache"  # $KVFORGE_CACHE in CI, relative to the checkout
# How a job installs kvforge: from the checkout (this project), or $KVFORGE_INSTALL (set by the CI files of a
# project `kvforge init` made, which holds no kvforge).
INSTALL_KVFORGE = os.environ.get("KVFORGE_INSTALL") or "python3 -m pip install -e ."
# kvforge's own sources: a change there re-runs every target.
TOOL_PATHS = ("kvforge/", "pyproject.toml")
VLLM_STEPS_FILE = ".buildkite/test_areas/kvforge_{target}.yaml"  # where a vLLM fork keeps --format buildkite-vllm


@dataclass
class Job:
    id: str
    kind: str
    target: str
    component: str
    platform: str
    name: str
    command: str
    setup: list[str] = field(default_factory=list)
    needs: list[str] = field(default_factory=list)
    shard: str = "1/1"
    runs_on: list[str] = field(default_factory=list)  # GitHub Actions labels
    agents: dict[str, str] = field(default_factory=dict)  # Buildkite agent tags
    container: str | None = None
    artifact: str | None = None  # the wheel artifact this job uploads (build) or downloads (cuda)
    artifact_path: str | None = None
    junit: list[str] = field(default_factory=list)  # JUnit XML globs to upload as test reports
    if_changed: list[str] = field(default_factory=list)  # project files the job depends on
    source_files: list[str] = field(default_factory=list)  # vLLM tree files the series touches
    selection: list[str] = field(default_factory=list)  # the tests (tree-relative) the job runs
    timeout_minutes: int = 60
    runs_here: bool = True  # False: needs hardware kvforge matrix does not assume; never reported as passed
    hardware: str = ""
    requires: str | None = None  # a component built on another (vllm-ascend on vllm): its tree is not vLLM's

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Matrix:
    jobs: list[Job]
    targets: list[dict]
    changed_since: str | None = None

    def of(self, kind: str) -> list[Job]:
        return [j for j in self.jobs if j.kind == kind]

    def to_json(self) -> dict:
        counts = {k: len(self.of(k)) for k in JOB_KINDS}
        return {"jobs": [j.to_json() for j in self.jobs], "targets": self.targets, "changed_since": self.changed_since,
                "counts": counts,
                "not_run": "kvforge matrix runs nothing; cuda and npu jobs are generated for runners with that "
                           "hardware and are never reported as passed here"}


def slug(text: str) -> str:
    """A key Buildkite and GitHub accept: letters, digits, '-' and '_'."""
    return re.sub(r"[^A-Za-z0-9_-]+", "_", text)


def parse_runs_on(specs: tuple[str, ...] | list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for spec in specs:
        plat, _, labels = spec.partition("=")
        if plat not in platforms_mod.PLATFORMS or not labels:
            raise KvforgeError(f"--runs-on {spec!r}: expected PLATFORM=LABEL[,LABEL] with PLATFORM one of "
                               f"{', '.join(platforms_mod.PLATFORMS)}", EXIT_USAGE)
        out[plat] = [x for x in labels.split(",") if x]
    return out


def _agents(plat: Platform) -> dict[str, str]:
    return dict(tag.split("=", 1) for tag in plat.labels("buildkite") if "=" in tag)


def _rel(path: Path, root: Path) -> str:
    return Path(path).resolve().relative_to(root.resolve()).as_posix()


@dataclass
class _Unit:
    """One component of one target, as its jobs see it (what every recipe below shares)."""

    target: Target
    comp: Component
    checks: list[str]  # the series' Checks
    tflag: str  # --target T [--component C]
    tid: str  # the job ids' suffix
    dist: str  # where the build job puts the wheel
    common: dict  # Job fields every job of the unit has
    kinds: Collection[str]
    cuda_shards: int
    runs_on: dict[str, list[str]]

    def selection(self, platform: str) -> list[str]:
        return sorted({*self.comp.tests.get(platform, ()), *self.checks})

    def job(self, kind: JobKind, plat: Platform, **fields) -> Job:
        """A Job of `kind` on `plat`'s runner: labels, agents, container, timeout and whether it runs
        anywhere come from the platform and kind tables; the recipe gives the rest."""
        anywhere = plat.probe == "always"
        fields.setdefault("id", f"{kind.name}-{self.tid}")
        labels = self.runs_on.get(plat.name) or plat.labels("github")
        return Job(kind=kind.name, platform=plat.name, runs_on=list(labels),
                   agents=_agents(plat), container=plat.container, timeout_minutes=kind.timeout_minutes,
                   runs_here=anywhere, hardware="" if anywhere else plat.hardware, **fields, **self.common)


def _build_jobs(u: _Unit, kind: JobKind, plat: Platform) -> list[Job]:
    """Every release wheel the component pins, overlaid and verified, in one job on the (x86_64) CPU runner:
    `--arch all` builds the aarch64 overlay there too (an overlay is arch-independent; the aarch64 wheel is
    checked by RECORD, files and metadata, its import labelled not run). Plus, per kvforge.project.platforms.DEVICES,
    the package's own build for a device (vLLM for `empty`) when a component of the target runs on one of
    the device's platforms (npu: an Ascend deployment installs vLLM without a device under vllm-ascend)."""
    t, c = u.target, u.comp
    jobs = []
    if c.wheels:
        vllm_like = platforms_mod.package_build(c.release.package).probe == "vllm"
        jobs.append(u.job(kind, plat, name=f"build {t.name}/{c.name}",
                          command=f"kvforge build {u.tflag} --arch all --out {u.dist}",
                          setup=[INSTALL_KVFORGE], artifact=f"wheel-{u.tid}", artifact_path=f"{u.dist}/*.whl",
                          junit=[f"{CACHE_DIR}/builds/{t.name}/{c.name}/*/verify-cpu.xml"] if vllm_like else [],
                          selection=u.checks if vllm_like else []))
    platforms_used = {p for comp in t.components for p in comp.platforms}
    for dev in platforms_mod.DEVICES.values():
        if canonicalize_name(c.release.package) in dev.packages and platforms_used & set(dev.for_platforms):
            dist = f"{u.dist}-{dev.name}"
            jobs.append(u.job(kind, plat, id=f"{kind.name}-{u.tid}-{dev.name}", name=f"build {t.name}/{c.name} "
                              f"(device {dev.name})", command=f"kvforge build {u.tflag} --device {dev.name} --out {dist}",
                              setup=[INSTALL_KVFORGE], artifact=f"wheel-{u.tid}-{dev.name}",
                              artifact_path=f"{dist}/*.whl",
                              junit=[f"{CACHE_DIR}/builds/{t.name}/{c.name}/*/verify-cpu-{dev.name}.xml"],
                              selection=u.checks))
    return jobs


def _verify_jobs(u: _Unit, kind: JobKind, plat: Platform) -> list[Job]:
    """`kvforge verify`: every patch proven with vLLM's tests on the platform (what .ci/run runs)."""
    t, c = u.target, u.comp
    if plat.name not in c.platforms:
        return []
    return [u.job(kind, plat, name=f"{kind.name} {t.name}/{c.name}: verify", command=f"kvforge verify {u.tflag}",
                  setup=[INSTALL_KVFORGE], junit=[f"{CACHE_DIR}/results/{t.name}/{c.name}/**/*.xml"],
                  selection=u.selection(plat.name))]


def _wheel_jobs(u: _Unit, kind: JobKind, plat: Platform) -> list[Job]:
    """The build job's wheel (with its dependencies: the platform's torch) in a venv, then
    `kvforge build --wheel --platform P --tests all`; split --cuda-shards ways."""
    t, c = u.target, u.comp
    if plat.name not in c.platforms or c.wheel is None:
        return []
    venv = f".venv-{plat.name}"
    shards = u.cuda_shards
    jobs = []
    for k in range(1, shards + 1):
        shard = f"{k}/{shards}"
        jobs.append(u.job(
            kind, plat, id=f"{kind.name}-{u.tid}" + (f"-{k}of{shards}" if shards > 1 else ""), shard=shard,
            name=f"{kind.name} {t.name}/{c.name}: wheel tests" + (f" ({shard})" if shards > 1 else ""),
            command=(f"kvforge build {u.tflag} --wheel {u.dist} --platform {plat.name} --python {venv}/bin/python "
                     f"--tests all" + (f" --shard {shard}" if shards > 1 else "")),
            # the build job's artifact holds every architecture's wheel: the runner's own
            setup=[INSTALL_KVFORGE, f"python3 -m venv {venv}",
                   f"{venv}/bin/python -m pip install {u.dist}/*_$(uname -m).whl pytest tblib"],
            needs=[f"{BUILD.name}-{u.tid}"] if BUILD.name in u.kinds else [],
            artifact=f"wheel-{u.tid}", artifact_path=u.dist,
            junit=[f"{CACHE_DIR}/builds/{t.name}/{c.name}/*/verify-{plat.name}.xml"], selection=u.selection(plat.name)))
    return jobs


def _tree_jobs(u: _Unit, kind: JobKind, plat: Platform) -> list[Job]:
    """On the platform's runner, in its container. A component built on another (v0.20.2rc's
    vllm-ascend): both patched trees installed and pytest of its selection from its tree
    (runner.hardware_steps). A vLLM component: the patched tree, the platform's plugin over it, then
    `kvforge test --platform P`."""
    t, c = u.target, u.comp
    if plat.name not in c.platforms:
        return []
    selection = u.selection(plat.name)
    if c.requires:
        steps = hardware_steps(t, c, plat, minimal(selection))
        return [u.job(kind, plat, name=f"{kind.name} {t.name}/{c.name}: on {c.requires}", command=steps[-1],
                      setup=[INSTALL_KVFORGE, *steps[:-1]],
                      junit=[f"{tree_name(t, c)}/kvforge-{t.name}-{c.name}-{plat.name}.xml"], selection=selection)]
    ci = plat.ci
    tree = f"vllm-{t.name}"
    ref = "main" if t.name == "main" else ci.plugin_ref.format(target=t.name)
    setup = [line.format(tree=tree, plugin=ci.plugin, plugin_repo=ci.plugin_repo, ref=ref) for line in ci.tree_setup]
    return [u.job(kind, plat, name=f"{kind.name} {t.name}/{c.name}: {ci.plugin}",
                  command=f'kvforge test {u.tflag} --platform {plat.name} --python "$(command -v python3)"',
                  setup=[INSTALL_KVFORGE, f"kvforge apply {u.tflag} --into {tree}", *setup],
                  junit=[f"{CACHE_DIR}/results/{t.name}/{c.name}/**/*.xml"], selection=selection)]


# How each kind of job is made (JobKind.recipe; kvforge.project.platforms holds the facts).
RECIPES: dict[str, Callable[[_Unit, JobKind, Platform], list[Job]]] = {
    "build": _build_jobs, "verify": _verify_jobs, "wheel": _wheel_jobs, "tree": _tree_jobs}


def build_matrix(targets: list[Target], root: Path, changed_since: str | None = None,
                 kinds: Collection[str] = tuple(JOB_KINDS), cuda_shards: int = 1,
                 runs_on: dict[str, list[str]] | None = None) -> Matrix:
    """Every job of `targets`, optionally only those changed since a revision: per target and
    component, one recipe per kind of job in JOB_KINDS' order (those in `kinds`)."""
    runs_on = runs_on or {}
    if cuda_shards < 1:
        raise KvforgeError("--cuda-shards must be at least 1", EXIT_USAGE)
    selected = {t.name: "all targets" for t in targets}
    if changed_since:
        selected = changed_targets(root, changed_since, targets)
    jobs: list[Job] = []
    listing = []
    for t in targets:
        for c in t.components:
            eol = t.lifecycle == "eol"  # kept for reference: no job in any format
            listing.append({"target": t.name, "component": c.name, "selected": t.name in selected and not eol,
                            "reason": "lifecycle eol" if eol else selected.get(t.name, "unchanged")})
            if t.name not in selected or eol:
                continue
            series = read_series(c.series_dir)
            checks = sorted({n for p in series.patches for n in p.checks})
            touched = sorted({f for p in series.patches for f in p.touched_paths})
            tflag = f"--target {shlex.quote(t.name)}" + (f" --component {shlex.quote(c.name)}"
                                                        if len(t.components) > 1 else "")
            project = [_rel(t.path, root), _rel(c.series_dir, root) + "/**", *[p + ("**" if p.endswith("/") else "")
                                                                           for p in TOOL_PATHS]]
            unit = _Unit(t, c, checks, tflag, slug(f"{t.name}-{c.name}"), f"dist/{t.name}",
                         dict(target=t.name, component=c.name, if_changed=project, source_files=touched,
                              requires=c.requires), kinds, cuda_shards, runs_on)
            for kind in JOB_KINDS.values():
                if kind.name in kinds:
                    jobs += RECIPES[kind.recipe](unit, kind, platforms_mod.get(kind.platform))
    return Matrix(jobs=jobs, targets=listing, changed_since=changed_since)


def changed_targets(root: Path, rev: str, targets) -> dict[str, str]:
    """{target: why} for the targets whose file or series changed since merge-base(rev, HEAD)."""
    if gitutil.run(root, "rev-parse", "--git-dir", check=False).returncode != 0:
        raise KvforgeError(f"--changed-since {rev}: the project at {root} is not a git repository", EXIT_USAGE)
    base = gitutil.run(root, "merge-base", rev, "HEAD", check=False)
    if base.returncode != 0:
        raise KvforgeError(f"--changed-since {rev}: no such revision, or no common history with HEAD in {root}",
                           EXIT_USAGE)
    top = Path(gitutil.run(root, "rev-parse", "--show-toplevel").stdout.strip())
    diff = gitutil.run(root, "diff", "--name-only", "--no-renames", "-z", base.stdout.strip(), "--", ".").stdout
    untracked = gitutil.run(root, "ls-files", "--others", "--exclude-standard", "-z", "--full-name", "--", ".").stdout
    changed = set()
    for p in (diff + "\0" + untracked).split("\0"):
        if p:
            try:
                changed.add((top / p).resolve().relative_to(root.resolve()).as_posix())
            except ValueError:
                continue  # outside the project
    tool = sorted(p for p in changed if p.startswith(TOOL_PATHS))
    out: dict[str, str] = {}
    for t in targets:
        if tool:
            out[t.name] = f"kvforge itself changed ({tool[0]})"
            continue
        tfile = _rel(t.path, root)
        if tfile in changed:
            out[t.name] = f"{tfile} changed"
            continue
        for c in t.components:
            sdir = _rel(c.series_dir, root) + "/"
            hit = sorted(p for p in changed if p.startswith(sdir))
            if hit:
                out[t.name] = f"{hit[0]} changed"
                break
    return out


# ---------------------------------------------------------------- formats

def github_outputs(m: Matrix) -> str:
    """Lines for $GITHUB_OUTPUT: <kind>=<{"include": [...]}> and has_<kind>=true|false."""
    lines = []
    for kind in JOB_KINDS:
        jobs = m.of(kind)
        if len(jobs) > GITHUB_MAX_JOBS:
            raise KvforgeError(f"{len(jobs)} {kind} jobs: a GitHub Actions matrix holds at most {GITHUB_MAX_JOBS}; "
                               "use --changed-since, fewer --cuda-shards, or split the workflow", EXIT_USAGE)
        include = [{"id": j.id, "name": j.name, "target": j.target, "component": j.component, "command": j.command,
                    "setup": "\n".join(j.setup), "runs_on": j.runs_on, "artifact": j.artifact or "",
                    "artifact_path": j.artifact_path or "", "junit": "\n".join(j.junit), "shard": j.shard,
                    "container": j.container or "", "timeout": j.timeout_minutes} for j in jobs]
        lines.append(f"{kind}={json.dumps({'include': include}, separators=(',', ':'), sort_keys=True)}")
        lines.append(f"has_{kind}={'true' if jobs else 'false'}")
    return "\n".join(lines) + "\n"


def buildkite_pipeline(m: Matrix) -> dict:
    """A Buildkite pipeline (upload it with `buildkite-agent pipeline upload --apply-if-changed`)."""
    steps = []
    for j in m.jobs:
        commands = list(j.setup)
        if JOB_KINDS[j.kind].recipe == "wheel":  # the build job's wheel
            commands.insert(0, f"buildkite-agent artifact download '{j.artifact_path}/*.whl' .")
        commands.append(j.command)
        step = {"label": f"{JOB_KINDS[j.kind].emoji} {j.name}", "key": j.id, "commands": commands, "agents": j.agents,
                "env": {"KVFORGE_CACHE": CACHE_DIR}, "timeout_in_minutes": j.timeout_minutes, "soft_fail": False,
                "if_changed": j.if_changed, "artifact_paths": [*([j.artifact_path] if JOB_KINDS[j.kind].recipe == "build" and j.artifact_path
                                                                 else []),
                                                               *j.junit]}
        if j.needs:
            step["depends_on"] = list(j.needs)
        if j.container:
            plat = platforms_mod.get(j.platform)
            docker: dict = {"image": j.container, "propagate-environment": True}
            if plat.docker_devices:
                docker["devices"] = list(plat.docker_devices)
            if plat.docker_volumes:
                docker["volumes"] = list(plat.docker_volumes)
            step["plugins"] = [{"docker#v5.12.0": docker}]
        steps.append(step)
    return {"steps": steps}


def vllm_steps(m: Matrix) -> dict:
    """One .buildkite/test_areas file in vLLM's format, for a vLLM fork that carries one target's series
    (saved as VLLM_STEPS_FILE.format(target=...), which every step depends on too: a change to it alone
    runs them). Only what vLLM's pipeline generator knows: its keys, its devices (cpu-small; no device:
    its default GPU), its image steps. The CPU step runs `kvforge verify` (failures judged against the
    base, as everywhere) from the kvforge project at $KVFORGE_PROJECT, with the fork's checkout as --from."""
    names = list(dict.fromkeys(j.target for j in m.jobs))
    if len(names) != 1:
        raise KvforgeError("--format buildkite-vllm describes the fork of one target's series: pass --target NAME "
                           f"(selected: {', '.join(names) or 'none'})", EXIT_USAGE)
    own_file = VLLM_STEPS_FILE.format(target=slug(names[0]))
    steps = []
    for j in m.jobs:
        if j.kind not in platforms_mod.PLATFORMS or not j.selection or not j.shard.startswith("1/") or j.requires:
            continue  # one step per platform (vLLM's own generator shards); vLLM's tree only
        ci = platforms_mod.get(j.platform).ci
        paths = [s.removeprefix("tests/") for s in minimal(j.selection)]  # vLLM's steps run in tests/
        if j.platform == "cpu":
            commands = [f"git clone --depth 1 \"$$KVFORGE_PROJECT\" /tmp/kvforge",
                        "python3 -m pip install -e /tmp/kvforge",
                        f"cd /tmp/kvforge && kvforge verify --target {shlex.quote(j.target)} "
                        f"--python \"$$(command -v python3)\" --repo \"$$BUILDKITE_BUILD_CHECKOUT_PATH\" "
                        f"--from \"$$BUILDKITE_BUILD_CHECKOUT_PATH\""]
        else:
            commands = ["pytest -v -s " + " ".join(shlex.quote(p) for p in paths)]
        step: dict = {"label": f"kvforge {j.target} ({j.platform}): series Checks and selection",
                      "key": slug(f"kvforge-{j.target}-{j.component}-{j.platform}"),
                      "timeout_in_minutes": j.timeout_minutes}
        if ci.vllm_device:
            step["device"] = ci.vllm_device
        step["source_file_dependencies"] = [*(j.source_files or [_rel_series(j)]), own_file]
        step["commands"] = commands
        if ci.vllm_soft_fail:
            step["soft_fail"] = True
        if ci.vllm_image:
            step["depends_on"] = [ci.vllm_image]
        if ci.vllm_num_devices is not None:
            step["num_devices"] = ci.vllm_num_devices
        steps.append(step)
    return {"group": f"kvforge {names[0]}", "depends_on": ["image-build"], "steps": steps}


def _rel_series(j: Job) -> str:
    return "vllm/v1/core/"  # a series that touches nothing yet: the area kvforge carries fixes for


def to_yaml(value, indent: int = 0) -> str:
    """Block YAML for dicts, lists and scalars (strings double-quoted as JSON, which YAML reads as is)."""
    pad = " " * indent
    if isinstance(value, dict):
        if not value:
            return pad + "{}\n"
        out = []
        for k, v in value.items():
            key = json.dumps(k) if not re.match(r"^[A-Za-z_][A-Za-z0-9_#.-]*$", k) else k
            if isinstance(v, (dict, list)) and v:
                out.append(f"{pad}{key}:\n{to_yaml(v, indent + 2)}")
            else:
                out.append(f"{pad}{key}: {_scalar(v)}\n")
        return "".join(out)
    if isinstance(value, list):
        if not value:
            return pad + "[]\n"
        out = []
        for v in value:
            if isinstance(v, (dict, list)) and v:
                body = to_yaml(v, indent + 2)
                out.append(f"{pad}- {body[indent + 2:]}")
            else:
                out.append(f"{pad}- {_scalar(v)}\n")
        return "".join(out)
    return pad + _scalar(value) + "\n"


def _scalar(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, (dict, list)):
        return "{}" if isinstance(v, dict) else "[]"
    return json.dumps(str(v), ensure_ascii=False)


def render_table(m: Matrix) -> str:
    rows = [[j.id, j.kind, j.shard, ",".join(j.runs_on), "yes" if j.runs_here else f"no ({j.platform} runner)",
             j.command] for j in m.jobs]
    skipped = [f"{t['target']}/{t['component']}" for t in m.targets if not t["selected"]]
    tail = f"\nnot selected (unchanged since {m.changed_since}): {', '.join(skipped)}" if skipped else ""
    return (table(["job", "kind", "shard", "runs-on", "runs anywhere", "command"], rows) +
            f"\n{len(m.jobs)} jobs; cuda and npu jobs are generated for their runners, never run or reported as "
            f"passed by kvforge matrix" + tail)


def matrix_command(fmt: str, changed_since: str | None, kinds: tuple[str, ...], target_names: tuple[str, ...],
                   cuda_shards: int, runs_on: tuple[str, ...]) -> Done:
    """`kvforge matrix`: the jobs, as JSON (--json, --format json) or as the text of `fmt`."""
    root = project_root()
    targets = [load_target(n, root) for n in target_names] if target_names else load_all(root)
    m = build_matrix(targets, root, changed_since, tuple(kinds) or tuple(JOB_KINDS), cuda_shards, parse_runs_on(runs_on))
    texts = {"github": lambda: github_outputs(m), "buildkite": lambda: to_yaml(buildkite_pipeline(m)),
             "buildkite-vllm": lambda: to_yaml(vllm_steps(m)), "commands": lambda: "\n".join(j.command for j in m.jobs),
             "targets": lambda: "\n".join(dict.fromkeys(j.target for j in m.jobs)), "table": lambda: render_table(m)}
    return Done(m.to_json(), "" if fmt == "json" else texts[fmt]())
