"""Where a build writes: the stage directory in --out a wheel is written in (<out>/.kvforge-build-<pid>),
--out's file-system errors as one line (exit 5), the verified wheel named in --out in one step and a
failing one deleted (place), and the build directory <cache>/builds/<target>/<component>/<digest> that
holds reports, verification JUnit and logs.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kvforge.core.errors import EXIT_ENV, KvforgeError
from kvforge.core.fsutil import remove_stale, sha256_file
from kvforge.git.context import Context
from kvforge.git.trees import Stack
from kvforge.wheels.result import BuildResult, Verification

# Writing to --out failed for a reason of its file system: full, over quota, file too large, read-only, denied
OUT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM)
STALE_STAGE = r"^\.kvforge-build-(?P<pid>\d+)$"


def out_error(out: Path, exc: OSError) -> KvforgeError:
    """A wheel that cannot be written to --out (full disk, quota, read-only, no permission): exit 5, one line."""
    return KvforgeError(f"--out {out}: cannot write the wheel there ({exc.strerror or exc}); nothing was written",
                        EXIT_ENV)


def make_stage(out: Path) -> Path:
    """`out` (made if missing) and in it a new stage directory of this process, <out>/.kvforge-build-<pid>
    (stale ones of dead processes removed): the wheel is written there, and named in `out` once verified."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KvforgeError(f"--out {out}: cannot create it ({exc.strerror or exc})", EXIT_ENV) from None
    with contextlib.suppress(OSError):
        remove_stale(out, STALE_STAGE)
    stage = out / f".kvforge-build-{os.getpid()}"  # pip installs only a file named like a wheel
    shutil.rmtree(stage, ignore_errors=True)
    try:
        stage.mkdir()
    except OSError as exc:
        raise out_error(out, exc) from None
    return stage


@contextlib.contextmanager
def writing_stage(out: Path, stage: Path, part: Path) -> Iterator[None]:
    """Errors while the wheel is written: the stage is removed; a write --out's disk refuses is exit 5, one
    line (an error reading the cached wheel is not)."""
    try:
        yield
    except OSError as exc:
        shutil.rmtree(stage, ignore_errors=True)
        if exc.errno not in OUT_ERRNOS or exc.filename not in (None, str(part), part):
            raise
        raise out_error(out, exc) from None
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def place(ctx: Context, stack: Stack, result: BuildResult, built: Path, wheel: Path | None, out: Path, t0: float,
          verify: Callable[[], Verification], platform: str) -> BuildResult:
    """Hash and verify the built wheel (`verify()`); a verified wheel gets its name in --out in one step, a
    failing one is deleted (`wheel`, --wheel FILE: only verified, left where it is); the report goes to the
    build directory."""
    try:
        v0 = time.monotonic()
        result.sha256, result.size = sha256_file(built), built.stat().st_size
        result.seconds["hash"] = round(time.monotonic() - v0, 3)
        result.verification = verify()
        result.seconds["verify"] = round(time.monotonic() - v0, 3)
        result.ok = result.verification.ok
        if not result.ok:
            result.reason = "verification failed: " + "; ".join(result.verification.problems[:3])
    except BaseException:
        if wheel is None:
            shutil.rmtree(built.parent, ignore_errors=True)
        raise
    if wheel is None:
        if result.ok:
            final = out / result.filename
            try:
                with open(built, "rb") as fh:
                    os.fsync(fh.fileno())
                os.replace(built, final)  # the verified wheel gets its name in --out in one step
            except OSError as exc:
                shutil.rmtree(built.parent, ignore_errors=True)
                raise out_error(out, exc) from None
            result.wheel = str(final)
        shutil.rmtree(built.parent, ignore_errors=True)
    else:
        result.wheel = str(wheel) if result.ok else None
    result.seconds["total"] = round(time.monotonic() - t0, 3)
    report = builds_dir(ctx, stack.digest) / f"build-{platform}{report_suffix(result)}.json"
    report.write_text(json.dumps(result.to_json(), indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
    result.report = str(report)
    return result


def builds_dir(ctx: Context, digest: str) -> Path:
    """<cache>/builds/<target>/<component>/<digest>: build reports, verification JUnit and logs."""
    path = ctx.cache.root / "builds" / ctx.target.name / ctx.component.name / digest
    path.mkdir(parents=True, exist_ok=True)
    return path


def report_suffix(result: BuildResult) -> str:
    """The report's and JUnit file's suffix: none for the component's default wheel (its names stay)."""
    return f"-{result.variant}" if result.variant else ""
