"""Triton kernels, each beside its naive PyTorch reference (chapter 06).

A subpackage of minivllm, never a top-level `kernels`: that name belongs to another project,
which transformers imports.
`KERNELS` maps each kernel's name to (kernel launcher, reference); the tests check every entry
against its reference, on the CPU through Triton's interpreter and on the GPU natively.

Importing this package defines the kernels, so `TRITON_INTERPRET=1` must be set before it is
imported when there is no GPU (the tests' conftest and `minivllm exercise check` do that).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minivllm.kernels._utils import aligned, assert_close, check_kernel_against_reference
from minivllm.kernels.activation import silu_and_mul, silu_and_mul_reference
from minivllm.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
    paged_prefill_attention,
    paged_prefill_attention_reference,
    decode_num_splits,
    decode_config,
    merge_block_s,
    prefill_block_m,
    prefill_tiles,
)
from minivllm.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_reference
from minivllm.kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_reference
from minivllm.kernels.gemm import (
    SKINNY_MAX_TOKENS,
    rms_norm_skinny_gemm,
    rms_norm_skinny_gemm_reference,
    skinny_gemm,
    skinny_gemm_reference,
)
from minivllm.kernels.sampling import argmax_sample, argmax_sample_reference, gumbel_sample, gumbel_sample_reference
from minivllm.kernels.step_inputs import unpack_step_inputs, unpack_step_inputs_reference
from minivllm.kernels.rotary import (
    qk_norm_rotary_embedding,
    qk_norm_rotary_embedding_reference,
    rotary_embedding,
    rotary_embedding_reference,
)

# --8<-- [start:registry]
KERNELS: dict[str, tuple[Callable, Callable]] = {
    "reshape_and_cache": (reshape_and_cache, reshape_and_cache_reference),
    "paged_decode_attention": (paged_decode_attention, paged_decode_attention_reference),
    "paged_prefill_attention": (paged_prefill_attention, paged_prefill_attention_reference),
    "fused_add_rms_norm": (fused_add_rms_norm, fused_add_rms_norm_reference),
    "rotary_embedding": (rotary_embedding, rotary_embedding_reference),
    "qk_norm_rotary_embedding": (qk_norm_rotary_embedding, qk_norm_rotary_embedding_reference),
    "silu_and_mul": (silu_and_mul, silu_and_mul_reference),
    "skinny_gemm": (skinny_gemm, skinny_gemm_reference),
    "rms_norm_skinny_gemm": (rms_norm_skinny_gemm, rms_norm_skinny_gemm_reference),
    "gumbel_sample": (gumbel_sample, gumbel_sample_reference),
    "argmax_sample": (argmax_sample, argmax_sample_reference),
    "unpack_step_inputs": (unpack_step_inputs, unpack_step_inputs_reference),
}
# --8<-- [end:registry]


# --8<-- [start:call-kernel]
def call_kernel(name: str, *args, **kernel_kwargs):
    """Run kernel `name`; with MINIVLLM_CHECK_KERNELS=1 also run its reference and compare.

    In-place kernels (which return None) are compared through the tensors they modify.
    """
    kernel, reference = KERNELS[name]
    if not check_kernel_against_reference():
        return kernel(*args, **kernel_kwargs)
    ref_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    out = kernel(*args, **kernel_kwargs)
    ref = reference(*ref_args)
    if out is None:
        pairs = [(a, r) for a, r in zip(args, ref_args) if isinstance(a, torch.Tensor)]
    else:
        outs = out if isinstance(out, tuple) else (out,)
        refs = ref if isinstance(ref, tuple) else (ref,)
        pairs = list(zip(outs, refs))
    for got, want in pairs:
        if got.numel():
            assert_close(name, torch.nan_to_num(got), torch.nan_to_num(want))
    return out
# --8<-- [end:call-kernel]


def jit_functions() -> list:
    """Every `@triton.jit` function of minivllm's kernels (for counting or forgetting compiles)."""
    import triton

    from minivllm.kernels import activation, gemm, paged_attention, reshape_and_cache, rms_norm, rotary, sampling

    modules = (activation, gemm, paged_attention, reshape_and_cache, rms_norm, rotary, sampling)
    return [obj for module in modules for obj in vars(module).values() if isinstance(obj, triton.runtime.JITFunction)]


def num_compiled_variants() -> int:
    """How many compiled variants of minivllm's Triton kernels this process holds (0 when
    interpreting). A benchmark compares it before and after its timed run: a compile inside
    the run is a stall that a warm-up should have taken."""
    # device_caches: per device, (kernel_cache, ...); kernel_cache maps a variant's key to its kernel.
    return sum(len(entry[0]) for fn in jit_functions() for entry in fn.device_caches.values())
