"""Chapter 05 exercise: replaying piecewise CUDA graphs, attention between the pieces.

A CPU has no CUDA graphs, so the pieces and the attention layers here are stand-ins that
record what the replay asks of them: the order of the calls, and what each attention call
gets (its own queries, K/V None, the step's metadata, and the fixed output buffer the next
piece reads, viewed in the queries' shape). The real thing runs in tests/test_cuda_graphs.py
on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.executor.cuda_graphs import PiecewiseCudaGraphRunner

NUM_HEADS, HEAD_DIM, MAX_TOKENS = 4, 8, 64


class Piece:
    def __init__(self, log: list, index: int) -> None:
        self.log, self.index = log, index

    def replay(self) -> None:
        self.log.append(("piece", self.index))


class Layer:
    """Records each call; writes its index into its output rows, as attention writes its result."""

    def __init__(self, log: list, index: int) -> None:
        self.log, self.index = log, index

    def attend(self, q, k, v, meta, output=None):
        self.log.append(("attention", self.index, q, k, v, meta, output))
        output.fill_(self.index)
        return output


def make_runner(size: int, num_layers: int, log: list) -> tuple[PiecewiseCudaGraphRunner, list[torch.Tensor]]:
    attn_output = torch.full((MAX_TOKENS, NUM_HEADS * HEAD_DIM), float("nan"))
    buffer = torch.zeros(MAX_TOKENS, 3 * NUM_HEADS * HEAD_DIM)
    runner = PiecewiseCudaGraphRunner(forward=None, capture_sizes=[size], input_ids=torch.zeros(MAX_TOKENS),
                                      positions=torch.zeros(MAX_TOKENS), slot_mapping=torch.zeros(MAX_TOKENS),
                                      attn_output=attn_output, pool=None)
    # Queries: strided views into a qkv-like buffer, as a piece leaves them.
    queries = [buffer[:size, : NUM_HEADS * HEAD_DIM].view(size, NUM_HEADS, HEAD_DIM) for _ in range(num_layers)]
    runner.pieces[size] = [Piece(log, i) for i in range(num_layers + 1)]
    runner.attention_calls[size] = [(Layer(log, i), q) for i, q in enumerate(queries)]
    runner.outputs[size] = torch.randn(size, 16)
    return runner, queries


@pytest.mark.exercise("ch05-piecewise-replay")
def test_pieces_and_attention_alternate_in_capture_order():
    log: list = []
    runner, _ = make_runner(size=16, num_layers=3, log=log)
    runner.replay(16, meta="the step's metadata")
    order = [entry[:2] for entry in log]
    assert order == [("piece", 0), ("attention", 0), ("piece", 1), ("attention", 1), ("piece", 2),
                     ("attention", 2), ("piece", 3)], "piece 0, then each layer's attention followed by the next piece"


@pytest.mark.exercise("ch05-piecewise-replay")
def test_attention_gets_its_queries_the_step_metadata_and_the_fixed_output_buffer():
    log: list = []
    size = 16
    runner, queries = make_runner(size=size, num_layers=2, log=log)
    meta = object()
    runner.replay(size, meta)
    calls = [entry for entry in log if entry[0] == "attention"]
    assert len(calls) == 2
    for (_, index, q, k, v, got_meta, output), want_q in zip(calls, queries):
        assert q is want_q, f"layer {index} must attend over its own recorded queries"
        assert k is None and v is None, "K/V are None: the piece before wrote them into the cache"
        assert got_meta is meta, "attention runs with the step's own metadata"
        assert output is not None and output.shape == q.shape, "the output is viewed in the queries' shape"
        assert output.data_ptr() == runner.attn_output.data_ptr(), "the output is the fixed buffer the next piece reads"
    assert (runner.attn_output[:size] == 1).all(), "the last attention's result is in the buffer's first `size` rows"
    assert runner.attn_output[size:].isnan().all(), "rows past `size` are not this replay's"


@pytest.mark.exercise("ch05-piecewise-replay")
def test_the_replay_returns_the_last_piece_output_of_its_size():
    for size in (1, 8, 64):
        runner, _ = make_runner(size=size, num_layers=1, log=[])
        assert runner.replay(size, meta=None) is runner.outputs[size]
