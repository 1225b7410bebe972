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

full() is incremental where it can be: the replay's unbounded pools hold millions of blocks, and
walking all of them at every admission and finish made the checker, not the scheduler, the
replay's cost (quadratic in the request count). When the free queue is vLLM's doubly linked
FreeKVCacheBlockQueue (its mutators are exactly QUEUE_MUTATORS), the checker wraps those mutators
and the pool's touch/free_blocks to note every block whose queue membership or ref_cnt can change
(in queue = linked, as vLLM keeps it). A check then looks at those blocks, the blocks with
ref_cnt > 0 and the blocks that violated last time, and gives the same violations as a whole-pool
walk: a block none of these name is unreferenced and in the queue, as at the last check. The first
check, every WHOLE_EVERY-th and the driver's final one still walk the whole pool.
"""

from __future__ import annotations

from collections import Counter, defaultdict

MAX_EXAMPLES = 20
# FreeKVCacheBlockQueue's public methods that change membership (prepend_n: vLLM's queue split), and
# the read-only one; a queue with any other public method is always walked whole.
QUEUE_MUTATORS = ("popleft", "popleft_n", "remove", "append", "append_n", "prepend_n")
QUEUE_READERS = ("get_all_free_blocks",)
POOL_MUTATORS = ("touch", "free_blocks")  # change ref_cnt of the blocks they are given
WHOLE_EVERY = 64


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
        self._dirty: set[int] | None = None  # blocks that may have changed since the last full(); None: walk all
        self._watch: set[int] = set()  # ref_cnt > 0 or a violation at the last full()
        self.whole_checks = 0
        self._incremental = self.free_queue_ok and self._track_changes()
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

    def _track_changes(self) -> bool:
        """Wrap the free queue's mutators and the pool's touch/free_blocks to note the blocks they
        change; False (always walk whole) when the queue is not the linked queue this knows."""
        q = self.pool.free_block_queue
        public = {n for n in dir(type(q)) if not n.startswith("_") and callable(getattr(type(q), n))}
        if not public or not public <= set(QUEUE_MUTATORS + QUEUE_READERS):
            return False

        def note(blocks) -> None:
            dirty = self._dirty
            if dirty is not None:
                for b in blocks:
                    dirty.add(b.block_id)

        def wrap(obj, name: str, args_hold_blocks: bool) -> None:
            orig = getattr(obj, name, None)
            if orig is None:
                return

            def wrapped(*args, **kwargs):
                if args_hold_blocks and args:
                    first = args[0]
                    if hasattr(first, "block_id"):  # remove(block), append(block)
                        note((first,))
                    else:  # a sequence or an iterable (free_blocks): materialize it once
                        first = list(first)
                        note(first)
                        args = (first, *args[1:])
                out = orig(*args, **kwargs)
                if out is not None and not args_hold_blocks:  # popleft -> block, popleft_n -> [blocks]
                    note((out,) if hasattr(out, "block_id") else out)
                return out

            setattr(obj, name, wrapped)

        for name in QUEUE_MUTATORS:
            wrap(q, name, args_hold_blocks=name not in ("popleft", "popleft_n"))
        for name in POOL_MUTATORS:
            wrap(self.pool, name, args_hold_blocks=True)
        return True

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
        self._check_refs(refs, step)

    def _check_refs(self, refs: Counter, step: int) -> None:
        blocks = self.pool.blocks
        for bid, n in refs.items():
            rc = blocks[bid].ref_cnt
            if rc != n:
                self.record("ref_cnt_mismatch", step, f"block {bid}: ref_cnt {rc}, referenced {n} times")
        self._live = refs

    def full(self, step: int, whole: bool = False) -> None:
        """At admissions/finishes: the free queue holds exactly the unreferenced blocks. `whole`:
        walk the whole pool (the driver's final check); else incremental where possible."""
        if not self.free_queue_ok:
            return
        self.full_checks += 1
        if (self._incremental and not whole and self._dirty is not None
                and self.full_checks % WHOLE_EVERY != 0):
            self._check_changed(step)
            return
        self._check_whole(step)

    def _check_changed(self, step: int) -> None:
        """full() over the blocks that may have changed (see the module doc)."""
        assert self._dirty is not None
        blocks, live = self.pool.blocks, self._live
        watch: set[int] = set()
        for bid in self._dirty | self._watch:
            b = blocks[bid]
            if b is self.null or getattr(b, "is_null", False):
                continue
            in_queue = b.prev_free_block is not None and b.next_free_block is not None
            bad = False
            if in_queue and b.ref_cnt != 0:
                bad = True
                self.record("referenced_block_in_free_queue", step,
                            f"block {bid} ref_cnt {b.ref_cnt} is in the free queue")
            if b.ref_cnt == 0 and not in_queue:
                bad = True
                self.record("unreferenced_block_not_free", step, f"block {bid} ref_cnt 0 but not in the free queue")
            if b.ref_cnt > 0 and bid not in live:
                bad = True
                self.record("ref_cnt_without_owner", step,
                            f"block {bid} ref_cnt {b.ref_cnt} but in no live block table")
            if bad or b.ref_cnt > 0:
                watch.add(bid)
        self._watch = watch
        self._dirty = set()

    def _check_whole(self, step: int) -> None:
        """full() by walking the free queue and every block of the pool."""
        self.whole_checks += 1
        q = self.pool.free_block_queue
        node, tail = q.fake_free_list_head.next_free_block, q.fake_free_list_tail
        in_queue = set()
        watch: set[int] = set()
        while node is not None and node is not tail:
            in_queue.add(node.block_id)
            if node.ref_cnt != 0:
                watch.add(node.block_id)
                self.record("referenced_block_in_free_queue", step,
                            f"block {node.block_id} ref_cnt {node.ref_cnt} is in the free queue")
            node = node.next_free_block
        live = self._live
        for b in self.pool.blocks:
            if b is self.null or getattr(b, "is_null", False):
                continue
            if b.ref_cnt == 0 and b.block_id not in in_queue:
                watch.add(b.block_id)
                self.record("unreferenced_block_not_free", step,
                            f"block {b.block_id} ref_cnt 0 but not in the free queue")
            if b.ref_cnt > 0:
                watch.add(b.block_id)
                if b.block_id not in live:
                    self.record("ref_cnt_without_owner", step,
                                f"block {b.block_id} ref_cnt {b.ref_cnt} but in no live block table")
        self._watch = watch
        if self._incremental:
            self._dirty = set()

    def result(self) -> dict:
        return dict(counts=dict(self.counts), examples=dict(self.examples),
                    block_ids_in_two_groups=len(self.cross_group_ids), full_checks=self.full_checks,
                    free_queue_checked=self.free_queue_ok)

    def cost(self) -> dict:
        """How full() ran (not part of the result: the result is the same either way)."""
        return dict(whole_pool_checks=self.whole_checks, incremental=self._incremental)
