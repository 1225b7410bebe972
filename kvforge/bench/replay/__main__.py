"""`python <this directory> ARGS`, run with cwd = a vLLM tree root: the replay (see cli.py).

Loads this directory, and only it, as the private package `kvforge_replay`: the directory is
taken off sys.path (its module names must not shadow anything vLLM imports), and `kvforge` is
blocked so that nothing here can import kvforge, installed or not. Running it any other way
(`python -m kvforge.bench.replay`) is refused: there kvforge is already imported.
"""

import importlib
import importlib.util
import os
import sys

if __package__:
    sys.exit(f"run the replay as `python {os.path.dirname(os.path.abspath(__file__))} ...` "
             "from a vLLM tree root, not with -m")

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.modules["kvforge"] = None  # type: ignore[assignment]  # None: any `import kvforge...` raises ImportError
_spec = importlib.util.spec_from_file_location("kvforge_replay", os.path.join(_HERE, "__init__.py"),
                                               submodule_search_locations=[_HERE])
assert _spec is not None and _spec.loader is not None, "a file location always gives a spec with a loader"
_pkg = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = _pkg
_spec.loader.exec_module(_pkg)
sys.argv[1:2] == ["ascend"] and sys.exit(importlib.import_module("kvforge_replay.ascend").main(sys.argv[2:]))  # ascend.py
# `python <this directory> overhead`: the scheduler-overhead server (overhead.py); else the replay (cli.py).
sys.exit(importlib.import_module("kvforge_replay." + ("overhead" if sys.argv[1:2] == ["overhead"] else "cli")).main())
