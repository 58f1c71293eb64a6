"""Prefix caching (chapter 04): a worked example, isolation by salt, and identical outputs.

The first tests drive the KV cache manager by hand, with exact block ids, the way vLLM's
`test_prefix_caching.py` does. The engine tests then run a tiny random-weight Llama greedily
with caching off and on, over workloads whose requests share prefixes, and demand the same
tokens: a cached block must hold exactly the K/V that recomputing it would give.
"""

from __future__ import annotations

import random

import pytest

from conftest import TEST_DEVICE
from hf_reference import TINY_CONFIGS, make_tiny_model
from minivllm import LLM, SamplingParams
from minivllm.config import SchedulerConfig
from minivllm.engine.types import EngineCoreRequest
from minivllm.kv_cache.block_hash import NONE_HASH, hash_block_tokens
from minivllm.kv_cache.manager import KVCacheManager
from minivllm.request import Request
from minivllm.scheduler.output import ModelRunnerOutput
from minivllm.scheduler.scheduler import Scheduler

BLOCK_SIZE = 4


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue]


def admit(manager: KVCacheManager, request: Request) -> tuple[list[int], int]:
    """What the scheduler does on admission: look up, then allocate the rest of the prompt."""
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    request.num_computed_tokens = num_hit_tokens
    new_ids = manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits)
    assert new_ids is not None, "test setup: the pool is too small"
    request.num_computed_tokens = request.num_tokens
    return [b.block_id for b in hits], num_hit_tokens


# -- a worked example, block by block -----------------------------------------------------------


def test_worked_example_sharing_touch_and_lru_eviction():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=True)
    shared = list(range(100, 108))  # two full blocks every request below starts with

    a = Request("a", shared + [1, 2], SamplingParams())  # 10 tokens: blocks 0, 1 full, 2 partial
    assert admit(manager, a) == ([], 0), "an empty cache has no hit"
    assert manager.get_block_ids("a") == [0, 1, 2]
    assert [manager.block_pool.blocks[i].block_hash is not None for i in (0, 1, 2)] == [True, True, False], (
        "only full blocks are cached"
    )

    b = Request("b", shared + [3, 4, 5, 6, 7], SamplingParams())  # 13 tokens
    assert admit(manager, b) == ([0, 1], 8), "b shares a's two full blocks"
    assert manager.get_block_ids("b") == [0, 1, 3, 4], "then gets blocks for its own 5 tokens"
    assert [manager.block_pool.blocks[i].ref_cnt for i in (0, 1, 2, 3, 4)] == [2, 2, 1, 1, 1]

    manager.free(a)  # reversed: 2 (now free), 1 and 0 (still held by b)
    assert free_ids(manager) == [5, 6, 7, 2]
    manager.free(b)  # reversed: 4, 3, 1, 0 join the back
    assert free_ids(manager) == [5, 6, 7, 2, 4, 3, 1, 0], "a request's tail is evicted before its head"
    assert len(manager.block_pool.cached_block_hash_to_block) == 3, "free blocks stay cached: 0, 1 and 3"

    c = Request("c", shared + [9, 9, 9], SamplingParams())  # 11 tokens
    assert admit(manager, c) == ([0, 1], 8), "free cached blocks are found again"
    assert free_ids(manager) == [6, 7, 2, 4, 3], "touch took 0 and 1 out of the middle; 5 went to c's tail"
    assert manager.get_block_ids("c") == [0, 1, 5]

    d = Request("d", list(range(200, 220)), SamplingParams())  # 20 tokens: 5 blocks, no hit
    b_third_block_hash = b.block_hashes[2]
    assert manager.block_pool.get_cached_block(b_third_block_hash).block_id == 3
    assert admit(manager, d) == ([], 0)
    assert manager.get_block_ids("d") == [6, 7, 2, 4, 3], "new blocks come off the front: least recently freed first"
    assert manager.block_pool.get_cached_block(b_third_block_hash) is None, "block 3 was evicted: its old hash finds nothing"
    assert manager.block_pool.blocks[3].block_hash == d.block_hashes[4], "block 3 was evicted and now caches d's fifth block"
    assert manager.block_pool.num_evictions == 1


def test_the_last_prompt_token_is_always_recomputed():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=True)
    prompt = list(range(50, 58))  # exactly two blocks
    admit(manager, Request("a", prompt, SamplingParams()))
    hits, num_hit_tokens = manager.get_computed_blocks(Request("b", prompt, SamplingParams()))
    assert num_hit_tokens == 4, (
        "a fully cached 8-token prompt still computes its last token (for its logits): only the first "
        "block (4 tokens) may be a hit, since the second holds the last token"
    )
    hits, num_hit_tokens = manager.get_computed_blocks(Request("c", prompt + [1], SamplingParams()))
    assert num_hit_tokens == 8, "one more token: both blocks are before the last token"


def test_hashes_chain_so_a_block_matches_only_with_its_whole_prefix():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=True)
    admit(manager, Request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams()))
    other_first_block = Request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams())
    assert manager.get_computed_blocks(other_first_block) == ([], 0), (
        "b's second block has a's tokens, but its first block differs: the chain makes it a miss"
    )
    assert hash_block_tokens(NONE_HASH, [1, 2, 3, 4]) != hash_block_tokens(NONE_HASH, [1, 2, 3, 4], ("lora", 1))


def test_different_cache_salts_never_share_blocks():
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE, enable_caching=True)
    prompt = list(range(10, 23))
    admit(manager, Request("alice", prompt, SamplingParams(), cache_salt="alice"))
    assert manager.get_computed_blocks(Request("bob", prompt, SamplingParams(), cache_salt="bob")) == ([], 0)
    assert manager.get_computed_blocks(Request("anon", prompt, SamplingParams())) == ([], 0), "no salt is a salt of its own"
    hits, num_hit_tokens = manager.get_computed_blocks(Request("alice2", prompt, SamplingParams(), cache_salt="alice"))
    assert num_hit_tokens == 12 and [b.block_id for b in hits] == manager.get_block_ids("alice")[:3], (
        "the same salt shares as usual"
    )


def test_a_hit_on_free_blocks_counts_against_the_free_pool():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE, enable_caching=True)
    a = Request("a", list(range(30, 39)), SamplingParams())  # 9 tokens, 3 blocks
    admit(manager, a)
    manager.free(a)
    b = Request("b", list(range(30, 38)) + list(range(60, 70)), SamplingParams())  # 18 tokens: 5 blocks
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    b.num_computed_tokens = num_hit_tokens
    assert manager.allocate_slots(b, b.num_tokens - num_hit_tokens, hits) is None, (
        "2 hit blocks + 3 new blocks are 5, the pool has 4: refuse"
    )
    assert manager.num_free_blocks == 4 and all(blk.ref_cnt == 0 for blk in hits), "a refusal takes nothing, not even the hits"


def test_reset_prefix_cache_waits_until_no_block_is_held():
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE, enable_caching=True)
    a = Request("a", list(range(9)), SamplingParams())
    admit(manager, a)
    assert manager.reset_prefix_cache() is False, "a running request may still need its cached blocks"
    assert len(manager.block_pool.cached_block_hash_to_block) == 2
    manager.free(a)
    assert manager.reset_prefix_cache() is True
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert manager.get_computed_blocks(Request("b", list(range(9)), SamplingParams())) == ([], 0)


# -- the scheduler: admission through the cache, and resuming after preemption ----------------


def make_scheduler(num_blocks: int) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    return Scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=True))


def add(scheduler: Scheduler, request_id: str, prompt: list[int], max_tokens: int = 16) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    scheduler.add_request(EngineCoreRequest(request_id, prompt, params, 0.0))


def step(scheduler: Scheduler, token: int = 7):
    so = scheduler.schedule()
    req_ids = list(so.num_scheduled_tokens)
    sampled = [[token] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens else [] for r in req_ids]
    return so, scheduler.update_from_output(so, ModelRunnerOutput(req_ids, sampled))


def test_admission_skips_the_cached_prefix_and_reports_it():
    s = make_scheduler(num_blocks=20)
    add(s, "a", list(range(100, 110)))
    step(s)
    add(s, "b", list(range(100, 108)) + [1, 2, 3])
    so, outputs = step(s)
    new_b = next(r for r in so.scheduled_new_reqs if r.req_id == "b")
    assert new_b.num_computed_tokens == 8 and so.num_scheduled_tokens["b"] == 3, "only b's 3 own tokens are computed"
    assert new_b.block_ids[:2] == s.kv_cache_manager.get_block_ids("a")[:2], "the runner is sent the shared blocks too"
    assert next(o for o in outputs if o.request_id == "b").num_cached_tokens == 8
    stats = s.kv_cache_manager.prefix_cache_stats
    assert (stats.num_query_tokens, stats.num_hit_tokens) == (10 + 11, 8)


def test_a_preempted_request_resumes_through_the_cache():
    # 5 blocks of 4. a and b take 2 blocks each (prompt 8); their first decodes need a 3rd.
    s = make_scheduler(num_blocks=5)
    add(s, "a", list(range(10, 18)), max_tokens=2)
    add(s, "b", list(range(20, 28)))
    step(s)
    so, _ = step(s)  # a takes the last free block; b is preempted, its 2 full blocks stay cached
    assert so.preempted_req_ids == {"b"}
    assert s.requests["b"].block_hashes, "b's block hashes are kept across preemption"
    so, _ = step(s)  # a finished last step; b resumes
    resumed = next(r for r in so.scheduled_cached_reqs if r.req_id == "b")
    assert resumed.resumed_from_preemption
    assert resumed.num_computed_tokens == 8 and so.num_scheduled_tokens == {"b": 1}, (
        "b's prompt blocks were still cached: only its one generated token is computed again"
    )


# -- the engine: caching on and off give the same tokens ---------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, TINY_CONFIGS["llama"]["vocab_size"]) for _ in range(n)]


def generate(folder, prompts, enable_prefix_caching: bool, **engine_args):
    engine_args.setdefault("num_gpu_blocks_override", 96)  # small tensors: fast to make
    engine_args.setdefault("max_model_len", 96)
    llm = LLM(str(folder), skip_tokenizer_init=True, device=TEST_DEVICE, dtype="float32",
              enable_prefix_caching=enable_prefix_caching, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, detokenize=False)
    outputs = []
    for batch in prompts:  # batches run one after another: later ones find earlier ones cached
        outputs += llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return llm, outputs


def shared_prefix_workloads(rng: random.Random) -> dict[str, list[list[list[int]]]]:
    system = random_tokens(rng, 37)
    turn1 = random_tokens(rng, 18)
    turn2 = turn1 + random_tokens(rng, 8)
    return {
        # one system prompt, several questions, all at once and then again
        "system-prompt": [[system + random_tokens(rng, n) for n in (3, 9, 14, 1)], [system + random_tokens(rng, 5)]],
        # a conversation: each turn's prompt extends the last one
        "multi-turn": [[turn1], [turn2], [turn2 + random_tokens(rng, 20)]],
        # the same prompt again, a whole number of blocks long: fully cached but the last token
        "identical": [[system[:32]], [system[:32], system[:32]]],
        # few-shot: two prefixes that share their start and then part
        "diverging": [[system[:20] + random_tokens(rng, 30), system[:20] + random_tokens(rng, 30), system + system[:9]]],
    }


@pytest.mark.parametrize("block_size", [4, 16])
def test_caching_on_and_off_give_the_same_tokens(tiny_llama, block_size):
    workloads = shared_prefix_workloads(random.Random(block_size))
    for name, batches in workloads.items():
        _, off = generate(tiny_llama, batches, False, block_size=block_size)
        llm, on = generate(tiny_llama, batches, True, block_size=block_size)
        for i, (want, got) in enumerate(zip(off, on)):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids, (
                f"{name}, request {i}, block_size={block_size}: caching changed the tokens "
                f"(num_cached_tokens={got.num_cached_tokens})"
            )
        stats = llm.llm_engine.get_stats()
        assert stats.prefix_cache_hits > 0, f"{name}: the shared prefixes should have been found in the cache"
        assert any(o.num_cached_tokens > 0 for o in on), f"{name}: some request should report cached tokens"
        assert all(o.num_cached_tokens == 0 for o in off), "without caching no token is cached"


def test_caching_on_and_off_give_the_same_tokens_under_preemption(tiny_llama):
    rng = random.Random(11)
    system = random_tokens(rng, 13)
    prompts = [[system + random_tokens(rng, n) for n in (2, 9, 5, 12, 1, 7)]]
    # 12 blocks of 4 cannot hold six ~20-token requests growing to ~26, even sharing 3 blocks.
    engine_args = dict(block_size=4, num_gpu_blocks_override=12, max_num_batched_tokens=16, max_model_len=40)
    _, off = generate(tiny_llama, prompts, False, **engine_args)
    llm, on = generate(tiny_llama, prompts, True, **engine_args)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    core = llm.llm_engine.engine_core
    assert core.scheduler.num_preemptions > 0, "the small pool should have forced preemptions"
    assert core.scheduler.kv_cache_manager.num_free_blocks == 12, "every block is free again at the end"


@pytest.mark.slow
def test_the_triton_backend_reads_cached_prefixes_too(tiny_llama):
    rng = random.Random(3)
    system = random_tokens(rng, 20)
    prompts = [[system + random_tokens(rng, 3)], [system + random_tokens(rng, 6), system + random_tokens(rng, 1)]]
    _, off = generate(tiny_llama, prompts, False, block_size=8, attention_backend="triton")
    llm, on = generate(tiny_llama, prompts, True, block_size=8, attention_backend="triton")
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert [o.num_cached_tokens for o in on] == [0, 16, 16], "the 20-token prefix fills two blocks of 8"


def test_engine_reset_prefix_cache_and_cache_salt(tiny_llama):
    rng = random.Random(5)
    prompt = random_tokens(rng, 30)
    llm = LLM(str(tiny_llama), skip_tokenizer_init=True, device=TEST_DEVICE, dtype="float32", block_size=4,
              max_model_len=64, num_gpu_blocks_override=64)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, detokenize=False)
    run = lambda **extra: llm.generate([{"prompt_token_ids": prompt, **extra}], params, use_tqdm=False)[0]  # noqa: E731
    assert run().num_cached_tokens == 0
    assert run().num_cached_tokens == 28, "the second time, the 7 full blocks before the last token are cached"
    assert run(cache_salt="tenant-1").num_cached_tokens == 0, "a salted prompt does not see unsalted blocks"
    assert run(cache_salt="tenant-1").num_cached_tokens == 28, "but sees its own"
    assert llm.reset_prefix_cache() is True
    assert run().num_cached_tokens == 0, "after a reset nothing is cached"
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": ""}], params, use_tqdm=False)
