"""The forward context: per-step data that every attention layer needs, set in one place.

The model's `forward(input_ids, positions)` looks like any transformer's. But attention also
needs the step's batch layout (where each request's tokens start, its block table, the slot
of every new token). Threading that through every layer's signature would clutter the model
code, so, as vLLM does, the model runner sets it here for the duration of one forward pass
and the attention layers read it. This is minivllm's only global mutable state (chapter 06).
While piecewise CUDA graphs are captured, it also carries the object that ends one graph at
each attention call and begins the next (`executor/cuda_graphs.py`, chapter 05).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minivllm.attention.metadata import AttentionMetadata

if TYPE_CHECKING:  # the executor imports the model layers, which import this module
    from minivllm.executor.cuda_graphs import PiecewiseCapture


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None  # None during a dummy (profiling) run
    # Set only while piecewise CUDA graphs are captured: its `split_at(layer, q, k, v)`
    # stands in for attention.
    piecewise_capture: PiecewiseCapture | None = None


_forward_context: ForwardContext | None = None


@contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata | None, piecewise_capture: PiecewiseCapture | None = None
) -> Iterator[None]:
    global _forward_context
    previous = _forward_context
    _forward_context = ForwardContext(attn_metadata, piecewise_capture)
    try:
        yield
    finally:
        _forward_context = previous


def get_forward_context() -> ForwardContext:
    if _forward_context is None:
        raise RuntimeError("attention ran outside set_forward_context(): the model runner sets it")
    return _forward_context
