"""`KVCacheManager`: which blocks each request holds, and allocating more as it grows.

The scheduler asks `allocate_slots(request, num_new_tokens)` before it schedules tokens: the
manager adds just enough blocks to hold `num_computed_tokens + num_new_tokens` tokens, or says
no (returns None) and the scheduler must preempt someone. The scheduler speaks only in block
ids; it never touches a tensor. Chapter 04 explains block tables and slot mapping.
"""

from __future__ import annotations

from minivllm.kv_cache.block_pool import BlockPool, KVCacheBlock
from minivllm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --8<-- [start:kv-cache-manager]
class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    # exercise[ch04-allocate-slots]: need cdiv(num_computed_tokens + num_new_tokens, block_size) blocks; take only the missing; None if too few free
    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens; return the ids of blocks added.

        The request's blocks (`req_to_blocks[request.request_id]`) must cover its
        `num_computed_tokens + num_new_tokens` tokens afterwards. Only the missing blocks are
        taken from the pool; the list is empty when the blocks it holds already have room.
        Returns None, allocating nothing, when the pool has too few free blocks.
        """
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_tokens_needed = request.num_computed_tokens + num_new_tokens
        num_new_blocks = cdiv(num_tokens_needed, self.block_size) - len(blocks)
        if num_new_blocks > self.block_pool.num_free_blocks:
            return None
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        return [b.block_id for b in new_blocks]

    def free(self, request: Request) -> None:
        """Give back every block of `request` (finished, aborted or preempted)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        # Free in reverse so the tail of a sequence is reused first (vLLM does the same: the
        # head blocks are the likelier prefix-cache hits once caching exists).
        self.block_pool.free_blocks(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage()
# --8<-- [end:kv-cache-manager]
