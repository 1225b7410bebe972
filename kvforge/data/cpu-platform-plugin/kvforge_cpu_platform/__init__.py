"""vLLM platform plugin for kvforge's test environments only: selects vLLM's CPU platform.

A vLLM source tree run without a CPU build of vLLM finds no platform on a CPU-only host
("Failed to infer device type"). kvforge installs this package into its own test environments,
never into a user's environment, where it would take over the platform of a GPU install.
"""


def register() -> str:
    return "vllm.platforms.cpu.CpuPlatform"
