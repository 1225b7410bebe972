"""`kvforge audit` (kvforge.proof.audit): what each patch changes in the program, on real vLLM sources.

One series of small patches on the real vLLM 0.20.2 sdist, one of each risky kind (a decorator moved,
@staticmethod dropped, a default changed, a referenced function removed, a module-level call added)
and one of each harmless kind (a new method, a body edit, a comment): every risky one is flagged at
its file and line, no harmless one is; an acknowledgement clears exactly what it names. And the
vllm-ascend 0008 that moved @torch.inference_mode() (as of a400183^) against today's.

The commands (`kvforge audit`, `kvforge lint` failing on the audit's problems, `--no-audit`) run once
through the CLI; the other tests call the library functions the commands call.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from helpers import git, make_patch, write_series

from kvforge.cli import main
from kvforge.core.cache import Cache, default_cache_dir
from kvforge.git.context import Context
from kvforge.git.trees import open_stack
from kvforge.proof.audit import audit_command, audit_target, lint_problems
from kvforge.proof.semantic import compare

REPO = Path(__file__).resolve().parent.parent
USER_CACHE = default_cache_dir()
RUNNER = "vllm/v1/worker/gpu_model_runner.py"
SCHED = "vllm/v1/core/sched/scheduler.py"
POOL = "vllm/v1/core/block_pool.py"
UTILS = "vllm/v1/core/kv_cache_utils.py"
ADVICE = "(acknowledge it in the header or undo it)"

GET_GROUP_ID = ('def get_group_id(key: BlockHashWithGroupId) -> int:\n'
                '    """Extract the group id from a `BlockHashWithGroupId`."""\n'
                '    return int.from_bytes(key[-4:], "big", signed=False)\n\n\n')

# name -> (edits, the text of the patched file whose line the problem names, or None: harmless)
PATCHES: dict[str, tuple[dict[str, tuple[str, str]], tuple[str, str] | None]] = {
    "decorator-moved": ({RUNNER: ("    @torch.inference_mode()\n    def execute_model(",
                                  "    @torch.inference_mode()\n    def _prepare_step(self) -> None:\n"
                                  "        self._step_prepared = True\n\n    def execute_model(")},
                        (RUNNER, "    @torch.inference_mode()\n    def _prepare_step")),
    "staticmethod-dropped": ({SCHED: ("    @staticmethod\n    def _is_blocked_waiting_status(",
                                      "    def _is_blocked_waiting_status(")},
                             (SCHED, "    def _is_blocked_waiting_status(")),
    "default-changed": ({POOL: ("        enable_kv_cache_events: bool = False,\n        metrics_collector",
                                "        enable_kv_cache_events: bool = True,\n        metrics_collector")},
                        (POOL, "    def __init__(\n        self,\n        num_gpu_blocks: int,")),
    "referenced-removed": ({UTILS: (GET_GROUP_ID, "")}, None),  # its line is the base's: checked below
    "module-call-added": ({UTILS: ("logger = init_logger(__name__)\n",
                                   'logger = init_logger(__name__)\nlogger.debug("kv cache utils imported")\n')},
                          (UTILS, 'logger.debug("kv cache utils imported")')),
    "new-method": ({POOL: ("    def get_usage(self) -> float:\n",
                           "    def num_used_blocks(self) -> int:\n"
                           "        return self.num_gpu_blocks - 1 - self.get_num_free_blocks()\n\n"
                           "    @staticmethod\n    def describe() -> str:\n        return 'block pool'\n\n"
                           "    def get_usage(self) -> float:\n")}, None),
    "body-edit": ({POOL: ("        if not total_gpu_blocks:\n            return 0\n",
                          "        if total_gpu_blocks <= 0:\n            return 0.0\n")}, None),
    "comment": ({UTILS: ("def get_block_hash(", "# The hash without its group id.\ndef get_block_hash("),
                 SCHED: ("        return status in (\n", "        # Waiting on something outside the scheduler.\n"
                                                       "        return status in (\n")}, None),
}
RISKY = ["decorator-moved", "staticmethod-dropped", "default-changed", "referenced-removed", "module-call-added"]


def line_of(repo: Path, commit: str, path: str, text: str) -> int:
    blob = git(repo, "show", f"{commit}:{path}")
    assert blob.count(text) == 1, (path, text)
    return blob[:blob.index(text)].count("\n") + 1


@pytest.fixture()
def audited(project, base_v0202):
    """The eight patches as one series on the real base, and its audit."""
    cache, base = base_v0202
    start = base.commit
    names, commits = [], []
    for n, (name, (edits, _)) in enumerate(PATCHES.items(), 1):
        file = f"{n:04d}-{name}.patch"
        _, start = make_patch(base.repo, start, edits, f"[Core] {name}", name, project / "patches" / "t" / file)
        names.append(file)
        commits.append(start)
    write_series(project, *names)
    ctx = Context.load(Cache(cache.root), "t")
    return ctx, audit_target(ctx), base, commits


def test_every_risky_change_is_flagged_at_its_file_and_line_and_no_harmless_one(audited):
    ctx, report, base, commits = audited
    problems = report.problems()
    by_patch = {p.n: p for p in report.patches}
    flagged = {report.patches[n - 1].fix_id for n in by_patch if by_patch[n].flagged}
    assert flagged == set(RISKY), [str(p) for p in problems]
    assert len(problems) == len(RISKY), [str(p) for p in problems]
    for n, (name, (_, where)) in enumerate(PATCHES.items(), 1):
        if where is None:
            continue
        path, text = where
        line = line_of(base.repo, commits[n - 1], path, text)
        if name == "decorator-moved":
            line = line_of(base.repo, commits[n - 1], path, "    @torch.inference_mode()\n    def _prepare_step")
        mine = [p for p in problems if f"patch {n:04d}:" in p.message]
        assert [(str(p.path), p.line) for p in mine] == [(path, line)], (name, [str(p) for p in mine])
        assert mine[0].message.endswith(ADVICE)
    text = {p.message.split(": ", 1)[0]: str(p) for p in problems}
    moved = text["patch 0001"]
    assert "@torch.inference_mode() moved from GPUModelRunner.execute_model" in moved
    assert "to GPUModelRunner._prepare_step" in moved and moved.startswith(f"{RUNNER}:")
    assert "@staticmethod removed from Scheduler._is_blocked_waiting_status" in text["patch 0002"]
    assert "default of `enable_kv_cache_events`: False -> True" in text["patch 0003"]
    base_line = line_of(base.repo, commits[3] + "^", UTILS, "def get_group_id(")
    removed = text["patch 0004"]
    assert removed.startswith(f"{UTILS}:{base_line}: patch 0004: def get_group_id removed")
    assert "`get_group_id` is still referenced at tests/v1/core/test_prefix_caching.py:" in removed
    assert "call-added" == by_patch[5].flagged[0].change.kind and "logger.debug" == by_patch[5].flagged[0].change.name


def test_harmless_changes_are_listed_never_flagged(audited):
    _, report, _, _ = audited
    new_method, body, comment = report.patches[5], report.patches[6], report.patches[7]
    assert [(f.change.kind, f.change.name) for f in new_method.findings] == [
        ("added", "BlockPool.num_used_blocks"), ("added", "BlockPool.describe")]
    assert [(f.change.kind, f.change.name) for f in body.findings] == [("body", "BlockPool.get_usage")]
    assert comment.findings == [] and sorted(f.path for f in comment.files) == [UTILS, SCHED]
    assert not any(f.risky for p in (new_method, body, comment) for f in p.findings)


def test_an_acknowledgement_clears_what_it_names_and_one_that_matches_nothing_is_shown_stale(audited):
    ctx, _, base, _ = audited
    patches = ctx.component.series_dir
    for old in patches.glob("*.patch"):
        old.unlink()
    start = base.commit
    _, c1 = make_patch(base.repo, start, PATCHES["decorator-moved"][0], "[Core] moved", "decorator-moved",
                       patches / "0001-decorator-moved.patch",
                       extra="Acknowledges: decorator-moved GPUModelRunner.execute_model: on purpose, in a test\n")
    make_patch(base.repo, c1, PATCHES["default-changed"][0], "[Core] default", "default-changed",
               patches / "0002-default-changed.patch",
               extra="Acknowledges: signature vllm/v1/core/block_pool.py::BlockPool.__init__: events on by default\n"
                     "Acknowledges: removed get_group_id: not what this patch does\n")
    write_series(patches.parent.parent, "0001-decorator-moved.patch", "0002-default-changed.patch")
    report = audit_target(ctx)
    assert report.problems() == [], [str(p) for p in report.problems()]
    stale = [str(p) for p in report.stale()]
    assert len(stale) == 1 and stale[0].endswith("0002-default-changed.patch:12: Acknowledges removed get_group_id: "
                                                 "patch 0002 makes no such change (remove the line)"), stale
    assert "warning: " + stale[0] in report.render()
    acked = [f for p in report.patches for f in p.findings if f.acknowledged]
    assert [(f.change.kind, f.acknowledged.reason) for f in acked] == [
        ("decorator-moved", "on purpose, in a test"), ("signature", "events on by default")]
    data = report.to_json()
    assert data["patches"][0]["changes"][0]["acknowledged"].startswith("decorator-moved GPUModelRunner.execute_model")
    assert "acknowledged" in report.render() and "FLAGGED" not in report.render()


def test_audit_command_formats_and_lint_problems(audited):
    ctx, report, _, _ = audited
    out = audit_command(ctx, "json")
    assert out.exit_code == 1 and out.error == "audit t/vllm: 5 problems"
    data = json.loads(json.dumps(out.to_json()))
    assert [p["patch"] for p in data["patches"]][:2] == ["0001-decorator-moved.patch", "0002-staticmethod-dropped.patch"]
    assert data["patches"][0]["counts"] == {"decorator-moved": 1, "added": 1}
    md = audit_command(ctx, "markdown").render()
    assert md.startswith("## Audit of t/vllm") and "| `vllm/v1/worker/gpu_model_runner.py:" in md
    table = audit_command(ctx, "table").render()
    assert "0006-new-method.patch (new-method): 2 added" in table
    assert table.splitlines()[-1].startswith("audit t/vllm: 5 problems (")
    assert [str(p) for p in lint_problems(ctx.cache, ["t"])] == [str(p) for p in report.problems()]


def test_audit_and_lint_commands_exit_1_on_the_flagged_changes(audited):
    ctx, report, _, _ = audited
    flagged = [str(p) for p in report.problems()]
    out = CliRunner().invoke(main, ["audit", "-t", "t", "--json"])
    assert out.exit_code == 1 and json.loads(out.stdout)["error"] == "audit t/vllm: 5 problems"
    lint = CliRunner().invoke(main, ["lint", "--json"])
    assert lint.exit_code == 1
    assert [p["message"] for p in json.loads(lint.stdout)["problems"]] == [f.split(": ", 1)[1] for f in flagged]
    headers_only = CliRunner().invoke(main, ["lint", "--no-audit"])
    assert headers_only.exit_code == 0, headers_only.output


def test_semantic_compare_signatures_bases_renames_and_statements():
    old = ("import os\n\n\nclass A(Base):\n    def f(self, a, b=1, *, c):\n        return a\n\n"
           "    def _helper(self, x):\n        return x * 2\n\n\ndef g(x) -> int:\n    return x + 1\n")
    new = ("import os\nimport sys\nos.environ.setdefault('X', '1')\n\n\nclass A(Base, Mixin):\n"
           "    def f(self, b=1, a=0, *, c=2) -> str:\n        # a comment\n        return a\n\n"
           "    def _twice(self, x):\n        return x * 2\n\n\nclass B:\n    def g(x) -> int:\n        return x + 1\n")
    got = {(c.kind, c.name): c for c in compare(old, new)}
    assert set(got) == {("import-added", "sys"), ("call-added", "os.environ.setdefault"), ("bases", "A"),
                        ("signature", "A.f"), ("renamed", "A._helper"), ("moved", "g"), ("added", "B")}
    sig = got[("signature", "A.f")].detail
    assert "default of `a`: (none) -> 0" in sig and "default of `c`: (none) -> 2" in sig
    assert "positional order self, a, b -> self, b, a" in sig and "return annotation (none) -> str" in sig
    assert got[("renamed", "A._helper")].other == "A._twice" and not got[("renamed", "A._helper")].public
    assert got[("moved", "g")].other == "B.g" and got[("call-added", "os.environ.setdefault")].line == 3


# ---------------------------------------------------------------- vllm-ascend's 0008, before and after a400183

ASCEND = "patches/v0.20.2rc-vllm-ascend"
OLD_0008 = "a400183^"


@pytest.fixture()
def ascend(project, base_v0202, monkeypatch):
    """Target t with v0.20.2rc's vllm-ascend component on the real 0.20.2rc1 sdist; its series dir is empty."""
    cache, _ = base_v0202
    dest = cache.downloads / "vllm_ascend-0.20.2rc1.tar.gz"
    if not dest.is_file():
        src = USER_CACHE / "downloads" / dest.name
        if not src.is_file():
            from kvforge.git.bases import download_sdist
            from kvforge.project.targets import load_target

            download_sdist(load_target("v0.20.2rc", REPO).component("vllm-ascend"), Cache(USER_CACHE), print)
        shutil.copy2(src, dest)
    real = (REPO / "targets" / "v0.20.2rc.toml").read_text()
    block = real.split("[[components]]")[2].replace(ASCEND, "patches/t-ascend")
    target = project / "targets" / "t.toml"
    target.write_text(target.read_text() + "\n[[components]]" + block)
    (project / "patches" / "t-ascend").mkdir()
    return project / "patches" / "t-ascend", Cache(cache.root)


def _series(directory: Path, old_0008: bool) -> None:
    names = [ln for ln in (REPO / ASCEND / "series").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    for name in names:
        if old_0008 and name.startswith("0008-"):
            raw = subprocess.run(["git", "show", f"{OLD_0008}:{ASCEND}/{name}"], cwd=REPO, check=True,
                                 capture_output=True).stdout
            (directory / name).write_bytes(raw)
        else:
            shutil.copy2(REPO / ASCEND / name, directory / name)
    (directory / "series").write_text("".join(n + "\n" for n in names))


@pytest.mark.parametrize("old", [True, False], ids=["0008-before-a400183", "0008-today"])
def test_0008_moved_inference_mode_is_flagged_then_not(ascend, old):
    directory, cache = ascend
    _series(directory, old)
    ctx = Context.load(cache, "t", "vllm-ascend", source="sdist")
    report = audit_target(ctx)
    p8 = report.patches[7]
    moved = [f for f in p8.findings if f.change.kind == "decorator-moved"]
    lint = [str(p) for p in report.problems() if "patch 0008:" in p.message and "inference_mode" in p.message]
    if not old:
        assert moved == [] and lint == []
        assert not any(f.change.kind.startswith("decorator") for f in p8.findings)
        return
    assert len(moved) == 1 and moved[0].flagged
    change = moved[0].change
    assert (change.name, change.other) == ("NPUModelRunner.execute_model", "NPUModelRunner._copy_kv_cache_blocks")
    stack = open_stack(ctx)
    runner = "vllm_ascend/worker/model_runner_v1.py"
    line = line_of(stack.base.repo, stack.commits[8], runner,
                   "    @torch.inference_mode()\n    def _copy_kv_cache_blocks(")
    assert len(lint) == 1 and lint[0].startswith(f"{runner}:{line}: patch 0008: ")
    assert ("patch 0008: @torch.inference_mode() moved from NPUModelRunner.execute_model (base line "
            in lint[0]) and lint[0].endswith(f"to NPUModelRunner._copy_kv_cache_blocks {ADVICE}")
