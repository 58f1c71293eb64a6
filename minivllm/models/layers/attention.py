"""The attention layer the models use: q, k, v in; attention over the paged cache out.

The layer itself is thin. The model runner binds each layer to its slice of the KV cache
(`kv_cache`) and to the chosen backend (`impl`) at start-up; every forward pass reads the
step's `AttentionMetadata` from the forward context. During the dummy run that sizes memory
there is no cache yet, and the layer does plain causal attention over the batch. While
piecewise CUDA graphs are captured, attention is where one graph ends and the next begins
(chapter 05): the layer hands its q, k, v to the capture and returns a fixed output buffer
that the replay fills by calling `attend` between the graphs.
Chapter 06 (attention backends).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.forward_context import get_forward_context
from minivllm.models.layers.custom_ops import use_triton_ops


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.kv_cache: torch.Tensor | None = None  # bound by the model runner
        self.impl = None  # the attention backend, bound by the model runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_written: bool = False) -> torch.Tensor:
        """`kv_written`: this step's k and v are in the cache already (the RoPE kernel wrote them)."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        context = get_forward_context()
        if context.piecewise_capture is not None:  # capturing: the graph breaks here
            return context.piecewise_capture.split_at(self, q, k, v)
        meta = context.attn_metadata
        if meta is None:  # dummy run: one causal sequence, nothing cached
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                is_causal=True, scale=self.scale, enable_gqa=True,
            ).transpose(0, 1)
        elif kv_written:
            out = self.attend(q, None, None, meta)
        else:
            out = self.attend(q, k, v, meta)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, meta, output: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The backend's paged attention over this layer's cache: [num_tokens, num_heads, head_dim].

        k and v are written into the cache first, unless None: a piecewise graph wrote them.
        """
        return self.impl.forward(q, k, v, self.kv_cache, meta, self.scale, output)

    # --8<-- [start:fused-kv-write]
    def fused_kv_write(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(this layer's cache, the step's slot mapping) when the RoPE kernel before attention may
        write this step's K/V into the cache itself, else None.

        Only with the Triton backend and the Triton ops on CUDA, in a step with a cache (not
        the dummy run that sizes memory), not while piecewise graphs are captured (their
        capture writes K/V inside the piece before attention) and not inside torch.compile's
        tracing (which would guard on the step's metadata).
        """
        if self.kv_cache is None or getattr(self.impl, "name", None) != "triton" or not use_triton_ops(q):
            return None
        if torch.compiler.is_compiling():
            return None
        context = get_forward_context()
        if context.piecewise_capture is not None or context.attn_metadata is None:
            return None
        return self.kv_cache, context.attn_metadata.slot_mapping
    # --8<-- [end:fused-kv-write]

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write this step's K/V into this layer's cache at `slot_mapping` (-1: skip)."""
        self.impl.write_kv(k, v, self.kv_cache, slot_mapping)
