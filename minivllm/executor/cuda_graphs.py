"""CUDA graphs: capture the forward pass once per size, replay it.

A step of a small model is mostly *launch overhead*: Qwen3-0.6B runs about ten kernels per
layer, 28 layers, each taking the host a few microseconds to launch, while the GPU finishes
many of them faster than that. A CUDA graph records the whole sequence of launches once;
replaying it is one launch. The catch: a graph replays exactly what it recorded — the same
kernels, the same tensor addresses, the same grid sizes. So:

  * every input lives in a buffer that never moves (the model runner's device buffers); a
    step copies its data into them before the replay;
  * a graph is captured for each size of a ladder (1, 2, 4, 8, 16, 32, ...); a batch of 13
    decodes is padded to 16 and runs the size-16 graph. Padded rows write nothing to the
    cache (slot -1) and their outputs are dropped;
  * host-side decisions made at capture time must hold for every replay: the paged decode
    kernel splits the context by the longest sequence it may meet, so capture passes
    `max_model_len` as that bound.

Two kinds of graphs, as vLLM's `cudagraph_mode=FULL_AND_PIECEWISE`:

  * *full* graphs (`CudaGraphRunner`) hold the whole forward pass of a decode-only batch,
    attention included: its layout (one query token per request) is the same every step;
  * *piecewise* graphs (`PiecewiseCudaGraphRunner`) serve every other step. Attention over a
    mix of prefills and decodes depends on host-side facts that change every step (how many
    prompts, how long, which tiles the prefill kernel runs), so it cannot be frozen into a
    graph. Everything else — projections, norms, RoPE, the MLP — depends only on the number
    of tokens — and so does writing the new K/V into the cache, given the slot mapping's
    fixed buffer. So the forward pass is cut at each attention call: the pieces between two
    attention calls (the cache write included) are captured per token count, and a replay
    runs piece 0, attention of layer 0 (eagerly, with the step's real metadata), piece 1, ...
    A 28-layer model is 29 graph replays and 28 eager attention launches (two when decodes
    share the step) instead of ~340 eager launches.

Chapter 05 (executor & worker) explains both with measurements.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from minivllm.attention.metadata import AttentionMetadata
from minivllm.forward_context import set_forward_context
from minivllm.models.layers.attention import Attention

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
        pool: tuple | None = None,
    ) -> None:
        self.forward = forward
        self.capture_sizes = capture_sizes
        self.make_decode_metadata = make_decode_metadata  # padded size -> metadata over the buffers
        self.input_ids = input_ids
        self.positions = positions
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = pool  # a memory pool shared with the piecewise graphs (never replayed at once)

    # --8<-- [start:capture]
    @torch.inference_mode()
    def capture(self) -> None:
        """Record one graph per size, largest first, all sharing one memory pool."""
        device = self.input_ids.device
        free_before = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
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


# --8<-- [start:piecewise-sizes]
def piecewise_capture_sizes(max_num_tokens: int, requested: list[int] | None = None) -> list[int]:
    """The token counts to capture piecewise: `requested`, or a ladder up to max_num_tokens.

    1, 2, 4, 8 and every 16 up to 256, like the decode ladder; above that four sizes per
    doubling (320, 384, 448, 512, 640, ...), so a step pads by less than a quarter of its
    tokens where padding costs compute. The step budget itself is always a size.
    """
    if requested is not None:
        return sorted(n for n in set(requested) if n <= max_num_tokens)
    sizes = [n for n in (1, 2, 4, 8) if n <= max_num_tokens] + list(range(16, min(256, max_num_tokens) + 1, 16))
    base = 256
    while base < max_num_tokens:
        sizes += [n for n in range(base + base // 4, 2 * base + 1, base // 4) if n <= max_num_tokens]
        base *= 2
    if sizes[-1] != max_num_tokens:
        sizes.append(max_num_tokens)
    return sizes
# --8<-- [end:piecewise-sizes]


def unowned_view(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over `tensor`'s memory that does not keep that memory allocated.

    The queries a piece leaves for attention live in the graphs' memory pool. Held normally,
    they would stay allocated for as long as the graphs live, and every captured size would
    keep 28 layers' worth of them. Released, their memory goes back to the pool and later
    pieces may reuse it — which is safe, because a replay runs in the order the capture ran:
    attention reads the queries before the next piece can overwrite them. (vLLM calls these
    weak references.) The CUDA array interface describes memory without owning it; an integer
    type of the same width stands in for dtypes it has no name for (bfloat16).
    """
    width = tensor.element_size()

    class _Memory:  # what torch.as_tensor reads: the address, shape and byte strides
        __cuda_array_interface__ = {
            "data": (tensor.data_ptr(), False),
            "shape": tuple(tensor.shape),
            "strides": tuple(stride * width for stride in tensor.stride()),
            "typestr": {1: "|i1", 2: "<i2", 4: "<i4", 8: "<i8"}[width],
            "version": 3,
        }

    return torch.as_tensor(_Memory(), device=tensor.device).view(tensor.dtype)


# --8<-- [start:piecewise-capture]
class PiecewiseCapture:
    """Set in the forward context while one size's pieces run: attention calls land here.

    With `pool` None it is a dry run: attention is skipped and nothing is recorded (the
    allocator settles, cuBLAS sets up its workspace). With a pool, each attention call ends
    the graph being captured and begins the next. Writing the new K/V into the cache goes
    into the graph before the cut: it needs only the slot mapping, a fixed buffer whose
    padded rows hold -1. What is left for the replay to run eagerly is the attention proper,
    over the cache, for which it records the layer and its queries; the layer gets back the
    fixed output buffer the next piece reads.
    """

    def __init__(self, attn_output: torch.Tensor, slot_mapping: torch.Tensor, pool: tuple | None) -> None:
        self.attn_output = attn_output  # [max tokens, num_heads * head_dim], filled at replay
        self.slot_mapping = slot_mapping  # the model runner's device buffer
        self.pool = pool
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.attention_calls: list[tuple[Attention, torch.Tensor]] = []

    def begin_piece(self) -> None:
        if self.pool is not None:
            self.graphs.append(torch.cuda.CUDAGraph())
            self.graphs[-1].capture_begin(pool=self.pool)

    def end_piece(self) -> None:
        if self.pool is not None:
            self.graphs[-1].capture_end()

    def split_at(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        num_tokens = q.shape[0]
        if self.pool is not None:
            layer.write_kv(k, v, self.slot_mapping[:num_tokens])
            self.end_piece()
            self.attention_calls.append((layer, unowned_view(q)))
            self.begin_piece()
        return self.attn_output[:num_tokens]
# --8<-- [end:piecewise-capture]


class PiecewiseCudaGraphRunner:
    """Captured pieces of the forward pass, per token count, with attention between them."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        capture_sizes: list[int],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        attn_output: torch.Tensor,
        pool: tuple,
    ) -> None:
        self.forward = forward
        self.capture_sizes = capture_sizes
        self.input_ids = input_ids
        self.positions = positions
        self.slot_mapping = slot_mapping
        self.attn_output = attn_output
        self.pool = pool
        self.pieces: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.attention_calls: dict[int, list[tuple[Attention, torch.Tensor]]] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    # --8<-- [start:piecewise-capture-loop]
    @torch.inference_mode()
    def capture(self) -> None:
        """Record each size's pieces, largest first, all sizes sharing one memory pool."""
        device = self.input_ids.device
        torch.cuda.empty_cache()  # measure from the allocator holding no idle blocks
        free_before = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        stream = torch.cuda.Stream(device)  # graphs cannot be captured on the default stream
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for size in reversed(self.capture_sizes):
                ids, pos = self.input_ids[:size], self.positions[:size]
                with set_forward_context(None, PiecewiseCapture(self.attn_output, self.slot_mapping, pool=None)):
                    self.forward(ids, pos)  # the dry run
                capture = PiecewiseCapture(self.attn_output, self.slot_mapping, self.pool)
                with set_forward_context(None, capture):
                    capture.begin_piece()
                    self.outputs[size] = self.forward(ids, pos)
                    capture.end_piece()
                self.pieces[size] = capture.graphs
                self.attention_calls[size] = capture.attention_calls
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        # The dry runs' blocks are cached by the allocator, outside the graphs' pool: give them
        # back, so that what is measured (and kept) is the pool.
        torch.cuda.empty_cache()
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info(
            "captured piecewise CUDA graphs for %d token counts (%d..%d), %d pieces each, in %.1f s, using %.2f GiB",
            len(self.pieces), self.capture_sizes[0], self.capture_sizes[-1], len(next(iter(self.pieces.values()))),
            self.capture_seconds, self.capture_bytes / 2**30,
        )
    # --8<-- [end:piecewise-capture-loop]

    def padded_size(self, num_tokens: int) -> int | None:
        return padded_batch_size(num_tokens, self.capture_sizes)

    # --8<-- [start:piecewise-replay]
    # exercise[ch05-piecewise-replay]: replay pieces[0]; then for each (layer, q) and the piece after it: layer.attend(q, None, None, meta, output=attn_output[:size] viewed as q's shape), then that piece; return outputs[size]
    def replay(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        """Run the size-`size` pieces on what is in the buffers now, attention between them.

        `self.pieces[size]` holds the captured graphs in order (one more than there are
        attention layers), `self.attention_calls[size]` the (layer, q) of each cut, q an
        [size, num_heads, head_dim] view of where the piece before it leaves the queries.
        Attention runs eagerly with `meta`, the step's own metadata (`num_actual_tokens` real
        tokens, the rest of the `size` rows padding that attention neither caches nor reads),
        with K/V None (the piece before wrote them into the cache), into the fixed buffer
        `self.attn_output` that the next piece reads. Returns `self.outputs[size]`, the last
        piece's hidden states.
        """
        pieces, calls = self.pieces[size], self.attention_calls[size]
        output = self.attn_output[:size].view(calls[0][1].shape)  # every layer's q has one shape
        pieces[0].replay()
        for (layer, q), piece in zip(calls, pieces[1:]):
            # K/V are None: the piece before wrote them into the cache.
            layer.attend(q, None, None, meta, output=output)
            piece.replay()
        return self.outputs[size]
    # --8<-- [end:piecewise-replay]
