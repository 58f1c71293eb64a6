"""Rotary position embedding (neox style) in Triton, in place on q and k (chapter 06).

For each token: look up cos/sin of its position in the precomputed cache (which already
includes llama3 frequency scaling), then rotate the channel pairs (i, i + d/2) of every q and
k head. One program per token handles all its heads, so cos/sin are read once per token.

Qwen3 normalizes every q and k head (an RMSNorm over head_dim, its own weight for q and for k)
just before RoPE. Unfused, that is three kernels and two copies of q and k per layer;
`qk_norm_rotary_embedding` does the norms and the rotation in one pass over each head, in
place, which matters most in small decode steps where each kernel costs more than its bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._utils import next_power_of_2
from minivllm.kernels.rms_norm import fused_add_rms_norm_reference


def rotary_embedding_reference(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, heads, dim], key [T, kv_heads, dim]; cos_sin_cache [max_pos, dim] = [cos | sin]."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(query), rotate(key)


def qk_norm_rotary_embedding_reference(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm each head of query (weight q_weight) and key (k_weight), then RoPE: Qwen3's order."""
    q_normed, _ = fused_add_rms_norm_reference(query, None, q_weight, eps)
    k_normed, _ = fused_add_rms_norm_reference(key, None, k_weight, eps)
    return rotary_embedding_reference(positions, q_normed, k_normed, cos_sin_cache)


@triton.jit
def _rotate_heads(ptr, stride_tok, stride_head, token, num_heads, cos, sin, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, weight_ptr, eps, NORM: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    base = ptr + token * stride_tok + offs_h[:, None] * stride_head + offs_d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:  # RMSNorm of each head (row) over its 2 * HALF channels, rounded as the unfused norm's output is
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(weight_ptr + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + HALF + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
        x1 = (x1 * rstd[:, None] * w1[None, :]).to(ptr.dtype.element_ty).to(tl.float32)
        x2 = (x2 * rstd[:, None] * w2[None, :]).to(ptr.dtype.element_ty).to(tl.float32)
    tl.store(base, (x1 * cos[None, :] - x2 * sin[None, :]).to(ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cache_ptr, q_stride_tok, q_stride_head, k_stride_tok, k_stride_head,
    num_q_heads, num_k_heads, q_weight_ptr, k_weight_ptr, eps,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    offs_d = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cache_ptr + pos * 2 * HALF + offs_d, mask=offs_d < HALF, other=0.0)
    sin = tl.load(cache_ptr + pos * 2 * HALF + HALF + offs_d, mask=offs_d < HALF, other=0.0)
    _rotate_heads(q_ptr, q_stride_tok, q_stride_head, token, num_q_heads, cos, sin, HALF, BLOCK_QH, BLOCK_HALF,
                  q_weight_ptr, eps, NORM)
    _rotate_heads(k_ptr, k_stride_tok, k_stride_head, token, num_k_heads, cos, sin, HALF, BLOCK_KH, BLOCK_HALF,
                  k_weight_ptr, eps, NORM)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates query and key in place (they must have unit stride in the last dim); returns them."""
    return _launch(positions, query, key, cos_sin_cache, None, None, 0.0)


def qk_norm_rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalizes every head of query and key, then rotates them, in place, in one kernel; returns them."""
    return _launch(positions, query, key, cos_sin_cache, q_weight, k_weight, eps)


def _launch(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both launchers' one kernel; without weights (plain RoPE) NORM is off and q/k stand in
    for the weight pointers, which are then never read."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    assert query.stride(-1) == 1 and key.stride(-1) == 1
    norm = q_weight is not None
    if num_tokens > 0:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            positions, query, key, cos_sin_cache, query.stride(0), query.stride(1), key.stride(0), key.stride(1),
            num_q_heads, num_k_heads, q_weight if norm else query, k_weight if norm else key, eps,
            HALF=half, BLOCK_HALF=next_power_of_2(half),
            BLOCK_QH=next_power_of_2(num_q_heads), BLOCK_KH=next_power_of_2(num_k_heads), NORM=norm,
        )
    return query, key
