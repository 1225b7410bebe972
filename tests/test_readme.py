"""README.md's commands run as written: every `kvforge ...` command of its code blocks, in order, in a copy of
this project's targets/ and patches/, with the real vLLM and vllm-ascend sdists of the user cache (offline) and
$HOME a temporary directory (so `~/src/vllm-rc` is a new tree): each exits 0."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvforge.core.cache import default_cache_dir

REPO_ROOT = Path(__file__).resolve().parent.parent
USER_CACHE = default_cache_dir()  # resolved at import, before fixtures point $KVFORGE_CACHE elsewhere
SDISTS = ("vllm-0.20.2.tar.gz", "vllm_ascend-0.20.2rc1.tar.gz")


def readme_commands(text: str) -> list[str]:
    """Every kvforge command in README.md's fenced code blocks, in order: each line's `&&`-separated parts whose
    program is kvforge (`kvforge` or a path ending in /kvforge), a trailing `# comment` dropped."""
    out: list[str] = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.M | re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            for part in (p.strip() for p in line.split("&&")):
                words = part.split()
                if words and (words[0] == "kvforge" or words[0].endswith("/kvforge")):
                    out.append(" ".join(["kvforge", *words[1:]]))
    return out


def test_the_commands_are_found():
    cmds = readme_commands((REPO_ROOT / "README.md").read_text())
    assert "kvforge apply --target v0.20.2rc" in cmds
    assert "kvforge apply -t v0.20.2rc --into ~/src/vllm-rc" in cmds
    assert cmds[-1] == "kvforge export -t v0.20.2rc --from ~/src/vllm-rc"


@pytest.mark.slow
def test_every_readme_command_runs_as_written(tmp_path):
    if not all((USER_CACHE / "downloads" / s).is_file() for s in SDISTS):
        pytest.skip(f"the user cache has not {', '.join(SDISTS)} (any slow test of v0.20.2rc downloads them)")
    project = tmp_path / "project"
    for d in ("targets", "patches"):
        shutil.copytree(REPO_ROOT / d, project / d)
    cache = tmp_path / "cache"
    (cache / "downloads").mkdir(parents=True)
    for s in SDISTS:
        (cache / "downloads" / s).symlink_to(USER_CACHE / "downloads" / s)
    (USER_CACHE / "envs").mkdir(parents=True, exist_ok=True)
    (cache / "envs").symlink_to(USER_CACHE / "envs", target_is_directory=True)  # the CPU test environments
    home = tmp_path / "home"
    (home / "src").mkdir(parents=True)
    env = {**os.environ, "HOME": str(home), "KVFORGE_ROOT": str(project), "KVFORGE_CACHE": str(cache),
           "KVFORGE_OFFLINE": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for cmd in readme_commands((REPO_ROOT / "README.md").read_text()):
        run = subprocess.run(["bash", "-c", cmd], cwd=project, env=env, capture_output=True, text=True,
                             timeout=3600)
        assert run.returncode == 0, f"{cmd}: exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
