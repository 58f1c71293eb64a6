"""Chapter 05 exercise: lay a step's scheduled tokens end to end, with positions and slots.

Each request i computes `num_scheduled_tokens[i]` new tokens this step, starting at position
`num_computed_tokens[i]`. The model sees them as one flat batch: request 0's tokens, then
request 1's, and so on. For each token the runner needs which request it belongs to, its
position, and its cache slot (chapter 04's slot mapping, done for every request at once).
The function is called through its module, as the model runner's persistent batch uses it.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.executor import gpu_input_batch, model_runner


@pytest.mark.exercise("ch05-flatten-batch")
def test_a_decode_and_a_prompt_chunk():
    # Request 0 decodes its token at position 9; request 1 computes positions 4..6 of its prompt.
    block_table = np.array([[7, 2, 6], [5, 3, 0]], dtype=np.int32)
    req_indices, positions, slots = gpu_input_batch.flatten_batch(
        np.array([9, 4]), np.array([1, 3]), block_table, block_size=4
    )
    assert req_indices.tolist() == [0, 1, 1, 1], "request 0 has one token, request 1 three, laid end to end"
    assert positions.tolist() == [9, 4, 5, 6], "each request's tokens start at its num_computed_tokens"
    assert slots.tolist() == [6 * 4 + 1, 3 * 4 + 0, 3 * 4 + 1, 3 * 4 + 2], "slot = block_table[i][p // 4] * 4 + p % 4"


@pytest.mark.exercise("ch05-flatten-batch")
def test_a_chunk_that_crosses_a_block_boundary():
    block_table = np.array([[4, 9, 1]], dtype=np.int32)
    _, positions, slots = gpu_input_batch.flatten_batch(np.array([2]), np.array([5]), block_table, block_size=3)
    assert positions.tolist() == [2, 3, 4, 5, 6]
    assert slots.tolist() == [14, 27, 28, 29, 3], "positions 3..5 are block 9, position 6 the first slot of block 1"


@pytest.mark.exercise("ch05-flatten-batch")
def test_the_result_is_int64_so_large_caches_do_not_overflow():
    block_table = np.array([[70_000_000]], dtype=np.int32)
    _, _, slots = gpu_input_batch.flatten_batch(np.array([0]), np.array([1]), block_table, block_size=64)
    assert slots.dtype == np.int64 and slots[0] == 70_000_000 * 64, "block_id * block_size exceeds int32 here"


@pytest.mark.exercise("ch05-flatten-batch")
@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.lists(st.tuples(st.integers(0, 30), st.integers(1, 12)), min_size=1, max_size=6), st.randoms())
def test_matches_the_slot_mapping_of_each_request(block_size, requests, rng):
    num_blocks = max(-(-(c + n) // block_size) for c, n in requests)
    block_table = np.array([rng.sample(range(1000), num_blocks) for _ in requests], dtype=np.int32)
    computed = np.array([c for c, _ in requests])
    scheduled = np.array([n for _, n in requests])
    req_indices, positions, slots = gpu_input_batch.flatten_batch(computed, scheduled, block_table, block_size)
    expected_slots, expected_positions, expected_reqs = [], [], []
    for i, (c, n) in enumerate(requests):
        expected_positions += range(c, c + n)
        expected_reqs += [i] * n
        expected_slots += model_runner.compute_slot_mapping(block_table[i].tolist(), range(c, c + n), block_size)
    assert req_indices.tolist() == expected_reqs
    assert positions.tolist() == expected_positions
    assert slots.tolist() == expected_slots, "the flat slots must equal chapter 04's slot mapping, request by request"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import random

    from hf_reference import TINY_CONFIGS, hf_greedy, make_tiny_model

    folder = make_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    rng = random.Random(5)
    prompts = [[rng.randrange(2, TINY_CONFIGS["llama"]["vocab_size"]) for _ in range(n)] for n in (1, 7, 13, 4)]
    return folder, prompts, [run.token_ids for run in hf_greedy(folder, prompts, 8, num_logprobs=1)]


@pytest.mark.exercise("ch05-flatten-batch")
def test_the_engine_under_stress_matches_hf_greedy(tiny_llama):
    """Your flatten_batch in the real engine: blocks of 3 tokens, 8-token steps, a preemption."""
    from conftest import TEST_DEVICE
    from minivllm import LLM, SamplingParams

    folder, prompts, expected = tiny_llama
    llm = LLM(str(folder), skip_tokenizer_init=True, device=TEST_DEVICE, dtype="float32", attention_backend="torch",
              block_size=3, num_gpu_blocks_override=14, max_num_batched_tokens=8, max_model_len=30)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    got = [out.outputs[0].token_ids for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    for i, (want, have) in enumerate(zip(expected, got)):
        assert have == want, f"with your flatten_batch, prompt {i} generated {have}, but transformers generates {want}"
