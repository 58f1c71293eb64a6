"""Chapter 04 exercises, in the real engine: your piece must give the same tokens as HF.

A tiny random-weight Llama (6 query heads over 2 KV heads: GQA ratio 3) generates greedily
for four prompts of different lengths. The engine runs under stress: blocks of 3 tokens, a
budget of 8 tokens per step (prompts are split into chunks), and a pool of 14 blocks that
cannot hold all four requests at full length (one is preempted and recomputed). With only
one of your functions swapped in, the tokens must equal transformers' greedy tokens.
"""

from __future__ import annotations

import random

import pytest

from conftest import TEST_DEVICE
from hf_reference import TINY_CONFIGS, hf_greedy, make_tiny_model
from minivllm import LLM, SamplingParams

PROMPT_LENGTHS = [1, 7, 13, 4]
MAX_TOKENS = 8
EXERCISES = [
    "ch04-get-new-blocks",
    "ch04-free-blocks",
    "ch04-allocate-slots",
    # ch04-slot-mapping is checked on its own (test_ch04_slot_mapping.py): the model runner
    # computes the whole batch's slots at once, chapter 05's flatten_batch (test_ch05_flatten_batch.py).
    "ch04-reshape-and-cache",
    "ch04-gather-kv",
    "ch04-prefill-attention",
    "ch04-decode-attention",
]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    rng = random.Random(4)
    vocab = TINY_CONFIGS["llama"]["vocab_size"]
    prompts = [[rng.randrange(2, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]
    expected = [run.token_ids for run in hf_greedy(folder, prompts, MAX_TOKENS, num_logprobs=1)]
    return folder, prompts, expected


@pytest.mark.parametrize(
    "exercise_id", [pytest.param(e, marks=pytest.mark.exercise(e), id=e) for e in EXERCISES]
)
def test_the_engine_under_stress_matches_hf_greedy(tiny_llama, exercise_id):
    folder, prompts, expected = tiny_llama
    llm = LLM(
        str(folder), skip_tokenizer_init=True, device=TEST_DEVICE, dtype="float32", attention_backend="torch",
        block_size=3, num_gpu_blocks_override=14, max_num_batched_tokens=8, max_model_len=30,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [out.outputs[0].token_ids for out in outputs]
    for i, (want, have) in enumerate(zip(expected, got)):
        assert have == want, (
            f"with your {exercise_id}, prompt {i} ({len(prompts[i])} tokens) generated {have}, "
            f"but transformers generates {want}"
        )
    core = llm.llm_engine.engine_core
    assert core.scheduler.num_preemptions >= 1, "the 14-block pool should have run full and forced a preemption"
    assert core.scheduler.kv_cache_manager.num_free_blocks == 14, "every block must be free once all requests finished"
