"""Target files: every wrong value is one line naming the file and the key, exit 2; project discovery."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvforge.cli import main
from kvforge.core.errors import EXIT_USAGE, KvforgeError
from kvforge.project.targets import load_target, parse_target, project_root

from conftest import TARGET_TOML, V0202_SHA256

INSTALL_ROOT = Path(__file__).resolve().parent.parent


def make_project(root: Path, name: str = "x", text: str | None = None) -> Path:
    (root / "targets").mkdir(parents=True, exist_ok=True)
    (root / "patches" / name).mkdir(parents=True, exist_ok=True)
    (root / "patches" / name / "series").write_text("")
    path = root / "targets" / f"{name}.toml"
    path.write_text(TARGET_TOML.format(name=name, sha=V0202_SHA256) if text is None else text)
    return path


def good(name: str = "x") -> str:
    return TARGET_TOML.format(name=name, sha=V0202_SHA256)


def parse_error(tmp_path: Path, text: str) -> str:
    path = make_project(tmp_path / "proj", text=text)
    with pytest.raises(KvforgeError) as info:
        parse_target(path, tmp_path / "proj")
    assert info.value.exit_code == EXIT_USAGE
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}: ") or msg.startswith("targets/x.toml: "), msg
    return msg


def test_good_target_parses(tmp_path):
    path = make_project(tmp_path / "proj")
    t = parse_target(path, tmp_path / "proj")
    c = t.component()
    assert (c.name, c.ref, c.release.sha256) == ("vllm", "v0.20.2", V0202_SHA256)
    assert c.series_dir == (tmp_path / "proj" / "patches" / "x").resolve()


WRONG_VALUES = [
    (f'sha256 = "{V0202_SHA256}"', "sha256 = 12345",
     "components[0].release.sha256 must be a 64-hex-digit string"),
    (f'sha256 = "{V0202_SHA256}"', 'sha256 = "abc"',
     "components[0].release.sha256 must be a 64-hex-digit string"),
    ('version = "0.20.2"', "version = 0.20", "components[0].release.version must be a string"),
    ('version = "0.20.2"', 'version = "../../../x"', "components[0].release.version"),
    ('package = "vllm"', 'package = "../vllm"', "components[0].release.package"),
    ('ref = "v0.20.2"', "ref = 2", "components[0].ref must be a string"),
    ('ref = "v0.20.2"', 'ref = "v1:refs/heads/x"', "components[0].ref"),
    ('name = "vllm"', 'name = "../../vllm"', "components[0].name"),
    ('repo = "https://invalid.invalid/vllm.git"', 'repo = "--upload-pack=x"', "components[0].repo"),
    ('platforms = ["cpu", "cuda"]', 'platforms = "cpu"', "components[0].platforms must be a list"),
    ('platforms = ["cpu", "cuda"]', 'platforms = ["cpu", 3]', "components[0].platforms"),
    ('cpu = ["tests/v1/core/test_kv_cache_utils.py"]', 'cpu = "tests"', "components[0].tests.cpu must be a list"),
    ('cpu = ["tests/v1/core/test_kv_cache_utils.py"]', 'cpu = ["/etc/passwd"]', "components[0].tests.cpu"),
    ('description = "test target on vLLM 0.20.2"', "description = 1", "description must be a string"),
    ('series = "patches/x"', "series = 7", "components[0].series must be a string"),
    ('series = "patches/x"', 'series = "../../etc"', "components[0].series"),
    ('series = "patches/x"', 'series = "/etc"', "components[0].series"),
    ('package = "vllm"', 'package = "vllm"\nsha265 = "x"', "components[0].release has an unknown key 'sha265'"),
]


@pytest.mark.parametrize("old,new,expected", WRONG_VALUES, ids=[new.splitlines()[-1] for _o, new, _e in WRONG_VALUES])
def test_wrong_values_are_named_with_their_key(tmp_path, old, new, expected):
    text = good()
    assert old in text
    msg = parse_error(tmp_path, text.replace(old, new, 1))
    assert expected in msg, msg


def test_wrong_table_shapes(tmp_path):
    assert "components must be a list of [[components]] tables" in parse_error(
        tmp_path / "a", 'name = "x"\ncomponents = 3\n')
    assert "components[0] must be a table" in parse_error(tmp_path / "b", 'name = "x"\ncomponents = [1]\n')
    text = good() + '\n[[components.in_base]]\nfix_id = 5\nreason = "r"\n'
    assert "components[0].in_base[0].fix_id must be a string" in parse_error(tmp_path / "c", text)
    text = good().replace('platforms = ["cpu", "cuda"]', 'platforms = ["cpu", "cuda"]\nrelease = 5')
    text = text[:text.index("[components.release]")] + text[text.index("[components.tests]"):]
    assert "components[0].release must be a table" in parse_error(tmp_path / "d", text)


def test_series_outside_the_project_is_refused_by_the_cli(tmp_path, monkeypatch):
    root = tmp_path / "proj"
    make_project(root, text=good().replace('series = "patches/x"', 'series = "../../etc"'))
    monkeypatch.setenv("KVFORGE_ROOT", str(root))
    monkeypatch.setenv("KVFORGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVFORGE_PYPI_URL", "http://127.0.0.1:9")
    res = CliRunner().invoke(main, ["base", "--target", "x", "--json"])
    assert res.exit_code == EXIT_USAGE, res.output
    assert "Traceback" not in res.output
    err = [ln for ln in res.stderr.splitlines() if ln.startswith("kvforge: error:")]
    assert len(err) == 1 and "components[0].series" in err[0] and "x.toml" in err[0], res.stderr


def test_sha256_of_the_wrong_type_is_bad_input_not_a_network_error(tmp_path, monkeypatch):
    root = tmp_path / "proj"
    make_project(root, text=good().replace(f'"{V0202_SHA256}"', "12345"))
    monkeypatch.setenv("KVFORGE_ROOT", str(root))
    monkeypatch.setenv("KVFORGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVFORGE_PYPI_URL", "http://127.0.0.1:9")
    res = CliRunner().invoke(main, ["base", "--target", "x", "--source", "sdist"])
    assert res.exit_code == EXIT_USAGE, res.output
    assert "x.toml: components[0].release.sha256 must be a 64-hex-digit string" in res.stderr
    assert not (tmp_path / "cache").exists()  # nothing written


def test_unreadable_target_file_is_one_line(tmp_path):
    path = make_project(tmp_path / "proj")
    path.write_bytes(b'name = "x"\ndescription = "\xff"\n')
    with pytest.raises(KvforgeError, match="not UTF-8"):
        parse_target(path, tmp_path / "proj")


# ------------------------------------------------------------------------------------ project discovery

def test_the_current_directory_wins_over_the_install_location(tmp_path, monkeypatch):
    fork = tmp_path / "my-fork"
    make_project(fork, name="mine")
    (fork / "sub" / "dir").mkdir(parents=True)
    monkeypatch.delenv("KVFORGE_ROOT", raising=False)
    monkeypatch.chdir(fork / "sub" / "dir")
    assert project_root() == fork.resolve()
    assert load_target("mine").name == "mine"


def test_kvforge_root_wins_then_install_location(tmp_path, monkeypatch):
    fork = tmp_path / "fork"
    make_project(fork)
    other = tmp_path / "other"
    make_project(other)
    monkeypatch.chdir(other)
    monkeypatch.setenv("KVFORGE_ROOT", str(fork))
    assert project_root() == fork.resolve()
    monkeypatch.delenv("KVFORGE_ROOT")
    nowhere = tmp_path / "nowhere"
    nowhere.mkdir()
    monkeypatch.chdir(nowhere)
    assert project_root() == INSTALL_ROOT


def test_kvforge_root_that_is_no_project_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFORGE_ROOT", str(tmp_path / "missing"))
    with pytest.raises(KvforgeError, match=r"KVFORGE_ROOT.*targets/") as info:
        project_root()
    assert info.value.exit_code == EXIT_USAGE


def test_target_names_are_file_names_in_targets(tmp_path):
    root = tmp_path / "proj"
    make_project(root)
    (tmp_path / "outside.toml").write_text(good("outside"))
    with pytest.raises(KvforgeError, match="unknown target '../../outside'"):
        load_target("../../outside", root)


X86 = "vllm-0.20.2-cp38-abi3-manylinux_2_35_x86_64.whl"
ARM = "vllm-0.20.2-cp38-abi3-manylinux_2_35_aarch64.whl"


def _pin(name: str, sha: str = "ab" * 32, table: str = "[[components.wheels]]") -> str:
    return f'\n{table}\nfilename = "{name}"\nsha256 = "{sha}"\n'


def test_wheels_pins_one_per_architecture(tmp_path):
    path = make_project(tmp_path / "proj", text=good() + _pin(X86) + _pin(ARM, "cd" * 32))
    comp = parse_target(path, tmp_path / "proj").component()
    assert [w.arch for w in comp.wheels] == ["x86_64", "aarch64"]
    assert comp.wheel is not None and comp.wheel.filename == X86  # build's x86_64 pin
    assert comp.wheel_for("aarch64").sha256 == "cd" * 32


def test_the_older_single_wheel_table_is_still_read(tmp_path):
    path = make_project(tmp_path / "proj", text=good() + _pin(ARM, table="[components.wheel]"))
    comp = parse_target(path, tmp_path / "proj").component()
    assert [w.filename for w in comp.wheels] == [ARM] and comp.wheel is None  # no x86_64 pin


@pytest.mark.parametrize("extra, expected", [
    (_pin(X86) + _pin(X86), f"components[0].wheels lists '{X86}' twice"),
    (_pin(X86, table="[components.wheel]") + _pin(ARM), "has both 'wheel' and 'wheels'"),
    (_pin("vllm-0.20.1-cp38-abi3-manylinux_2_35_x86_64.whl"), "is not a wheel of vllm==0.20.2"),
    (_pin(X86, sha="xyz"), "components[0].wheels[0].sha256 must be a 64-hex-digit string"),
])
def test_bad_wheel_pins_are_one_line(tmp_path, extra, expected):
    assert expected in parse_error(tmp_path, good() + extra)


def test_wheels_that_is_no_list_is_one_line(tmp_path):
    text = good().replace("platforms =", "wheels = 5\nplatforms =", 1)
    assert "components[0].wheels must be a list of [[components.wheels]] tables" in parse_error(tmp_path, text)


def test_lifecycle_defaults_to_maintained_and_takes_eol(tmp_path):
    path = make_project(tmp_path / "proj")
    assert parse_target(path, tmp_path / "proj").lifecycle == "maintained"
    path.write_text('lifecycle = "eol"\n' + good())
    assert parse_target(path, tmp_path / "proj").lifecycle == "eol"


def test_an_unknown_lifecycle_is_one_line(tmp_path):
    msg = parse_error(tmp_path, 'lifecycle = "retired"\n' + good())
    assert "lifecycle 'retired' must be \"maintained\" or \"eol\"" in msg


ADDON = """
[[components]]
name = "addon"
repo = "https://invalid.invalid/addon.git"
ref = "r1"
series = "patches/x"
platforms = ["cpu"]
requires = "vllm"

[components.release]
package = "addon"
version = "0.0.1"

[components.tests]
requirements = ["scipy", "pandas>=2; python_version >= '3.10'"]
cpu = ["tests"]
"""


def test_test_requirements_are_pep_508_lines_of_a_component_built_on_another(tmp_path):
    path = make_project(tmp_path / "proj", text=good() + ADDON)
    addon = parse_target(path, tmp_path / "proj").component("addon")
    assert addon.requirements == ("scipy", "pandas>=2; python_version >= '3.10'")
    assert "requirements" not in addon.tests
    assert parse_target(path, tmp_path / "proj").component("vllm").requirements == ()
    line = 'requirements = ["scipy", "pandas>=2; python_version >= \'3.10\'"]'
    for new, expected in (('requirements = "scipy"', "tests.requirements must be a list of PEP 508"),
                          ('requirements = ["scipy", 3]', "tests.requirements must be a list of PEP 508"),
                          ('requirements = ["sci py!"]', "not a PEP 508 requirement"),
                          ('requirements = ["scipy", "SciPy>=1"]', "names a project twice"),
                          ('requirements = ["x @ https://invalid.invalid/x.whl"]', "not a URL")):
        msg = parse_error(tmp_path / new.replace(" ", "_").replace("/", "_"), good() + ADDON.replace(line, new))
        assert f"components[1].{expected}" in msg or expected in msg, msg
    msg = parse_error(tmp_path / "norequires", good() + ADDON.replace('requires = "vllm"\n', ""))
    assert "components[1].tests.requirements needs 'requires'" in msg, msg


def test_the_real_target_gives_vllm_ascend_its_pure_python_requirements():
    va = load_target("v0.20.2rc", INSTALL_ROOT).component("vllm-ascend")
    assert set(va.requirements) == {"scipy", "numba", "pandas"}
