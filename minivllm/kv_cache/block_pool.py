"""The block pool: every KV block of the cache, a free queue, and the prefix cache's index.

The KV cache is cut into fixed-size blocks of `block_size` token slots. A request owns a list
of blocks (its block table), so its K/V need not be contiguous and no memory is reserved for
tokens it has not produced yet. This is the memory half of PagedAttention; chapter 04 tells
the story. The pool hands out block ids; the tensors that hold K/V live in the model runner.

With prefix caching (chapter 04, "Prefix caching") a full block is also entered in
`cached_block_hash_to_block` under its block hash, and stays there after its last holder
frees it: a free block keeps its K/V until the pool needs the memory. Blocks are evicted
lazily, when `get_new_blocks` takes them off the front of the free queue — the least recently
freed first. A request that finds a cached block takes it back with `touch`, out of the middle
of the free queue if nobody held it. With a CPU tier (`offload.py`) an evicted block's K/V are
copied to host memory first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from minivllm.kv_cache.block_hash import BlockHash
from minivllm.kv_cache.free_queue import FreeKVCacheBlockQueue, KVCacheBlock
from minivllm.kv_cache.offload import CPUOffloadTier

__all__ = ["BlockPool", "KVCacheBlock"]


# --8<-- [start:block-pool]
class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = False, offload_tier: CPUOffloadTier | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Least recently freed first: a freed block goes to the back, so it is evicted last.
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # The prefix cache: one block per hash (the first block computed for it).
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.offload_tier = offload_tier
        self.num_evictions = 0  # cached blocks whose K/V were dropped for new ones (statistics)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    # exercise[ch04-get-new-blocks]: popleft from free_block_queue, self._maybe_evict_cached_block(it), ref_cnt = 1; ValueError, taking nothing, if too few are free
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks off the front of the free queue, each now held once.

        A free block may still be in the prefix cache; its old K/V are about to be
        overwritten, so call `self._maybe_evict_cached_block(block)` on each block taken.
        Raises ValueError, and takes nothing, when fewer than `num_blocks` blocks are free.
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks but only {self.num_free_blocks} are free")
        new_blocks = [self.free_block_queue.popleft() for _ in range(num_blocks)]
        for block in new_blocks:
            assert block.ref_cnt == 0, f"block {block.block_id} was on the free list while in use"
            self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
        return new_blocks

    # exercise[ch04-free-blocks]: ref_cnt -= 1 for each block, in order; a block that reaches 0 goes to the back of free_block_queue
    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; a block nobody holds any more becomes free.

        Freed blocks join the back of the free queue in the order given, so they are the
        last to be handed out again. A cached block stays cached while it is free.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed twice"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    # exercise[ch04-touch]: each block: if ref_cnt == 0 it is free, so free_block_queue.remove(block); then ref_cnt += 1
    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Add one holder to each block, found in the prefix cache by a new request.

        A cached block that nobody held is still in the free queue (it may be evicted any
        moment): take it out, wherever it is, before counting the new holder.
        """
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def usage(self) -> float:
        """Share of blocks in use, 0.0 – 1.0 (cached blocks that nobody holds count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks
# --8<-- [end:block-pool]

    # -- the prefix cache -----------------------------------------------------------------

    # --8<-- [start:cache-blocks]
    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash]) -> None:
        """Enter full blocks in the prefix cache, `blocks[i]` under `block_hashes[i]`.

        If another block already holds a hash (two requests computed the same prefix at the
        same time), the first stays the cached one and this block stays private: one block
        per hash keeps eviction simple.
        """
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is not None:
                assert block.block_hash == block_hash, f"block {block.block_id} changed its hash"
                continue
            if block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop `block` from the prefix cache (its K/V are about to be overwritten).

        With a CPU tier its K/V are stored there first. Returns True if it was cached.
        """
        if block.block_hash is None:
            return False
        if self.offload_tier is not None:
            self.offload_tier.store(block.block_hash, block.block_id)
        del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1
        return True
    # --8<-- [end:cache-blocks]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only possible while no request holds a block.

        Returns False, changing nothing, while some block is held: a running request may be
        about to read a cached block, and its K/V must stay findable until it finishes.
        """
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.offload_tier is not None:
            self.offload_tier.reset()
        return True
