"""What the GPU does in a decode step besides the graph replay (chapter 05).

    python scripts/gpu/step_timeline.py --shape qwen3-0.6b --batch 1

One request (or `--batch`) of 128 random tokens decodes greedily with CUDA graphs and async
scheduling, as `bench latency` runs it; the torch profiler records `--tokens` steps in the
middle. Printed per step: every GPU activity family (kernels inside the replay, the LM head,
sampling, copies) with its count and microseconds, their sum, the step's wall time on the
GPU (first start to last end, over the steps), and the time the GPU sat idle: the span less
the union of the activities' intervals (a plain sum of durations overcounts where programmatic
dependent launch overlaps a kernel with the one before). The idle gaps of 2 µs or more are
grouped by the activities on either side, which says where in the step the GPU waits. Before
the profiled steps, as many unprofiled steps are timed on the host's clock.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from minivllm import LLM, SamplingParams
from minivllm.bench.shapes import write_shape_folder

parser = argparse.ArgumentParser()
parser.add_argument("--shape", default="qwen3-0.6b")
parser.add_argument("--batch", type=int, default=1)
parser.add_argument("--tokens", type=int, default=40)
parser.add_argument("--json", default=None)
args = parser.parse_args()

model = str(write_shape_folder(args.shape, tempfile.mkdtemp()))
llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, enable_prefix_caching=False,
          gpu_memory_utilization=0.5, max_num_seqs=max(16, args.batch), async_scheduling=True)
vocab_size = llm.llm_engine.config.model_config.vocab_size
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(vocab_size) for _ in range(128)]} for _ in range(args.batch)]
warm = 16
params = SamplingParams(temperature=0.0, max_tokens=warm + 2 * args.tokens + 16, ignore_eos=True, detokenize=False)
llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False), use_tqdm=False)

engine = llm.llm_engine
for i, p in enumerate(prompts):
    engine.add_request(f"timeline-{i}", p, params)
for _ in range(warm):
    engine.step()
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(args.tokens):
    engine.step()
torch.cuda.synchronize()
wall_us_per_step = (time.perf_counter() - start) * 1e6 / args.tokens
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(args.tokens):
        engine.step()
    torch.cuda.synchronize()
while engine.has_unfinished_requests():
    engine.step()


def family(name: str) -> str:
    return re.sub(r"[<(].*", "", name)[:60]


events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0]
events.sort(key=lambda e: e.time_range.start)
busy = collections.defaultdict(lambda: [0, 0.0])
for e in events:
    row = busy[family(e.name)]
    row[0] += 1
    row[1] += e.time_range.elapsed_us()
span_us = events[-1].time_range.end - events[0].time_range.start
steps = args.tokens
rows = sorted(({"activity": k, "per_step": v[0] / steps, "us_per_step": v[1] / steps} for k, v in busy.items()),
              key=lambda r: -r["us_per_step"])
busy_us = sum(r["us_per_step"] for r in rows)


def union_and_gaps(intervals: list[tuple[float, float, str]], min_gap: float = 2.0) -> tuple[float, dict]:
    """The length of the union of (start, end, name) intervals sorted by start, and the gaps of
    at least `min_gap` between them: {"last to end -> next to start": [count, total]}."""
    union, gaps = 0.0, collections.defaultdict(lambda: [0, 0.0])
    covered_until, last_name = intervals[0][0], intervals[0][2]
    for begin, end, name in intervals:
        if begin > covered_until:
            if begin - covered_until >= min_gap:
                gaps[f"{last_name} -> {name}"][0] += 1
                gaps[f"{last_name} -> {name}"][1] += begin - covered_until
            covered_until = begin
        if end > covered_until:
            union += end - covered_until
            covered_until, last_name = end, name
    return union, gaps


union_us, gaps = union_and_gaps([(e.time_range.start, e.time_range.end, family(e.name)) for e in events])
gap_rows = sorted(({"between": k, "per_step": v[0] / steps, "us_per_step": v[1] / steps} for k, v in gaps.items()),
                  key=lambda r: -r["us_per_step"])
result = {"shape": args.shape, "batch": args.batch, "steps": steps, "wall_us_per_step": wall_us_per_step,
          "gpu_span_us_per_step": span_us / steps, "sum_of_durations_us_per_step": busy_us,
          "busy_us_per_step": union_us / steps, "idle_us_per_step": (span_us - union_us) / steps,
          "rows": rows, "idle_gaps": gap_rows, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
if args.json:
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
print(f"{args.shape} batch {args.batch}: {wall_us_per_step:.1f} µs per step unprofiled; profiled, "
      f"{span_us / steps:.1f} µs on the GPU, {union_us / steps:.1f} busy, {(span_us - union_us) / steps:.1f} idle "
      f"({busy_us:.1f} µs of durations, overlaps counted twice)")
for r in rows[:20]:
    print(f"  {r['activity']:60} {r['per_step']:6.1f} x  {r['us_per_step']:8.2f} µs")
print("  idle gaps of 2 µs or more, by their neighbours:")
for r in gap_rows[:10]:
    print(f"  {r['between'][:90]:90} {r['per_step']:6.2f} x  {r['us_per_step']:8.2f} µs")
