#!/usr/bin/env python3
"""kvforge build's overlay vs a plain `cp` of the release wheel vs `wheel unpack` + `wheel pack`.

For a target (default v0.20.2rc) with a [components.wheel] pin: the release wheel (downloaded once
into the kvforge cache) is
- copied with `cp` to a new file, as kvforge writes a new file (the floor: every byte read and written
  once); the copy is deleted outside the timing. (`cp` onto the previous run's copy also truncates it,
  which costs 2-3x the copy itself on ext4: that is not the alternative; --wheels shows it apart.)
- overlaid the way `kvforge build` does before it verifies: prepare.prepare_wheel itself, i.e. the series'
  stack (reused from the cache), the changed files from git, the checks (RECORD against the archive, the
  wheel's files equal to the base's, the wheel built from the base's commit), the raw copy of every
  unchanged member, the new RECORD, and the sha256 of the input checked in a thread (`prepare + overlay`);
  `overlay` alone is the writing of the wheel;
- unpacked and packed again with the `wheel` tool after replacing the same files (the naive way:
  every member is decompressed and compressed again).
Each is run --runs times (median shown). The output wheels of the overlay are compared: equal
bytes every run. Verification (pip install, RECORD, Checks in the test env) is not part of these
times; `kvforge build` prints it separately ("verify"), and --with-verify runs one full build.

    python bench/build_vs_cp.py [--target v0.20.2rc] [--runs 3] [--with-verify]

--wheels: one line per kind of wheel `kvforge build` makes for the target (vLLM x86_64 and aarch64,
vllm-ascend x86_64 and aarch64, vLLM for device empty), verification apart, each against its obvious
alternative: `cp` of the release wheel to a new file for an overlay; for --device empty, vLLM's own
`pip wheel` of the unpatched tree with VLLM_TARGET_DEVICE=empty (same env, same build tools). Goal: <= 2x.
Shown apart: "stack s", the part of kvforge's time that is open_stack (the series files parsed, the
stack's refs read); "sha256 s", hashing the input wheel, which a build does (in a thread, next to the
overlay) only when the file has no stamp of an earlier check (download_wheel stamps what it downloads);
"cp onto s", `cp` onto the previous copy.

    python bench/build_vs_cp.py --wheels [--target v0.20.2rc] [--runs 1] [--no-device]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvforge.wheels import changes as kchanges  # noqa: E402
from kvforge.wheels import choose as kchoose  # noqa: E402
from kvforge.wheels import device as kdevice  # noqa: E402
from kvforge.wheels import download as kdownload  # noqa: E402
from kvforge.wheels import prepare as kprepare  # noqa: E402
from kvforge.wheels import result as kresult  # noqa: E402
from kvforge.core.cache import Cache  # noqa: E402
from kvforge.git.context import Context  # noqa: E402
from kvforge.core.fsutil import sha256_file  # noqa: E402
from kvforge.project.platforms import DEVICES, package_build  # noqa: E402
from kvforge.git.trees import open_stack  # noqa: E402


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cp_new_file(upstream: Path, dest: Path) -> float:
    """`cp` of the release wheel to a new file (as kvforge writes a new file); the copy is removed outside the
    timing. (cp onto the copy of the previous run would also truncate it: 2-3x slower, not the alternative.)"""
    t = timed(lambda: subprocess.run(["cp", str(upstream), str(dest)], check=True))
    dest.unlink()
    return t


def overlay_like_build(ctx, out: Path, pin=None) -> tuple[Path, dict]:
    """What `kvforge build` does before verification: prepare.prepare_wheel (build_target up to verification)."""
    prep = kprepare.prepare_wheel(ctx, out, pin=pin or ctx.component.wheel)
    assert not isinstance(prep, kresult.BuildResult)
    replaced = [c.path for c in prep.changes if c.action in ("replace", "add", "remove")]
    return prep.built, {**prep.result.seconds, "replaced": replaced}


def per_wheel(args) -> int:
    """--wheels: a line per kind of wheel, verification apart, against its alternative."""
    say = lambda m: print(f"  {m}", file=sys.stderr)  # noqa: E731
    base_ctx = Context.load(Cache(None), args.target, progress=say, source=args.source)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvforge-bench-", dir=base_ctx.cache.root) as tmp:
        tmp = Path(tmp)
        for comp in base_ctx.target.components:
            ctx = base_ctx.for_component(comp.name)
            open_stack(ctx)
            chosen = kchoose.wheels_to_build(ctx, "all")  # the pins, or the index's choice where none is pinned
            for arch in ("x86_64", "aarch64"):
                pins = [w for w, _pinned in chosen if w.arch == arch][-1:]  # one per kind (vllm_ascend: its newest Python)
                for pin in pins:
                    upstream = kdownload.download_wheel(comp, ctx.cache, say, pin)
                    cps, ours, stacks, onto, digests = [], [], [], [], set()
                    hashing = timed(lambda: sha256_file(upstream))
                    for i in range(args.runs):
                        cps.append(cp_new_file(upstream, tmp / "cp.whl"))
                        onto.append(timed(lambda: subprocess.run(["cp", str(upstream), str(tmp / "onto.whl")],
                                                                 check=True)))
                        t = time.perf_counter()
                        built, secs = overlay_like_build(ctx, tmp / f"ov{i}", pin)
                        ours.append(time.perf_counter() - t)
                        stacks.append(secs["stack"])
                        digests.add(sha256_file(built))
                        shutil.rmtree(tmp / f"ov{i}")
                    (tmp / "onto.whl").unlink()
                    rows.append((f"{comp.name} {arch} overlay", pin.filename, "cp of the release wheel (new file)",
                                 cps, ours, stacks, len(digests) == 1, hashing, onto))
            for dev in DEVICES.values():
                if comp.release.package.lower() not in dev.packages or args.runs < 1 or args.no_device:
                    continue
                own, ours, stacks, digests = [], [], [], set()
                for i in range(args.runs):
                    own.append(timed(lambda i=i: own_device_build(ctx, dev, tmp / f"own{i}")))
                    real_verify = kdevice.verify_wheel
                    kdevice.verify_wheel = lambda *a, **k: kresult.Verification(ok=True)  # verification apart
                    try:
                        t = time.perf_counter()
                        res = kdevice.build_device(ctx, tmp / f"dev{i}", dev)
                        ours.append(time.perf_counter() - t)
                    finally:
                        kdevice.verify_wheel = real_verify
                    stacks.append(res.seconds.get("stack", 0.0))
                    digests.add(res.sha256)
                rows.append((f"{comp.name} device {dev.name}", res.filename, f"vLLM's own pip wheel (unpatched, "
                             f"VLLM_TARGET_DEVICE={dev.name})", own, ours, stacks, len(digests) == 1, None, None))
    print(f"{'wheel':<28} {'kvforge s':>9} {'stack s':>7} {'alt s':>7} {'x alt':>6} {'<=2x':>5} {'same bytes':>10} "
          f"{'sha256 s':>8} {'cp onto s':>9}  alternative")
    worst = 0.0
    for name, _file, alt, alts, ours, stacks, same, hashing, onto in rows:
        a, o, st = statistics.median(alts), statistics.median(ours), statistics.median(stacks)
        worst = max(worst, o / a)
        apart = (f"{hashing:>8.3f} {statistics.median(onto):>9.3f}" if onto else f"{'-':>8} {'-':>9}")
        print(f"{name:<28} {o:>9.3f} {st:>7.3f} {a:>7.3f} {o / a:>6.2f} {'yes' if o / a <= 2 else 'NO':>5} "
              f"{str(same):>10} {apart}  {alt}")
    print(f"{len(rows)} kinds of wheel, {args.runs} runs each (median), verification apart; worst {worst:.2f}x")
    return 0


def own_device_build(ctx, dev, dest: Path) -> None:
    """vLLM's own build for the device of the unpatched base tree: export, then `pip wheel` with the device's
    environment in the same CPU env and build tools kvforge uses."""
    from kvforge.git import gitutil
    from kvforge.env.venv import target_env

    stack = open_stack(ctx)
    env = target_env(ctx, base=stack.base)
    tree = dest / "tree"
    gitutil.export(stack.base.repo.parent, stack.base.commit, tree, env={"GIT_DIR": str(stack.base.repo)})
    tools = kdevice.build_tools(ctx, env, tree, dev)
    e = env.environ({**dict(dev.environ_items), "SETUPTOOLS_SCM_PRETEND_VERSION": ctx.component.release.version})
    e["PYTHONPATH"] = str(tools)
    subprocess.run([str(env.python), "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(dest / "dist"), str(tree)], check=True, env=e, cwd=tree, capture_output=True)
    shutil.rmtree(dest)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="v0.20.2rc")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--wheels", action="store_true", help="a line per kind of wheel (see above)")
    ap.add_argument("--source", choices=["auto", "git", "sdist"], default="auto", help="where the bases come from")
    ap.add_argument("--with-verify", action="store_true", help="also run one full `kvforge build` (with verification)")
    ap.add_argument("--no-device", action="store_true", help="--wheels: leave out the --device lines (minutes)")
    args = ap.parse_args()
    os.environ.setdefault("KVFORGE_ROOT", str(ROOT))
    if args.wheels:
        return per_wheel(args)
    ctx = Context.load(Cache(None), args.target, progress=lambda m: print(f"  {m}", file=sys.stderr))
    upstream = kdownload.download_wheel(ctx.component, ctx.cache, ctx.say)
    open_stack(ctx)  # build the stack once: the runs below reuse it, as a second `kvforge build` does
    size = upstream.stat().st_size
    print(f"{args.target}: {upstream.name} ({size / 1e6:.0f} MB), {args.runs} runs each, median")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="kvforge-bench-", dir=ctx.cache.root) as tmp:
        tmp = Path(tmp)
        rows["cp"] = [cp_new_file(upstream, tmp / "cp.whl") for _ in range(args.runs)]
        digests, overlay_only, replaced = set(), [], []
        full = []
        for i in range(args.runs):
            out = tmp / f"ov{i}"
            t = time.perf_counter()
            built, secs = overlay_like_build(ctx, out)
            full.append(time.perf_counter() - t)
            overlay_only.append(secs["overlay"])
            replaced = secs["replaced"]
            digests.add(sha256_file(built))
            shutil.rmtree(out)
        rows["kvforge overlay (writing the wheel)"] = overlay_only
        rows["kvforge build, prepare + overlay"] = full
        have_wheel = importlib.util.find_spec("wheel") is not None
        if have_wheel:
            stack = open_stack(ctx)
            blobs = kchanges.read_blobs(stack.base.repo, [f"{stack.commits[-1]}:{p}" for p in replaced])

            def unpack_pack(i: int) -> None:
                d = tmp / f"wp{i}"
                subprocess.run([sys.executable, "-m", "wheel", "unpack", "-d", str(d), str(upstream)], check=True,
                               capture_output=True)
                (unpacked,) = list(d.iterdir())
                for spec, data in blobs.items():
                    (unpacked / spec.split(":", 1)[1]).write_bytes(data)
                (d / "out").mkdir()  # wheel pack names its output from WHEEL's Tag: ...-linux_x86_64.whl
                subprocess.run([sys.executable, "-m", "wheel", "pack", "-d", str(d / "out"), str(unpacked)],
                               check=True, capture_output=True, env={**os.environ, "SOURCE_DATE_EPOCH": "946684800"})
                shutil.rmtree(d)

            rows["wheel unpack + wheel pack"] = [timed(lambda i=i: unpack_pack(i)) for i in range(args.runs)]
    cp = statistics.median(rows["cp"])
    print(f"{'method':<38} {'median s':>9} {'x cp':>6}   runs")
    for name, times in rows.items():
        med = statistics.median(times)
        print(f"{name:<38} {med:>9.2f} {med / cp:>6.2f}   " + " ".join(f"{t:.2f}" for t in times))
    if "wheel unpack + wheel pack" not in rows:
        print("wheel unpack + wheel pack: not measured (pip install wheel)")
    print(f"overlay output identical in every run: {len(digests) == 1} ({digests.pop()[:16]}...)")
    print(f"replaced {len(replaced)} files: {', '.join(replaced)}")
    if args.with_verify:
        with tempfile.TemporaryDirectory(prefix="kvforge-bench-out-") as out:
            res = subprocess.run([sys.executable, "-m", "kvforge.cli", "build", "--target", args.target, "--out", out,
                                  "--json"], capture_output=True, text=True, cwd=ROOT)
            doc = json.loads(res.stdout)
            print(f"full kvforge build (exit {res.returncode}): " +
                  ", ".join(f"{k} {v}s" for k, v in doc.get("seconds", {}).items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
