"""Block-table invariants of vLLM's KV cache manager, checked while the replay runs.

A violation is a result (counted by kind, with up to MAX_EXAMPLES examples), never a crash: the
base tree is expected to break some of them. Kinds:

    block_in_two_groups             one block id in two KV cache groups' live block tables
    ref_cnt_mismatch                a live block's ref_cnt differs from the number of references
    referenced_block_in_free_queue  a block with ref_cnt > 0 sits in the free queue
    unreferenced_block_not_free     a block with ref_cnt 0 is not in the free queue
    ref_cnt_without_owner           a block with ref_cnt > 0 is in no live block table (the copy sources a
                                    coordinator retains for the worker, `_retained_copy_sources`, count
                                    as owners)
    partial_entry_outlives_block    the block pool handed out a block that a partial prefix-cache entry
                                    (block_pool.partial_hash_index, vllm-ascend) still names
    stats_attribution_mismatch      (recorded by the driver) per-request counters do not add up

The checker only reads the scheduler's structures (duck-typed: req_to_blocks, block_pool,
free_block_queue); the driver decides when to call light() and full().
"""

from __future__ import annotations

from collections import Counter, defaultdict

MAX_EXAMPLES = 20


class Checker:
    """Block-table invariants, recorded as results."""

    MAX_EXAMPLES = MAX_EXAMPLES

    def __init__(self, scheduler):
        self.kvm = scheduler.kv_cache_manager
        self.coord = self.kvm.coordinator
        self.pool = self.coord.block_pool
        self.null = self.pool.null_block
        self.managers = self.coord.single_type_managers
        self.counts: Counter = Counter()
        self.examples: dict[str, list] = defaultdict(list)
        self.cross_group_ids: set[int] = set()
        self.free_queue_ok = hasattr(getattr(self.pool, "free_block_queue", None), "fake_free_list_head")
        self.full_checks = 0
        self._live: Counter = Counter()  # block id -> references in live tables, as of the last light()
        self.step = 0
        index = getattr(self.pool, "partial_hash_index", None)
        if index is not None:  # every block handed out must be named by no partial entry
            get_new_blocks = self.pool.get_new_blocks

            def checked_get_new_blocks(num_blocks: int):
                blocks = get_new_blocks(num_blocks)
                for bid in index.block_ids() & {b.block_id for b in blocks}:
                    self.record("partial_entry_outlives_block", self.step,
                                f"block {bid} handed out while a partial entry names it")
                return blocks

            self.pool.get_new_blocks = checked_get_new_blocks

    def record(self, kind: str, step: int, detail: str) -> None:
        """Count a violation of `kind` at `step`; keep the first MAX_EXAMPLES details."""
        self.counts[kind] += 1
        if len(self.examples[kind]) < self.MAX_EXAMPLES:
            self.examples[kind].append(dict(step=step, detail=detail))

    def light(self, step: int) -> None:
        """Every step: no block in two groups' live tables; ref counts == references."""
        self.step = step + 1  # get_new_blocks runs during the next step's schedule
        null = self.null
        owner: dict[int, int] = {}
        refs: Counter = Counter()
        for b in getattr(self.coord, "_retained_copy_sources", ()):
            refs[b.block_id] += 1
        for g, m in enumerate(self.managers):
            for rid, blocks in m.req_to_blocks.items():
                for b in blocks:
                    if b is null:
                        continue
                    bid = b.block_id
                    refs[bid] += 1
                    o = owner.setdefault(bid, g)
                    if o != g and bid not in self.cross_group_ids:
                        self.cross_group_ids.add(bid)
                        self.record("block_in_two_groups", step, f"block {bid} in groups {o} and {g} (req {rid})")
        blocks = self.pool.blocks
        for bid, n in refs.items():
            rc = blocks[bid].ref_cnt
            if rc != n:
                self.record("ref_cnt_mismatch", step, f"block {bid}: ref_cnt {rc}, referenced {n} times")
        self._live = refs

    def full(self, step: int) -> None:
        """At admissions/finishes: the free queue holds exactly the unreferenced blocks."""
        if not self.free_queue_ok:
            return
        self.full_checks += 1
        q = self.pool.free_block_queue
        node, tail = q.fake_free_list_head.next_free_block, q.fake_free_list_tail
        in_queue = set()
        while node is not None and node is not tail:
            in_queue.add(node.block_id)
            if node.ref_cnt != 0:
                self.record("referenced_block_in_free_queue", step,
                            f"block {node.block_id} ref_cnt {node.ref_cnt} is in the free queue")
            node = node.next_free_block
        live = self._live
        for b in self.pool.blocks:
            if b is self.null or getattr(b, "is_null", False):
                continue
            if b.ref_cnt == 0 and b.block_id not in in_queue:
                self.record("unreferenced_block_not_free", step,
                            f"block {b.block_id} ref_cnt 0 but not in the free queue")
            if b.ref_cnt > 0 and b.block_id not in live:
                self.record("ref_cnt_without_owner", step,
                            f"block {b.block_id} ref_cnt {b.ref_cnt} but in no live block table")

    def result(self) -> dict:
        return dict(counts=dict(self.counts), examples=dict(self.examples),
                    block_ids_in_two_groups=len(self.cross_group_ids), full_checks=self.full_checks,
                    free_queue_checked=self.free_queue_ok)
