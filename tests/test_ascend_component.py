"""A second component that builds on the first (v0.20.2rc's vllm-ascend on vllm): the target file
keys, apply of both trees, commands over every component, the test env with the first one's patched
tree and declared stand-ins, and the real vllm-ascend sdist applied beside the real vLLM base."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import FAKE_TARGET, git, make_patch

from kvforge.core.cache import default_cache_dir
from kvforge.cli import main
from kvforge.core.errors import KvforgeError
from kvforge.project.targets import Release, load_target, parse_target

REPO = Path(__file__).resolve().parent.parent
ASCEND_SDIST = "vllm_ascend-0.20.2rc1.tar.gz"
USER_CACHE = default_cache_dir()  # resolved at import, before fixtures point $KVFORGE_CACHE at a test cache

ADDON = """
[[components]]
name = "addon"
repo = "https://invalid.invalid/addon.git"
ref = "releases/v9rc"
series = "patches/fake-addon"
platforms = ["cpu", "npu"]
requires = "vllm"

[components.release]
package = "addon"
version = "0.0.1"

[components.tests]
standins = ["torchair"]
cpu = ["tests/test_addon.py"]
npu = ["tests"]
"""
ADDON_FILES = {
    "addon_pkg/__init__.py": "",
    "addon_pkg/ext.py": ("from vllm_like.core import double\n\n\ndef quadruple(x):\n    return double(double(x))\n\n\n"
                         "def sextuple(x):\n    return double(x) * 2  # the bug\n"),
    "tests/test_addon.py": ("import pytest\n\n\ndef test_quadruple():\n    from addon_pkg.ext import quadruple\n\n"
                            "    assert quadruple(2) == 8\n\n\ndef test_standin_imports_and_raises_when_used():\n"
                            "    import torchair\n    import torchair.npu_fx_compiler\n"
                            "    from kvforge_standin import StandInUsed\n\n    assert torchair.STANDIN\n"
                            "    with pytest.raises(StandInUsed, match='torchair.compile was used'):\n"
                            "        torchair.compile()\n"),
}
TRIPLE_TEST = "tests/test_addon_triple.py"


def kvforge(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture()
def two(fake, monkeypatch):
    """The fake target with a second component `addon` (its own git upstream) built on `vllm`."""
    upstream = fake.root.parent / "addon-upstream"
    for rel, text in ADDON_FILES.items():
        (upstream / rel).parent.mkdir(parents=True, exist_ok=True)
        (upstream / rel).write_text(text)
    git(upstream, "init", "-q")
    git(upstream, "add", "-A")
    git(upstream, "commit", "-qm", "r1")
    git(upstream, "tag", "releases/v9rc")
    # vllm's release package names its importable package: the fake's is vllm_like.
    (fake.root / "targets" / "fake.toml").write_text(
        FAKE_TARGET.replace('package = "vllm"', 'package = "vllm_like"') + ADDON)
    (fake.root / "patches" / "fake-addon").mkdir()
    (fake.root / "patches" / "fake-addon" / "series").write_text("")
    monkeypatch.setenv("KVFORGE_ADDON_REPO", str(upstream))
    fake.addon = upstream
    return fake


def vllm_triple(fake) -> str:
    """A vLLM-side patch adding triple(); the addon's Checks need it."""
    edit = ("def clamp", "def triple(x):\n    return 3 * x\n\n\ndef clamp")
    return fake.patch("0001-triple", {"vllm_like/core.py": edit}, kind="refactor")


def addon_fix(fake) -> None:
    """An addon fix whose Checks test uses vllm_like.core.triple (only in the PATCHED vllm tree)."""
    base = git(fake.addon, "rev-parse", "HEAD").strip()
    test = ("from addon_pkg.ext import sextuple\n\n\ndef test_sextuple():\n    assert sextuple(1) == 6\n")
    d = fake.root / "patches" / "fake-addon"
    fixed = "from vllm_like.core import triple\n\n    return double(triple(x))"
    make_patch(fake.addon, base, {"addon_pkg/ext.py": ("return double(x) * 2  # the bug", fixed),
                                  TRIPLE_TEST: ("", test)},
               "[Core] sextuple on the patched vllm", "sextuple", d / "0001-sextuple.patch", kind="fix",
               extra=f"Checks: {TRIPLE_TEST}::test_sextuple\n")
    (d / "series").write_text("0001-sextuple.patch\n")


# ---------------------------------------------------------------- target file

def test_requires_and_standins_are_type_checked(two):
    t = load_target("fake")
    addon = t.component("addon")
    assert addon.requires == "vllm" and addon.standins == ("torchair",) and "standins" not in addon.tests
    path = two.root / "targets" / "fake.toml"
    text = path.read_text()
    for old, new, said in (('requires = "vllm"', 'requires = "addon"', "must name an earlier component"),
                           ('standins = ["torchair"]', 'standins = ["no_such_module"]', "kvforge does not ship"),
                           ('standins = ["torchair"]', 'standins = ["not a module"]', "list of Python module names")):
        path.write_text(text.replace(old, new))
        with pytest.raises(KvforgeError, match=said):
            parse_target(path, two.root)
    path.write_text(text.replace('requires = "vllm"\n', ""))
    with pytest.raises(KvforgeError, match="standins needs 'requires'"):
        parse_target(path, two.root)
    # PEP 625 sdist names: the project name's separators become '_'.
    assert Release("vllm-ascend", "0.20.2rc1").filename == ASCEND_SDIST
    assert Release("vllm_ascend", "0.20.2rc1").filename == ASCEND_SDIST
    assert Release("vllm", "0.20.2").filename == "vllm-0.20.2.tar.gz"


def test_the_real_target_declares_vllm_ascend_on_vllm():
    t = load_target("v0.20.2rc", REPO)
    assert [c.name for c in t.components] == ["vllm", "vllm-ascend"]
    va = t.component("vllm-ascend")
    assert (va.requires, va.ref, va.platforms) == ("vllm", "releases/v0.20.2rc", ("cpu", "npu"))
    assert va.release.filename == ASCEND_SDIST and va.release.sha256.startswith("8ebd5c5b")
    assert "torch_npu" in va.standins and va.tests["cpu"] and va.tests["npu"]


# ---------------------------------------------------------------- apply: both trees

def test_apply_without_component_makes_both_trees(two, tmp_path, monkeypatch):
    tmp_path = tmp_path / "work"
    tmp_path.mkdir()
    vllm_triple(two)
    two.series("0001-triple")
    addon_fix(two)
    monkeypatch.chdir(tmp_path)
    res = kvforge("apply", "-t", "fake", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert [c["component"] for c in data["components"]] == ["vllm", "addon"]
    v, a = tmp_path / "vllm-fake", tmp_path / "addon-fake"
    assert git(v, "rev-parse", "--abbrev-ref", "HEAD").strip() == "kvforge/fake"  # the first keeps its name
    assert git(a, "rev-parse", "--abbrev-ref", "HEAD").strip() == "kvforge/fake-addon"
    assert git(a, "rev-parse", "kvforge/base/fake-addon").strip() == git(two.addon, "rev-parse", "HEAD").strip()
    assert "def triple" in (v / "vllm_like/core.py").read_text() and (a / TRIPLE_TEST).is_file()
    assert git(a, "config", "kvforge.component").strip() == "addon"
    res = kvforge("apply", "-t", "fake")  # again: both are no-ops
    assert res.exit_code == 0 and res.stdout.count("nothing to do") == 2, res.output


def test_apply_component_errors_and_all_or_nothing(two, tmp_path, monkeypatch):
    tmp_path = tmp_path / "work"
    tmp_path.mkdir()
    monkeypatch.chdir(tmp_path)
    for opt in (["--branch", "b"], ["--keep-conflict"]):
        res = kvforge("apply", "-t", "fake", *opt, "--json")
        assert res.exit_code == 2 and "add --component" in json.loads(res.stdout)["error"], res.output
    # --into names one tree: the first component's, said so (README's `apply -t v0.20.2rc --into DIR` as written).
    res = kvforge("apply", "-t", "fake", "--into", "x", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["component"] == "vllm", res.output
    assert "--into names one tree: vllm, the first (--component NAME for another)" in res.stderr
    shutil.rmtree(tmp_path / "x")
    res = kvforge("apply", "-t", "fake", "--component", "nope")
    assert res.exit_code == 2 and "has no component 'nope'" in res.output
    # A patch of the second series that does not apply: neither tree is made.
    d = two.root / "patches" / "fake-addon"
    bad = make_patch(two.addon, git(two.addon, "rev-parse", "HEAD").strip(),
                     {"addon_pkg/ext.py": ("def quadruple", "def quad")}, "[Core] x", "x", d / "0001-x.patch")[0]
    bad.write_text(bad.read_text().replace("-def quadruple", "-def quintuple"))
    (d / "series").write_text("0001-x.patch\n")
    res = kvforge("apply", "-t", "fake")
    assert res.exit_code == 3, res.output
    assert "fake/addon: 0001-x.patch" in res.output and not list(tmp_path.iterdir())
    # One component alone, into a directory of the user's choice.
    bad.unlink()
    (d / "series").write_text("")
    res = kvforge("apply", "-t", "fake", "--component", "addon", "--into", str(tmp_path / "mine"))
    assert res.exit_code == 0 and (tmp_path / "mine" / "addon_pkg").is_dir(), res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


# ---------------------------------------------------------------- tests on the first one's patched tree

def test_verify_every_component_with_the_patched_tree_and_standins(two):
    vllm_triple(two)
    two.series("0001-triple")
    addon_fix(two)
    res = kvforge("verify", "-t", "fake", "--json")
    assert res.exit_code == 0, res.output
    docs = json.loads(res.stdout)
    assert docs["ok"] and [d["component"] for d in docs["components"]] == ["vllm", "addon"]
    vllm, addon = docs["components"]
    assert vllm["layer"] is None
    layer = addon["layer"]
    # The addon's fix is proven only because vllm_like.core.triple comes from the PATCHED vllm tree.
    assert addon["patches"][0]["status"] == "proven" and addon["regression"]["passed"] == 3
    assert layer["requires"] == "vllm" and layer["state"] == "patched" and layer["packages"] == ["vllm_like"]
    assert [s["module"] for s in layer["standins"]] == ["torchair"] and "NPU" in layer["standins"][0]["summary"]
    head = git(two.upstream, "rev-parse", "HEAD").strip()
    assert layer["commit"] != head and Path(layer["path"], "vllm_like", "core.py").is_file()
    # Text output names the tree and every stand-in; --from names one tree, so it needs --component.
    res = kvforge("test", "-t", "fake", "--component", "addon")
    assert res.exit_code == 0, res.output
    assert "built on vllm patched" in res.output and "torchair: kvforge stand-in for torchair" in res.output
    res = kvforge("verify", "-t", "fake", "--from", str(two.addon))
    assert res.exit_code == 2 and "add --component" in res.output
    # The npu platform: only the addon has it; not run here (exit 7), never passed.
    res = kvforge("test", "-t", "fake", "--platform", "npu", "--json")
    assert res.exit_code == 7, res.output
    doc = json.loads(res.stdout)
    assert doc["component"] == "addon" and doc["command"].startswith("kvforge apply --target fake && ")
    assert "VLLM_TARGET_DEVICE=empty VLLM_VERSION_OVERRIDE=0.0.1 python3 -m pip install -e vllm-fake" in doc["command"]
    assert "cd addon-fake && python3 -m pytest" in doc["command"]


def test_lint_and_export_take_the_component(two, tmp_path, monkeypatch):
    tmp_path = tmp_path / "work"
    tmp_path.mkdir()
    addon_fix(two)
    res = kvforge("lint", "-t", "fake", "--component", "addon", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["patches"] == 1, res.output
    assert kvforge("lint", "--component", "nope").exit_code == 2
    monkeypatch.chdir(tmp_path)
    assert kvforge("apply", "-t", "fake").exit_code == 0
    tree = tmp_path / "addon-fake"
    message = git(tree, "log", "-1", "--format=%B").replace("sextuple on", "Sextuple on")
    git(tree, "commit", "-q", "--amend", "-m", message)
    monkeypatch.chdir(tree)  # the tree says which component it is (git config kvforge.component)
    res = kvforge("export", "-t", "fake", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["component"] == "addon"
    assert "Sextuple on" in (two.root / "patches" / "fake-addon" / "0001-sextuple.patch").read_text()
    monkeypatch.chdir(tmp_path.parent)
    res = kvforge("export", "-t", "fake", "--from", str(tmp_path))
    assert res.exit_code == 2 and "add --component" in res.output


# ---------------------------------------------------------------- the real vllm-ascend sdist

@pytest.fixture()
def ascend_sdist(base_v0202) -> Path:
    cache, _ = base_v0202
    dest = cache.downloads / ASCEND_SDIST
    if not dest.is_file():
        src = USER_CACHE / "downloads" / ASCEND_SDIST
        if not src.is_file():
            from kvforge.git.bases import download_sdist
            from kvforge.core.cache import Cache

            download_sdist(load_target("v0.20.2rc", REPO).component("vllm-ascend"), Cache(USER_CACHE), print)
        shutil.copy2(src, dest)
    return dest


def test_real_two_tree_apply_from_the_sdists(project, ascend_sdist, tmp_path, monkeypatch):
    """v0.20.2rc's own component blocks on the real vLLM 0.20.2 and vllm-ascend 0.20.2rc1 sdists."""
    real = (REPO / "targets" / "v0.20.2rc.toml").read_text()
    blocks = real.split("[[components]]")
    text = (project / "targets" / "t.toml").read_text() + "\n[[components]]" + blocks[2].replace(
        "patches/v0.20.2rc-vllm-ascend", "patches/t-ascend")
    (project / "targets" / "t.toml").write_text(text)
    (project / "patches" / "t-ascend").mkdir()
    (project / "patches" / "t-ascend" / "series").write_text("")
    monkeypatch.chdir(tmp_path)
    res = kvforge("apply", "-t", "t", "--source", "sdist", "--json")
    assert res.exit_code == 0, res.output
    docs = json.loads(res.stdout)["components"]
    assert [(d["component"], d["base_source"], d["base_ref"]) for d in docs] == [
        ("vllm", "sdist", "v0.20.2"), ("vllm-ascend", "sdist", "releases/v0.20.2rc")]
    ascend = tmp_path / "vllm-ascend-t"
    assert (ascend / "vllm_ascend" / "patch" / "platform" / "patch_kv_cache_coordinator.py").is_file()
    assert (tmp_path / "vllm-t" / "vllm" / "v1" / "core" / "kv_cache_coordinator.py").is_file()
    msg = git(ascend, "log", "-1", "--format=%B", "kvforge/base/t-vllm-ascend")
    assert "archive: vllm_ascend-0.20.2rc1.tar.gz" in msg and "sha256: 8ebd5c5b" in msg
    assert git(ascend, "status", "--porcelain") == ""


def test_pr_for_the_second_component_takes_its_branch_from_its_ref(two):
    vllm_triple(two)
    two.series("0001-triple")
    addon_fix(two)
    # kvforge pr routes by the component's upstream (kvforge/data/upstream-policy.toml): the addon stands in for
    # vllm-ascend here, a component on another one with maintained release branches.
    target = two.root / "targets" / "fake.toml"
    target.write_text(target.read_text().replace("https://invalid.invalid/addon.git",
                                                 "https://github.com/vllm-project/vllm-ascend.git"))
    res = kvforge("pr", "-t", "fake", "--style", "vllm-ascend", "--fix", "sextuple", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["component"] == "addon" and doc["title"] == "[v9rc][Core][BugFix] sextuple on the patched vllm"
    # No evidence yet: the body says nothing is claimed as tested (and names no kvforge command: it is for
    # upstream reviewers); the warning tells the carrier how to get the evidence.
    assert "nothing here is claimed as tested" in doc["text"] and "kvforge" not in doc["text"]
    assert any("kvforge verify -t fake --component addon" in w for w in doc["warnings"])
    assert "stand-in modules for torchair" in doc["text"]  # the test plan names the stand-ins
    from kvforge.flow.pr.open import base_branch
    from kvforge.flow.pr.text import Text

    assert base_branch(Text(**{k: doc[k] for k in Text.__dataclass_fields__ if k in doc
                               and k not in ("evidence",)})) == "releases/v9rc"
