"""What `kvforge build` reports: each changed path and what the build did with it (Change), the
verification of the installed wheel (Verification), the BuildResult of one wheel, its verdict (exit code
and error line) and its text.

Plain data and its rendering; the other modules of kvforge.wheels fill these in, and this one imports none
of them. BuildResult.to_json() is the build's --json object and the report in the build directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvforge.core.errors import EXIT_NOT_RUN, EXIT_TESTS


@dataclass
class Change:
    """A path the series changes (git diff) and what the build does with it (changes.classify)."""

    path: str
    status: str  # A | M | D (git diff --name-status)
    action: str = ""  # replace | add | remove | not packaged | refused
    why: str = ""


@dataclass
class Verification:
    """What verify_wheel found of the installed wheel; ok once it found no problem."""

    ok: bool = False
    site: str = ""  # where the wheel was installed (removed afterwards)
    python: str = ""
    platform: str = "cpu"
    record: dict = field(default_factory=dict)
    modules: dict = field(default_factory=dict)
    probe: dict = field(default_factory=dict)
    tests: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    seconds: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class BuildResult:
    """One wheel's build: its inputs (base, series, release wheel), what it did, the wheel in --out and its
    verification."""

    target: str
    component: str
    mode: str  # overlay | source | device
    version: str
    local_version: str = ""  # the wheel's version: the release's + kvforge's local label (local_version)
    base: str = ""
    base_ref: str = ""
    series: str = ""
    origin: str = "series"
    fix_ids: list[str] = field(default_factory=list)
    upstream: dict = field(default_factory=dict)  # filename, sha256, path
    wheel: str | None = None  # the verified wheel in --out (None: not built, or refused)
    filename: str = ""
    sha256: str = ""
    size: int = 0
    build_tag: str = ""
    changes: list[Change] = field(default_factory=list)
    verification: Verification | None = None
    command: str | None = None  # --mode source: the build to run on a build machine
    seconds: dict = field(default_factory=dict)
    ok: bool = False
    reason: str = ""
    report: str | None = None
    arch: str | None = "x86_64"  # the release wheel's machine architecture (None: pure Python, --device)
    device: str = ""  # --device NAME: the package's own build for that device (empty), not an overlay
    variant: str = ""  # what tells this wheel from the component's others: "", "aarch64", "cp311-x86_64", "empty"
    pinned: bool = True  # False: the target pins no wheel for this architecture; chosen from the index's list

    def to_json(self) -> dict:
        data = {k: v for k, v in self.__dict__.items() if k not in ("changes", "verification")}
        data["changes"] = [c.__dict__ for c in self.changes]
        data["verification"] = self.verification.to_json() if self.verification else None
        return data


def verdict(result: BuildResult) -> tuple[int, str | None]:
    """The build's exit code and error line: not run for --mode source, tests failed for a failing wheel."""
    if result.mode == "source":
        return EXIT_NOT_RUN, result.reason
    if not result.ok:
        return EXIT_TESTS, f"{result.target}: {result.reason}"
    return 0, None


def render(result: BuildResult) -> str:
    """The text of `kvforge build`: the source build's command, or the changes, the verification and the wheel."""
    lines: list[str] = []
    echo = lines.append
    if result.mode == "source":
        echo(f"# {result.target}: vLLM's own build of the patched tree (on a build machine):")
        echo(result.command or "")  # click.echo(None) printed an empty line
        return "\n".join(lines)
    echo(f"{result.target}/{result.component}: base {result.base_ref} ({result.base[:12]}), series {result.series} "
         f"({len(result.fix_ids)} patch{'' if len(result.fix_ids) == 1 else 'es'}: "
         f"{', '.join(result.fix_ids) or 'none'})")
    if result.device:
        echo(f"built for device {result.device} by {result.upstream.get('built_by')}: {result.upstream.get('filename')} "
             f"-> version {result.local_version}")
    else:
        echo(f"upstream {result.upstream.get('filename')} (sha256 {result.upstream.get('sha256', '')[:16]}...)"
             + ("" if result.pinned else "; not pinned in the target: chosen from the index's file list"))
    for c in result.changes:
        echo(f"  {c.action:<13} {c.path}" + (f"  ({c.why})" if c.why else ""))
    v = result.verification
    if v is not None:
        echo(f"verification ({v.platform}, {v.python}):")
        if v.record:
            echo(f"  RECORD: {v.record['checked']} files checked against the installed wheel (sha256 and size)")
        if v.modules:
            echo(f"  patched files installed = patched tree: {len(v.modules['equal'])} equal")
        if v.record.get("compiled"):
            cc = v.record["compiled"]
            echo(f"  compiled files (.so): {cc['equal']} of {cc['files']} equal to the release wheel's")
        if v.record.get("metadata"):
            md = v.record["metadata"]
            echo(f"  installed {md.get('dist_info')}: Version {md.get('version')}, kvforge.json {md.get('identity')}")
        p = v.probe
        if p and p.get("not_run") and isinstance(p["not_run"], str):
            echo(f"  NOT RUN {p['not_run']}")
        if p and "imported" in p and "vllm_file" not in p:
            echo(f"  import next to {p.get('required')}: {len(p['imported'])} modules imported from the wheel")
            for mod, why in sorted((p.get("not_run") or {}).items()):
                echo(f"    NOT RUN import {mod}: {why}")
        if v.tests.get("note") and not v.tests.get("selected"):
            echo(f"  tests: {v.tests['note']}")
        if p and "vllm_file" in p:
            echo(f"  import vllm -> {p['vllm_file']} (version {p['version']}, metadata {p['metadata_version']}, "
                 f"== release: {p['version_is_release']}; WHEEL Build: {', '.join(p['wheel_build'])})")
            echo(f"  {p['compiled']}; platform {p['platform']}; torch {p['torch']}")
            for mod, where in (p.get("imported") or {}).items():
                echo(f"  import {mod} -> {where or (p.get('import_errors') or {}).get(mod)}")
        if v.tests.get("selected"):
            tt = v.tests
            echo(f"  tests ({tt['mode']}, shard {tt['shard']}): {tt.get('passed', 0)} passed, {tt.get('failed', 0)} "
                 f"failed, {tt.get('errors', 0)} errors, {tt.get('skipped', 0)} skipped in {tt.get('seconds', 0)}s; "
                 f"{tt.get('vllm_modules_loaded', 0)} vllm modules loaded, all from the installed wheel: "
                 f"{not tt.get('vllm_modules_elsewhere')}")
            if tt.get("junit"):
                echo(f"  JUnit XML: {tt['junit']}")
        for prob in v.problems:
            echo(f"  PROBLEM {prob}")
    if result.ok:
        echo(f"{result.wheel}")
        echo(f"sha256 {result.sha256}  {result.size} bytes; seconds: "
             + ", ".join(f"{k} {v}" for k, v in result.seconds.items()))
    return "\n".join(lines)
