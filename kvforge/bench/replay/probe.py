"""Does issue #33775's trigger hold? A probe on allocations that bring external tokens.

It wraps the KV cache manager's allocate_slots (the wrapper never changes what vLLM does and
never raises: probe errors are recorded) and, on a copy of the free-queue order, replays v0.20's
per-group allocation: group i touches its own hits, then takes its external blocks from the
queue head. A later group's untouched hit block inside that reach would be handed to group i
while still being group j's hit. The condition depends only on the state, so it is reported for
every tree, fixed or not; the checker (invariants.py) says whether the tree then broke.
"""

from __future__ import annotations

import inspect

from .invariants import MAX_EXAMPLES


class ExternalProbe:
    """For allocations with external tokens: did a local-hit block sit where an
    earlier group's external allocation would take it (issue #33775)?"""

    def __init__(self, scheduler):
        self.kvm = scheduler.kv_cache_manager
        self.allocations: set[str] = set()
        self.triggered: set[str] = set()
        self.examples: list[dict] = []
        self.errors: list[str] = []
        orig = self.kvm.allocate_slots
        sig = inspect.signature(orig)

        def allocate_slots(*args, **kwargs):
            try:
                bound = sig.bind(*args, **kwargs)
                a = bound.arguments
                ext = a.get("num_external_computed_tokens", 0) or 0
                ncb = a.get("new_computed_blocks")
                if ext > 0 and ncb is not None:
                    self._probe(a["request"], a.get("num_new_computed_tokens", 0) or 0, ext, ncb)
            except Exception as exc:  # the probe must never break the replay
                if len(self.errors) < 5:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
            return orig(*args, **kwargs)

        self.kvm.allocate_slots = allocate_slots

    def _probe(self, request, local: int, ext: int, ncb) -> None:
        self.allocations.add(request.request_id)
        managers = self.kvm.coordinator.single_type_managers
        hits_by_group = ncb.blocks if hasattr(ncb, "blocks") else ncb
        total = local + ext
        kept: list[list] = []  # the hit blocks each group would touch
        takes: list[int] = []  # blocks each group takes from the queue for external tokens
        for m, raw in zip(managers, hits_by_group):
            skipped = m.get_num_skipped_tokens(total) // m.block_size if hasattr(m, "get_num_skipped_tokens") else 0
            kept.append([b for b in list(raw)[skipped:] if not getattr(b, "is_null", False)])
            takes.append(max(0, -(-total // m.block_size) - max(len(raw), skipped)))
        q = self.kvm.block_pool.free_block_queue
        order: list[int] = []
        node, tail = q.fake_free_list_head.next_free_block, q.fake_free_list_tail
        limit = sum(takes) + sum(len(k) for k in kept) + 1
        while node is not None and node is not tail and len(order) < limit:
            order.append(node.block_id)
            node = node.next_free_block
        found = []
        for j in range(1, len(managers)):
            reach_n = sum(takes[:j])
            if reach_n == 0:
                continue
            removed = {b.block_id for k in kept[:j] for b in k}
            reach = [bid for bid in order if bid not in removed][:reach_n]
            reach_set = set(reach)
            for b in kept[j]:
                if b.ref_cnt == 0 and b.block_id in reach_set:
                    found.append((j, b.block_id))
        if found:
            first = request.request_id not in self.triggered
            self.triggered.add(request.request_id)
            if first and len(self.examples) < MAX_EXAMPLES:
                self.examples.append(dict(request=request.request_id, local=local, external=ext,
                                          group_block=found[:8]))

    def result(self) -> dict:
        return dict(allocations_with_external_tokens=len(self.allocations), trigger_held=len(self.triggered),
                    trigger_examples=self.examples, probe_errors=self.errors)
