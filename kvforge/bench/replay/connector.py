"""The external KV tier of the external-hit scenarios, as a scheduler-side vLLM KV connector.

It models an unbounded offload tier (LMCache-style) shared by instances: every block is stored
once computed, and a request is offered, synchronously, the tokens beyond its local hit that the
tier holds. vLLM builds the connector itself (by module path: this module), so the replay talks
to it through STATE: scheduler.build() resets it before each Scheduler is made; the connector
registers itself there; the driver adds other instances' blocks (tier_adds) through it and reads
what was offered to each request. One replay at a time per process. Needs vLLM.
"""

from __future__ import annotations

import sys

from .ceilings import Keyer, block_keys
from .compat import kw

CLASS_NAME = "ReplayTierConnector"


class TierState:
    """What the replay and the connector vLLM made share (one scheduler at a time)."""

    def __init__(self) -> None:
        self.reset(16)

    def reset(self, align: int) -> None:
        self.align = align  # key granularity: the workload's hit alignment
        self.offers: dict[str, tuple[int, int]] = {}  # request id -> (local hit tokens, external tokens)
        self.connector = None  # the live connector, once vLLM has built it


STATE = TierState()


def transfer_config(vcfg):
    """A KVTransferConfig that makes vLLM load this module's connector (vcfg: vllm.config)."""
    # Loaded by module path, as vLLM loads out-of-tree connectors; some
    # versions resolve the class while building VllmConfig.
    setattr(sys.modules[__name__], CLASS_NAME, connector_class())
    return vcfg.KVTransferConfig(**kw(
        vcfg.KVTransferConfig, kv_connector=CLASS_NAME, kv_role="kv_both",
        kv_connector_module_path=__name__))


def connector_class():
    """The connector class, built on this tree's KVConnectorBase_V1 (and SupportsHMA if it has it)."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import base as cbase

    bases = [cbase.KVConnectorBase_V1]
    if hasattr(cbase, "SupportsHMA"):
        bases.append(cbase.SupportsHMA)

    def __init__(self, vllm_config, role, kv_cache_config=None, *args, **kwargs):
        cbase.KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        self.align = STATE.align
        self.store = set()  # block keys stored (bytes)
        self.live = {}  # request id -> (request, keyer)
        STATE.connector = self

    def get_num_new_matched_tokens(self, request, num_computed_tokens, *args, **kwargs):
        n = 0
        for k in block_keys(list(request.prompt_token_ids), self.align):
            if k not in self.store:
                break
            n += 1
        have = min(n * self.align, (request.num_tokens - 1) // self.align * self.align)
        ext = max(0, have - num_computed_tokens)
        STATE.offers[request.request_id] = (num_computed_tokens, ext)
        return ext, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens, *args, **kwargs):
        if request.request_id not in self.live:
            self.live[request.request_id] = (request, Keyer(self.align))

    def build_connector_meta(self, scheduler_output, *args, **kwargs):
        # Store what the previous steps computed (the worker saves it after the step).
        for rid in scheduler_output.num_scheduled_tokens:
            entry = self.live.get(rid)
            if entry is not None:
                req, keyer = entry
                self.store.update(keyer.extend_to(req.all_token_ids, req.num_computed_tokens))
        return cbase.KVConnectorMetadata()

    def request_finished(self, request, block_ids, *args, **kwargs):
        entry = self.live.pop(request.request_id, None)
        if entry is not None:
            self.store.update(entry[1].extend_to(request.all_token_ids, request.num_computed_tokens))
        return False, None

    def request_finished_all_groups(self, request, block_ids, *args, **kwargs):
        return self.request_finished(request, block_ids)

    ns = dict(__init__=__init__, get_num_new_matched_tokens=get_num_new_matched_tokens,
              update_state_after_alloc=update_state_after_alloc,
              build_connector_meta=build_connector_meta, request_finished=request_finished,
              request_finished_all_groups=request_finished_all_groups, __module__=__name__)
    cls = type(CLASS_NAME, tuple(bases), ns)
    # Worker-side abstract methods: never called on the scheduler side.
    missing = set(getattr(cls, "__abstractmethods__", ()))
    for name in missing:
        setattr(cls, name, lambda self, *a, **k: None)
    if missing:
        cls = type(CLASS_NAME, (cls,), {"__module__": __name__})
    return cls


def add_to_tier(sequences) -> None:
    """Blocks another instance computed meanwhile enter the shared tier (no connector: nothing)."""
    conn = STATE.connector
    for seq in sequences:
        if conn is not None:
            conn.store.update(block_keys(seq, conn.align))
