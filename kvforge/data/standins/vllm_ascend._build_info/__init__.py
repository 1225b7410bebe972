"""kvforge stand-in for vllm_ascend/_build_info.py, which vllm-ascend's setup.py writes while it
builds the Ascend kernels (a build that needs CANN and torch-npu). It names the SoC family the build
was made for; A2 (Atlas A2, 910B) is the family of vllm-ascend's CI runner linux-aarch64-a2b3-1.
"""

STANDIN = True
__device_type__ = "A2"
