"""A matrix product for a handful of tokens in Triton: `x @ weight.T` for 1-8 rows (chapter 06).

A decode step at batch 1 multiplies one activation row by every weight matrix of the model:
all of its time is reading the weights, and the arithmetic is nothing. What matters is keeping
enough weight bytes in flight on every multiprocessor. cuBLAS sometimes picks a kernel made for
larger batches here: on the H200 it took 12.6 µs for Qwen3-0.6B's o projection (4 MiB, a third
of a terabyte per second), where this kernel takes 4.6 µs.

This kernel gives each program BLOCK_N weight rows and walks along K in BLOCK_K slices: it
loads a [BLOCK_N, BLOCK_K] tile of the weight (contiguous rows, so the loads are wide), the
matching [BLOCK_M, BLOCK_K] slice of the activations, and accumulates the products with plain
multiply-adds in float32 (no tensor cores: with BLOCK_M of 1-8 they would mostly multiply
padding). Every program reads a disjoint set of weight rows, so there is no second pass to
combine partial sums and the result does not depend on timing. `skinny_gemm_wins` says for
which products the layers use it; cuBLAS keeps the others.

`rms_norm_skinny_gemm` is the same kernel with the residual add and the RMSNorm before the
product folded in: a norm scales a whole row by one number, so the product can multiply the
un-normalized row into its weights and apply that number at the end, and the norm kernel
before qkv and gate_up need not run.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from minivllm.kernels._utils import next_power_of_2, pdl_enabled, pdl_launch_options
from minivllm.kernels.activation import silu_and_mul_reference
from minivllm.kernels.rms_norm import fused_add_rms_norm_reference

# The largest token count the kernel is meant for; beyond it tensor-core GEMMs win.
SKINNY_MAX_TOKENS = 8


def skinny_gemm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated_input: bool = False
) -> torch.Tensor:
    if gated_input:  # x = [gate | up]: the product's input is silu(gate) * up in float32, rounded once to x's dtype
        x = silu_and_mul_reference(x.float()).to(x.dtype)
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


# --8<-- [start:skinny-gemm-kernel]
# exercise[ch06-skinny-gemm]: rows n = pid*BLOCK_N + arange; load w for slice 0, then (USE_PDL) gdc_wait; per K slice load x [BLOCK_M, BLOCK_K] (masked, 0), acc += x[:, None, :] * w[None, :, :] in fp32, load the next slice's w; sum over k (+ bias); store masked
@triton.jit
def _skinny_gemm_kernel(
    x_ptr, weight_ptr, bias_ptr, out_ptr, M, N, K, x_stride, out_stride,
    norm_weight_ptr, residual_ptr, residual_out_ptr, eps,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SUM_EACH_SLICE: tl.constexpr, USE_PDL: tl.constexpr, GATED: tl.constexpr,
    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NORM_WEIGHT_AHEAD: tl.constexpr,
):
    """out[m, n] = sum_k x[m, k] * weight[n, k] (+ bias[n]) for this program's BLOCK_N rows n.

    Program p owns the weight rows n = p * BLOCK_N ... p * BLOCK_N + BLOCK_N - 1 (those < N)
    and computes out[m, n] for all of them and every m < M (M <= BLOCK_M, a power of two).
    weight is [N, K] with contiguous rows: element (n, k) is at weight_ptr + n * K + k (make
    n int64 before multiplying: N * K can pass 2**31). Row m of x starts at x_ptr + m *
    x_stride, row m of out at out_ptr + m * out_stride; both have contiguous elements. Walk K in
    slices of BLOCK_K: for each, load the [BLOCK_M, BLOCK_K] slice of x and multiply it with
    the [BLOCK_N, BLOCK_K] weight tile of that slice, accumulating in float32 with plain
    multiply-adds (broadcast to [BLOCK_M, BLOCK_N, BLOCK_K]; no tl.dot, which needs 16 rows).
    Masks: n < N, m < M, k < K, and 0 for masked lanes. The weight tile of each slice is
    loaded one slice ahead: the first before the loop, the next one inside it, so the weight
    bytes are always in flight. The first load also comes before `gdc_wait` (when USE_PDL):
    weights never change, so they may be read while the previous kernel, which wrote x, is
    still running; x may be read only after the wait. With SUM_EACH_SLICE, reduce over k after
    every slice into a [BLOCK_M, BLOCK_N] accumulator; without it, keep a [BLOCK_M, BLOCK_N,
    BLOCK_K] accumulator and reduce once after the loop (fewer shuffles, more registers). With
    HAS_BIAS add bias[n] (in float32; without it bias_ptr is unused). Store in out's dtype,
    only where m < M and n < N. GATED (not part of the exercise: the tests leave it off): the
    rows of x hold 2K elements, [gate | up], and the product's input is silu(gate) * up,
    computed here in float32 and rounded to x's dtype as the separate SiLU-and-mul kernel
    would store it: the MLP's down projection then needs no activation kernel before it.
    NORM (not part of the exercise either): the product's input is RMSNorm(h) with
    h = x (+ residual, with HAS_RESIDUAL: added in float32, rounded to x's dtype, and stored
    by program 0 as the new residual at residual_out_ptr; residual rows are contiguous). The
    normalization is split around the weight stream instead of standing in front of it: the
    slices multiply h * norm_weight, the sum of h² accumulates beside them, and the result is
    scaled by 1 / sqrt(mean(h²) + eps) at the end (the scale is the same for the whole row).
    NORM_WEIGHT_AHEAD: the norm weight's slices are loaded one ahead, like the weights, in
    float32 (the first before the wait); without it each is loaded where it is used, which
    holds fewer registers.
    """
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = weight_ptr + offs_n.to(tl.int64)[:, None] * K  # weight is [N, K], rows contiguous
    x_rows = x_ptr + offs_m[:, None] * x_stride
    w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
    if NORM:
        if NORM_WEIGHT_AHEAD:  # the norm's weight never changes either
            norm_w = tl.load(norm_weight_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        residual_rows = residual_ptr + offs_m[:, None] * K
        residual_out_rows = residual_out_ptr + offs_m[:, None] * K
        sum_sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if USE_PDL:  # everything below may read what the previous kernel wrote
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if SUM_EACH_SLICE:
        out = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:  # partial products per (m, n, k-lane), summed over the lanes after the loop
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + offs_k) < K
        a = tl.load(x_rows + k + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if GATED:
            gate = a.to(tl.float32)
            up = tl.load(x_rows + K + k + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            a = (gate / (1.0 + tl.exp(-gate)) * up.to(tl.float32)).to(x_ptr.dtype.element_ty)
        a = a.to(tl.float32)
        next_k = k + BLOCK_K + offs_k  # the next slice (all masked off after the last)
        if NORM:
            row_mask = m_mask[:, None] & k_mask[None, :]
            if HAS_RESIDUAL:  # the sum as the norm kernel rounds it; one program stores it
                a = (a + tl.load(residual_rows + k + offs_k[None, :], mask=row_mask, other=0.0).to(tl.float32))
                a = a.to(x_ptr.dtype.element_ty)
                if tl.program_id(0) == 0:
                    tl.store(residual_out_rows + k + offs_k[None, :], a, mask=row_mask)
                a = a.to(tl.float32)
            sum_sq += tl.sum(a * a, axis=1)
            if NORM_WEIGHT_AHEAD:
                a = a * norm_w[None, :]
                norm_w = tl.load(norm_weight_ptr + next_k, mask=next_k < K, other=0.0).to(tl.float32)
            else:
                a = a * tl.load(norm_weight_ptr + k + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        products = a[:, None, :] * w.to(tl.float32)[None, :, :]
        w = tl.load(w_rows + next_k[None, :], mask=n_mask[:, None] & (next_k < K)[None, :], other=0.0)
        if SUM_EACH_SLICE:
            out += tl.sum(products, axis=2)
        else:
            acc += products
    if not SUM_EACH_SLICE:
        out = tl.sum(acc, axis=2)
    if NORM:
        out = out * (1.0 / tl.sqrt(sum_sq / K + eps))[:, None]
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * out_stride + offs_n[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
# --8<-- [end:skinny-gemm-kernel]


# (BLOCK_N, BLOCK_K, num_warps, num_stages, sum_each_slice): within 2 % of the fastest variant
# on every product that skinny_gemm_wins picks, in the H200 sweep (scripts/gpu/sweep_skinny_gemm.py,
# each product timed alone, before programmatic dependent launch).
SKINNY_TILE = (4, 512, 4, 2, False)
# For 1-2 tokens under PDL: two weight rows per program and 1,024-wide slices, so that for
# K = 1,024 (Qwen3-0.6B's qkv and gate_up) a program's whole tile is loaded before gdc_wait,
# while the previous kernel still runs. Chosen in the whole engine, where it made Qwen3-0.6B's
# batch-1 decode step 7-10 % faster (scripts/gpu/engine_variants.py skinny-tile=..., chapter 06).
SKINNY_TILE_FEW_TOKENS = (2, 1024, 4, 2, False)


def skinny_tile(num_tokens: int) -> tuple[int, int, int, int, bool]:
    """The skinny GEMM's default tile for a product of `num_tokens` rows."""
    return SKINNY_TILE_FEW_TOKENS if num_tokens <= 2 else SKINNY_TILE


# --8<-- [start:skinny-gemm-wins]
def skinny_gemm_wins(num_tokens: int, n: int, k: int) -> bool:
    """Whether this kernel beats cuBLAS on a [num_tokens, k] x [n, k] product.

    For one token, every product. Timed alone (the H200 sweep, chapter 06), cuBLAS won on the
    matrices of more than 4 Mi elements (gate_up, Llama's qkv and down); but in the engine's
    batch-1 step, under PDL and with the 1-2 token tile, the kernel loads its weights while the
    kernel before it still runs, which cuBLAS does not: with it on every product the step took
    1.014 ms against 1.027 for Qwen3-0.6B and 1.136 against 1.209 for Llama-3.2-1B (an H100,
    `skinny-few=1` in scripts/gpu/engine_variants.py). For two tokens it lost there (1.117
    against 1.108, 1.403 against 1.254), so from two tokens on the sweep decides: matrices of at
    most 4 Mi elements (8 MiB in bf16), of at most 2,048 rows for two tokens and 1,024 for three
    or four; cuBLAS for the rest and at eight tokens.
    """
    if num_tokens == 1:
        return True
    if n * k > 4 << 20:
        return False
    return n <= (2048 if num_tokens == 2 else 1024) and num_tokens <= 4
# --8<-- [end:skinny-gemm-wins]


# Which products after an RMSNorm do the norm themselves (`rms_norm_skinny_gemm`): of at most
# this many tokens, with at most this many input features (one slice of the 1-2 token tile).
NORM_IN_PRODUCT_MAX_TOKENS = 1
NORM_IN_PRODUCT_MAX_K = SKINNY_TILE_FEW_TOKENS[1]
# The norm weight's slices loaded one ahead (as measured) or where they are used (fewer
# registers, not yet timed: chapter 06; `scripts/gpu/engine_variants.py norm-weight-at-use`).
NORM_WEIGHT_LOADED_AHEAD = True


# --8<-- [start:norm-in-product-wins]
def norm_in_product_wins(num_tokens: int, k: int) -> bool:
    """Whether a product the skinny GEMM takes should also do the RMSNorm before it.

    Measured in the engine on an H100 (chapter 06, "The norm beside the weight stream"), with
    the norm in every one-token product after it: Qwen3-0.6B (K = 1,024, one slice) replayed
    its batch-1 step in 0.892-0.893 ms against 0.903-0.904 with the norm kernel, three runs
    each; Llama-3.2-1B (K = 2,048, two slices) in 1.033 against 0.951. So one token, one slice.
    """
    return num_tokens <= NORM_IN_PRODUCT_MAX_TOKENS and k <= NORM_IN_PRODUCT_MAX_K
# --8<-- [end:norm-in-product-wins]


def skinny_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gated_input: bool = False,
    block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
    sum_each_slice: bool | None = None, use_pdl: bool | None = None,
) -> torch.Tensor:
    """`x @ weight.T (+ bias)` for x of at most SKINNY_MAX_TOKENS rows (after flattening).

    With `gated_input`, x's rows are [gate | up] (twice weight's in-features) and the product
    is `(silu(gate) * up) @ weight.T`, SiLU-and-mul done inside the kernel.
    """
    n, k = weight.shape
    x2 = _rows(x, 2 * k if gated_input else k)
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    _launch(x2, weight, bias, out, gated_input, None, block_n, block_k, num_warps, num_stages, sum_each_slice, use_pdl)
    return out.view(*x.shape[:-1], n)


def rms_norm_skinny_gemm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(RMSNorm(x + residual) @ weight.T (+ bias), x + residual)`: the norm kernel, then the product."""
    normed, new_residual = fused_add_rms_norm_reference(x, residual, norm_weight, eps)
    return skinny_gemm_reference(normed, weight, bias), new_residual


# --8<-- [start:rms-norm-skinny-gemm]
def rms_norm_skinny_gemm(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None, block_k: int | None = None, use_pdl: bool | None = None,
    norm_weight_ahead: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add, the RMSNorm and the product after it, in one kernel: returns
    `(RMSNorm(x + residual) @ weight.T (+ bias), x + residual)`; with `residual` None the
    input is x and the second result is x itself.

    The normalized row is never stored: each program multiplies (x + residual) * norm_weight
    into its weight rows and scales its sums by the row's 1 / rms at the end. So it is not
    rounded to the model dtype between the norm and the product, as it is between the two
    kernels; the results agree to that rounding.
    """
    n, k = weight.shape
    if norm_weight.shape != (k,):
        raise ValueError(f"norm weight has shape {tuple(norm_weight.shape)}, the product needs ({k},)")
    x2 = _rows(x, k)
    residual_in = residual_out = None
    if residual is not None:
        residual_in = residual.reshape(-1, k).contiguous()  # the kernel steps K elements from row to row
        residual_out = torch.empty_like(x2)
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    ahead = NORM_WEIGHT_LOADED_AHEAD if norm_weight_ahead is None else norm_weight_ahead
    norm = _NormInput(norm_weight, eps, residual_in, residual_out, ahead)
    _launch(x2, weight, bias, out, False, norm, block_k=block_k, use_pdl=use_pdl)
    return out.view(*x.shape[:-1], n), (x if residual is None else residual_out.view(x.shape))
# --8<-- [end:rms-norm-skinny-gemm]


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """x as [tokens, width] with unit stride along a row, for at most SKINNY_MAX_TOKENS tokens."""
    x2 = x.reshape(-1, width)
    if x2.shape[0] > SKINNY_MAX_TOKENS:
        raise ValueError(f"skinny_gemm is for at most {SKINNY_MAX_TOKENS} tokens, got {x2.shape[0]}")
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


class _NormInput(NamedTuple):
    """What the kernel needs to do the add + RMSNorm before its product (`NORM`)."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None  # None: no residual to add
    residual_out: torch.Tensor | None
    weight_ahead: bool  # NORM_WEIGHT_AHEAD


def _launch(
    x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, gated_input: bool,
    norm: _NormInput | None, block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, sum_each_slice: bool | None = None, use_pdl: bool | None = None,
) -> None:
    """One launch of the skinny GEMM kernel, with the norm before its product when `norm` is given."""
    m, (n, k) = x2.shape[0], weight.shape
    if m == 0:
        return
    weight = weight.contiguous()  # the kernel steps K elements from row to row
    tile = skinny_tile(m)
    block_n = block_n or tile[0]
    block_k = min(block_k or tile[1], next_power_of_2(k))  # a slice wider than K only adds masked lanes
    num_warps, num_stages = num_warps or tile[2], num_stages or tile[3]
    sum_each_slice = tile[4] if sum_each_slice is None else sum_each_slice
    use_pdl = pdl_enabled(x2.device) if use_pdl is None else use_pdl
    with_norm = norm is not None
    norm = norm or _NormInput(weight, 0.0, None, None, False)  # pointers the kernel leaves unread without NORM
    residual, residual_out = norm.residual, norm.residual_out
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x2, weight, bias if bias is not None else weight, out, m, n, k, x2.stride(0), out.stride(0),
        norm.weight, residual if residual is not None else x2, residual_out if residual_out is not None else x2, norm.eps,
        HAS_BIAS=bias is not None, BLOCK_M=next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        SUM_EACH_SLICE=sum_each_slice, USE_PDL=use_pdl, GATED=gated_input,
        NORM=with_norm, HAS_RESIDUAL=residual is not None, NORM_WEIGHT_AHEAD=norm.weight_ahead,
        num_warps=num_warps, num_stages=num_stages,
        **pdl_launch_options(use_pdl),
    )
