"""The skinny GEMM kernel against cuBLAS at the weight shapes of a batch-1..8 decode step (chapter 06).

    python scripts/gpu/sweep_skinny_gemm.py --json skinny.json   (on the GPU machine)

Qwen3-0.6B's and Llama-3.2-1B's matrices (qkv, o, gate_up, down, lm_head). Each variant runs
inside a CUDA graph over enough distinct copies of the weight to exceed the 60 MB L2 twice, as
a model's successive layers do, so the time is launch-free and the weights come from memory.
Every variant is checked against the float32 reference; GB/s counts the weight bytes read,
against the copy bandwidth measured in the same run. The last table is the per-step total:
each model's layers' four products plus the LM head, best variant per shape vs cuBLAS.
"""

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
from minivllm.bench.ceilings import copy_bandwidth_gbps  # noqa: E402
from minivllm.kernels.gemm import skinny_gemm, skinny_gemm_reference, skinny_tile  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
parser.add_argument("--json", default=None)
args = parser.parse_args()

# name -> (layers, [(matrix, N, K)])
MODELS = {
    "qwen3-0.6b": (28, [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072),
                        ("lm_head", 151936, 1024)]),
    "llama-3.2-1b": (16, [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192),
                          ("lm_head", 128256, 2048)]),
}
VARIANTS = [
    dict(block_n=bn, block_k=bk, num_warps=w, num_stages=s, sum_each_slice=e)
    for bn, bk, w, s, e in itertools.product([4, 8, 16], [128, 256, 512], [4, 8], [2, 4], [False, True])
]


def m_pad(m: int) -> int:
    return 1 << max(0, (m - 1).bit_length())


def graph_time_us(fn, weights, x, reps: int = 5) -> float:
    """Mean time of fn(x, w) per call, over a CUDA graph that calls it on every copy, reps times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights:
            fn(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for w in weights:
                fn(x, w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (reps * len(weights)))
    del graph
    return sorted(times)[len(times) // 2]


copy = copy_bandwidth_gbps()
print(f"copy bandwidth {copy:.0f} GB/s")
results = {"copy_GBps": copy, "device": torch.cuda.get_device_name(), "shapes": []}
summary = []
for model, (layers, shapes) in MODELS.items():
    for m in args.tokens:
        per_step = {"cublas": 0.0, "best": 0.0, "default": 0.0}
        for matrix, n, k in shapes:
            nbytes = n * k * 2
            copies = max(2, -(-120_000_000 // nbytes))
            gen = torch.Generator(device="cuda").manual_seed(0)
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02 for _ in range(copies)]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = skinny_gemm_reference(x, weights[0])
            row = {"model": model, "matrix": matrix, "tokens": m, "N": n, "K": k, "bytes": nbytes}
            row["cublas_us"] = graph_time_us(lambda x, w: F.linear(x, w), weights, x)
            cublas_err = ((F.linear(x, weights[0]).float() - ref.float()).norm() / ref.float().norm()).item()
            row["cublas_rel_err"] = cublas_err

            def measure(v: dict) -> dict | None:
                try:
                    out = skinny_gemm(x, weights[0], **v)
                except Exception as e:  # too many registers or too much shared memory: skipped and said so
                    print(f"{model} {matrix} m={m} {v}: {type(e).__name__}")
                    return None
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                if err > 2e-2:  # a wrong variant is reported, never timed as a candidate
                    print(f"{model} {matrix} m={m} {v}: WRONG, relative error {err:.2e}")
                    return None
                t = graph_time_us(lambda x, w: skinny_gemm(x, w, **v), weights, x)
                return {**v, "us": t, "GBps": nbytes / t / 1e3, "rel_err": err}

            default = measure(dict(zip(("block_n", "block_k", "num_warps", "num_stages", "sum_each_slice"), skinny_tile(m))))
            # Variants whose tile holds more than 256 float32 values per thread would spill: skipped.
            fits = [v for v in VARIANTS if m_pad(m) * v["block_n"] * v["block_k"] <= 256 * 32 * v["num_warps"]]
            variants = [r for r in map(measure, fits) if r is not None]
            best = min(variants, key=lambda r: r["us"])
            row.update(best=best, default=default, top=sorted(variants, key=lambda r: r["us"])[:8])
            results["shapes"].append(row)
            count = 1 if matrix == "lm_head" else layers
            per_step["cublas"] += count * row["cublas_us"]
            per_step["best"] += count * min(best["us"], row["cublas_us"])
            per_step["default"] += count * default["us"]
            print(f"{model:13s} m={m} {matrix:8s} cuBLAS {row['cublas_us']:7.2f} us ({nbytes / row['cublas_us'] / 1e3:5.0f} GB/s)"
                  f"  best {best['us']:7.2f} us ({best['GBps']:5.0f} GB/s = {best['GBps'] / copy:.2f}x copy)"
                  f" bn{best['block_n']} bk{best['block_k']} w{best['num_warps']} s{best['num_stages']}"
                  f" e{int(best['sum_each_slice'])}  default {default['us']:7.2f} us", flush=True)
            weights.clear()
            torch.cuda.empty_cache()
        summary.append((model, m, per_step))
results["per_step"] = [{"model": a, "tokens": m, **p} for a, m, p in summary]
if args.json:
    json.dump(results, open(args.json, "w"), indent=1)
print("\nper decode step, all products (us): model, tokens, cuBLAS, best per shape, default tile")
for model, m, p in summary:
    print(f"  {model:13s} m={m}: cuBLAS {p['cublas']:7.1f}  best {p['best']:7.1f}  default {p['default']:7.1f}")
