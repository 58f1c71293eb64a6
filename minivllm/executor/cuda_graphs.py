"""CUDA graphs for decode steps: capture the forward pass once per batch size, replay it.

A decode step of a small model is mostly *launch overhead*: Qwen3-0.6B runs about ten kernels
per layer, 28 layers, each taking the host a few microseconds to launch, while the GPU
finishes many of them faster than that. A CUDA graph records the whole sequence of launches
once; replaying it is one launch. The catch: a graph replays exactly what it recorded — the
same kernels, the same tensor addresses, the same grid sizes. So:

  * every input lives in a buffer that never moves (the model runner's device buffers); a
    step copies its data into them before the replay;
  * a graph is captured for each size of a ladder (1, 2, 4, 8, 16, 32, ...); a batch of 13
    decodes is padded to 16 and runs the size-16 graph. Padded rows write nothing to the
    cache (slot -1) and their outputs are dropped;
  * host-side decisions made at capture time must hold for every replay: the paged decode
    kernel splits the context by the longest sequence it may meet, so capture passes
    `max_model_len` as that bound.

Only decode-only steps replay graphs (the design nano-vllm uses; vLLM also captures mixed
batches piecewise). Prefill steps run eagerly: they are large enough that launches are a
small share of their time. Chapter 05 (executor & worker) explains it with measurements.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.forward_context import set_forward_context

logger = logging.getLogger("minivllm")


# --8<-- [start:capture-sizes]
def cuda_graph_capture_sizes(max_num_seqs: int, requested: list[int] | None = None) -> list[int]:
    """The batch sizes to capture: `requested`, or 1, 2, 4, 8 and every 16 up to max_num_seqs.

    Dense at the small end, where one padded row is a large share of the batch; every 16
    above, where a graph per size would cost memory and capture time for little gain.
    """
    if requested is not None:
        return sorted(n for n in set(requested) if n <= max_num_seqs) or [min(requested)]
    sizes = [n for n in (1, 2, 4, 8) if n <= max_num_seqs] + list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)  # the largest batch the scheduler can form must fit a graph
    return sizes
# --8<-- [end:capture-sizes]


# --8<-- [start:padded-size]
# exercise[ch05-padded-graph-size]: bisect for the first captured size >= num_reqs; None past the largest
def padded_batch_size(num_reqs: int, capture_sizes: list[int]) -> int | None:
    """The captured batch size a step of `num_reqs` decodes runs at, or None if none fits.

    `capture_sizes` is sorted ascending. A batch runs the smallest graph that holds it, its
    extra rows padding; a batch larger than every captured size runs eagerly (None).
    """
    i = bisect.bisect_left(capture_sizes, num_reqs)
    return capture_sizes[i] if i < len(capture_sizes) else None
# --8<-- [end:padded-size]


class CudaGraphRunner:
    """Captured decode graphs over the model runner's persistent device buffers."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        capture_sizes: list[int],
        make_decode_metadata: Callable[[int], AttentionMetadata],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        self.forward = forward
        self.capture_sizes = capture_sizes
        self.make_decode_metadata = make_decode_metadata  # padded size -> metadata over the buffers
        self.input_ids = input_ids
        self.positions = positions
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    # --8<-- [start:capture]
    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per size, largest first, all sharing one memory pool."""
        device = self.input_ids.device
        free_before = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.capture_sizes):
            meta = self.make_decode_metadata(size)
            with set_forward_context(meta):
                # A warm-up run first: it compiles Triton kernels and settles the allocator,
                # neither of which may happen during capture.
                self.forward(self.input_ids[:size], self.positions[:size])
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self.forward(self.input_ids[:size], self.positions[:size])
            self.graphs[size] = graph
        torch.cuda.synchronize(device)
        used = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info(
            "captured %d CUDA graphs (decode batch sizes %d..%d) in %.1f s, using %.2f GiB",
            len(self.graphs), self.capture_sizes[0], self.capture_sizes[-1], time.perf_counter() - start, used / 2**30,
        )
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = used
    # --8<-- [end:capture]

    def padded_size(self, num_reqs: int) -> int | None:
        return padded_batch_size(num_reqs, self.capture_sizes)

    def replay(self, size: int) -> torch.Tensor:
        """Run the size-`size` graph on what is in the buffers now; its hidden states."""
        self.graphs[size].replay()
        return self.outputs[size]
