"""What a runner with a platform's hardware runs (cuda, npu): the one command line or the shell steps
that get a target's tree, install it for the device and run pytest there.

kvforge never runs these itself: `kvforge test --platform P` prints hardware_command when the
hardware is not here, and `kvforge matrix` puts hardware_steps into the npu job of a component built
on another. The platform facts (install lines, hardware) are data in kvforge/project/platforms.py; this
module only assembles them.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.project.platforms import Platform, get
from kvforge.project.targets import Component, Target


def tree_name(target: Target, comp: Component, on_base: bool = False) -> str:
    """The directory `kvforge apply --target T` makes for a component (apply.default_into)."""
    return f"{comp.name}-{target.name}" + ("-base" if on_base else "")


def hardware_steps(target: Target, comp: Component, plat: Platform, nodes: list[str],
                   on_base: bool = False) -> list[str]:
    """Shell steps a runner with the hardware runs for a component built on another, the last one
    running its tests: get both trees (`kvforge apply --target T` makes every component's), install
    the required one (vLLM without a device) and then this one (its kernels build against CANN,
    into the tree), then pytest from this tree's root, where the built kernels are. With on_base,
    the component's base ref from git, on the same patched required tree."""
    if comp.requires is None or plat.install_required is None or plat.install_component is None:
        raise AssertionError(f"{comp.name} on {plat.name}: not a component built on another on a platform "
                             "that installs both trees")
    nodes = minimal(list(nodes))  # a node inside a listed directory is not passed twice
    dep = target.component(comp.requires)
    dep_tree, tree = tree_name(target, dep), tree_name(target, comp, on_base)
    t = shlex.quote(target.name)
    if on_base:
        get_trees = [f"kvforge apply --target {t} --component {shlex.quote(dep.name)}",
                     f"git clone --depth 1 -b {shlex.quote(comp.ref)} {shlex.quote(comp.repo)} {tree}"]
    else:
        get_trees = [f"kvforge apply --target {t}"]
    junit = f"kvforge-{target.name}-{comp.name}-{plat.name}.xml"
    return [*get_trees, plat.install_required.format(tree=dep_tree, version=shlex.quote(dep.release.version)),
            plat.install_component.format(tree=tree),
            f"cd {tree} && python3 -m pytest -o junit_family=xunit2 --junitxml={junit} "
            + " ".join(shlex.quote(n) for n in nodes)]


def hardware_command(target: Target, component: Component, platform: str, nodes: list[str], on_base: bool,
                     python: Path | str | None = None) -> str:
    """What a runner with the hardware runs.

    A component built on another (vllm-ascend): both trees installed on the device
    (hardware_steps), then pytest in the component's tree. Otherwise, without `python`:
    get the tree (a clone of the base ref, or `kvforge apply --into`), install vLLM for the device,
    run pytest on `nodes`. With `python` (the interpreter the runner set up for the
    device): `kvforge test --platform P --python PATH --target T`, which picks the selection itself.
    """
    plat = get(platform)
    if getattr(component, "requires", None) and plat.install_component:
        return " && ".join(hardware_steps(target, component, plat, nodes, on_base))
    if python is not None:
        cmd = ["kvforge", "test", "--platform", platform, "--python", str(python), "--target", target.name]
        if len(getattr(target, "components", ())) > 1:
            cmd += ["--component", component.name]
        if on_base:
            cmd.append("--base")
        return shlex.join(cmd)
    if plat.install is None:
        raise KvforgeError(f"platform {platform}: kvforge builds its environment itself "
                           f"(`kvforge test --platform {platform} --target {target.name}`)", EXIT_USAGE)
    tree = f"vllm-{target.name}" + ("-base" if on_base else "")
    get_tree = (f"git clone --depth 1 -b {component.ref} {component.repo} {tree}" if on_base
                else f"kvforge apply --target {target.name} --into {tree}")
    return (f"{get_tree} && cd {tree} && {plat.install} && python -m pytest -o junit_family=xunit2 "
            f"--junitxml=kvforge-{target.name}-{platform}.xml " + " ".join(nodes))


def minimal(selection: list[str]) -> list[str]:
    """The selectors without those another one already covers (a node in a listed file or directory)."""
    paths = [s.rstrip("/") for s in selection if "::" not in s]
    def covered(s: str) -> bool:
        p = s.split("::", 1)[0].rstrip("/")
        return any(q != s.rstrip("/") and (p == q or p.startswith(q + "/")) for q in paths)
    return [s for s in selection if not covered(s)]
