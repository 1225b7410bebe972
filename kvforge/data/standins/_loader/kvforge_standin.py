"""What kvforge's stand-in modules are made of (kvforge/data/standins/<module>/__init__.py).

`stand_in(name)` turns the module being imported into a stand-in: any attribute it lacks, and any
submodule imported under it (`torch_npu._inductor`, `torchvision.transforms.v2.functional`), is an
`Absent` placeholder. Placeholders may be looked up, chained, subclassed and written in
annotations (`torch.npu.Stream | None`), which is all importing vllm-ascend's scheduler-side code
does with them; calling one, or using one as a value (truth, number, comparison, iteration),
raises StandInUsed naming it. So a test that touches a stood-in module fails; it never passes on
made-up behaviour.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class StandInUsed(RuntimeError):
    """The code under test used a module that kvforge stood in for (its logic needs that module)."""


class Absent:
    """A placeholder for anything under a stood-in module."""

    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Absent(f"{self._name}.{attr}")

    def _used(self, *_args, **_kwargs):
        raise StandInUsed(f"{self._name} was used, but {self._name.split('.')[0]} is a kvforge stand-in here "
                          "(declared in the target file): the code under test needs the real module")

    __call__ = __bool__ = __int__ = __index__ = __float__ = __iter__ = __len__ = _used
    __eq__ = __lt__ = __le__ = __gt__ = __ge__ = __contains__ = __getitem__ = _used
    __hash__ = object.__hash__

    def _annotation(self, _other):
        return self  # `torch.npu.Stream | None` in an annotation is a type, not a use

    __or__ = __ror__ = _annotation

    def __mro_entries__(self, bases):
        return (object,)  # `class X(torch_npu.Foo)` defines X; calling Foo's behaviour is what raises

    def __repr__(self) -> str:
        return f"<kvforge stand-in {self._name}>"


class StandInModule(types.ModuleType):
    """A stood-in module: attributes it does not define are placeholders."""

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Absent(f"{self.__name__}.{attr}")


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, prefix: str):
        self.prefix = prefix + "."

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self.prefix):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = StandInModule(spec.name, f"kvforge stand-in submodule of {self.prefix[:-1]}")
        module.__path__ = []
        module.STANDIN = True
        return module

    def exec_module(self, module):
        pass


def stand_in(name: str) -> types.ModuleType:
    """Make the module `name` (being imported) and everything under it a stand-in."""
    module = sys.modules[name]
    module.__class__ = StandInModule
    module.STANDIN = True
    if not any(isinstance(f, _Submodules) and f.prefix == name + "." for f in sys.meta_path):
        sys.meta_path.insert(0, _Submodules(name))
    return module
