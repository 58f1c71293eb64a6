"""The free block queue: a doubly linked list through the blocks, in eviction (LRU) order.

With prefix caching a free block is not empty: it may still hold the K/V of a cached prefix,
and a later request can take it back ("touch" it). That request must pull the block out of
the *middle* of the free queue, which a `deque` can only do in O(n). vLLM links the free
blocks through two pointers stored in the blocks themselves, so taking one out is O(1); this
is the same structure. The front is the least recently freed block, the next to be evicted;
freed blocks join the back. Chapter 04 ("Eviction") explains the order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of the paged KV cache, as the scheduler side sees it (an id, no tensors)."""

    block_id: int
    ref_cnt: int = 0  # how many requests hold this block
    block_hash: bytes | None = None  # set while the block is in the prefix cache
    # Links of the free queue; both None while the block is not in it.
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:  # the links would recurse through the whole queue
        cached = ", cached" if self.block_hash is not None else ""
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}{cached})"


# --8<-- [start:free-queue]
class FreeKVCacheBlockQueue:
    """Free blocks, least recently freed first. popleft, append and remove are all O(1)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        # Two sentinels that are never handed out: no operation has to special-case an end.
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free_block = self.tail
        self.tail.prev_free_block = self.head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Front (next to evict) to back (most recently freed)."""
        block = self.head.next_free_block
        while block is not self.tail:
            yield block
            block = block.next_free_block

    def popleft(self) -> KVCacheBlock:
        """Take the block at the front: the least recently freed."""
        if self.num_free_blocks == 0:
            raise ValueError("no free block left")
        block = self.head.next_free_block
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the back: it is evicted after every block already in the queue."""
        assert block.prev_free_block is None and block.next_free_block is None, f"{block} is already free"
        last = self.tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.tail
        self.tail.prev_free_block = block
        self.num_free_blocks += 1

    # exercise[ch04-free-queue-remove]: link block's neighbours to each other, clear its two links, count one block less
    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from wherever it is in the queue, in O(1).

        Its neighbours (`prev_free_block`, `next_free_block`; a sentinel at either end) are
        linked to each other; the block's own two links become None, so it is visibly out
        of the queue; `num_free_blocks` drops by one. Raises ValueError if the block is not
        in the queue (its links are None).
        """
        if block.prev_free_block is None or block.next_free_block is None:
            raise ValueError(f"{block} is not in the free queue")
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
# --8<-- [end:free-queue]
