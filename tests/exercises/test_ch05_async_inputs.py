"""Chapter 05 exercise: with async scheduling, which input tokens come from the last step.

Step n + 1 is prepared while step n still runs, so a decode whose input is step n's sampled
token finds it only on the device. `inputs_from_last_step` names those decodes and where their
token sits; the model runner stages them as negative token ids, which the unpacking of the
step's inputs resolves on the device. Called through its module, as the
model runner calls it; the last test runs whole engines with it.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from conftest import TEST_DEVICE
from hf_reference import make_tiny_model
from minivllm import LLM, SamplingParams
from minivllm.executor import model_runner


@pytest.mark.exercise("ch05-inputs-from-last-step")
def test_only_positions_the_row_does_not_hold_come_from_the_device():
    positions = np.array([7, 12, 3, 40])
    known = np.array([7, 13, 3, 39])  # decode 1 has its token on the host; decode 3 is past its row
    rows = {"a": 2, "c": 0, "d": 5, "b": 1}
    dst, src = model_runner.inputs_from_last_step(positions, known, ["a", "b", "c", "d"], rows)
    assert dst.tolist() == [0, 2, 3] and src.tolist() == [2, 0, 5]
    assert dst.dtype == np.int64 and src.dtype == np.int64, "they become index tensors on the device"


@pytest.mark.exercise("ch05-inputs-from-last-step")
def test_a_synchronous_step_needs_nothing_from_the_device():
    dst, src = model_runner.inputs_from_last_step(np.array([4, 9]), np.array([5, 10]), ["x", "y"], {})
    assert len(dst) == 0 and len(src) == 0
    dst, src = model_runner.inputs_from_last_step(np.array([], dtype=np.int64), np.array([], dtype=np.int64), [], {})
    assert len(dst) == 0 and len(src) == 0, "a step without decodes"


@pytest.mark.exercise("ch05-inputs-from-last-step")
def test_an_overlapped_engine_generates_the_synchronous_tokens(tmp_path):
    folder = str(make_tiny_model("qwen3", tmp_path / "qwen3"))
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 400) for _ in range(n)]} for n in (4, 19, 11)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)

    def tokens(async_scheduling: bool) -> list[list[int]]:
        llm = LLM(folder, skip_tokenizer_init=True, device=TEST_DEVICE, dtype="float32", num_gpu_blocks_override=64,
                  async_scheduling=async_scheduling)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    assert tokens(True) == tokens(False), "a decode read the wrong input token"
