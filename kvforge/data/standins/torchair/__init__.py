"""kvforge stand-in for torchair, Ascend's torch.compile graph backend (part of torch-npu), which
needs CANN and an NPU.

Declared for vllm-ascend's CPU tests: its tests/ut/conftest.py applies every worker patch, and the
NPU graph patch (patch_npugraph_ex_triton) imports torchair at module level. No scheduler-side
logic under test compiles graphs; everything under this module is a placeholder that raises
StandInUsed when used (kvforge_standin.py).
"""

import importlib

from kvforge_standin import stand_in

__version__ = "0.0.0+kvforge.standin"
stand_in(__name__)
for _sub in ("fx_summary", "npu_fx_compiler"):  # torchair imports these itself; vllm-ascend reloads them
    importlib.import_module(f"{__name__}.{_sub}")
