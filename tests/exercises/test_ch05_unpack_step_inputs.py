"""Chapter 05 exercise: a step's inputs out of the one buffer they travel in.

The host writes a step's arrays end to end into one int32 buffer behind a header of
(offset, length) pairs; on the device one kernel writes each array where the model reads it.
`unpack_step_inputs_reference` is that kernel's job in plain torch: the CPU path, and the
kernel's reference. Called through its module, as the stager calls it; the last test runs an
engine on it.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import TEST_DEVICE
from hf_reference import hf_greedy, make_tiny_model
from minivllm import LLM, SamplingParams
from minivllm.executor import step_inputs
from minivllm.executor.step_inputs import (
    BLOCK_TABLE_WIDTH, BLOCK_TABLES, HEADER_WORDS, INPUT_IDS, LOGITS_INDICES, POSITIONS, QUERY_START_LOC, SEQ_LENS,
    SLOT_MAPPING, StepInputStager,
)

SENTINEL = -7  # what the device buffers hold before: a value no array below contains


def device_buffers(max_tokens: int = 16, max_reqs: int = 4, max_blocks: int = 6) -> tuple[torch.Tensor, ...]:
    """The model runner's buffers, in the stager's order, their dtypes as the runner's."""
    return (
        torch.full((max_tokens,), SENTINEL, dtype=torch.int64),  # input_ids
        torch.full((max_tokens,), SENTINEL, dtype=torch.int64),  # positions
        torch.full((max_tokens,), SENTINEL, dtype=torch.int64),  # slot_mapping
        torch.full((max_reqs + 1,), SENTINEL, dtype=torch.int32),  # query_start_loc
        torch.full((max_reqs,), SENTINEL, dtype=torch.int32),  # seq_lens
        torch.full((max_reqs, max_blocks), SENTINEL, dtype=torch.int32),  # block_tables
        torch.full((max_tokens,), SENTINEL, dtype=torch.int64),  # logits_indices
    )


@pytest.mark.exercise("ch05-unpack-step-inputs")
def test_each_array_lands_in_its_buffer_and_the_rest_is_untouched():
    # Two requests: a decode at position 5 and a 3-token prompt chunk; blocks of 4 tokens.
    arrays = {INPUT_IDS: [11, 12, 13, 14], POSITIONS: [5, 0, 1, 2], SLOT_MAPPING: [29, 8, 9, 10],
              QUERY_START_LOC: [0, 1, 4], SEQ_LENS: [6, 3], BLOCK_TABLES: [3, 7, 2, 0], LOGITS_INDICES: [0, 3]}
    header = [0] * HEADER_WORDS
    body: list[int] = []
    for segment in (LOGITS_INDICES, SEQ_LENS, INPUT_IDS, BLOCK_TABLES, POSITIONS, QUERY_START_LOC, SLOT_MAPPING):
        header[2 * segment], header[2 * segment + 1] = HEADER_WORDS + len(body), len(arrays[segment])
        body += arrays[segment]  # in an order of their own: the header says where each one is
    header[BLOCK_TABLE_WIDTH] = 2
    staged = torch.tensor(header + body, dtype=torch.int32)
    buffers = device_buffers()
    step_inputs.unpack_step_inputs_reference(staged, 4, *buffers, torch.zeros(1, dtype=torch.int64))
    input_ids, positions, slots, qsl, seq_lens, block_tables, logits_indices = buffers
    assert input_ids[:4].tolist() == [11, 12, 13, 14] and positions[:4].tolist() == [5, 0, 1, 2]
    assert slots[:4].tolist() == [29, 8, 9, 10] and logits_indices[:2].tolist() == [0, 3]
    assert qsl[:3].tolist() == [0, 1, 4] and seq_lens[:2].tolist() == [6, 3]
    assert block_tables[:2, :2].tolist() == [[3, 7], [2, 0]], "two rows of width 2, at the buffer's row stride"
    assert (block_tables[:, 2:] == SENTINEL).all(), "columns past the width keep what they held"
    assert (input_ids[4:] == SENTINEL).all() and (qsl[3:] == SENTINEL).all(), "nothing past an array's length"
    assert input_ids.dtype == torch.int64 and qsl.dtype == torch.int32, "each buffer keeps its dtype"


@pytest.mark.exercise("ch05-unpack-step-inputs")
def test_a_negative_token_id_is_a_row_of_the_last_step():
    header = [0] * HEADER_WORDS
    header[2 * INPUT_IDS], header[2 * INPUT_IDS + 1] = HEADER_WORDS, 4
    staged = torch.tensor(header + [-3, 40, -1, 0], dtype=torch.int32)
    last_sampled = torch.tensor([900, 901, 902], dtype=torch.int64)
    buffers = device_buffers()
    step_inputs.unpack_step_inputs_reference(staged, 4, *buffers, last_sampled)
    assert buffers[0][:4].tolist() == [902, 40, 900, 0], "-(r + 1) is row r of the last step's tokens; 0 is a token"
    assert (buffers[1] == SENTINEL).all() and (buffers[5] == SENTINEL).all(), "empty arrays write nothing"


@pytest.mark.exercise("ch05-unpack-step-inputs")
@settings(max_examples=40, deadline=None)
@given(num_reqs=st.integers(1, 4), width=st.integers(1, 6), num_tokens=st.integers(1, 16), data=st.data())
def test_what_the_stager_writes_comes_back(num_reqs, width, num_tokens, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    stager = StepInputStager(256, torch.device("cpu"))  # on the CPU, `upload` calls the function above
    stager.start()
    expected, views = {}, {}
    for segment, length in ((INPUT_IDS, num_tokens), (POSITIONS, num_tokens), (SLOT_MAPPING, num_tokens),
                            (QUERY_START_LOC, num_reqs + 1), (SEQ_LENS, num_reqs), (LOGITS_INDICES, num_reqs)):
        expected[segment] = rng.integers(0, 2**31 - 1, length)
        views[segment] = stager.take(segment, length)
        views[segment][:] = expected[segment]
    expected[BLOCK_TABLES] = rng.integers(0, 2**31 - 1, (num_reqs, width))
    stager.take_rows(BLOCK_TABLES, num_reqs, width)[:] = expected[BLOCK_TABLES]
    # Some decodes take their token from the last step's sampled row r: staged as -(r + 1).
    pending = rng.random(num_tokens) < 0.3
    last_sampled = torch.tensor(rng.integers(0, 50_000, 8), dtype=torch.int64)
    rows = rng.integers(0, 8, num_tokens)
    views[INPUT_IDS][pending] = -(rows[pending] + 1)
    expected[INPUT_IDS] = np.where(pending, last_sampled.numpy()[rows], expected[INPUT_IDS])
    buffers = device_buffers()
    stager.upload(buffers, last_sampled)
    for segment, values in expected.items():
        target = buffers[segment]
        got = target[:num_reqs, :width] if segment == BLOCK_TABLES else target[: len(values)]
        assert got.tolist() == values.tolist(), f"array {segment}"
    assert (buffers[BLOCK_TABLES][:, width:] == SENTINEL).all() and (buffers[BLOCK_TABLES][num_reqs:] == SENTINEL).all()


@pytest.mark.exercise("ch05-unpack-step-inputs")
def test_an_engine_on_it_generates_the_reference_tokens(tmp_path):
    folder = make_tiny_model("qwen3", tmp_path / "qwen3")
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 400) for _ in range(n)] for n in (5, 13, 9)]
    reference = [run.token_ids for run in hf_greedy(folder, prompts, max_tokens=6, num_logprobs=0)]
    llm = LLM(str(folder), skip_tokenizer_init=True, device=TEST_DEVICE, dtype="float32", num_gpu_blocks_override=64,
              async_scheduling=True)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference, "a step's inputs reached the model wrong"
