"""The decode kernel's shortest split, measured as a CUDA graph launches it (chapters 05, 06).

    python scripts/gpu/decode_split_latency.py --json split.json      (on the GPU machine)

A CUDA graph launches the decode kernel for max_model_len, so the launch has as many splits
as the longest possible context needs; each context then cuts itself into splits of its own
length over that count, in whole tiles and at least `min_split_tiles` tiles long, unless it
has at most `whole_context_tiles` tiles and stays whole. A context in one split needs no merge
but walks its tiles one after another; in several, the tiles run side by side and the last
split merges. This times, in a graph of one decode call per layer (each layer its own cache,
so the K/V come from memory as in a step), each setting MIN/WHOLE of `--settings` (1/1: no
context kept whole beyond one tile) at a few batch sizes and context lengths, for head_dim 128 (Qwen3-0.6B:
16 query and 8 KV heads, 28 layers) and 64 (Llama-3.2-1B: 32 and 8, 16 layers). Checks each
setting against the float32 reference first. Prints a table last.
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
from minivllm.kernels import decode_config, paged_decode_attention, paged_decode_attention_reference  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--json", default=None)
parser.add_argument("--replays", type=int, default=40)
parser.add_argument("--max-model-len", type=int, default=4096)
parser.add_argument("--batches", default="1,4,32")
parser.add_argument("--contexts", default="160,600,2000,4000")
parser.add_argument("--settings", default="2/1,1/1,4/1,8/1,1/4", help="min_split_tiles/whole_context_tiles, ...")
args = parser.parse_args()

device = torch.device("cuda")
BLOCK_SIZE = 16
MODELS = {"qwen3-0.6b": (16, 8, 128, 28), "llama-3.2-1b": (32, 8, 64, 16)}  # heads, KV heads, head_dim, layers


results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "copy_GBps": copy_bandwidth_gbps(), "max_model_len": args.max_model_len, "rows": []}
settings = [tuple(int(v) for v in item.split("/")) for item in args.settings.split(",")]
for model, (heads, kv_heads, head_dim, layers) in MODELS.items():
    block_n = decode_config(head_dim)[0]
    for batch in (int(b) for b in args.batches.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            blocks_per_seq = triton.cdiv(context, BLOCK_SIZE)
            block_tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=device).view(batch, -1)
            # Padded as the engine's block table is: one row as long as max_model_len needs.
            table = torch.zeros(batch, triton.cdiv(args.max_model_len, BLOCK_SIZE), dtype=torch.int32, device=device)
            table[:, :blocks_per_seq] = block_tables
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
            caches = [torch.randn(2, batch * blocks_per_seq, BLOCK_SIZE, kv_heads, head_dim, device=device,
                                  dtype=torch.bfloat16) for _ in range(layers)]
            queries = [torch.randn(batch, heads, head_dim, device=device, dtype=torch.bfloat16) for _ in range(layers)]
            outs = [torch.empty_like(q) for q in queries]
            want = paged_decode_attention_reference(queries[0], caches[0], table, seq_lens, head_dim**-0.5)
            kv_bytes = batch * context * kv_heads * head_dim * 2 * 2
            row = {"model": model, "batch": batch, "context": context, "block_n": block_n,
                   "kv_floor_us": kv_bytes / results["copy_GBps"] / 1e3}
            for min_tiles, whole_tiles in settings:
                launch = dict(max_seq_len=args.max_model_len, min_split_tiles=min_tiles, whole_context_tiles=whole_tiles)
                got = paged_decode_attention(queries[0], caches[0], table, seq_lens, head_dim**-0.5, **launch)
                err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                assert err < 1e-2, (model, batch, context, min_tiles, whole_tiles, err)  # bf16 output rounding is ~4e-3

                def step(launch=launch):
                    for q, cache, out in zip(queries, caches, outs):
                        paged_decode_attention(q, cache, table, seq_lens, head_dim**-0.5, out=out, **launch)

                row[f"{min_tiles}/{whole_tiles}"] = graph_us_per_call(step, layers, args.replays)
            results["rows"].append(row)
            print(row, flush=True)
            del caches, queries, outs

if args.json:
    json.dump(results, open(args.json, "w"), indent=1)
print(f"copy {results['copy_GBps']:.0f} GB/s; decode attention in a graph sized for {args.max_model_len} tokens, "
      "µs per layer, by the shortest split / the longest context kept whole (tiles)")
print(f"{'model':13} {'batch':>5} {'ctx':>5} {'floor':>6} " + " ".join(f"{f'{m}/{w}':>7}" for m, w in settings))
for r in results["rows"]:
    print(f"{r['model']:13} {r['batch']:5} {r['context']:5} {r['kv_floor_us']:6.2f} "
          + " ".join(f"{r[f'{m}/{w}']:7.2f}" for m, w in settings))
