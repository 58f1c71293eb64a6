"""A stateful hypothesis test of the prefix cache (chapter 04).

Random admissions (prompts drawn from a few shared prefixes), decode steps, frees and resets
run against a small `KVCacheManager` with caching on, beside a plain model of what must hold:

- a reference count is never negative, and equals the number of requests holding the block;
- a block is never both free and owned;
- an evicted block is never reachable through its hash: every hash in the cache leads to a
  block whose contents (tracked here, token by token) still hash to it;
- the free queue is in LRU order: blocks freed earlier are evicted first, and a block taken
  back by a cache hit leaves the queue wherever it was.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minivllm.kv_cache.block_hash import BlockHashInputs, extend_block_hashes
from minivllm.kv_cache.manager import KVCacheManager
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams

NUM_BLOCKS = 11
BLOCK_SIZE = 3
PREFIXES = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 9, 9], [8, 8, 8, 8, 8, 8, 8, 8, 8]]
REQUEST_IDS = [f"r{i}" for i in range(5)]


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_caching=True)
        self.running: dict[str, Request] = {}
        self.contents: dict[int, tuple[int, ...]] = {}  # block id -> the tokens up to its end
        self.expected_free = list(range(NUM_BLOCKS))  # the LRU order the queue must have

    # -- rules ---------------------------------------------------------------------------------

    @rule(req=st.sampled_from(REQUEST_IDS), prefix=st.sampled_from(range(len(PREFIXES))),
          suffix=st.lists(st.integers(0, 3), max_size=5), salt=st.sampled_from([None, None, "s"]))
    def admit(self, req: str, prefix: int, suffix: list[int], salt: str | None) -> None:
        if req in self.running:
            return
        request = Request(req, PREFIXES[prefix] + suffix, SamplingParams(), cache_salt=salt)
        hits, num_hit_tokens = self.manager.get_computed_blocks(request)
        assert num_hit_tokens < request.num_tokens, "the last token is never a hit"
        for i, block in enumerate(hits):
            assert self.contents[block.block_id] == tuple(request.all_token_ids[: (i + 1) * BLOCK_SIZE]), (
                "a hit must hold exactly this request's tokens up to its end"
            )
        request.num_computed_tokens = num_hit_tokens
        free_before = self.manager.num_free_blocks
        new_ids = self.manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
        if new_ids is None:
            assert self.manager.num_free_blocks == free_before, "a refused admission takes nothing"
            return
        for block in hits:  # touched: out of the free queue, wherever it was
            if block.block_id in self.expected_free:
                self.expected_free.remove(block.block_id)
        self._took_new_blocks(new_ids)
        request.num_computed_tokens = request.num_tokens
        self.running[req] = request
        self._record_contents(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token: int) -> None:
        req = data.draw(st.sampled_from(sorted(self.running)))
        request = self.running[req]
        request.append_output_token(token)
        new_ids = self.manager.allocate_slots(request, 1)
        if new_ids is None:
            request.output_token_ids.pop()
            request.all_token_ids.pop()
            return
        self._took_new_blocks(new_ids)
        request.num_computed_tokens += 1
        self._record_contents(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data) -> None:
        req = data.draw(st.sampled_from(sorted(self.running)))
        blocks = list(self.manager.req_to_blocks[req])
        self.manager.free(self.running.pop(req))
        for block in reversed(blocks):
            if block.ref_cnt == 0:
                self.expected_free.append(block.block_id)

    @rule()
    def reset(self) -> None:
        was_idle = not self.running
        assert self.manager.reset_prefix_cache() is was_idle, "a reset succeeds exactly when no block is held"
        if was_idle:
            assert self.manager.block_pool.cached_block_hash_to_block == {}

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def ref_counts_match_holders(self) -> None:
        holders = {b.block_id: 0 for b in self.manager.block_pool.blocks}
        for blocks in self.manager.req_to_blocks.values():
            for block in blocks:
                holders[block.block_id] += 1
        for block in self.manager.block_pool.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has a negative reference count"
            assert block.ref_cnt == holders[block.block_id], f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {holders[block.block_id]}"

    @invariant()
    def free_means_unowned_and_lru_order_holds(self) -> None:
        free = [b.block_id for b in self.manager.block_pool.free_block_queue]
        owned = {b.block_id for blocks in self.manager.req_to_blocks.values() for b in blocks}
        assert not set(free) & owned, f"blocks both free and owned: {sorted(set(free) & owned)}"
        assert len(free) == len(set(free)) == self.manager.num_free_blocks
        assert set(free) | owned == set(range(NUM_BLOCKS)), "every block is free or owned"
        assert free == self.expected_free, f"free queue {free}, LRU order expects {self.expected_free}"

    @invariant()
    def every_cached_hash_leads_to_its_contents(self) -> None:
        pool = self.manager.block_pool
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, f"block {block.block_id} is indexed under a hash it does not carry"
            tokens = self.contents.get(block.block_id)
            assert tokens is not None and len(tokens) % BLOCK_SIZE == 0
            assert block_hash in self._possible_hashes(tokens), (
                f"block {block.block_id} was overwritten (now {tokens}) but is still found by its old hash"
            )
        for block in pool.blocks:
            if block.block_hash is not None:
                assert pool.cached_block_hash_to_block[block.block_hash] is block

    # -- helpers ---------------------------------------------------------------------------------

    def _took_new_blocks(self, new_ids: list[int]) -> None:
        assert new_ids == self.expected_free[: len(new_ids)], (
            f"new blocks {new_ids} must come off the front of the LRU order {self.expected_free}"
        )
        del self.expected_free[: len(new_ids)]
        for block_id in new_ids:
            self.contents.pop(block_id, None)  # its old K/V are being overwritten

    def _record_contents(self, request: Request) -> None:
        blocks = self.manager.req_to_blocks[request.request_id]
        for i, block in enumerate(blocks[: request.num_computed_tokens // BLOCK_SIZE]):
            self.contents[block.block_id] = tuple(request.all_token_ids[: (i + 1) * BLOCK_SIZE])

    @staticmethod
    def _possible_hashes(tokens: tuple[int, ...]) -> set[bytes]:
        """The last block's hash for these tokens, with each salt the rules may have used."""
        hashes = set()
        for salt in (None, "s"):
            chain: list[bytes] = []
            extend_block_hashes(chain, list(tokens), BLOCK_SIZE, BlockHashInputs(cache_salt=salt))
            hashes.add(chain[-1])
        return hashes


PrefixCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPrefixCache = PrefixCacheMachine.TestCase
