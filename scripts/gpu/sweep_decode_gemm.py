"""cuBLAS on the matrix products of decode steps at batch 16-256, against their floors (chapter 05).

    python scripts/gpu/sweep_decode_gemm.py --json decode-gemm.json   (on the GPU machine)

For each linear layer of Qwen3-0.6B and Llama-3.2-1B (the LM head too) and M tokens: the
product through `F.linear` (what the engine's layers call at these sizes), timed in a CUDA
graph over enough weight copies to miss the L2, beside its floor: the longer of reading the
weight at the copy bandwidth and doing 2*M*N*K FLOPs at the bf16 matrix rate, both measured
in the same run. A product far above its floor is where a throughput run's matrix time goes.
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
from minivllm.bench.ceilings import copy_bandwidth_gbps  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--json", default=None)
args = parser.parse_args()

copy = copy_bandwidth_gbps()
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
torch.matmul(a, a)
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(10):
    torch.matmul(a, a)
end.record()
torch.cuda.synchronize()
matrix_tflops = 10 * 2 * 8192**3 / (start.elapsed_time(end) * 1e-3) / 1e12
del a

SHAPES = {  # name: (N, K) of the weight
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
                   "lm_head": (151936, 1024)},
    "llama-3.2-1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
                     "lm_head": (128256, 2048)},
}
rows = []
for model, layers in SHAPES.items():
    for name, (n, k) in layers.items():
        copies = max(2, (512 << 20) // (n * k * 2))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        for m in (16, 64, 128, 256):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for w in weights:
                F.linear(x, w)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for w in weights:
                    F.linear(x, w)
            graph.replay()
            torch.cuda.synchronize()
            start.record()
            for _ in range(5):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) * 1e3 / (5 * copies)
            read_us = n * k * 2 / (copy * 1e3)
            math_us = 2 * m * n * k / (matrix_tflops * 1e6)
            floor = max(read_us, math_us)
            rows.append({"model": model, "matrix": name, "M": m, "N": n, "K": k, "us": us, "read_us": read_us,
                         "math_us": math_us, "times_floor": us / floor})
        del weights
print(f"copy {copy:.0f} GB/s, bf16 matrix rate {matrix_tflops:.0f} TFLOP/s")
print(f"{'model':14s} {'matrix':8s} {'M':>4s} {'us':>8s} {'read':>7s} {'math':>7s} {'x floor':>7s}")
for r in rows:
    print(f"{r['model']:14s} {r['matrix']:8s} {r['M']:4d} {r['us']:8.1f} {r['read_us']:7.1f} {r['math_us']:7.1f} "
          f"{r['times_floor']:7.2f}")
if args.json:
    json.dump({"copy_GBps": copy, "matrix_tflops": matrix_tflops, "rows": rows}, open(args.json, "w"), indent=1)
