"""When the model layers call a Triton kernel instead of their torch code (chapter 06).

On CUDA the layers use the kernels of `minivllm.kernels` (fused add + RMSNorm, RoPE in place,
SiLU-and-mul); on the CPU they keep their plain torch code, which is also what the kernels
are checked against. `MINIVLLM_TRITON_OPS=0` turns the kernels off on CUDA, to compare.
"""

from __future__ import annotations

import os

import torch


def use_triton_ops(x: torch.Tensor) -> bool:
    return x.is_cuda and os.environ.get("MINIVLLM_TRITON_OPS", "1") != "0"


def call_kernel(name: str, *args, **kwargs):
    from minivllm.kernels import call_kernel as _call  # imported late: it defines the kernels

    return _call(name, *args, **kwargs)
