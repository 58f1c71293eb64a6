"""`KVCacheManager`: which blocks each request holds, allocating more, and the prefix cache.

The scheduler asks `allocate_slots(request, num_new_tokens)` before it schedules tokens: the
manager adds just enough blocks to hold `num_computed_tokens + num_new_tokens` tokens, or says
no (returns None) and the scheduler must preempt someone. The scheduler speaks only in block
ids; it never touches a tensor. Chapter 04 explains block tables and slot mapping.

With prefix caching, a request being admitted first asks `get_computed_blocks`: the longest
run of its leading full blocks already in the cache. Those tokens count as computed, their
blocks are shared (ref-counted), and only the rest is computed. Every full block a request
fills is entered in the cache as soon as its tokens are scheduled. With a CPU tier the lookup
continues there (`get_offloaded_prefix`), and the hits are copied back instead of recomputed.
Chapter 04's "Prefix caching" and "KV offloading" sections walk through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from minivllm.kv_cache.block_hash import BlockHash, extend_block_hashes
from minivllm.kv_cache.block_pool import BlockPool
from minivllm.kv_cache.free_queue import KVCacheBlock
from minivllm.kv_cache.offload import CPUOffloadTier
from minivllm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since start-up, in tokens (vLLM counts the same way)."""

    num_requests: int = 0  # admissions that looked the cache up
    num_query_tokens: int = 0  # tokens those requests had when they were admitted
    num_hit_tokens: int = 0  # of those, found in the cache (GPU or CPU tier)
    num_cpu_hit_tokens: int = 0  # of the hits, copied back from the CPU tier

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


# --8<-- [start:kv-cache-manager]
class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = False, num_cpu_blocks: int = 0
    ) -> None:
        if num_cpu_blocks and not enable_caching:
            raise ValueError("the CPU tier (KV offloading) finds blocks by their hash: it needs enable_caching")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.offload_tier = CPUOffloadTier(num_cpu_blocks) if num_cpu_blocks else None
        self.block_pool = BlockPool(num_blocks, enable_caching, self.offload_tier)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # per request: leading blocks already in the cache
        self.prefix_cache_stats = PrefixCacheStats()

    # exercise[ch04-computed-blocks]: walk block_hashes(request) up to (num_tokens - 1) // block_size blocks; stop at the first get_cached_block miss
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The request's leading blocks already in the prefix cache, and the tokens they hold.

        Walk the request's block hashes (`self.block_hashes(request)`) in order and look each
        up with `self.block_pool.get_cached_block`; stop at the first miss: a block is only
        reusable if every block before it is. Look at most `(num_tokens - 1) // block_size`
        blocks: the last token is always computed again, because the model must produce
        its logits to sample the next token. Returns `([], 0)` when caching is disabled.
        Nothing is taken yet: `allocate_slots` takes the blocks if the request is admitted.
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        computed: list[KVCacheBlock] = []
        for block_hash in self.block_hashes(request)[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            computed.append(block)
        return computed, len(computed) * self.block_size

    # exercise[ch04-allocate-slots]: need cdiv(num_computed_tokens + num_new_tokens, block_size); new_computed_blocks count as held; None if too few free; touch, take, cache
    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVCacheBlock] = ()
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens; return the ids of the blocks taken new.

        The request's blocks (`req_to_blocks[request.request_id]`) must cover its
        `num_computed_tokens + num_new_tokens` tokens afterwards. On admission
        `new_computed_blocks` are its prefix-cache hits (already counted in
        `num_computed_tokens`): they come first in its block table, and
        `self.block_pool.touch` takes them. The blocks still missing are taken from the pool
        with `get_new_blocks`. Touching a hit that nobody held takes it off the free queue,
        so such hits count against the free blocks too. Returns None, changing nothing, when
        the pool has too few free blocks; `[]` when no new block is needed. Last, full blocks
        are entered in the prefix cache: `self.cache_full_blocks(request, num_tokens)`.
        """
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_tokens_needed = request.num_computed_tokens + num_new_tokens
        num_new_blocks = cdiv(num_tokens_needed, self.block_size) - len(blocks) - len(new_computed_blocks)
        if num_new_blocks <= 0 and not new_computed_blocks:  # most decode steps: room is there
            self.cache_full_blocks(request, num_tokens_needed)
            return []
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_new_blocks, 0) + num_free_hits > self.block_pool.num_free_blocks:
            return None
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        blocks.extend(new_blocks)
        self.cache_full_blocks(request, num_tokens_needed)
        return [b.block_id for b in new_blocks]

    def free(self, request: Request) -> None:
        """Give back every block of `request` (finished, aborted or preempted)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        # Free in reverse: the tail of a sequence is evicted first, and its head — the likelier
        # prefix of someone else — stays cached longest (vLLM does the same).
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage()
# --8<-- [end:kv-cache-manager]

    # -- the prefix cache -----------------------------------------------------------------

    # --8<-- [start:cache-full-blocks]
    def block_hashes(self, request: Request) -> list[BlockHash]:
        """The hashes of the request's full blocks, extended as it grew (kept on the request)."""
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.block_hash_inputs)
        return request.block_hashes

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Enter the request's blocks that `num_tokens` tokens fill in the prefix cache.

        Called when the tokens are *scheduled*, before the forward pass computes them: a block
        found by another request in the same step is read by attention after this step's
        K/V were written (every layer writes the cache before it reads it).
        """
        if not self.enable_caching:
            return
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        num_done = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= num_done:
            return
        blocks = self.req_to_blocks[request.request_id]
        hashes = self.block_hashes(request)
        self.block_pool.cache_full_blocks(blocks[num_done:num_full], hashes[num_done:num_full])
        self.num_cached_blocks[request.request_id] = num_full
    # --8<-- [end:cache-full-blocks]

    def record_admission(self, request: Request, num_hit_tokens: int, num_cpu_hit_tokens: int = 0) -> None:
        """Count one admission's lookup in the prefix-cache statistics."""
        if not self.enable_caching:
            return
        stats = self.prefix_cache_stats
        stats.num_requests += 1
        stats.num_query_tokens += request.num_tokens
        stats.num_hit_tokens += num_hit_tokens
        stats.num_cpu_hit_tokens += num_cpu_hit_tokens

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (and the CPU tier); False while any block is held."""
        return self.block_pool.reset_prefix_cache()

    # -- KV offloading (the CPU tier) ---------------------------------------------------------

    # --8<-- [start:offloaded-prefix]
    def get_offloaded_prefix(self, request: Request, num_gpu_hit_blocks: int) -> list[BlockHash]:
        """The hashes that continue a GPU prefix hit from the CPU tier, in order.

        Same rules as `get_computed_blocks`: consecutive from where the GPU hit stopped, and
        never the block holding the last token.
        """
        if self.offload_tier is None:
            return []
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in self.block_hashes(request)[num_gpu_hit_blocks:max_hit_blocks]:
            if block_hash not in self.offload_tier:
                break
            hits.append(block_hash)
        return hits

    def load_offloaded_blocks(self, request: Request, first_block: int, block_hashes: list[BlockHash]) -> None:
        """Copy CPU-tier hits into the request's blocks `first_block`, `first_block + 1`, ...

        Call after `allocate_slots` gave the request those blocks; the copies run in the
        worker before this step's forward pass.
        """
        blocks = self.req_to_blocks[request.request_id]
        for i, block_hash in enumerate(block_hashes):
            self.offload_tier.load(block_hash, blocks[first_block + i].block_id)

    def swap_out(self, request: Request) -> None:
        """Swap preemption: copy the request's full, cached blocks to the CPU tier now.

        Its partly filled last block has no hash, so it is recomputed when the request resumes.
        """
        if self.offload_tier is None:
            return
        for block in self.req_to_blocks.get(request.request_id, []):
            if block.block_hash is not None:
                self.offload_tier.store(block.block_hash, block.block_id)

    def take_kv_transfers(self):  # -> KVTransfers | None
        """This step's GPU ↔ CPU copies, for the SchedulerOutput (None without a CPU tier)."""
        return self.offload_tier.take_transfers() if self.offload_tier is not None else None
    # --8<-- [end:offloaded-prefix]


def make_kv_cache_manager(config, num_gpu_blocks: int) -> KVCacheManager:  # config: EngineConfig
    """The engine's manager: caching as configured, and a CPU tier of `kv_offloading_size` GiB."""
    from minivllm.kv_cache.offload import num_cpu_blocks

    cache = config.cache_config
    cache.num_cpu_blocks = num_cpu_blocks(config)
    return KVCacheManager(num_gpu_blocks, cache.block_size, cache.enable_prefix_caching, cache.num_cpu_blocks)


def prefix_cache_stats(manager: KVCacheManager) -> dict[str, int]:
    """The prefix-cache fields of `EngineCoreStats`."""
    stats = manager.prefix_cache_stats
    tier = manager.offload_tier
    return {
        "prefix_cache_queries": stats.num_query_tokens,
        "prefix_cache_hits": stats.num_hit_tokens,
        "prefix_cache_cpu_hits": stats.num_cpu_hit_tokens,
        "num_cached_blocks": len(manager.block_pool.cached_block_hash_to_block),
        "num_offloaded_blocks": len(tier.hash_to_cpu_block) if tier is not None else 0,
    }
