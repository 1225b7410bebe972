"""What the workload allows: per request, the prefix an unbounded cache could serve.

Block keys are chained digests of whole `align`-token blocks (align = the LCM of the groups'
block sizes, topologies.hit_alignment), so equal keys mean equal prefixes. The tier connector
keys its store the same way. With an EAGLE-style drafter a block is sound to reuse only when the
token after it matches too (the drafter's KV at the block's last position is built from it):
lookahead_ceilings() is the bound of that rule. Standard library only.
"""

from __future__ import annotations

import hashlib
from array import array


class Keyer:
    """Incremental chained block keys of one growing token sequence."""

    def __init__(self, align: int):
        self.align, self.parent = align, b""
        self.keys: list[bytes] = []

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


def _lookahead_keys(tokens, align: int, lookahead: int, n_tokens: int) -> list[bytes]:
    """Chained digests of the whole `align`-token blocks of tokens[:n_tokens] whose `lookahead`
    following tokens are known too, each digest covering its block and those tokens."""
    keys: list[bytes] = []
    parent = b""
    while (len(keys) + 1) * align + lookahead <= n_tokens:
        start = len(keys) * align
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(array("q", tokens[start:start + align]).tobytes())
        parent = h.digest()
        tail = hashlib.blake2b(parent, digest_size=16)
        tail.update(array("q", tokens[start + align:start + align + lookahead]).tobytes())
        keys.append(tail.digest())
    return keys


def lookahead_ceilings(requests: list[dict], align: int, lookahead: int = 1) -> list[int]:
    """Per request, the most tokens a prefix cache can serve soundly to an EAGLE-style drafter:
    as ceilings(), but a shared block counts only when the `lookahead` tokens after it are shared
    too. Below ceilings() exactly where a request leaves a cached sequence at a block boundary."""
    seen: set[bytes] = set()
    out = []
    for r in requests:
        prompt = r["prompt"]
        n = 0
        for k in _lookahead_keys(prompt, align, lookahead, len(prompt)):
            if k not in seen:
                break
            n += 1
        cap = (len(prompt) - 1) // align * align
        out.append(min(n * align, cap))
        # Computed: the prompt and all but the last output token; the tokens after a block may
        # include that last one.
        seq = prompt + r["output"]
        computed = len(seq) - 1
        seen.update(k for i, k in enumerate(_lookahead_keys(seq, align, lookahead, len(seq)))
                    if (i + 1) * align <= computed)
    return out
