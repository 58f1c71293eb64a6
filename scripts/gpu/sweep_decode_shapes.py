"""The paged decode kernel at the shapes of the throughput benchmark's decode steps (chapter 06).

    python scripts/gpu/sweep_decode_shapes.py --json decode-shapes.json   (on the GPU machine)

For Qwen3-0.6B (16 query / 8 KV heads, head_dim 128) and Llama-3.2-1B (32 / 8, head_dim 64):
256 sequences with contexts drawn uniformly from [100, 1024] + [0, 1024) (the nano-vllm
workload in mid-decode), block size 16, blocks shuffled. Times every (tile, warps, stages)
variant at the launcher's own split count, checks each against the reference, and prints
GB/s of K/V read against the copy bandwidth measured in the same run.
"""

import argparse
import itertools
import json
import os
import sys

import torch
import triton

sys.path.insert(0, os.getcwd())
from minivllm.bench.ceilings import copy_bandwidth_gbps  # noqa: E402
from minivllm.kernels.paged_attention import paged_decode_attention, paged_decode_attention_reference  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=256)
parser.add_argument("--json", default=None)
args = parser.parse_args()

ms = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
copy = copy_bandwidth_gbps()
gen = torch.Generator().manual_seed(0)
context = (torch.randint(100, 1025, (args.batch,), generator=gen) + torch.randint(0, 1024, (args.batch,), generator=gen))
results = {"copy_GBps": copy, "batch": args.batch, "mean_context": context.float().mean().item(), "shapes": {}}
for name, heads, kv_heads, head_dim in [("qwen3-0.6b", 16, 8, 128), ("llama-3.2-1b", 32, 8, 64)]:
    block_size = 16
    blocks_per_seq = (context + block_size - 1) // block_size
    num_blocks = int(blocks_per_seq.sum())
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    order = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(args.batch, int(blocks_per_seq.max()), dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks_per_seq.tolist()):
        block_tables[i, :n] = order[start : start + n]
        start += n
    block_tables, seq_lens = block_tables.cuda(), context.to(torch.int32).cuda()
    q = torch.randn(args.batch, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    nbytes = 2 * int(context.sum()) * kv_heads * head_dim * 2
    few = slice(0, 8)
    ref = paged_decode_attention_reference(q[few], kv, block_tables[few], seq_lens[few], head_dim**-0.5)
    rows = []
    for block_n, warps, stages in itertools.product([32, 64, 128], [2, 4, 8], [2, 3, 4]):
        f = lambda: paged_decode_attention(q, kv, block_tables, seq_lens, head_dim**-0.5,  # noqa: E731
                                           block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            out = f()
        except Exception as e:  # a variant that does not fit (shared memory) is skipped, and said so
            print(f"{name} block_n={block_n} warps={warps} stages={stages}: {type(e).__name__}")
            continue
        err = ((out[few].float() - ref.float()).norm() / ref.float().norm()).item()
        t = ms(f)
        rows.append({"block_n": block_n, "warps": warps, "stages": stages, "ms": t, "GBps": nbytes / t / 1e6, "rel_err": err})
    rows.sort(key=lambda r: r["ms"])
    default = next(r for r in rows if (r["block_n"], r["warps"], r["stages"]) == (64, 4, 3))
    results["shapes"][name] = {"kv_bytes": nbytes, "rows": rows, "default": default}
    print(f"\n{name}: {args.batch} seqs, mean context {results['mean_context']:.0f}, K/V {nbytes / 1e6:.0f} MB, copy {copy:.0f} GB/s")
    print(f"  default (64, 4 warps, 3 stages): {default['ms'] * 1e3:.1f} us, {default['GBps']:.0f} GB/s = {default['GBps'] / copy:.2f}x copy")
    for r in rows[:5]:
        print(f"  block_n {r['block_n']:3d} warps {r['warps']} stages {r['stages']}: {r['ms'] * 1e3:7.1f} us "
              f"{r['GBps']:6.0f} GB/s = {r['GBps'] / copy:.2f}x copy  err {r['rel_err']:.1e}")
if args.json:
    json.dump(results, open(args.json, "w"), indent=1)
