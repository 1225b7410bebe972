"""kvforge: carry, prove and measure downstream vLLM prefix-cache patch series."""

__version__ = "0.1.0"
