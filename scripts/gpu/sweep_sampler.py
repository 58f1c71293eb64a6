"""The one-pass Gumbel-max sampling kernel against the PyTorch sampler (chapter 06).

    python scripts/gpu/sweep_sampler.py --json sampler.json   (on the GPU machine)

For the vocabularies of Llama-3.2-1B (128,256) and Qwen3-0.6B (151,936) and 1 to 256 rows of
bf16 logits at temperature 0.6: the PyTorch path the engine took before (upcast, temperature,
softmax, exponential race), then the kernel at its default launch and at other warps / lane
groups / split counts. Checks each variant's tokens against the reference on the same
uniforms, and prints microseconds beside the floor (one read of the bf16 logits at the copy
bandwidth measured in the same run).

    python scripts/gpu/sweep_sampler.py --greedy --json greedy.json

does the same for an all-greedy batch: the PyTorch path before (upcast, then `argmax`) against
the kernel with its noise off (`argmax_sample`), whose tokens must equal the argmax's.
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
from minivllm.kernels.sampling import GUMBEL_SUB, argmax_sample, gumbel_sample, gumbel_sample_reference  # noqa: E402
from minivllm.sample.sampler import apply_temperature, sample_exponential_race  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--json", default=None)
parser.add_argument("--greedy", action="store_true", help="an all-greedy batch: argmax, not a draw")
args = parser.parse_args()

us = lambda fn: 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
copy = copy_bandwidth_gbps()
results = {"copy_GBps": copy, "greedy": args.greedy, "rows": []}
for vocab, batch in itertools.product([128256, 151936], [1, 4, 16, 64, 256]):
    # Several logits buffers in turn, so that repeated launches do not read them from the L2.
    copies = max(1, (256 << 20) // (batch * vocab * 2))
    logits = [torch.randn(batch, vocab, device="cuda").mul_(3).to(torch.bfloat16) for _ in range(copies)]
    temperature = torch.full((batch,), 0.6, device="cuda")
    turn = iter(itertools.cycle(logits))

    def torch_path():
        if args.greedy:
            return next(turn).float().argmax(dim=-1)
        probs = apply_temperature(next(turn).float(), temperature).softmax(-1)
        return sample_exponential_race(probs, {})

    def sample(x, splits, warps, sub):
        if args.greedy:
            return argmax_sample(x, num_splits=splits, num_warps=warps, sub=sub)
        return gumbel_sample(x, temperature, 17, num_splits=splits, num_warps=warps, sub=sub)

    floor_us = batch * vocab * 2 / (copy * 1e3)
    row = {"vocab": vocab, "batch": batch, "floor_us": floor_us, "torch_us": us(torch_path), "kernel": []}
    ref = logits[0].float().argmax(-1) if args.greedy else gumbel_sample_reference(logits[0], temperature, 17)
    for warps, sub, splits in [(4, GUMBEL_SUB, None), (8, GUMBEL_SUB, None), (16, GUMBEL_SUB, None),
                               (4, 256, None), (8, 1024, None), (4, GUMBEL_SUB, 1)]:
        if sub == GUMBEL_SUB or args.greedy:  # the same uniforms as the reference (or none): the same tokens
            agree = (sample(logits[0], splits, warps, sub) == ref).float().mean().item()
        else:
            agree = None
        t = us(lambda: sample(next(turn), splits, warps, sub))
        row["kernel"].append({"num_warps": warps, "sub": sub, "splits": splits, "us": t, "agree_with_reference": agree})
    results["rows"].append(row)
    best = min(row["kernel"], key=lambda r: r["us"])
    default = row["kernel"][0]
    print(f"V {vocab:6d} B {batch:3d}: floor {floor_us:6.1f} us  torch {row['torch_us']:7.1f}  kernel default "
          f"{default['us']:6.1f} (agree {default['agree_with_reference']:.3f})  best {best['us']:6.1f} "
          f"(warps {best['num_warps']}, sub {best['sub']}, splits {best['splits']})")
if args.json:
    json.dump(results, open(args.json, "w"), indent=1)
