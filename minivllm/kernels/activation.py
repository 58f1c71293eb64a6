"""SiLU-and-mul in Triton: `silu(x[:, :d]) * x[:, d:]` for the gated MLP (chapter 06).

A purely memory-bound op: read 2d, write d per row. Programs tile (row, column block) so each
reads two contiguous slices of its row and writes one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from minivllm.kernels._utils import pdl_enabled, pdl_launch_options


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, D: tl.constexpr, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    if USE_PDL:  # programmatic dependent launch: x is the previous kernel's output (kernels/_utils.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + D + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_stride + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    block = 1024
    use_pdl = pdl_enabled(x.device)
    if x2.shape[0] > 0:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), D=d, BLOCK=block, USE_PDL=use_pdl, **pdl_launch_options(use_pdl)
        )
    return out.view(*x.shape[:-1], d)
