"""Chapter 05 exercise: which captured CUDA graph a decode batch runs.

Graphs are captured at a ladder of batch sizes. A batch of n decodes runs the smallest
captured size that holds it, the extra rows padding; a batch larger than every captured size
runs eagerly. The function is called through its module, as the model runner calls it.
"""

from __future__ import annotations

import pytest

from minivllm.executor import cuda_graphs

LADDER = [1, 2, 4, 8, 16, 32, 48]


@pytest.mark.exercise("ch05-padded-graph-size")
def test_an_exact_size_is_not_padded():
    for n in LADDER:
        assert cuda_graphs.padded_batch_size(n, LADDER) == n, f"{n} decodes have a graph of their own size"


@pytest.mark.exercise("ch05-padded-graph-size")
def test_between_sizes_the_next_larger_graph_runs():
    assert cuda_graphs.padded_batch_size(3, LADDER) == 4
    assert cuda_graphs.padded_batch_size(17, LADDER) == 32, "17 rows need the 32 graph: 15 rows of padding"
    assert cuda_graphs.padded_batch_size(33, LADDER) == 48


@pytest.mark.exercise("ch05-padded-graph-size")
def test_past_the_largest_size_there_is_no_graph():
    assert cuda_graphs.padded_batch_size(49, LADDER) is None, "a batch larger than every graph runs eagerly"
    assert cuda_graphs.padded_batch_size(5, [8]) == 8 and cuda_graphs.padded_batch_size(9, [8]) is None


@pytest.mark.exercise("ch05-padded-graph-size")
def test_every_batch_up_to_max_num_seqs_has_a_graph_in_the_default_ladder():
    for max_num_seqs in (1, 3, 16, 100, 256):
        sizes = cuda_graphs.cuda_graph_capture_sizes(max_num_seqs)
        for n in range(1, max_num_seqs + 1):
            size = cuda_graphs.padded_batch_size(n, sizes)
            assert size is not None and n <= size <= max_num_seqs, f"max_num_seqs={max_num_seqs}, n={n}: got {size}"
