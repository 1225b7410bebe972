"""What the workload allows: per request, the prefix an unbounded cache could serve.

Block keys are chained digests of whole `align`-token blocks (align = the LCM of the groups'
block sizes, topologies.hit_alignment), so equal keys mean equal prefixes. The tier connector
keys its store the same way. Standard library only.
"""

from __future__ import annotations

import hashlib
from array import array


class Keyer:
    """Incremental chained block keys of one growing token sequence."""

    def __init__(self, align: int):
        self.align, self.keys, self.parent = align, [], b""

    def extend_to(self, tokens, n_tokens: int) -> list[bytes]:
        """Key every whole block within the first n_tokens not keyed yet; return the new keys."""
        new = []
        while (len(self.keys) + 1) * self.align <= n_tokens:
            start = len(self.keys) * self.align
            h = hashlib.blake2b(self.parent, digest_size=16)
            h.update(array("q", tokens[start:start + self.align]).tobytes())
            self.parent = h.digest()
            self.keys.append(self.parent)
            new.append(self.parent)
        return new


def block_keys(tokens: list[int], align: int) -> list[bytes]:
    """Chained digests of the full `align`-token blocks of a token sequence."""
    return Keyer(align).extend_to(tokens, len(tokens))


def ceilings(requests: list[dict], align: int) -> list[int]:
    """Per request, the most tokens any prefix cache could serve.

    The longest prefix shared with what an earlier-submitted request computed
    (its prompt and all but its last output token), in whole `align` blocks,
    capped below the prompt length (vLLM recomputes at least the last token).
    An unbounded cache that never evicts reaches exactly this.
    """
    seen: set[bytes] = set()
    out = []
    for r in requests:
        prompt = r["prompt"]
        n = 0
        for k in block_keys(prompt, align):
            if k not in seen:
                break
            n += 1
        cap = (len(prompt) - 1) // align * align
        out.append(min(n * align, cap))
        seen.update(block_keys(prompt + r["output"][:-1], align))
    return out
