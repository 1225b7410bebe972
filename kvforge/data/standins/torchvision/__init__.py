"""kvforge stand-in for torchvision, whose CPU build for kvforge's torch is not on PyPI (PyPI's wheel
is built for CUDA and does not load with torch CPU: `operator torchvision::nms does not exist`).

Declared for vllm-ascend's CPU tests only: vllm-ascend's tests/ut/conftest.py applies every worker
patch, one of which imports vLLM's Qwen3-VL model, whose transformers image processor imports
torchvision.transforms at module level. No scheduler-side logic under test uses images;
everything under this module is a placeholder that raises StandInUsed when used (kvforge_standin.py).
"""

from kvforge_standin import stand_in

__version__ = "0.0.0+kvforge.standin"
stand_in(__name__)
