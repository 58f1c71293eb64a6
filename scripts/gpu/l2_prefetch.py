"""Does prefetching the coming weights into L2 shorten a batch-1 layer? (chapters 05, 06)

    python scripts/gpu/l2_prefetch.py --json prefetch.json      (on the GPU machine)

1. What a prefetch of 8 MiB costs by itself, after a write that flushes L2 (each of the
   kernel's three ways, `l2_prefetch_kernel.py`, at a few chunk sizes).
2. A batch-1 layer without attention, 28 times in a CUDA graph (Qwen3-0.6B and Llama-3.2-1B
   shapes; add + RMSNorm, qkv, a norm standing in for RoPE, o, add + RMSNorm, gate_up, down
   with SiLU-and-mul), each layer its own weights: with no prefetch, with every layer sharing
   one set of weights (they stay in L2: the ceiling of what prefetching can give), and with
   a side stream that prefetches the next half-layer's (or the next layer's) weights when
   each half starts. Every variant's output is checked against the plain chain's.

A measured negative result (chapter 06, "Prefetching the next weights into L2"): every
prefetch variant was slower than none; the engine does not prefetch.

Prints a table last; `--json` writes every number.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.getcwd())
from minivllm.bench.ceilings import copy_bandwidth_gbps, graph_us_per_call  # noqa: E402
from minivllm.kernels import fused_add_rms_norm, skinny_gemm  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from l2_prefetch_kernel import l2_prefetch  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--json", default=None)
parser.add_argument("--replays", type=int, default=50)
args = parser.parse_args()

device = torch.device("cuda")
props = torch.cuda.get_device_properties(device)
results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "l2_bytes": props.L2_cache_size, "copy_GBps": copy_bandwidth_gbps()}
bf16 = torch.bfloat16

# 1. What prefetching 8 MiB costs on its own, after a 64 MiB write that flushes L2.
weight = torch.randn(4096, 1024, device=device, dtype=bf16) * 1024**-0.5
flush = torch.empty(64 << 20, dtype=torch.uint8, device=device)
PREFETCHES = [("bulk", 64 << 10), ("bulk", 256 << 10), ("bulk", 1 << 20), ("lines", 256 << 10), ("loads", 64 << 10),
              ("loads", 256 << 10)]
for mode, per_program in PREFETCHES:
    key = f"{mode},{per_program >> 10}KiB"
    results[f"flush_and_prefetch_8MiB_{key}_us"] = graph_us_per_call(
        lambda: [(flush.fill_(1), l2_prefetch(weight, mode=mode, bytes_per_program=per_program))], 1, args.replays)
results["flush_64MiB_alone_us"] = graph_us_per_call(lambda: flush.fill_(1), 1, args.replays)

# 2. Layers without attention.
SHAPES = {  # hidden, q size, kv size, intermediate, layers
    "qwen3-0.6b": (1024, 2048, 1024, 3072, 28),
    "llama-3.2-1b": (2048, 2048, 512, 8192, 16),
}
side = torch.cuda.Stream()


def layer_weights(hidden, q, kv, inter):
    def w(n, k):
        return torch.randn(n, k, device=device, dtype=bf16) * k**-0.5
    return {"qkv": w(q + 2 * kv, hidden), "o": w(hidden, q), "gate_up": w(2 * inter, hidden), "down": w(hidden, inter)}


rows = []
for shape, (hidden, q, kv, inter, num_layers) in SHAPES.items():
    layers = [layer_weights(hidden, q, kv, inter) for _ in range(num_layers)]
    norm_w = torch.rand(hidden, device=device, dtype=bf16) + 0.5
    head_norm_w = torch.rand(q + 2 * kv, device=device, dtype=bf16) + 0.5
    h0 = torch.randn(1, hidden, device=device, dtype=bf16)

    def chain(weights, prefetch=None, budget=None, mode="bulk", per_program=256 << 10):
        def issue(tensors):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                left = budget
                for t in tensors:
                    nbytes = t.numel() * t.element_size() if left is None else min(left, t.numel() * t.element_size())
                    if nbytes > 0:
                        l2_prefetch(t, nbytes, mode=mode, bytes_per_program=per_program)
                    if left is not None:
                        left -= nbytes

        def run():
            h, residual = h0.clone(), torch.zeros_like(h0)
            for i, w in enumerate(weights):
                nxt = weights[i + 1] if i + 1 < len(weights) else None
                if prefetch == "half":
                    issue([w["gate_up"], w["down"]])
                elif prefetch == "layer" and nxt is not None:
                    issue([nxt["qkv"], nxt["o"], nxt["gate_up"], nxt["down"]])
                h, residual = fused_add_rms_norm(h, residual, norm_w, 1e-6)
                qkv = skinny_gemm(h, w["qkv"])
                qkv, _ = fused_add_rms_norm(qkv, None, head_norm_w, 1e-6)  # stands in for RoPE
                attn = qkv[:, :q]
                h = skinny_gemm(attn, w["o"])
                if prefetch == "half" and nxt is not None:
                    issue([nxt["qkv"], nxt["o"]])
                h, residual = fused_add_rms_norm(h, residual, norm_w, 1e-6)
                gate_up = torch.nn.functional.linear(h, w["gate_up"])
                h = skinny_gemm(gate_up, w["down"], gated_input=True)
            if prefetch is not None:
                torch.cuda.current_stream().wait_stream(side)
            return h
        return run

    floor_us = sum(t.numel() * 2 for t in layers[0].values()) / (results["copy_GBps"] * 1e3)
    variants = {
        "no prefetch": chain(layers),
        "shared weights (in L2)": chain([layers[0]] * num_layers),
        **{f"half-layer ahead, {mode} {per_program >> 10} KiB": chain(layers, "half", mode=mode, per_program=per_program)
           for mode, per_program in PREFETCHES},
        "half-layer ahead, bulk 256 KiB, 16 MiB cap": chain(layers, "half", budget=16 << 20),
        "the side stream's fork and join alone (16 bytes)": chain(layers, "half", budget=16),
        "next layer at layer start": chain(layers, "layer"),
    }
    want = variants["no prefetch"]()
    for name, fn in variants.items():
        if "shared" not in name:  # the same weights give the same output, prefetch or not
            assert torch.equal(fn(), want), name
        us = graph_us_per_call(fn, num_layers, args.replays)
        rows.append({"shape": shape, "variant": name, "us_per_layer": us, "floor_us": floor_us})
        print(shape, name, round(us, 2), flush=True)
results["layers"] = rows

if args.json:
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in results.items() if k != "layers"})
print(f"{'shape':14} {'variant':50} {'us/layer':>9} {'floor':>6}")
for r in rows:
    print(f"{r['shape']:14} {r['variant']:50} {r['us_per_layer']:9.2f} {r['floor_us']:6.2f}")
