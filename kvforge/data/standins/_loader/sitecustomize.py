"""kvforge stand-ins: declared replacements for modules that need hardware this machine lacks.

Loaded at interpreter start-up (this directory is on PYTHONPATH only when a component declares
stand-ins, `[components.tests] standins = [...]` in its target file). It puts one finder in front
of sys.meta_path that answers for exactly the names in $KVFORGE_STANDINS (comma-separated, dotted
names allowed, e.g. `vllm_ascend._build_info`), loading `$KVFORGE_STANDINS_DIR/<name>/__init__.py`;
every other import is left to Python. A stand-in never pretends to compute: whatever the code under
test calls on it raises `StandInUsed`, naming the module, so a test that does touch it fails loudly.
"""

import importlib.abc
import importlib.util
import os
import sys

_NAMES = tuple(n for n in os.environ.get("KVFORGE_STANDINS", "").split(",") if n)
_DIR = os.environ.get("KVFORGE_STANDINS_DIR", "")


class _StandInFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _NAMES or not _DIR:
            return None
        init = os.path.join(_DIR, fullname, "__init__.py")
        if not os.path.isfile(init):
            return None
        return importlib.util.spec_from_file_location(fullname, init,
                                                      submodule_search_locations=[os.path.dirname(init)])


if _NAMES and not any(isinstance(f, _StandInFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _StandInFinder())
