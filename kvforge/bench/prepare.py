"""What a bench of one component does before it runs its trees (bench prefix-cache, bench
scheduler-overhead): the stack (base and patched trees), its checked test environment, the VLLM_*
settings in force and the evidence name and directory they give. Owns none of the running."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvforge.core import evidence
from kvforge.env.venv import Env, target_env
from kvforge.git.trees import Stack, open_stack


@dataclass
class Prepared:
    stack: Stack
    env: Env  # the target's test environment for the stack's base, checked
    changes: bool  # some patch changes the base (else both trees are the base tree)
    note: str  # said when nothing changes the base ("" otherwise)
    settings: dict[str, str]  # the VLLM_* variables set: they change what vLLM does, so they are evidence
    name: str  # the evidence name: `name` given, with "-vllm<hash of settings>" when any are set
    outdir: Path  # evidence.attachments(cache, stack.key, kind, name)


def prepare(ctx, kind: str, name: str, unchanged_note: Callable[[Stack], str]) -> Prepared:
    """Open ctx's stack and its test environment; say `unchanged_note(stack)` when no patch changes
    the base, then the VLLM_* settings in force (in that order)."""
    say = ctx.progress
    stack = open_stack(ctx)
    env = target_env(ctx, base=stack.base)
    env.check()
    changes = bool(stack.size) and not all(stack.in_base(n) for n in range(1, stack.size + 1))
    note = "" if changes else unchanged_note(stack)
    if note:
        say(note)
    settings = {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_")}
    if settings:
        name += "-vllm" + hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:8]
        say("with " + " ".join(f"{k}={v}" for k, v in settings.items()))
    return Prepared(stack, env, changes, note, settings, name, evidence.attachments(ctx.cache, stack.key, kind, name))
