"""The paged decode kernel at the shapes of the throughput benchmark's decode steps (chapter 06).

    python scripts/gpu/sweep_decode_shapes.py --json decode-shapes.json   (on the GPU machine)

For Qwen3-0.6B (16 query / 8 KV heads, head_dim 128) and Llama-3.2-1B (32 / 8, head_dim 64):
256 sequences with contexts drawn uniformly from [100, 1024] + [0, 1024) (the nano-vllm
workload in mid-decode), block size 16, with two block layouts: `shuffled` (every block of
the pool in random order) and `contiguous` (each sequence's blocks in a row, as a prompt's
blocks come off a fresh pool). Times (tile, warps, stages) variants at the launcher's own
split count in both launch orders (`heads_fastest`: the KV heads of one sequence neighbours
in the grid, so they read one block's rows together; else the sequences of one KV head),
then, with the default tile, more splits than the launcher picks and the sequences ordered
longest first (two ways to balance uneven contexts across the GPU's programs); checks each
against the reference, and prints GB/s of K/V read against the copy bandwidth measured in
the same run.
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
from minivllm.kernels.paged_attention import (  # noqa: E402
    DECODE_HEADS_FASTEST,
    decode_config,
    paged_decode_attention,
    paged_decode_attention_reference,
)

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=256)
parser.add_argument("--json", default=None)
args = parser.parse_args()

ms = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
copy = copy_bandwidth_gbps()
gen = torch.Generator().manual_seed(0)
context = (torch.randint(100, 1025, (args.batch,), generator=gen) + torch.randint(0, 1024, (args.batch,), generator=gen))
results = {"copy_GBps": copy, "batch": args.batch, "mean_context": context.float().mean().item(), "shapes": {}}
shapes = [("qwen3-0.6b", 16, 8, 128), ("llama-3.2-1b", 32, 8, 64)]
for (name, heads, kv_heads, head_dim), layout in itertools.product(shapes, ["shuffled", "contiguous"]):
    block_size = 16
    blocks_per_seq = (context + block_size - 1) // block_size
    num_blocks = int(blocks_per_seq.sum())
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    order = torch.randperm(num_blocks, generator=gen) if layout == "shuffled" else torch.arange(num_blocks)
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

    def measure(label: dict, q, block_tables, seq_lens, **kwargs) -> None:
        f = lambda: paged_decode_attention(q, kv, block_tables, seq_lens, head_dim**-0.5, **kwargs)  # noqa: E731
        try:
            out = f()
        except Exception as e:  # a variant that does not fit (shared memory) is skipped, and said so
            print(f"{name} {label}: {type(e).__name__}")
            return
        order = label.get("order")
        got = out if order is None else out[torch.argsort(order)]  # back to the original order
        err = ((got[few].float() - ref.float()).norm() / ref.float().norm()).item()
        t = ms(f)
        rows.append({**{k: v for k, v in label.items() if k != "order"}, "ms": t, "GBps": nbytes / t / 1e6, "rel_err": err})

    for (block_n, warps, stages), heads_fastest in itertools.product(
            [(64, 4, 3), (128, 4, 3), (128, 8, 3), (256, 4, 4), (256, 8, 3)], [False, True]):
        measure({"block_n": block_n, "warps": warps, "stages": stages, "heads_fastest": heads_fastest}, q, block_tables,
                seq_lens, block_n=block_n, num_warps=warps, num_stages=stages, heads_fastest=heads_fastest)
    tile_n, tile_warps, tile_stages = decode_config(head_dim)
    for splits in (2, 4):
        measure({"block_n": tile_n, "warps": tile_warps, "stages": tile_stages, "splits": splits, "heads_fastest": True},
                q, block_tables, seq_lens, num_splits=splits, heads_fastest=True)
    longest_first = torch.argsort(seq_lens, descending=True)
    measure({"block_n": tile_n, "warps": tile_warps, "stages": tile_stages, "longest_first": True, "heads_fastest": True,
             "order": longest_first}, q[longest_first], block_tables[longest_first], seq_lens[longest_first], heads_fastest=True)
    rows.sort(key=lambda r: r["ms"])
    default = next(r for r in rows if (r["block_n"], r["warps"], r["stages"]) == decode_config(head_dim)
                   and "splits" not in r and not r.get("longest_first") and r["heads_fastest"] == DECODE_HEADS_FASTEST)
    results["shapes"][f"{name}-{layout}"] = {"kv_bytes": nbytes, "rows": rows, "default": default}
    print(f"\n{name}, {layout} blocks: {args.batch} seqs, mean context {results['mean_context']:.0f}, K/V {nbytes / 1e6:.0f} MB, copy {copy:.0f} GB/s")
    print(f"  default (block_n, warps, stages) {decode_config(head_dim)}: {default['ms'] * 1e3:.1f} us, {default['GBps']:.0f} GB/s = {default['GBps'] / copy:.2f}x copy")
    for r in rows:
        extra = f" splits {r['splits']}" if "splits" in r else (" longest first" if r.get("longest_first") else "")
        extra += " heads fastest" if r["heads_fastest"] else ""
        print(f"  block_n {r['block_n']:3d} warps {r['warps']} stages {r['stages']}{extra}: {r['ms'] * 1e3:7.1f} us "
              f"{r['GBps']:6.0f} GB/s = {r['GBps'] / copy:.2f}x copy  err {r['rel_err']:.1e}")
if args.json:
    json.dump(results, open(args.json, "w"), indent=1)
