"""Rotary position embedding (RoPE), neox style, with llama3 frequency scaling (chapter 06).

RoPE rotates each pair of channels (i, i + d/2) of q and k by the angle `position * inv_freq[i]`,
so the dot product of a query and a key depends only on their distance. The cos/sin of every
position up to `max_position` are computed once, in float32, and looked up per token.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from minivllm.models.layers.custom_ops import call_kernel, use_triton_ops


def rope_parameters(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from a config of transformers 4.x or 5.x."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:  # transformers 5: one dict holding theta and the scaling fields
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        return float(theta), (params if params.get("rope_type", "default") != "default" else None)
    return float(getattr(hf_config, "rope_theta", 10000.0)), getattr(hf_config, "rope_scaling", None)


# --8<-- [start:llama3-scaling]
def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's long-context rule: slow down only the low frequencies, smoothly."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are divided by `factor`, short ones kept...
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    # ...and the band between is interpolated.
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
# --8<-- [end:llama3-scaling]


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if scaling is not None:
            rope_type = scaling.get("rope_type", scaling.get("type"))
            if rope_type != "llama3":
                raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: llama3)")
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_position, head_dim / 2]
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    # --8<-- [start:rope-forward]
    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
        q_norm: nn.Module | None = None, k_norm: nn.Module | None = None,
        kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query [T, heads, head_dim], key [T, kv_heads, head_dim] → rotated (copies, or in place on CUDA).

        With `q_norm` and `k_norm` (Qwen3's per-head RMSNorms), each head is normalized first;
        on CUDA one kernel does both. `kv_write` = (value, kv_cache, slot_mapping), given only
        where the Triton kernel runs (see `Attention.fused_kv_write`), has that kernel also
        write the rotated key and the value into the paged cache.
        """
        if use_triton_ops(query):
            cache_args = kv_write or ()
            if q_norm is not None:
                return call_kernel("qk_norm_rotary_embedding", positions, query, key, self.cos_sin_cache,
                                   q_norm.weight, k_norm.weight, q_norm.eps, *cache_args)
            return call_kernel("rotary_embedding", positions, query, key, self.cos_sin_cache, *cache_args)
        if kv_write is not None:
            raise ValueError("kv_write needs the Triton kernel (a CUDA tensor, MINIVLLM_TRITON_OPS not 0)")
        if q_norm is not None:
            query, key = q_norm(query), k_norm(key)
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)  # each [T, head_dim / 2]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
        return _rotate(query, cos, sin), _rotate(key, cos, sin)
    # --8<-- [end:rope-forward]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)  # neox style: pair channel i with i + head_dim / 2
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rotated.to(x.dtype)
