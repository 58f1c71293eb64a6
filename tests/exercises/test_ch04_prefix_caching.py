"""Chapter 04 exercises: prefix caching — the block hash chain, the LRU free queue, touching a
cached block, and finding a request's cached prefix.

Every call goes through its module or class (`block_hash.hash_block_tokens`,
`free_queue.FreeKVCacheBlockQueue`, `block_pool.BlockPool`, `manager.KVCacheManager`), so
`minivllm exercise check 04` can swap your functions in. The last test runs the real engine
with your piece in it: caching on must give the tokens of caching off.
"""

from __future__ import annotations

import hashlib
import random
from array import array

import pytest

from conftest import TEST_DEVICE
from hf_reference import TINY_CONFIGS, make_tiny_model
from minivllm import LLM, SamplingParams
from minivllm.kv_cache import block_hash, block_pool, free_queue, manager
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams as Params

# -- hash_block_tokens ----------------------------------------------------------------------------


@pytest.mark.exercise("ch04-block-hash")
def test_a_block_hash_is_sha256_of_parent_tokens_and_extra_keys():
    want = hashlib.sha256(block_hash.NONE_HASH + array("q", [5, 6, 7]).tobytes() + b"None").digest()
    assert block_hash.hash_block_tokens(block_hash.NONE_HASH, [5, 6, 7]) == want, (
        "feed sha256 the parent hash, the token ids as 64-bit integers, then repr(extra_keys)"
    )
    assert len(block_hash.hash_block_tokens(block_hash.NONE_HASH, [1])) == 32, "the digest is 32 bytes"


@pytest.mark.exercise("ch04-block-hash")
def test_equal_inputs_give_equal_hashes_and_any_change_changes_the_hash():
    h = block_hash.hash_block_tokens
    base = h(block_hash.NONE_HASH, [1, 2, 3, 4])
    assert h(block_hash.NONE_HASH, [1, 2, 3, 4]) == base, "the same block must hash the same every time"
    assert h(block_hash.NONE_HASH, [1, 2, 3, 5]) != base, "one token changed: a different block"
    assert h(block_hash.NONE_HASH, [4, 3, 2, 1]) != base, "order matters"
    assert h(base, [1, 2, 3, 4]) != base, "the same tokens after a different parent are a different block"
    assert h(block_hash.NONE_HASH, [1, 2, 3, 4], (None, (), "salt")) != base, "extra keys (here a cache salt) change it"
    assert h(block_hash.NONE_HASH, [1, 2, 3, 4], (7, (), None)) != h(block_hash.NONE_HASH, [1, 2, 3, 4], (8, (), None))
    assert h(block_hash.NONE_HASH, [300]) != h(block_hash.NONE_HASH, [44, 1]), "token ids must not run together"


@pytest.mark.exercise("ch04-block-hash")
def test_the_chain_makes_a_block_depend_on_every_block_before_it():
    hashes_a: list[bytes] = []
    hashes_b: list[bytes] = []
    inputs = block_hash.BlockHashInputs()
    block_hash.extend_block_hashes(hashes_a, [1, 2, 3, 4, 5, 6, 7], 3, inputs)
    block_hash.extend_block_hashes(hashes_b, [9, 2, 3, 4, 5, 6, 7], 3, inputs)
    assert len(hashes_a) == 2, "7 tokens in blocks of 3: two full blocks are hashed, the partial one is not"
    assert hashes_a[1] != hashes_b[1], "the second blocks hold the same tokens, but the first blocks differ"


# -- FreeKVCacheBlockQueue.remove ------------------------------------------------------------------


def queue_of(n: int) -> tuple[free_queue.FreeKVCacheBlockQueue, list[free_queue.KVCacheBlock]]:
    blocks = [free_queue.KVCacheBlock(i) for i in range(n)]
    return free_queue.FreeKVCacheBlockQueue(blocks), blocks


@pytest.mark.exercise("ch04-free-queue-remove")
def test_remove_takes_a_block_out_of_the_middle_and_keeps_the_order():
    queue, blocks = queue_of(5)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4], "the others keep their order"
    assert len(queue) == 4, "one block fewer"
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None, "a removed block has no links"
    assert blocks[1].next_free_block is blocks[3] and blocks[3].prev_free_block is blocks[1], "its neighbours now link to each other"


@pytest.mark.exercise("ch04-free-queue-remove")
def test_remove_works_at_both_ends_and_on_the_last_block():
    queue, blocks = queue_of(3)
    queue.remove(blocks[0])
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [1], "front and back can be removed"
    queue.remove(blocks[1])
    assert len(queue) == 0 and list(queue) == [], "the queue is empty"
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [2], "the sentinels must still be linked correctly"


@pytest.mark.exercise("ch04-free-queue-remove")
def test_popleft_and_append_after_removals_keep_lru_order():
    queue, blocks = queue_of(6)
    queue.remove(blocks[0])
    queue.remove(blocks[3])
    queue.append(blocks[0])
    assert queue.popleft() is blocks[1], "popleft uses remove: the new front is block 1"
    assert [b.block_id for b in queue] == [2, 4, 5, 0]


@pytest.mark.exercise("ch04-free-queue-remove")
def test_removing_a_block_that_is_not_free_is_an_error():
    queue, blocks = queue_of(3)
    queue.remove(blocks[1])
    with pytest.raises(ValueError):
        queue.remove(blocks[1])
    assert len(queue) == 2 and [b.block_id for b in queue] == [0, 2], "a refused remove changes nothing"


# -- BlockPool.touch ---------------------------------------------------------------------------------


@pytest.mark.exercise("ch04-touch")
def test_touch_takes_free_cached_blocks_out_of_the_queue_wherever_they_are():
    pool = block_pool.BlockPool(6, enable_caching=True)
    held = pool.get_new_blocks(6)
    pool.free_blocks([held[4], held[1], held[3]])  # free queue: 4, 1, 3
    pool.touch([held[1]])
    assert [b.block_id for b in pool.free_block_queue] == [4, 3], "block 1 left the middle of the queue"
    assert held[1].ref_cnt == 1 and pool.num_free_blocks == 2


@pytest.mark.exercise("ch04-touch")
def test_touch_adds_a_holder_to_blocks_already_held():
    pool = block_pool.BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.touch(blocks)
    assert [b.ref_cnt for b in blocks] == [2, 2], "a block already held gains one more holder"
    assert pool.num_free_blocks == 2, "held blocks were never in the free queue"
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 2, "one holder is left each: still not free"


# -- KVCacheManager.get_computed_blocks ----------------------------------------------------------------


def admit(kv: manager.KVCacheManager, request: Request) -> None:
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    request.num_computed_tokens = num_hit_tokens
    assert kv.allocate_slots(request, request.num_tokens - num_hit_tokens, hits) is not None
    request.num_computed_tokens = request.num_tokens


@pytest.mark.exercise("ch04-computed-blocks")
def test_computed_blocks_are_the_longest_cached_run_of_leading_blocks():
    kv = manager.KVCacheManager(num_blocks=12, block_size=3, enable_caching=True)
    admit(kv, Request("a", list(range(10, 20)), Params()))  # 10 tokens: 3 full blocks cached
    hits, num_tokens = kv.get_computed_blocks(Request("b", list(range(10, 19)) + [0, 0, 0, 0], Params()))
    assert [b.block_id for b in hits] == [0, 1, 2] and num_tokens == 9, "b starts with a's three full blocks"
    hits, num_tokens = kv.get_computed_blocks(Request("c", list(range(10, 16)) + [1, 1, 1, 1, 1], Params()))
    assert [b.block_id for b in hits] == [0, 1] and num_tokens == 6, "c parts from a in its third block"
    assert kv.get_computed_blocks(Request("d", [0] + list(range(11, 20)), Params())) == ([], 0), (
        "d's first block differs: nothing after it can match either"
    )


@pytest.mark.exercise("ch04-computed-blocks")
def test_the_block_with_the_last_token_is_never_a_hit():
    kv = manager.KVCacheManager(num_blocks=12, block_size=3, enable_caching=True)
    admit(kv, Request("a", list(range(10, 22)), Params()))  # 12 tokens: 4 full blocks
    hits, num_tokens = kv.get_computed_blocks(Request("b", list(range(10, 22)), Params()))
    assert num_tokens == 9 and len(hits) == 3, "the same 12 tokens: the last block holds the last token, so 3 blocks"
    hits, num_tokens = kv.get_computed_blocks(Request("c", list(range(10, 20)), Params()))
    assert num_tokens == 9, "10 tokens: the 3 blocks before the last token"


@pytest.mark.exercise("ch04-computed-blocks")
def test_no_hit_when_caching_is_off_and_nothing_is_taken():
    kv = manager.KVCacheManager(num_blocks=8, block_size=2, enable_caching=False)
    admit(kv, Request("a", [1, 2, 3, 4, 5], Params()))
    assert kv.get_computed_blocks(Request("b", [1, 2, 3, 4, 5], Params())) == ([], 0)
    on = manager.KVCacheManager(num_blocks=8, block_size=2, enable_caching=True)
    admit(on, Request("a", [1, 2, 3, 4, 5], Params()))
    free_before = on.num_free_blocks
    on.get_computed_blocks(Request("b", [1, 2, 3, 4, 5], Params()))
    assert on.num_free_blocks == free_before and [b.ref_cnt for b in on.block_pool.blocks[:2]] == [1, 1], (
        "a lookup only looks: allocate_slots takes the blocks"
    )


# -- the engine, with your piece in it ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize(
    "exercise_id",
    [pytest.param(e, marks=pytest.mark.exercise(e), id=e)
     for e in ["ch04-block-hash", "ch04-free-queue-remove", "ch04-touch", "ch04-computed-blocks"]],
)
def test_the_engine_with_caching_matches_the_engine_without(tiny_llama, exercise_id):
    rng = random.Random(9)
    vocab = TINY_CONFIGS["llama"]["vocab_size"]
    system = [rng.randrange(2, vocab) for _ in range(14)]
    batches = [[system + [rng.randrange(2, vocab) for _ in range(n)] for n in (2, 6)], [system + [5, 6, 7]], [system]]
    results = {}
    for caching in (False, True):
        llm = LLM(str(tiny_llama), skip_tokenizer_init=True, device=TEST_DEVICE, dtype="float32", block_size=3,
                  num_gpu_blocks_override=16, max_num_batched_tokens=8, max_model_len=30, enable_prefix_caching=caching)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, detokenize=False)
        outs = [o for batch in batches for o in llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)]
        results[caching] = ([o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs])
    assert results[True][0] == results[False][0], f"with your {exercise_id}, caching changed the generated tokens"
    assert results[True][1][2:] == [12, 12], (
        f"with your {exercise_id}, the later requests should find the 14-token system prompt's 4 full blocks cached"
    )
