"""The block pool: every KV block of the cache, and a free list.

The KV cache is cut into fixed-size blocks of `block_size` token slots. A request owns a list
of blocks (its block table), so its K/V need not be contiguous and no memory is reserved for
tokens it has not produced yet. This is the memory half of PagedAttention; chapter 04 tells
the story. The pool hands out block ids; the tensors that hold K/V live in the model runner.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0  # how many requests hold this block


# --8<-- [start:block-pool]
class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # FIFO order: a freed block goes to the back, so recently used blocks are reused last.
        self.free_block_queue: deque[KVCacheBlock] = deque(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    # exercise[ch04-get-new-blocks]: pop from the front of free_block_queue, ref_cnt = 1 each; ValueError, taking nothing, if too few are free
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks off the front of the free queue, each now held once.

        Raises ValueError, and takes nothing, when fewer than `num_blocks` blocks are free.
        """
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks but only {self.num_free_blocks} are free")
        new_blocks = [self.free_block_queue.popleft() for _ in range(num_blocks)]
        for block in new_blocks:
            assert block.ref_cnt == 0, f"block {block.block_id} was on the free list while in use"
            block.ref_cnt = 1
        return new_blocks

    # exercise[ch04-free-blocks]: ref_cnt -= 1 for each block, in order; a block that reaches 0 goes to the back of free_block_queue
    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; a block nobody holds any more becomes free.

        Freed blocks join the back of the free queue in the order given, so they are the
        last to be handed out again.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed twice"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def usage(self) -> float:
        """Share of blocks in use, 0.0 – 1.0."""
        return 1.0 - self.num_free_blocks / self.num_blocks
# --8<-- [end:block-pool]
