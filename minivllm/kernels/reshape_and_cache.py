"""`reshape_and_cache`: write this step's new K and V into the paged cache (chapter 04/06).

Every new token t has a slot `slot_mapping[t] = block_id * block_size + offset`; its K and V
([num_kv_heads, head_dim] each) are copied to `kv_cache[0 or 1, block_id, offset]`. One
program per token; a negative slot means "padding, write nothing" (CUDA graphs pad batches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._utils import next_power_of_2, pdl_enabled, pdl_launch_options


def reshape_and_cache_reference(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    valid = slot_mapping >= 0
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slot_mapping[valid]] = key[valid]
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slot_mapping[valid]] = value[valid]


# --8<-- [start:reshape-and-cache-kernel]
# exercise[ch06-reshape-and-cache-kernel]: (USE_PDL: gdc_wait first) slot = slot_mapping[token]; if slot >= 0, copy the token's ROW elements of key to cache + slot*ROW and of value to that + cache_kv_stride
@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, cache_ptr, slot_mapping_ptr,
    key_stride, value_stride, cache_kv_stride,
    ROW: tl.constexpr, ROW_PADDED: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program copies the K and V of one new token into the paged cache.

    Program t reads slot_mapping[t]; a negative slot is padding: write nothing. Token t's key
    is ROW = num_kv_heads * head_dim contiguous elements at key_ptr + t * key_stride (its
    value: value_ptr + t * value_stride). In the cache [2, num_blocks, block_size, heads, dim],
    slot s of the K half starts at cache_ptr + s * ROW; the V half is cache_kv_stride elements
    further. ROW_PADDED is ROW rounded up to a power of 2: lanes at ROW and beyond must be
    neither loaded nor stored. With USE_PDL (programmatic dependent launch, chapter 06) the
    program may start before the previous kernel, which wrote key and value, has finished:
    call `tl.extra.cuda.gdc_wait()` before reading anything.
    """
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        offsets = tl.arange(0, ROW_PADDED)
        mask = offsets < ROW
        k = tl.load(key_ptr + token * key_stride + offsets, mask=mask)
        v = tl.load(value_ptr + token * value_stride + offsets, mask=mask)
        # A slot holds ROW = num_kv_heads * head_dim contiguous elements of K (and of V).
        tl.store(cache_ptr + slot * ROW + offsets, k, mask=mask)
        tl.store(cache_ptr + cache_kv_stride + slot * ROW + offsets, v, mask=mask)
# --8<-- [end:reshape-and-cache-kernel]


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [num_tokens, num_kv_heads, head_dim] → kv_cache [2, blocks, block_size, heads, dim]."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    row = key.shape[1] * key.shape[2]
    assert key.stride(2) == 1 and key.stride(1) == key.shape[2], "key rows must be contiguous per token"
    assert value.stride(2) == 1 and value.stride(1) == value.shape[2], "value rows must be contiguous per token"
    use_pdl = pdl_enabled(key.device)
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), value.stride(0), kv_cache.stride(0),
        ROW=row, ROW_PADDED=next_power_of_2(row), USE_PDL=use_pdl, **pdl_launch_options(use_pdl),
    )
