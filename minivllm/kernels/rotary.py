"""Rotary position embedding (neox style) in Triton, in place on q and k (chapter 06).

For each token: look up cos/sin of its position in the precomputed cache (which already
includes llama3 frequency scaling), then rotate the channel pairs (i, i + d/2) of every q and
k head. One program per token handles all its heads, so cos/sin are read once per token.

Qwen3 normalizes every q and k head (an RMSNorm over head_dim, its own weight for q and for k)
just before RoPE. Unfused, that is three kernels and two copies of q and k per layer;
`qk_norm_rotary_embedding` does the norms and the rotation in one pass over each head, in
place, which matters most in small decode steps where each kernel costs more than its bytes.
Given the layer's KV cache and the step's slot mapping, the same kernel also writes the
rotated key and the value into the cache (what `reshape_and_cache` does otherwise): one
kernel fewer per layer again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._utils import next_power_of_2, pdl_enabled, pdl_launch_options
from minivllm.kernels.reshape_and_cache import reshape_and_cache_reference
from minivllm.kernels.rms_norm import fused_add_rms_norm_reference


def rotary_embedding_reference(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
    value: torch.Tensor | None = None, kv_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, heads, dim], key [T, kv_heads, dim]; cos_sin_cache [max_pos, dim] = [cos | sin].

    With kv_cache, also writes the rotated key and `value` into it at slot_mapping (-1: skip).
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    query, key = rotate(query), rotate(key)
    if kv_cache is not None:
        n = slot_mapping.shape[0]  # rows past the slot mapping are padding
        reshape_and_cache_reference(key[:n], value[:n], kv_cache, slot_mapping)
    return query, key


def qk_norm_rotary_embedding_reference(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
    value: torch.Tensor | None = None, kv_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm each head of query (weight q_weight) and key (k_weight), then RoPE: Qwen3's order."""
    q_normed, _ = fused_add_rms_norm_reference(query, None, q_weight, eps)
    k_normed, _ = fused_add_rms_norm_reference(key, None, k_weight, eps)
    return rotary_embedding_reference(positions, q_normed, k_normed, cos_sin_cache, value, kv_cache, slot_mapping)


@triton.jit
def _rotate_heads(ptr, stride_tok, stride_head, token, num_heads, cos, sin, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, weight_ptr, eps, NORM: tl.constexpr,
                  cache_ptr, slot, WRITE_CACHE: tl.constexpr):
    """Rotate (after normalizing, with NORM) the heads of one token in place; with WRITE_CACHE
    also store them in the cache's K half at `slot`, unless it is negative (padding)."""
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
    out1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(ptr.dtype.element_ty)
    out2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(ptr.dtype.element_ty)
    tl.store(base, out1, mask=mask)
    tl.store(base + HALF, out2, mask=mask)
    if WRITE_CACHE:
        if slot >= 0:  # a slot holds num_heads * 2 * HALF contiguous elements
            dst = cache_ptr + slot * num_heads * 2 * HALF + offs_h[:, None] * 2 * HALF + offs_d[None, :]
            tl.store(dst, out1, mask=mask)
            tl.store(dst + HALF, out2, mask=mask)


# --8<-- [start:rotary-kernel]
# num_slots is the step's token count: left unspecialized, it never causes a recompile
# (Triton would otherwise compile a variant for 1 and for multiples of 16).
@triton.jit(do_not_specialize=["num_slots"])
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cache_ptr, q_stride_tok, q_stride_head, k_stride_tok, k_stride_head,
    num_q_heads, num_k_heads, q_weight_ptr, k_weight_ptr, eps,
    v_ptr, v_stride_tok, v_stride_head, kv_cache_ptr, cache_kv_stride, slot_mapping_ptr, num_slots,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, NORM: tl.constexpr,
    WRITE_CACHE: tl.constexpr, USE_PDL: tl.constexpr,
):
    if USE_PDL:  # programmatic dependent launch: q, k, v are the previous kernel's output
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    offs_d = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cache_ptr + pos * 2 * HALF + offs_d, mask=offs_d < HALF, other=0.0)
    sin = tl.load(cache_ptr + pos * 2 * HALF + HALF + offs_d, mask=offs_d < HALF, other=0.0)
    slot = -1
    if WRITE_CACHE:  # tokens past the slot mapping are padding: written nowhere
        slot = tl.load(slot_mapping_ptr + token, mask=token < num_slots, other=-1)
    _rotate_heads(q_ptr, q_stride_tok, q_stride_head, token, num_q_heads, cos, sin, HALF, BLOCK_QH, BLOCK_HALF,
                  q_weight_ptr, eps, NORM, kv_cache_ptr, slot, False)
    _rotate_heads(k_ptr, k_stride_tok, k_stride_head, token, num_k_heads, cos, sin, HALF, BLOCK_KH, BLOCK_HALF,
                  k_weight_ptr, eps, NORM, kv_cache_ptr, slot, WRITE_CACHE)
    if WRITE_CACHE:  # V goes into the cache as it is, in the V half
        if slot >= 0:
            offs_h = tl.arange(0, BLOCK_KH)
            offs_v = tl.arange(0, 2 * BLOCK_HALF)
            mask = (offs_h[:, None] < num_k_heads) & (offs_v[None, :] < 2 * HALF)
            v = tl.load(v_ptr + token * v_stride_tok + offs_h[:, None] * v_stride_head + offs_v[None, :], mask=mask)
            dst = kv_cache_ptr + cache_kv_stride + slot * num_k_heads * 2 * HALF
            tl.store(dst + offs_h[:, None] * 2 * HALF + offs_v[None, :], v, mask=mask)
# --8<-- [end:rotary-kernel]


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
    value: torch.Tensor | None = None, kv_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates query and key in place (they must have unit stride in the last dim); returns them.

    With kv_cache ([2, blocks, block_size, kv_heads, head_dim]) the same kernel also writes the
    rotated key and `value` into it at slot_mapping, which saves the cache-write kernel.
    """
    return _launch(positions, query, key, cos_sin_cache, None, None, 0.0, value, kv_cache, slot_mapping)


def qk_norm_rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
    value: torch.Tensor | None = None, kv_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalizes every head of query and key, then rotates them, in place, in one kernel; returns them.

    With kv_cache, writes the rotated key and `value` into the cache too (see rotary_embedding).
    """
    return _launch(positions, query, key, cos_sin_cache, q_weight, k_weight, eps, value, kv_cache, slot_mapping)


def _launch(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
    value: torch.Tensor | None, kv_cache: torch.Tensor | None, slot_mapping: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both launchers' one kernel. Without weights (plain RoPE) NORM is off, and without a
    cache WRITE_CACHE is off; q/k then stand in for the pointers that are never read."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    assert query.stride(-1) == 1 and key.stride(-1) == 1
    norm = q_weight is not None
    write_cache = kv_cache is not None
    if write_cache:
        assert value is not None and slot_mapping is not None and value.stride(-1) == 1
        assert kv_cache.is_contiguous() and kv_cache.shape[-2:] == key.shape[-2:], "cache must be [2, blocks, size, heads, dim]"
    if num_tokens > 0:
        half = head_dim // 2
        use_pdl = pdl_enabled(query.device)
        _rotary_kernel[(num_tokens,)](
            positions, query, key, cos_sin_cache, query.stride(0), query.stride(1), key.stride(0), key.stride(1),
            num_q_heads, num_k_heads, q_weight if norm else query, k_weight if norm else key, eps,
            value if write_cache else key, value.stride(0) if write_cache else 0, value.stride(1) if write_cache else 0,
            kv_cache if write_cache else key, kv_cache.stride(0) if write_cache else 0,
            slot_mapping if write_cache else positions, slot_mapping.shape[0] if write_cache else 0,
            HALF=half, BLOCK_HALF=next_power_of_2(half),
            BLOCK_QH=next_power_of_2(num_q_heads), BLOCK_KH=next_power_of_2(num_k_heads), NORM=norm,
            WRITE_CACHE=write_cache, USE_PDL=use_pdl, **pdl_launch_options(use_pdl),
        )
    return query, key
