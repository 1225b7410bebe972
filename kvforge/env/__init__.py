"""Test environments: the venv kvforge builds (torch, vLLM's pure-Python requirements, the CPU platform
plugin), the user's own interpreter with an overlay, where torch comes from, and components built
on another (vllm-ascend on vLLM: layering, stand-ins).
"""
