"""kvforge ends its child processes when it is ended: SIGTERM (a CI job's timeout), SIGHUP, SIGINT. A real
`kvforge test` runs a real pytest child (vLLM 0.20.2's tree, the CPU env) whose test sleeps; the signal is
sent to kvforge only (as a runner's timeout sends it), and the pytest process must be gone after."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import make_patch, write_series

from kvforge.core.cache import default_cache_dir

SLEEPER = '''\
import os
import time


def test_sleeps():
    with open(os.environ["KVFORGE_SIGNAL_TEST_PIDFILE"], "w") as fh:
        fh.write(str(os.getpid()))
    time.sleep(600)
'''
CHECK = "tests/v1/core/test_kvforge_sleeps.py::test_sleeps"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as fh:
            state = next(ln for ln in fh if ln.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError):
        return False
    return " Z " not in state and "zombie" not in state  # a zombie has ended (its parent is gone)


def _signals_as_at_a_terminal() -> None:
    """kvforge starts with SIGINT's default disposition, as under a terminal: a runner that started this
    suite in the background (`cmd &` in a script) has SIGINT ignored, and that would be inherited."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_kvforge_ends_its_pytest_child_on_a_signal(project, base_v0202, tmp_path, sig):
    cache, base = base_v0202
    envs = default_cache_dir() / "envs"
    envs.mkdir(parents=True, exist_ok=True)
    if not (cache.root / "envs").exists():
        (cache.root / "envs").symlink_to(envs, target_is_directory=True)
    make_patch(base.repo, base.commit, {"tests/v1/core/test_kvforge_sleeps.py": ("", SLEEPER)}, "[Misc] sleep",
               "sleeps", project / "patches" / "t" / "0001-sleeps.patch", kind="fix", extra=f"Checks: {CHECK}\n")
    write_series(project, "0001-sleeps.patch")
    pidfile = tmp_path / "pytest.pid"
    env = {k: v for k, v in os.environ.items() if k != "KVFORGE_TEST_PYTHON"}
    env["KVFORGE_SIGNAL_TEST_PIDFILE"] = str(pidfile)
    proc = subprocess.Popen([sys.executable, "-c", "from kvforge.cli import main; main()", "test", "-t", "t",
                             "-k", "test_sleeps"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=_signals_as_at_a_terminal)
    try:
        deadline = time.monotonic() + 600
        while not pidfile.exists() or not pidfile.read_text():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the sleeping test never started"
            time.sleep(0.5)
        child = int(pidfile.read_text())
        assert alive(child)
        os.kill(proc.pid, sig)  # kvforge only, not its group: as a runner's timeout does
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == (143 if sig == signal.SIGTERM else 130), err
    assert ("terminated (SIGTERM)" if sig == signal.SIGTERM else "interrupted") in err
    assert "Traceback" not in err
    for _ in range(50):
        if not alive(child):
            break
        time.sleep(0.1)
    assert not alive(child), f"pytest ({child}) still runs after kvforge ended"
