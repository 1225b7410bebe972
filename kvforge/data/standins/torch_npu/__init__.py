"""kvforge stand-in for torch_npu (Ascend's PyTorch backend), which needs CANN and an NPU.

Declared in targets/*.toml (`[components.tests] standins`) for vllm-ascend's CPU tests, whose logic
under test (block sizes, KV cache specs, the KV cache coordinator and managers) computes nothing on
an NPU: vllm-ascend imports torch_npu at module level. Importing this succeeds and sets `torch.npu`
as torch_npu does; everything under it is a placeholder that raises StandInUsed when called or used
as a value (kvforge_standin.py). Only `torch_npu.npu.is_available()` (False) and `device_count()`
(0) answer, truthfully: there is no NPU here.
"""

import torch
from kvforge_standin import Absent, StandInUsed, stand_in  # noqa: F401  (StandInUsed: for tests)

__version__ = "0.0.0+kvforge.standin"
stand_in(__name__)


class _Npu(Absent):
    """torch_npu.npu: answers the two questions whose truthful answer is known here (no NPU)."""

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        return 0


npu = _Npu("torch_npu.npu")
if not hasattr(torch, "npu"):
    torch.npu = npu  # what importing the real torch_npu does
