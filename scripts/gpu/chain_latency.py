"""What a kernel costs in a chain of dependent kernels, in a CUDA graph (chapters 05, 06).

    python scripts/gpu/chain_latency.py --json chain.json      (on the GPU machine)

At batch 1 a decode step is a chain of ~250 small kernels, each reading what the one before
wrote. This measures, each in a CUDA graph replayed many times:

1. the floor: a chain of 256 kernels that each add one to a 1,024-element vector, with and
   without programmatic dependent launch (PDL): the time one dependent kernel costs, whatever
   it does;
2. for the pre-norm products (qkv, gate_up of Qwen3-0.6B and Llama-3.2-1B) at 1 and 2 tokens,
   a chain of one such product per layer (distinct weights, so they come from memory, as in a
   step), three ways: the product alone (skinny GEMM), and the fused add + RMSNorm kernel
   before it with cuBLAS or with the skinny GEMM. The difference is what the norm kernel
   costs in the chain: the most that doing the norm inside the product could save.

Prints a table last; `--json` writes every number with the copy bandwidth measured in the run.
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
from minivllm.kernels import fused_add_rms_norm, skinny_gemm, skinny_gemm_reference  # noqa: E402
from minivllm.kernels._utils import pdl_launch_options  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--json", default=None)
parser.add_argument("--replays", type=int, default=50)
args = parser.parse_args()


@triton.jit
def _add_one_kernel(x_ptr, out_ptr, N: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) + 1.0)


device = torch.device("cuda")
results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "copy_GBps": copy_bandwidth_gbps()}

# 1. The floor of a dependent kernel.
vectors = [torch.zeros(1024, device=device, dtype=torch.bfloat16) for _ in range(2)]
for use_pdl in (False, True):
    def add_chain(use_pdl=use_pdl):
        for i in range(256):
            _add_one_kernel[(1,)](vectors[i % 2], vectors[(i + 1) % 2], N=1024, USE_PDL=use_pdl,
                                  **pdl_launch_options(use_pdl))
    results[f"empty_kernel_us_pdl={use_pdl}"] = graph_us_per_call(add_chain, 256, args.replays)

# 2. Pre-norm products in a chain, one per layer.
SHAPES = {  # (model, product): (N, K, layers)
    ("qwen3-0.6b", "qkv"): (4096, 1024, 28), ("qwen3-0.6b", "gate_up"): (6144, 1024, 28),
    ("llama-3.2-1b", "qkv"): (3072, 2048, 16), ("llama-3.2-1b", "gate_up"): (16384, 2048, 16),
}
rows = []
for (model, product), (n, k, layers) in SHAPES.items():
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5 for _ in range(layers)]
    norm_weight = torch.rand(k, device=device, dtype=torch.bfloat16) + 0.5
    for tokens in (1, 2):
        x0 = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
        residual0 = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
        # Correctness at this shape against the float32 reference.
        got, want = skinny_gemm(x0, weights[0]), skinny_gemm_reference(x0, weights[0])
        rel_err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert rel_err < 1e-2, (model, product, tokens, rel_err)  # bf16 output rounding is ~4e-3

        def chain(way):
            def run():
                x, residual = x0, residual0
                for w in weights:
                    if way == "skinny alone":
                        out = skinny_gemm(x, w)
                    else:
                        h, residual = fused_add_rms_norm(x, residual, norm_weight, 1e-6)
                        out = skinny_gemm(h, w) if way == "norm + skinny" else F.linear(h, w)
                    x = out[:, :k]  # the next layer's input (a view: unit stride in the last dimension)
            return run

        row = {"model": model, "product": product, "N": n, "K": k, "tokens": tokens, "layers": layers,
               "rel_err": rel_err, "floor_us": n * k * 2 / results["copy_GBps"] / 1e3}
        for way in ("skinny alone", "norm + cublas", "norm + skinny"):
            row[way] = graph_us_per_call(chain(way), layers, args.replays)
        rows.append(row)
results["chains"] = rows

if args.json:
    json.dump(results, open(args.json, "w"), indent=1)
print(f"copy {results['copy_GBps']:.0f} GB/s; a dependent kernel in a graph: "
      f"{results['empty_kernel_us_pdl=False']:.2f} µs without PDL, {results['empty_kernel_us_pdl=True']:.2f} µs with")
print(f"{'model':13} {'product':8} {'tok':>3} {'floor':>6} {'skinny':>7} {'norm+cuBLAS':>11} {'norm+skinny':>11} "
      f" (µs per layer)")
for r in rows:
    print(f"{r['model']:13} {r['product']:8} {r['tokens']:>3} {r['floor_us']:6.2f} {r['skinny alone']:7.2f} "
          f"{r['norm + cublas']:11.2f} {r['norm + skinny']:11.2f}")
