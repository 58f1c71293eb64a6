"""Async scheduling (chapter 05): step n+1 is scheduled and launched before step n reports.

The scheduler sees a step's sampled tokens one step late, so each test runs the same work
with and without async scheduling and asks for the same tokens, through chunked prefill,
preemption, stop tokens, aborts and requests whose sampling needs the host's tokens. Each also
checks that steps really overlapped (`num_overlapped_steps`), so a silent fallback to
synchronous steps fails, and that every KV block came back.
"""

from __future__ import annotations

import random

import pytest

from conftest import TEST_DEVICE
from hf_reference import make_tiny_model
from minivllm import LLM, SamplingParams
from minivllm.engine.arg_utils import EngineArgs

PROMPT_LENGTHS = [3, 17, 20, 9, 14, 6]
# Small budgets force chunked prefill (16 tokens a step) and preemption (too few blocks).
STRESS = dict(max_num_batched_tokens=16, num_gpu_blocks_override=9, block_size=4, max_model_len=32)


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    folder = make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3-async"))
    rng = random.Random(11)
    prompts = [[rng.randrange(2, 400) for _ in range(n)] for n in PROMPT_LENGTHS]
    return str(folder), prompts


def make_llm(folder: str, async_scheduling: bool, **overrides) -> LLM:
    settings = dict(skip_tokenizer_init=True, device=TEST_DEVICE, dtype="float32", num_gpu_blocks_override=64)
    settings.update(overrides)
    return LLM(folder, async_scheduling=async_scheduling, **settings)


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, **kwargs)


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.llm_engine.engine_core.get_stats()
    assert stats.num_free_blocks == stats.num_gpu_blocks, "a finished request kept KV blocks"


def overlapped(llm: LLM) -> int:
    return llm.llm_engine.engine_core.num_overlapped_steps


def test_the_same_tokens_through_chunked_prefill_and_preemption(tiny_qwen3):
    folder, prompts = tiny_qwen3
    params = [greedy(max_tokens) for max_tokens in (12, 5, 9, 1, 12, 7)]  # different ends
    expected = run(make_llm(folder, False, **STRESS), prompts, params)
    llm = make_llm(folder, True, **STRESS)
    assert run(llm, prompts, params) == expected
    core = llm.llm_engine.engine_core
    assert core.scheduler.num_preemptions > 0, "the stress settings should preempt"
    assert overlapped(llm) > 0, "no step was launched while another ran"
    assert_all_blocks_free(llm)


def test_a_stop_token_ends_the_request_at_the_same_place(tiny_qwen3):
    """The step after a stop token was already launched; its token must be dropped."""
    folder, prompts = tiny_qwen3
    free_run = run(make_llm(folder, False), prompts, [greedy(16)] * len(prompts))
    # Stop each request at its 4th token: the step launched after it computes one more.
    params = [SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[tokens[3]], detokenize=False)
              for tokens in free_run]
    expected = run(make_llm(folder, False), prompts, params)
    assert all(len(tokens) <= 4 for tokens in expected)
    llm = make_llm(folder, True)
    assert run(llm, prompts, params) == expected
    assert overlapped(llm) > 0
    assert_all_blocks_free(llm)


def test_seeded_sampling_draws_the_same_tokens(tiny_qwen3):
    folder, prompts = tiny_qwen3
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=10, ignore_eos=True, detokenize=False)
              for i in range(len(prompts))]
    expected = run(make_llm(folder, False), prompts, params)
    llm = make_llm(folder, True)
    assert run(llm, prompts, params) == expected
    assert overlapped(llm) > 0


def test_logprobs_arrive_with_their_tokens(tiny_qwen3):
    folder, prompts = tiny_qwen3

    def run_with_logprobs(async_scheduling: bool):
        llm = make_llm(folder, async_scheduling)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(6, logprobs=2), use_tqdm=False)
        return llm, [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                     for o in outputs]

    _, expected = run_with_logprobs(False)
    llm, got = run_with_logprobs(True)
    assert got == expected
    assert overlapped(llm) > 0


def test_requests_that_need_host_tokens_run_synchronous_steps(tiny_qwen3):
    """Penalties and min_tokens read the tokens so far: while such a request runs, no overlap."""
    folder, prompts = tiny_qwen3
    params = [greedy(10, repetition_penalty=1.5), greedy(10), greedy(10, min_tokens=3), greedy(10), greedy(10), greedy(10)]
    expected = run(make_llm(folder, False), prompts, params)
    llm = make_llm(folder, True)
    assert run(llm, prompts, params) == expected
    assert llm.llm_engine.engine_core.scheduler.num_requests_needing_host_tokens == 0
    assert_all_blocks_free(llm)


def test_an_abort_while_a_step_is_pending_frees_the_request(tiny_qwen3):
    folder, prompts = tiny_qwen3
    expected = run(make_llm(folder, False), prompts, [greedy(12)] * len(prompts))
    llm = make_llm(folder, True)
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, greedy(12))
    for _ in range(4):
        engine.step()
    assert engine.engine_core.pending_step is not None, "a step should be in flight"
    engine.abort_request(["2"])
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    assert "2" not in finished
    for i in range(len(prompts)):
        if i != 2:
            assert finished[str(i)] == expected[i], f"request {i}"
    assert_all_blocks_free(llm)


def test_async_scheduling_needs_the_in_process_executor(tiny_qwen3):
    folder, _ = tiny_qwen3
    args = EngineArgs(model=folder, async_scheduling=True, distributed_executor_backend="mp", device=TEST_DEVICE)
    with pytest.raises(ValueError, match="async_scheduling"):
        args.create_engine_config()
