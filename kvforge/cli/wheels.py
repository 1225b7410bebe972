"""The commands that make artefacts: build (the patched wheels, verified) and matrix (the CI jobs). Each
finishes the outcome of one library function, imported when the command runs."""

from __future__ import annotations

from pathlib import Path

import click

from kvforge.core.cache import Cache
from kvforge.project.platforms import DEVICES, JOB_KINDS, PLATFORMS
from kvforge.cli.finish import finish, handle_errors
from kvforge.cli.options import (command, component_option, json_option, make_ctx, target_option, targets_option,
                                 tree_component, tree_options, with_cache)


def _shard_value(_ctx, _param, value):
    if value is None:
        return (1, 1)
    try:
        k, n = (int(x) for x in value.split("/", 1))
    except ValueError:
        raise click.BadParameter("expected K/N, e.g. 1/2") from None
    if not 1 <= k <= n:
        raise click.BadParameter("expected K/N with 1 <= K <= N")
    return (k, n)


@command("build")
@target_option
@component_option
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("dist"), show_default=True,
              help="Directory the verified wheel is written to (a wheel that fails verification is not left there).")
@click.option("--mode", type=click.Choice(["overlay", "source"]), default="overlay", show_default=True,
              help="overlay: the release wheel with the series' files replaced; source: print vLLM's own build "
                   "of the patched tree (VLLM_USE_PRECOMPILED=1 with the release wheel), not run here (exit 7).")
@click.option("--wheel", "wheel_path", type=click.Path(exists=True, path_type=Path), metavar="FILE|DIR",
              help="Do not build: verify this patched wheel (or the target's wheel in DIR), e.g. on a GPU runner.")
@click.option("--platform", "platform_name", type=click.Choice(list(PLATFORMS)), default="cpu", show_default=True,
              help="Where the verification tests run (cuda/npu need --python and the hardware, else exit 7).")
@click.option("--tests", "tests_mode", type=click.Choice(["checks", "all"]), default="checks", show_default=True,
              help="Verify with the series' Checks, or with the platform's selection plus the Checks.")
@click.option("--shard", callback=_shard_value, metavar="K/N", help="Run only the K-th of N parts of the tests.")
@click.option("--arch", type=click.Choice(["x86_64", "aarch64", "all"]),
              help="Which release wheels to overlay: an architecture's pins, or all [default: the x86_64 ones]. "
                   "A wheel this machine cannot import is checked by RECORD, files and metadata; its import is "
                   "labelled not run.")
@click.option("--device", type=click.Choice(list(DEVICES)),
              help="Instead of an overlay: vLLM's own build of the patched tree for this device (empty: "
                   "VLLM_TARGET_DEVICE=empty, pure Python, the vLLM an Ascend deployment installs under vllm-ascend).")
@tree_options
@with_cache
def build_cmd(cache: Cache, target_name: str, component: str | None, out: Path, mode: str, wheel_path: Path | None,
              platform_name: str, tests_mode: str, shard: tuple[int, int], arch: str | None, device: str | None,
              from_rev: str | None, python: Path | None,
              torch_index: str | None, source: str, repo_url: str | None, as_json: bool) -> None:
    """Build the target's patched wheels from the release wheels, and verify them.

    \b
    The release wheels (pinned in the target file, [[components.wheels]], one per platform tag)
    are downloaded once; the files the series changes are replaced with the patched tree's,
    everything else is copied as stored (compiled .so files, data), RECORD is rewritten. The
    version gets kvforge's local label (0.20.2+kvforge.<target>.<digest>: pip freeze/show say it);
    vllm.__version__ stays the release's (vllm-ascend checks it exactly); a build tag and
    <dist-info>/kvforge.json name the series. Same base and series: the same bytes.
    --component vllm-ascend overlays vllm-ascend's release wheels (its .so files untouched).
    Every build is verified before it gets its name in --out: installed with --no-deps, RECORD
    checked, the patched files compared with the tree, then the series' Checks run with vllm
    imported from the installed wheel. A series that changes compiled inputs or packaging
    (csrc/, setup.py, requirements, ...) is refused: --mode source prints vLLM's own build.
    """
    from kvforge.wheels import build

    component = tree_component(target_name, component, from_rev)
    ctx = make_ctx(cache, target_name, component, source=source, repo_url=repo_url, from_rev=from_rev,
                   python=python, torch_index=torch_index)
    finish(build.build_command(ctx, out, mode, tests_mode, platform_name, wheel_path, shard, arch, device), as_json)


@command("matrix")
@click.option("--format", "fmt", type=click.Choice(["table", "json", "github", "buildkite", "buildkite-vllm",
                                                    "commands", "targets"]),
              default="table", show_default=True,
              help="github: lines for $GITHUB_OUTPUT; buildkite: a pipeline for `buildkite-agent pipeline upload`; "
                   "buildkite-vllm: steps in vLLM's .buildkite/test_areas format; commands/targets: one per line.")
@click.option("--changed-since", metavar="REV",
              help="Only the targets whose target file or series changed since REV (all when kvforge changed).")
@click.option("--kind", "kinds", multiple=True, type=click.Choice(list(JOB_KINDS)),
              help="Only these kinds of job (repeatable) [default: all].")
@targets_option("Only these targets (repeatable).")
@click.option("--cuda-shards", type=int, default=1, show_default=True, help="Split each cuda job's tests N ways.")
@click.option("--runs-on", "runs_on", multiple=True, metavar="PLATFORM=LABEL[,LABEL]",
              help="GitHub runner labels for a platform instead of kvforge/project/platforms.py's defaults.")
@json_option
@handle_errors
def matrix_cmd(fmt: str, changed_since: str | None, kinds: tuple[str, ...], target_names: tuple[str, ...],
               cuda_shards: int, runs_on: tuple[str, ...], as_json: bool) -> None:
    """The CI jobs of every target: build, cpu, cuda and npu, each a kvforge command.

    Generated only: nothing is run, and cuda/npu jobs (runs_here: false) are never reported as
    passed. With --json (or --format json) errors are a JSON object too.
    """
    from kvforge.ci import matrix

    as_json = as_json or fmt == "json"
    finish(matrix.matrix_command("json" if as_json else fmt, changed_since, kinds, target_names, cuda_shards,
                                 runs_on), as_json)


COMMANDS = [build_cmd, matrix_cmd]
