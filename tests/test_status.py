"""`kvforge status`: the rebase ledger of each series, and `--check` (Drop-When against the target's base)."""

from __future__ import annotations

import json
import subprocess

import pytest
from click.testing import CliRunner
from helpers import make_patch, write_series

from kvforge.cli import main

LEDGER = """\
# written by hand in the format kvforge.project.ledger renders
[[dropped]]
file = "0002-old-fix.patch"
fix_id = "old-fix"
decision = "upstream"
reason = "upstream has it: reverse-apply, drop-when"
dropped_at = "2026-11-23T12:00:00Z"
onto_version = "0.22.0"
base_commit = "0123456789abcdef0123456789abcdef01234567"
signals = [
  { name = "reverse-apply", fired = true, strong = true, detail = "applies in reverse" },
  { name = "patch-id", strong = false, detail = "no history" },
  { name = "drop-when", fired = true, strong = true, detail = "version >= 0.22.0: the base is 0.22.0" },
  { name = "checks", fired = false, strong = false, detail = "not run" },
]
"""


def kvforge(*args: str):
    return CliRunner().invoke(main, list(args))


def test_status_shows_the_rebase_ledger(fake):
    fake.patch("0001-kept-fix", {"vllm_like/core.py": ("return 2 * x", "return x + x")}, kind="refactor")
    fake.series("0001-kept-fix")
    (fake.root / "patches" / "fake" / "dropped.toml").write_text(LEDGER)
    res = kvforge("status")
    assert res.exit_code == 0, res.output
    assert "old-fix" in res.stdout and "dropped: upstream onto 0.22.0" in res.stdout
    row = next(line for line in res.stdout.splitlines() if "0002-old-fix.patch" in line)
    assert "reverse-apply, drop-when" in row and "patch-id" not in row and "checks" not in row
    data = json.loads(kvforge("status", "--json").stdout)
    assert data["fixes"]["old-fix"]["fake/vllm"] == {"state": "dropped", "detail": "upstream onto 0.22.0"}
    assert data["fixes"]["kept-fix"]["fake/vllm"]["state"] == "carried"
    [entry] = data["dropped"]
    assert (entry["target"], entry["file"], entry["onto_version"]) == ("fake", "0002-old-fix.patch", "0.22.0")
    assert [s["fired"] for s in entry["signals"]] == [True, None, True, False]


def _in_order(chars: str, text: str) -> bool:
    """Every character of `chars` in `text`, in order (a wrapped cell's pieces lie on later lines)."""
    it = iter(text)
    return all(c in it for c in chars)


def test_status_fits_the_terminal_and_json_is_never_fitted(fake):
    """COLUMNS=80 kvforge status | awk '{ if (length > 80) exit 1 }'; every cell's text is still there."""
    fake.patch("0001-kept-fix", {"vllm_like/core.py": ("return 2 * x", "return x + x")}, kind="refactor")
    fake.series("0001-kept-fix")
    (fake.root / "patches" / "fake" / "dropped.toml").write_text(LEDGER)
    wide = kvforge("status").stdout
    assert max(len(ln) for ln in wide.splitlines()) > 80
    res = CliRunner(env={"COLUMNS": "80"}).invoke(main, ["status"])
    assert res.exit_code == 0 and all(len(ln) <= 80 for ln in res.stdout.splitlines()), res.stdout
    for cell in ("0002-old-fix.patch", "reverse-apply, drop-when", "upstream onto 0.22.0"):
        assert _in_order("".join(cell.split()), "".join(res.stdout.split())), cell  # wrapped, never cut
    assert CliRunner(env={"COLUMNS": "80"}).invoke(main, ["status", "--json"]).stdout == \
        kvforge("status", "--json").stdout


def test_status_check_evaluates_drop_when_against_the_base(project, base_v0202):
    """Target t is on the real vLLM 0.20.2 sdist (built from upstream bc150f502, no history)."""
    _cache, base = base_v0202
    cases = {
        "0001-reached": "version >= 0.20.2",
        "0002-not-yet": "version >= 0.21.0",
        "0003-this-commit": "base-contains bc150f502",
        "0004-needs-history": "base-contains 588db1836",
        "0005-pr": "upstream-pr-merged https://github.com/vllm-project/vllm/pull/44488",
    }
    for n, (name, expr) in enumerate(cases.items()):
        out = project / "patches" / "t" / f"{name}.patch"
        make_patch(base.repo, base.commit, {"vllm/v1/core/block_pool.py": ("class BlockPool", f"class BlockPool{n}")},
                   f"[Core] {name}", name.split("-", 1)[1], out)
        out.write_bytes(out.read_bytes().replace(b"Drop-When: never", f"Drop-When: {expr}".encode()))
    write_series(project, *(f"{n}.patch" for n in cases))
    res = kvforge("status", "--check", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    got = {r["file"].removesuffix(".patch"): r["fired"] for r in data["patches"]}
    assert got == {"0001-reached": True, "0002-not-yet": False, "0003-this-commit": True,
                   "0004-needs-history": None, "0005-pr": None}
    assert data["droppable"] == ["t/vllm/0001-reached.patch", "t/vllm/0003-this-commit.patch"]
    assert {r["base"] for r in data["patches"]} == {f"0.20.2 ({base.commit[:12]})"}
    text = kvforge("status", "--check").stdout
    assert "2 patches could be dropped now" in text and "2 cannot be told here" in text


def test_status_check_with_an_unusable_cache_is_exit_5_naming_it(fake, tmp_path, monkeypatch):
    """--check materialises bases into the cache: a cache it cannot write is an environment problem (5, one
    line naming the cache), not a base "unavailable" for every patch and exit 0 blaming the network."""
    fake.patch("0001-kept-fix", {"vllm_like/core.py": ("return 2 * x", "return x + x")}, kind="refactor")
    fake.series("0001-kept-fix")
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory\n")
    monkeypatch.setenv("KVFORGE_CACHE", str(a_file / "cache"))  # a path under a file
    res = kvforge("status", "--check")
    assert res.exit_code == 5, res.output
    [line] = res.stderr.strip().splitlines()
    assert f"cannot write the kvforge cache at {a_file}" in line and "network" not in line
    res = kvforge("status", "--check", "--json")
    assert res.exit_code == 5 and json.loads(res.stdout)["exit"] == 5
    # Read-only (immutable, so that root is refused too): the cache exists, nothing can be made in it.
    cache = tmp_path / "ro-cache"
    cache.mkdir()
    monkeypatch.setenv("KVFORGE_CACHE", str(cache))
    if subprocess.run(["chattr", "+i", str(cache)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")  # the path-under-a-file case above still ran
    try:
        res = kvforge("status", "--check")
    finally:
        subprocess.run(["chattr", "-i", str(cache)], check=True)
    assert res.exit_code == 5, res.output
    assert f"cannot write the kvforge cache at {cache}" in res.stderr and list(cache.iterdir()) == []
    assert kvforge("status").exit_code == 0  # without --check no cache is needed
