"""The synthetic model runner: what the "model" outputs each step. Standard library only.

Sampled tokens follow each request's planned output, so every tree sees the same token stream.
With speculative decoding, each scheduled draft token is accepted with probability spec.accept
(one random.Random per seed, drawn in scheduling order), and the next drafts are the next k
planned tokens. Counts drafted/accepted tokens for the result.
"""

from __future__ import annotations

import random


class Sampler:
    """Synthetic model runner: planned output tokens, drafts and acceptance."""

    def __init__(self, planned: dict[str, list[int]], spec: dict | None, seed: int):
        self.planned = planned
        self.spec = spec or {}  # {"k": drafts per step, "accept": probability}; only read with drafts
        self.rng = random.Random(f"accept:{seed}")
        self.drafted = 0
        self.accepted = 0

    def sampled(self, req, spec_tokens: list[int]) -> list[int]:
        """The tokens this step emits for `req`: accepted drafts + one, from the plan."""
        plan = self.planned[req.request_id]
        pos = len(req.output_token_ids)
        n = 1
        if spec_tokens:
            a = 0
            while a < len(spec_tokens) and self.rng.random() < self.spec["accept"]:
                a += 1
            self.drafted += len(spec_tokens)
            self.accepted += a
            n = a + 1
        return plan[pos:pos + n] or plan[-1:]

    def drafts(self, req) -> list[int]:
        """The draft tokens proposed for `req`'s next step: the next k planned tokens."""
        plan = self.planned[req.request_id]
        pos = len(req.output_token_ids)
        return list(plan[pos:pos + self.spec["k"]])
