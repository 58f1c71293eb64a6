"""A stateful hypothesis test of the KV block pool and manager (chapter 04).

Random sequences of allocate / free over several requests must keep two invariants: no block
is owned by two requests (or by one request twice), and free + owned = all blocks.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from minivllm.kv_cache.manager import KVCacheManager, cdiv
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams

NUM_BLOCKS = 13  # small and odd: the pool runs full often
BLOCK_SIZE = 3


class BlockPoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.requests = {f"r{i}": Request(f"r{i}", [1], SamplingParams()) for i in range(4)}

    @rule(req=st.sampled_from(["r0", "r1", "r2", "r3"]), num_new_tokens=st.integers(1, 12))
    def allocate(self, req: str, num_new_tokens: int) -> None:
        request = self.requests[req]
        held = len(self.manager.get_block_ids(req))
        free_before = self.manager.num_free_blocks
        needed = cdiv(request.num_computed_tokens + num_new_tokens, BLOCK_SIZE) - held
        new_ids = self.manager.allocate_slots(request, num_new_tokens)
        if needed > free_before:
            assert new_ids is None, "allocation must fail when too few blocks are free"
            assert self.manager.num_free_blocks == free_before, "a failed allocation must take nothing"
        else:
            assert new_ids is not None and len(new_ids) == max(needed, 0)
            request.num_computed_tokens += num_new_tokens
            assert len(self.manager.get_block_ids(req)) * BLOCK_SIZE >= request.num_computed_tokens

    @rule(req=st.sampled_from(["r0", "r1", "r2", "r3"]))
    def free(self, req: str) -> None:
        self.manager.free(self.requests[req])
        self.requests[req].num_computed_tokens = 0
        assert self.manager.get_block_ids(req) == []

    @invariant()
    def no_block_owned_twice_and_count_conserved(self) -> None:
        owned = [b for r in self.requests for b in self.manager.get_block_ids(r)]
        assert len(owned) == len(set(owned)), f"a block is owned twice: {sorted(owned)}"
        free_ids = [b.block_id for b in self.manager.block_pool.free_block_queue]
        assert not set(owned) & set(free_ids), "a block is both free and owned"
        assert len(owned) + len(free_ids) == NUM_BLOCKS, "blocks were lost or created"


TestBlockPool = BlockPoolMachine.TestCase
