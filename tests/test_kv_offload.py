"""KV offloading (chapter 04): the CPU tier's bookkeeping, its copies, and identical outputs.

An evicted cached block is copied to the CPU tier and copied back on a later hit instead of
being recomputed; swap preemption copies a victim's blocks out at once. The engine tests run
a tiny random-weight Llama with a GPU cache too small to keep the shared prefixes, so that the
hits must come from the CPU tier, and demand the tokens of a run without offloading.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import TEST_DEVICE
from hf_reference import TINY_CONFIGS, make_tiny_model
from minivllm import LLM, SamplingParams
from minivllm.config import SchedulerConfig
from minivllm.engine.types import EngineCoreRequest
from minivllm.kv_cache.manager import KVCacheManager
from minivllm.kv_cache.offload import CPUKVCache, CPUOffloadTier, KVTransfers, cpu_block_runs
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams as Params
from minivllm.scheduler.scheduler import Scheduler

H = [bytes([i]) * 32 for i in range(10)]  # stand-in block hashes


# -- the tier's bookkeeping -------------------------------------------------------------------------


def test_the_tier_stores_in_order_and_evicts_the_least_recently_used():
    tier = CPUOffloadTier(num_cpu_blocks=3)
    for i in range(3):
        assert tier.store(H[i], gpu_block_id=10 + i)
    assert tier.take_transfers().gpu_to_cpu == [(10, 0), (11, 1), (12, 2)]
    assert tier.store(H[0], 20) and not tier.pending, "a hash already stored is not copied again"
    tier.store(H[3], 13)  # full: H[1] is now the least recently used (H[0] was refreshed)
    assert H[1] not in tier and H[0] in tier and tier.hash_to_cpu_block[H[3]] == 1
    assert tier.take_transfers().gpu_to_cpu == [(13, 1)]


def test_a_cpu_block_read_this_step_is_not_overwritten_in_the_same_step():
    tier = CPUOffloadTier(num_cpu_blocks=2)
    tier.store(H[0], 5)
    tier.store(H[1], 6)
    tier.take_transfers()
    tier.load(H[0], gpu_block_id=9)  # H[0] becomes the most recent; H[1] the LRU
    tier.load(H[1], gpu_block_id=8)
    assert tier.store(H[2], 7) is False, "both CPU blocks are read by this step's loads: nothing may be evicted"
    transfers = tier.take_transfers()
    assert transfers.cpu_to_gpu == [(0, 9), (1, 8)] and transfers.gpu_to_cpu == []
    assert tier.store(H[2], 7), "next step the blocks are free to reuse"


def test_cpu_block_runs_group_consecutive_cpu_blocks():
    pairs = [(2, 40), (0, 17), (1, 3), (7, 1), (8, 2), (5, 9)]  # (cpu block, gpu block)
    assert cpu_block_runs(pairs) == [(0, [17, 3, 40]), (5, [9]), (7, [1, 2])], "sorted by CPU block, cut at gaps"
    assert cpu_block_runs([]) == []


def test_cpu_kv_cache_copies_blocks_out_and_back():
    torch.manual_seed(0)
    gpu = [torch.randn(2, 6, 4, 2, 3) for _ in range(2)]  # 2 layers, 6 blocks of 4 tokens
    original = [c.clone() for c in gpu]
    cpu = CPUKVCache(gpu, num_cpu_blocks=4)
    cpu.execute(KVTransfers(gpu_to_cpu=[(1, 0), (2, 1), (4, 3)]))
    for c in gpu:
        c.zero_()
    # Load back into other GPU blocks; store block 5 in the same step, before the loads.
    cpu.execute(KVTransfers(gpu_to_cpu=[(5, 2)], cpu_to_gpu=[(0, 3), (1, 4), (3, 0)]))
    for layer, (now, before) in enumerate(zip(gpu, original)):
        assert torch.equal(now[:, 3], before[:, 1]) and torch.equal(now[:, 4], before[:, 2]), f"layer {layer}: K/V lost in the round trip"
        assert torch.equal(now[:, 0], before[:, 4])
        assert torch.equal(cpu.cpu_kv_caches[layer][:, 2], torch.zeros_like(before[:, 5])), "block 5 was zero when stored"


# -- the manager and scheduler: evictions go to the tier, hits come back ------------------------


def admit(manager: KVCacheManager, request: Request) -> None:
    hits, num_hit_tokens = manager.get_computed_blocks(request)
    request.num_computed_tokens = num_hit_tokens
    assert manager.allocate_slots(request, request.num_tokens - num_hit_tokens, hits) is not None
    request.num_computed_tokens = request.num_tokens


def test_an_evicted_cached_block_is_found_in_the_tier():
    manager = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True, num_cpu_blocks=8)
    a = Request("a", [1, 2, 3, 4, 5], Params())  # blocks 0, 1 full and cached, 2 partial
    admit(manager, a)
    manager.free(a)
    admit(manager, Request("b", [9, 9, 8, 8, 7, 7, 6], Params()))  # 4 blocks: evicts both of a's
    transfers = manager.take_kv_transfers()
    assert transfers.gpu_to_cpu == [(1, 0), (0, 1)], (
        "a's tail block (1) is evicted first, then its head (0): they go to CPU blocks 0 and 1"
    )
    again = Request("a2", [1, 2, 3, 4, 5], Params())
    assert manager.get_computed_blocks(again) == ([], 0), "nothing of a is left in the GPU cache"
    assert manager.get_offloaded_prefix(again, 0) == again.block_hashes[:2], "both full blocks are in the CPU tier"


def test_the_scheduler_loads_cpu_hits_into_new_blocks_and_counts_them():
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32)
    s = Scheduler(config, KVCacheManager(num_blocks=6, block_size=2, enable_caching=True, num_cpu_blocks=8))
    params = Params(max_tokens=1, ignore_eos=True)
    s.add_request(EngineCoreRequest("a", [1, 2, 3, 4, 5], params, 0.0))
    s.schedule()
    s.finish_requests(["a"], s.requests["a"].status.FINISHED_LENGTH_CAPPED)
    s.add_request(EngineCoreRequest("b", list(range(10, 21)), params, 0.0))  # 6 blocks: evicts everything
    so = s.schedule()
    assert len(so.kv_transfers.gpu_to_cpu) == 2, "a's two cached blocks are stored as they are evicted"
    s.finish_requests(["b"], s.requests["b"].status.FINISHED_LENGTH_CAPPED)
    s.add_request(EngineCoreRequest("c", [1, 2, 3, 4, 5, 6], params, 0.0))
    so = s.schedule()
    new_c = so.scheduled_new_reqs[0]
    assert new_c.num_computed_tokens == 4 and so.num_scheduled_tokens["c"] == 2, "4 tokens come from the CPU tier"
    assert [dst for _, dst in so.kv_transfers.cpu_to_gpu] == new_c.block_ids[:2], "loaded into c's first two blocks"
    stats = s.kv_cache_manager.prefix_cache_stats
    assert stats.num_cpu_hit_tokens == 4 and stats.num_hit_tokens == 4


# -- the engine: offloading on and off give the same tokens --------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def run_engine(folder, batches, **engine_args):
    llm = LLM(str(folder), skip_tokenizer_init=True, device=TEST_DEVICE, dtype="float32", block_size=4,
              num_gpu_blocks_override=14, max_num_batched_tokens=16, max_model_len=48, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, detokenize=False)
    outputs = []
    for batch in batches:
        outputs += llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outputs], [o.num_cached_tokens for o in outputs]


def workload(seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(2, TINY_CONFIGS["llama"]["vocab_size"]) for _ in range(n)]  # noqa: E731
    first, second = tokens(17), tokens(17)
    # A 40-token request needs 12 of the 14 blocks: it evicts most of the prefix before it,
    # which must then come back from the CPU tier.
    return [[first + tokens(3)], [tokens(40)], [first + tokens(4)], [second + tokens(5), second + tokens(2)],
            [tokens(40)], [second + tokens(6)]]


def test_offloading_on_and_off_give_the_same_tokens(tiny_llama):
    batches = workload(1)
    _, want, _ = run_engine(tiny_llama, batches, enable_prefix_caching=False)
    llm, got, cached = run_engine(tiny_llama, batches, kv_offloading_size=0.01)
    assert got == want, "tokens changed when cached blocks came back from the CPU tier"
    stats = llm.llm_engine.get_stats()
    assert stats.prefix_cache_cpu_hits > 0, f"the prefixes should have been evicted and found in the CPU tier: {stats}"
    assert cached[2] == 16 and cached[6] == 16, "each 17-token prefix (4 full blocks) comes back after the big request"


def test_swap_preemption_gives_the_same_tokens(tiny_llama):
    rng = random.Random(2)
    prompts = [[rng.randrange(2, 200) for _ in range(n)] for n in (14, 9, 17, 6, 12)]
    _, want, _ = run_engine(tiny_llama, [prompts], enable_prefix_caching=False)
    llm, got, _ = run_engine(tiny_llama, [prompts], kv_offloading_size=0.01, preemption_mode="swap")
    assert got == want, "tokens changed with swap preemption"
    core = llm.llm_engine.engine_core
    assert core.scheduler.num_preemptions > 0, "14 blocks cannot hold all five requests: preemptions"
    assert core.scheduler.kv_cache_manager.offload_tier.num_stored > 0, "victims' blocks were swapped out"


def test_offloading_settings_are_checked(tiny_llama):
    common = dict(skip_tokenizer_init=True, device=TEST_DEVICE, dtype="float32", num_gpu_blocks_override=16, max_model_len=48)
    with pytest.raises(ValueError, match="kv_offloading_size"):
        LLM(str(tiny_llama), preemption_mode="swap", **common)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(str(tiny_llama), kv_offloading_size=0.01, enable_prefix_caching=False, **common)
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(str(tiny_llama), preemption_mode="discard", **common)
