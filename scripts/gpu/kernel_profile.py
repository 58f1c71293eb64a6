"""Which GPU kernels a decode step's CUDA graph runs, and how long each takes (chapter 05).

    python scripts/gpu/kernel_profile.py --shape qwen3-0.6b --batch 1 --batch 256

For each batch size: B random 128-token prompts decode a few tokens (so the graph's buffers
hold a real step), then the torch profiler records `--replays` replays of that size's graph.
Prints, per replay, the GPU time of each kernel family (the kernel's name, count per replay,
microseconds), the sum of kernel times, and the replay's wall time: the difference is the
idle time between kernels, which only fewer kernels (or programmatic dependent launch) remove.
With `--json`, writes every row.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from minivllm import LLM, SamplingParams
from minivllm.bench.shapes import write_shape_folder

parser = argparse.ArgumentParser()
parser.add_argument("--shape", default="qwen3-0.6b")
parser.add_argument("--batch", type=int, action="append", default=None)
parser.add_argument("--input-len", type=int, default=128)
parser.add_argument("--max-model-len", type=int, default=4096)
parser.add_argument("--replays", type=int, default=20)
parser.add_argument("--top", type=int, default=16)
parser.add_argument("--json", default=None)
args = parser.parse_args()
batches = args.batch or [1, 256]

model = str(write_shape_folder(args.shape, tempfile.mkdtemp()))
llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, max_model_len=args.max_model_len,
          enable_prefix_caching=False, gpu_memory_utilization=0.5, max_num_seqs=max(batches))
runner = llm.llm_engine.engine_core.executor.worker.model_runner
graphs = runner.cuda_graphs
vocab_size = llm.llm_engine.config.model_config.vocab_size
rng = random.Random(0)


def family(name: str) -> str:
    """A kernel's name without template arguments and launch-specific suffixes."""
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"\(.*", "", name)
    return name[:70]


results = {}
for batch in batches:
    prompts = [{"prompt_token_ids": [rng.randrange(vocab_size) for _ in range(args.input_len)]} for _ in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False), use_tqdm=False)
    size = graphs.padded_size(batch)
    for _ in range(5):
        graphs.replay(size)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.replays):
        graphs.replay(size)
    end.record()
    torch.cuda.synchronize()
    replay_us = start.elapsed_time(end) * 1e3 / args.replays
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.replays):
            graphs.replay(size)
        torch.cuda.synchronize()
    per_family: dict[str, list[float]] = collections.defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            per_family[family(event.name)].append(event.device_time)  # microseconds
    rows = sorted(
        ({"kernel": k, "per_replay": len(v) / args.replays, "us_per_replay": sum(v) / args.replays,
          "us_each": sum(v) / len(v)} for k, v in per_family.items()),
        key=lambda r: -r["us_per_replay"],
    )
    kernel_us = sum(r["us_per_replay"] for r in rows)
    launches = sum(r["per_replay"] for r in rows)
    results[batch] = {"padded_size": size, "replay_us": replay_us, "kernel_us": kernel_us, "kernels_per_replay": launches,
                      "rows": rows}
    print(f"\n== {args.shape} batch {batch} (graph {size}): replay {replay_us:.0f} us, kernels {kernel_us:.0f} us, "
          f"{launches:.0f} kernels, idle between kernels {replay_us - kernel_us:.0f} us "
          f"({(replay_us - kernel_us) / max(launches, 1):.2f} us each)")
    print(f"{'kernel':70s} {'n':>5s} {'us':>8s} {'us each':>8s}")
    for r in rows[: args.top]:
        print(f"{r['kernel']:70s} {r['per_replay']:5.0f} {r['us_per_replay']:8.1f} {r['us_each']:8.2f}")
if args.json:
    json.dump({"shape": args.shape, "max_model_len": args.max_model_len, "input_len": args.input_len,
               "results": results}, open(args.json, "w"), indent=1)
