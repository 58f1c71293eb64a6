"""When the model layers call a Triton kernel instead of their torch code (chapter 06).

On CUDA the layers use the kernels of `minivllm.kernels` (fused add + RMSNorm, RoPE in place,
SiLU-and-mul, and the skinny GEMM for the few-token products where it beats cuBLAS); on the
CPU they keep their plain torch code, which is also what the kernels are checked against.
`MINIVLLM_TRITON_OPS=0` turns the kernels off on CUDA, to compare.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def use_triton_ops(x: torch.Tensor) -> bool:
    return x.is_cuda and os.environ.get("MINIVLLM_TRITON_OPS", "1") != "0"


def call_kernel(name: str, *args, **kwargs):
    from minivllm.kernels import call_kernel as _call  # imported late: it defines the kernels

    return _call(name, *args, **kwargs)


# --8<-- [start:linear]
def skinny_gemm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `x @ weight.T` goes to the skinny GEMM kernel: on CUDA, for the 1-4 token
    products it wins (`skinny_gemm_wins`). Not inside torch.compile's tracing: there the
    token count is symbolic and a branch on it would specialize the compiled graph to one
    batch size."""
    if not use_triton_ops(x) or weight.dtype != x.dtype or torch.compiler.is_compiling():
        return False
    from minivllm.kernels.gemm import skinny_gemm_wins

    return skinny_gemm_wins(x.numel() // x.shape[-1], weight.shape[0], weight.shape[1])


def norm_in_product_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the RMSNorm before `x @ weight.T` is done inside the skinny GEMM: for the
    products it takes where that was measured faster (`norm_in_product_wins`)."""
    if not skinny_gemm_applies(x, weight):
        return False
    from minivllm.kernels.gemm import norm_in_product_wins

    return norm_in_product_wins(x.numel() // x.shape[-1], weight.shape[1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated_input: bool = False) -> torch.Tensor:
    """`F.linear`, or on CUDA the skinny GEMM kernel for the 1-4 token products it wins.

    `gated_input`: x's rows are [gate | up] and the product's input is silu(gate) * up, done
    inside the skinny kernel (the caller checks `skinny_gemm_applies` on the product first).
    """
    if gated_input:
        return call_kernel("skinny_gemm", x, weight, bias, True)
    if skinny_gemm_applies(x, weight):
        return call_kernel("skinny_gemm", x, weight, bias)
    return F.linear(x, weight, bias)
# --8<-- [end:linear]
