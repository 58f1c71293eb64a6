"""Chapter 01 exercise: `LLM.generate`'s loop over engine steps.

`generate` adds every prompt as a request, then calls `_run_engine`, which steps the engine
until nothing is left and hands back one final output per request, in the order the prompts
were given. A tiny random-weight Llama runs the real engine; the requests are given different
lengths so that they finish in a different order from the one they came in.
"""

from __future__ import annotations

import pytest

from conftest import TEST_DEVICE
from hf_reference import make_tiny_model
from minivllm import LLM, SamplingParams

# Finishing order: the second (2 tokens) first, then the fourth, the third, the first.
MAX_TOKENS = [9, 2, 6, 4]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = make_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    return LLM(str(folder), skip_tokenizer_init=True, device=TEST_DEVICE, dtype="float32", max_num_batched_tokens=16)


def generate(llm: LLM, prompts: list[list[int]], max_tokens: list[int]):
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False) for n in max_tokens]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.exercise("ch01-run-engine")
def test_one_final_output_per_prompt_in_prompt_order(llm):
    prompts = [[5, 6, 7], [8, 9], list(range(10, 30)), [31]]
    outputs = generate(llm, prompts, MAX_TOKENS)
    assert len(outputs) == len(prompts), "one output per prompt, none dropped, none twice"
    assert [o.prompt_token_ids for o in outputs] == prompts, "outputs come back in the order of the prompts"
    assert all(o.finished for o in outputs), "only final outputs: a request's last one has finished set"
    assert [len(o.outputs[0].token_ids) for o in outputs] == MAX_TOKENS, "each output holds all its tokens"
    assert not llm.llm_engine.has_unfinished_requests(), "the loop runs until no request is left"


@pytest.mark.exercise("ch01-run-engine")
def test_the_same_prompts_again_give_the_same_tokens(llm):
    # Greedy decoding: a second call must start from an empty engine and repeat the first.
    prompts = [[40, 41, 42, 43], [44], [45, 46]]
    first = generate(llm, prompts, [5, 3, 7])
    second = generate(llm, prompts, [5, 3, 7])
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert [o.request_id for o in first] != [o.request_id for o in second], "each call's requests are new ones"


@pytest.mark.exercise("ch01-run-engine")
def test_a_single_prompt(llm):
    (output,) = generate(llm, [[7, 8, 9]], [3])
    assert output.finished and len(output.outputs[0].token_ids) == 3
