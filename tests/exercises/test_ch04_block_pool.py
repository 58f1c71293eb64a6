"""Chapter 04 exercises: the block pool and the KV cache manager.

`BlockPool` hands out block ids from a free queue and takes them back; `KVCacheManager` gives
each request just enough blocks for its tokens. Pools here are small and odd-sized so that
they run full, and block sizes are chosen so that token counts fall mid-block.

Every call goes through the class (`block_pool.BlockPool`, `manager.KVCacheManager`), so
`minivllm exercise check 04` can swap your methods in.
"""

from __future__ import annotations

import pytest

from minivllm.config import SchedulerConfig
from minivllm.engine.types import EngineCoreRequest
from minivllm.kv_cache import block_pool, manager
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler import scheduler as scheduler_module


def free_ids(pool: block_pool.BlockPool) -> list[int]:
    """The free queue, front first, as block ids."""
    return [b.block_id for b in pool.free_block_queue]


def make_request(request_id: str, num_computed_tokens: int = 0) -> Request:
    request = Request(request_id, [1, 2, 3], SamplingParams())
    request.num_computed_tokens = num_computed_tokens
    return request


# -- BlockPool.get_new_blocks -----------------------------------------------------------------


@pytest.mark.exercise("ch04-get-new-blocks")
def test_new_blocks_come_off_the_front_of_the_free_queue_each_held_once():
    pool = block_pool.BlockPool(7)
    first = pool.get_new_blocks(3)
    assert [b.block_id for b in first] == [0, 1, 2], "blocks are taken from the front of the free queue"
    assert all(b.ref_cnt == 1 for b in first), "a block just handed out is held by exactly one request"
    assert pool.num_free_blocks == 4 and free_ids(pool) == [3, 4, 5, 6], "taken blocks leave the free queue"
    second = pool.get_new_blocks(2)
    assert [b.block_id for b in second] == [3, 4]
    assert all(b is pool.blocks[b.block_id] for b in first + second), "hand out the pool's own KVCacheBlock objects"


@pytest.mark.exercise("ch04-get-new-blocks")
def test_freed_blocks_are_handed_out_again_in_free_queue_order():
    pool = block_pool.BlockPool(6)
    blocks = pool.get_new_blocks(6)
    pool.free_blocks([blocks[4], blocks[1]])  # the reference free_blocks: 4 then 1 join the back
    again = pool.get_new_blocks(2)
    assert [b.block_id for b in again] == [4, 1], "the free queue is first in, first out"
    assert all(b.ref_cnt == 1 for b in again)


@pytest.mark.exercise("ch04-get-new-blocks")
def test_asking_for_more_blocks_than_are_free_raises_and_takes_nothing():
    pool = block_pool.BlockPool(5)
    pool.get_new_blocks(3)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2, "a refused request must not take any block"
    assert free_ids(pool) == [3, 4], "a refused request must leave the free queue as it was"
    assert all(pool.blocks[i].ref_cnt == 0 for i in (3, 4))


@pytest.mark.exercise("ch04-get-new-blocks")
def test_the_last_free_blocks_can_be_taken_then_the_pool_is_empty():
    pool = block_pool.BlockPool(4)
    assert pool.get_new_blocks(0) == [], "asking for no block gives an empty list"
    assert [b.block_id for b in pool.get_new_blocks(4)] == [0, 1, 2, 3], "every block can be handed out"
    assert pool.num_free_blocks == 0 and pool.usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


# -- BlockPool.free_blocks --------------------------------------------------------------------


@pytest.mark.exercise("ch04-free-blocks")
def test_freed_blocks_join_the_back_of_the_free_queue_in_the_order_given():
    pool = block_pool.BlockPool(8)
    blocks = pool.get_new_blocks(5)  # 5, 6, 7 stay free
    pool.free_blocks([blocks[3], blocks[0]])
    assert free_ids(pool) == [5, 6, 7, 3, 0], "freed blocks go to the back, in the order they were given"
    assert blocks[3].ref_cnt == 0 and blocks[0].ref_cnt == 0
    assert [b.ref_cnt for b in (blocks[1], blocks[2], blocks[4])] == [1, 1, 1], "blocks not freed stay held"


@pytest.mark.exercise("ch04-free-blocks")
def test_a_block_held_twice_is_free_only_when_both_holders_let_go():
    pool = block_pool.BlockPool(3)
    block = pool.get_new_blocks(1)[0]
    block.ref_cnt += 1  # a second holder, as a shared prefix block will have with prefix caching
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and block.block_id not in free_ids(pool), "one holder is left: the block is not free"
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and free_ids(pool) == [1, 2, 0], "the last holder let go: the block is free"


@pytest.mark.exercise("ch04-free-blocks")
def test_freeing_every_block_makes_the_whole_pool_free_again():
    pool = block_pool.BlockPool(5)
    blocks = pool.get_new_blocks(5)
    assert pool.num_free_blocks == 0
    pool.free_blocks(list(reversed(blocks)))
    assert pool.num_free_blocks == 5 and pool.usage() == 0.0
    assert free_ids(pool) == [4, 3, 2, 1, 0]
    assert all(b.ref_cnt == 0 for b in blocks)


# -- KVCacheManager.allocate_slots ------------------------------------------------------------


@pytest.mark.exercise("ch04-allocate-slots")
def test_a_new_request_gets_just_enough_blocks_for_its_tokens():
    kv = manager.KVCacheManager(num_blocks=9, block_size=4)
    new_ids = kv.allocate_slots(make_request("a"), 10)
    assert new_ids == [0, 1, 2], "10 tokens in blocks of 4 need 3 blocks, no more"
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 6


@pytest.mark.exercise("ch04-allocate-slots")
def test_a_decoding_request_gets_a_block_only_when_its_last_block_is_full():
    block_size = 4
    kv = manager.KVCacheManager(num_blocks=20, block_size=block_size)
    request = make_request("a")
    assert kv.allocate_slots(request, 5) == [0, 1]
    request.num_computed_tokens = 5
    for num_tokens in range(6, 23):  # decode one token at a time
        new_ids = kv.allocate_slots(request, 1)
        expected_new = 1 if (num_tokens - 1) % block_size == 0 else 0
        assert new_ids is not None and len(new_ids) == expected_new, (
            f"token {num_tokens}: the request held {len(kv.get_block_ids('a')) - len(new_ids or [])} blocks "
            f"of {block_size}; it needs a new one only when the old ones are full"
        )
        request.num_computed_tokens = num_tokens
        assert len(kv.get_block_ids("a")) == -(-num_tokens // block_size)


@pytest.mark.exercise("ch04-allocate-slots")
def test_a_prompt_chunk_that_starts_mid_block_gets_only_the_missing_blocks():
    kv = manager.KVCacheManager(num_blocks=10, block_size=5)
    request = make_request("a")
    kv.allocate_slots(request, 3)  # a first chunk of 3 tokens: 1 block, 2 slots left in it
    request.num_computed_tokens = 3
    new_ids = kv.allocate_slots(request, 9)  # tokens 3..11: 12 tokens need 3 blocks in all
    assert new_ids == [1, 2], "the chunk fills the rest of block 0, then needs 2 more blocks"
    assert kv.get_block_ids("a") == [0, 1, 2], "new blocks are appended to the request's block table"


@pytest.mark.exercise("ch04-allocate-slots")
def test_when_the_pool_runs_full_allocation_fails_and_takes_nothing():
    kv = manager.KVCacheManager(num_blocks=5, block_size=4)
    a, b = make_request("a"), make_request("b")
    assert kv.allocate_slots(a, 13) == [0, 1, 2, 3], "13 tokens need 4 blocks"
    a.num_computed_tokens = 13
    assert kv.allocate_slots(b, 7) is None, "b needs 2 blocks, only 1 is free: refuse"
    assert kv.num_free_blocks == 1, "a refused allocation must take no block"
    assert kv.get_block_ids("b") == [], "a refused allocation gives the request no block"
    assert kv.allocate_slots(b, 4) == [4], "4 tokens fit in the last free block"
    assert kv.num_free_blocks == 0
    assert kv.allocate_slots(a, 3) == [], "a's 4th block still has room for 3 tokens: no block needed, even from an empty pool"
    a.num_computed_tokens = 16
    assert kv.allocate_slots(a, 1) is None, "a's blocks are full and the pool is empty: refuse"
    assert kv.get_block_ids("a") == [0, 1, 2, 3]


@pytest.mark.exercise("ch04-allocate-slots")
def test_blocks_freed_by_one_request_go_to_the_next():
    kv = manager.KVCacheManager(num_blocks=3, block_size=2)
    a, b = make_request("a"), make_request("b")
    assert kv.allocate_slots(a, 6) == [0, 1, 2]
    assert kv.allocate_slots(b, 1) is None, "the pool is full"
    kv.free(a)
    assert sorted(kv.allocate_slots(b, 5)) == [0, 1, 2], "a's blocks, freed, are handed to b"


@pytest.mark.exercise("ch04-allocate-slots")
def test_the_scheduler_preempts_when_allocate_slots_says_no():
    # 6 blocks of 3 tokens. Two 9-token prompts fill 3 blocks each; the first decode of each
    # needs a 4th block and the pool is empty, so the later request must be preempted.
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, enable_chunked_prefill=True, max_model_len=18)
    s = scheduler_module.Scheduler(config, manager.KVCacheManager(num_blocks=6, block_size=3))
    for request_id in "ab":
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        s.add_request(EngineCoreRequest(request_id, list(range(10, 19)), params, 0.0))
    first = s.schedule()
    assert first.num_scheduled_tokens == {"a": 9, "b": 9}
    assert s.kv_cache_manager.num_free_blocks == 0, "3 blocks each: the pool is full"
    for request_id in "ab":
        s.requests[request_id].append_output_token(7)  # what update_from_output does with a sampled token
    second = s.schedule()
    assert second.preempted_req_ids == {"b"}, "a needs a 4th block; the only way to get one is to preempt b"
    assert second.num_scheduled_tokens == {"a": 1}
    assert len(s.kv_cache_manager.get_block_ids("a")) == 4 and s.kv_cache_manager.get_block_ids("b") == []
