"""The residual add + RMSNorm after a product, done by the product's last program (chapters 05, 06).

    python scripts/gpu/norm_epilogue.py --json norm-epilogue.json      (on the GPU machine)

A decoder layer's o and down products are each followed by the fused add + RMSNorm kernel,
two of the eight kernels of a batch-1 layer. A norm needs the whole row, and each program of
the skinny GEMM computes only two of its outputs, so the norm cannot be a plain epilogue. But
the program that finishes last can do it: every program stores its outputs, then adds one to
a counter; the one that sees the count reach the number of programs knows every output is
written, resets the counter, and normalizes the rows (the decode kernel's in-kernel merge does
the same). That takes a kernel boundary out of the chain and adds a serial tail to the product
(an atomic, a read of the rows from L2, the norm). Which costs more is measured here, in a
chain of layers captured in a CUDA graph with PDL, as the engine replays them:

    pre product (qkv and attention's stand-in, or gate_up) -> post product (o, or down with
    SiLU-and-mul) -> add + RMSNorm -> the next layer's pre product ...

three ways: the post product without any norm (what the norm costs at most), followed by the
norm kernel (the engine today), and with the norm in its last program. Correctness first: the
fused way's new residual must equal the norm kernel's bit for bit and its normalized rows
within one bf16 rounding. The product is a copy of the library kernel's loop, so that the
norm's weight can be loaded before the PDL wait; the fourth way (this copy, then the norm
kernel) checks that the copy times as the library's kernel does. Prints a table last;
`--json` writes every number.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.getcwd())
from minivllm.bench.ceilings import copy_bandwidth_gbps, graph_us_per_call  # noqa: E402
from minivllm.kernels import fused_add_rms_norm, skinny_gemm  # noqa: E402
from minivllm.kernels._utils import next_power_of_2, pdl_enabled, pdl_launch_options  # noqa: E402
from minivllm.kernels.gemm import skinny_gemm_wins, skinny_tile  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--json", default=None)
parser.add_argument("--replays", type=int, default=50)
args = parser.parse_args()


@triton.jit
def _skinny_add_norm_kernel(
    x_ptr, weight_ptr, out_ptr, residual_ptr, norm_weight_ptr, normed_ptr, counter_ptr, M, N, K, x_stride, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr,
    GATED: tl.constexpr, FUSE_NORM: tl.constexpr, USE_PDL: tl.constexpr,
):
    """The skinny GEMM (minivllm/kernels/gemm.py, one accumulator reduced after the loop, PDL
    on), then with FUSE_NORM: residual += out, normed = RMSNorm(residual), by the last program."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = weight_ptr + offs_n.to(tl.int64)[:, None] * K
    x_rows = x_ptr + offs_m[:, None] * x_stride
    w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & (offs_k < K)[None, :], other=0.0)
    if FUSE_NORM:  # the norm's weight never changes either: loaded before the wait by every program
        offs = tl.arange(0, NORM_BLOCK)
        norm_w = tl.load(norm_weight_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + offs_k) < K
        a = tl.load(x_rows + k + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if GATED:
            gate = a.to(tl.float32)
            up = tl.load(x_rows + K + k + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            a = (gate / (1.0 + tl.exp(-gate)) * up.to(tl.float32)).to(x_ptr.dtype.element_ty)
        products = a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        next_k = k + BLOCK_K + offs_k
        w = tl.load(w_rows + next_k[None, :], mask=n_mask[:, None] & (next_k < K)[None, :], other=0.0)
        acc += products
    out = tl.sum(acc, axis=2)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])
    if FUSE_NORM:
        # Every program's outputs stored (the barrier), then counted (the atomic releases them
        # to the GPU); the one that sees num_programs - 1 is the last and sees them all.
        tl.debug_barrier()
        if tl.atomic_add(counter_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            tl.atomic_xchg(counter_ptr, 0)
            mask = offs < N
            for m in range(0, M):
                y = tl.load(out_ptr + m * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
                r = tl.load(residual_ptr + m * N + offs, mask=mask, other=0.0)
                h = (y.to(tl.float32) + r.to(tl.float32)).to(residual_ptr.dtype.element_ty)
                tl.store(residual_ptr + m * N + offs, h, mask=mask)
                hf = h.to(tl.float32)
                rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / N + eps)
                tl.store(normed_ptr + m * N + offs, (hf * rstd * norm_w).to(normed_ptr.dtype.element_ty), mask=mask)


COUNTER = torch.zeros(1, dtype=torch.int32, device="cuda" if torch.cuda.is_available() else "cpu")


def skinny_add_norm(x, weight, residual, norm_weight, eps, gated=False, fuse=True):
    """(normed, residual) = add_rms_norm(x @ weight.T, residual), residual updated in place."""
    n, k = weight.shape
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    normed = torch.empty_like(out)
    block_n, block_k, warps, stages, _ = skinny_tile(m)
    _skinny_add_norm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, residual, norm_weight, normed, COUNTER, m, n, k, x.stride(0), eps,
        BLOCK_M=next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=min(block_k, next_power_of_2(k)),
        NORM_BLOCK=next_power_of_2(n), GATED=gated, FUSE_NORM=fuse, USE_PDL=pdl_enabled(x.device),
        num_warps=warps, num_stages=stages, **pdl_launch_options(pdl_enabled(x.device)),
    )
    return (normed if fuse else out), residual


def pre_product(x, weight):  # the engine's rule: the skinny GEMM where it wins, else cuBLAS
    n, k = weight.shape
    return skinny_gemm(x, weight) if skinny_gemm_wins(x.shape[0], n, k) else F.linear(x, weight)


device = torch.device("cuda")
results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "copy_GBps": copy_bandwidth_gbps()}
# (model, post product): (hidden, pre product's N, post product's K, gated, layers)
SHAPES = {
    ("qwen3-0.6b", "o"): (1024, 2048, 2048, False, 28),
    ("qwen3-0.6b", "down"): (1024, 6144, 3072, True, 28),
    ("llama-3.2-1b", "o"): (2048, 2048, 2048, False, 16),
    ("llama-3.2-1b", "down"): (2048, 16384, 8192, True, 16),
}
EPS = 1e-6
rows = []
for (model, product), (hidden, pre_n, post_k, gated, layers) in SHAPES.items():
    pre_w = [torch.randn(pre_n, hidden, device=device, dtype=torch.bfloat16) * hidden**-0.5 for _ in range(layers)]
    post_w = [torch.randn(hidden, post_k, device=device, dtype=torch.bfloat16) * post_k**-0.5 for _ in range(layers)]
    norm_w = torch.rand(hidden, device=device, dtype=torch.bfloat16) + 0.5
    for tokens in (1, 2, 4):
        if not skinny_gemm_wins(tokens, hidden, post_k):
            continue  # the engine keeps this post product on cuBLAS: nothing to fuse into
        x0 = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
        residual0 = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
        # Correctness: one layer's post product + norm, fused against the norm kernel after the
        # library's skinny GEMM.
        pre = pre_product(x0, pre_w[0])
        want_normed, want_residual = fused_add_rms_norm(skinny_gemm(pre, post_w[0], gated_input=gated), residual0, norm_w, EPS)
        got_residual = residual0.clone()
        got_normed, _ = skinny_add_norm(pre, post_w[0], got_residual, norm_w, EPS, gated)
        torch.cuda.synchronize()
        assert COUNTER.item() == 0, "the last program must reset the counter"
        residual_equal = torch.equal(got_residual, want_residual)
        # The sum of squares may be reduced in another order: one bf16 rounding apart at most.
        normed_err = ((got_normed.float() - want_normed.float()).abs() / want_normed.float().abs().clamp_min(1e-3)).max().item()
        assert residual_equal and normed_err <= 2**-7, (model, product, tokens, residual_equal, normed_err)

        def chain(way):
            def run():
                x, residual = x0, residual0.clone()
                for pw, qw in zip(pre_w, post_w):
                    h = pre_product(x, pw)
                    if way == "no norm":
                        y = skinny_gemm(h, qw, gated_input=gated)
                    elif way == "norm kernel":
                        y, residual = fused_add_rms_norm(skinny_gemm(h, qw, gated_input=gated), residual, norm_w, EPS)
                    elif way == "script kernel + norm kernel":  # the same product, this script's copy
                        y, _ = skinny_add_norm(h, qw, residual, norm_w, EPS, gated, fuse=False)
                        y, residual = fused_add_rms_norm(y, residual, norm_w, EPS)
                    else:
                        y, residual = skinny_add_norm(h, qw, residual, norm_w, EPS, gated)
                    x = y
            return run

        row = {"model": model, "product": product, "tokens": tokens, "layers": layers,
               "normed_max_rel_err": normed_err, "residual_bit_equal": residual_equal}
        for way in ("no norm", "norm kernel", "script kernel + norm kernel", "norm in last program"):
            row[way] = graph_us_per_call(chain(way), layers, args.replays)
        rows.append(row)
        print(row, flush=True)
results["chains"] = rows

if args.json:
    json.dump(results, open(args.json, "w"), indent=1)
print(f"copy {results['copy_GBps']:.0f} GB/s; µs per layer of the chain (pre product, post product, norm)")
print(f"{'model':13} {'post':5} {'tok':>3} {'no norm':>8} {'norm kernel':>11} {'same, copy':>10} {'in last prog':>12} {'saved':>6}")
for r in rows:
    print(f"{r['model']:13} {r['product']:5} {r['tokens']:>3} {r['no norm']:8.2f} {r['norm kernel']:11.2f} "
          f"{r['script kernel + norm kernel']:10.2f} {r['norm in last program']:12.2f} "
          f"{r['norm kernel'] - r['norm in last program']:6.2f}")
