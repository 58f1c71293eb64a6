"""Fused residual add + RMSNorm in Triton (chapter 06).

`residual = x + residual; out = residual / sqrt(mean(residual²) + eps) * weight`. One program
per row: the row is read once, the sum written back as the new residual, and the normalized
row written out; the unfused torch version reads and writes the row several times. The sum
is rounded to the input dtype before normalizing, as HF models do, so results match them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels._utils import next_power_of_2, pdl_enabled, pdl_launch_options


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (normalized, new residual); with residual None the new residual is x."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight.float()).to(x.dtype), x


# --8<-- [start:fused-add-rms-norm-kernel]
# exercise[ch06-fused-add-rms-norm]: offs = arange(BLOCK), mask offs < N; load w, then (USE_PDL) gdc_wait; x (+ residual, in fp32, stored rounded as the new residual); rstd = 1/sqrt(sum(h*h)/N + eps); store h*rstd*w
@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, x_stride, residual_stride, out_stride, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program normalizes one row of N elements; BLOCK is N rounded up to a power of 2.

    Row r of x starts at x_ptr + r * x_stride (of residual: residual_ptr + r * residual_stride;
    of out: out_ptr + r * out_stride); its elements are contiguous. With HAS_RESIDUAL, first
    h = x + residual, added in float32 and rounded to the model dtype, is stored as the new
    residual at residual_out_ptr + r * N (contiguous rows); without it, h = x and the residual
    pointers are unused. Then out = h / sqrt(mean(h²) + eps) * weight, computed in float32 and
    stored in out's dtype. Lanes at N and beyond must be neither loaded nor stored. The weight
    is loaded first: with USE_PDL (programmatic dependent launch) this program may start
    while the previous kernel, which wrote x, still runs; after `gdc_wait` its writes are
    visible, and only then may x and residual be read (the weight never changes).
    """
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * residual_stride + offs, mask=mask, other=0.0).to(tl.float32))
        x = x.to(residual_out_ptr.dtype.element_ty)  # the residual stream keeps the model dtype
        tl.store(residual_out_ptr + row * N + offs, x, mask=mask)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / N + eps)
    tl.store(out_ptr + row * out_stride + offs, (h * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)
# --8<-- [end:fused-add-rms-norm-kernel]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n = shape[-1]
    # The kernel walks a row with unit stride, and writes the new residual as contiguous rows.
    assert x2.stride(-1) == 1, "x must have unit stride in its last dimension"
    out = torch.empty_like(x2)
    if residual is None:
        residual_in, residual_out = x2, x2
    else:
        residual_in = residual.reshape(-1, n)
        assert residual_in.stride(-1) == 1, "residual must have unit stride in its last dimension"
        residual_out = torch.empty_like(x2)
    use_pdl = pdl_enabled(x.device)
    if x2.shape[0] > 0:
        _fused_add_rms_norm_kernel[(x2.shape[0],)](
            x2, residual_in, weight, out, residual_out, x2.stride(0), residual_in.stride(0), out.stride(0), eps,
            N=n, BLOCK=next_power_of_2(n), HAS_RESIDUAL=residual is not None, USE_PDL=use_pdl,
            **pdl_launch_options(use_pdl),
        )
    return out.view(shape), (x if residual is None else residual_out.view(shape))
