"""Where the GPU's time goes over a whole throughput run (chapter 05).

    python scripts/gpu/run_profile.py --shape llama-3.2-1b --async-scheduling --json run.json

Runs `minivllm bench throughput`'s default workload (256 requests, prompt and output lengths
uniform in [100, 1024], temperature 0.6) once to warm up, then once more under the torch
profiler, recording only what runs on the GPU. Prints the run's wall time; the GPU's busy
time (the union of all kernel and copy intervals), so `wall - busy` is the time the GPU
waited for the host; and the kernel families by total time, each with its share of the run.
A kernel family is its name without template arguments; the Triton kernels keep their names
(`_decode_partial_kernel`, ...), cuBLAS's are grouped as `gemm`. Then the run cut into
`--windows` equal spans of time: in each, the GPU's busy share, the steps the host launched
and their mean batch (running requests), which shows in which phase of the run (prefill,
full batches, the shrinking tail) the GPU waits for the host. Last, the idle gaps between
the GPU's busy intervals by length: microsecond gaps are the device's own latency between
work already queued; gaps of tens of microseconds and more are the GPU waiting for the host.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from minivllm import LLM, SamplingParams
from minivllm.bench.shapes import write_shape_folder
from minivllm.bench.throughput import random_workload

parser = argparse.ArgumentParser()
parser.add_argument("--shape", default="llama-3.2-1b")
parser.add_argument("--async-scheduling", action="store_true")
parser.add_argument("--top", type=int, default=18)
parser.add_argument("--windows", type=int, default=16)
parser.add_argument("--json", default=None)
args = parser.parse_args()

model = str(write_shape_folder(args.shape, tempfile.mkdtemp()))
llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, max_num_seqs=256,
          gpu_memory_utilization=0.9, async_scheduling=args.async_scheduling)
vocab_size = llm.llm_engine.config.model_config.vocab_size
prompts, output_lens = random_workload(256, 100, 1024, vocab_size, seed=0)
params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True, detokenize=False) for n in output_lens]
requests = [{"prompt_token_ids": p} for p in prompts]


def family(name: str) -> str:
    if re.search(r"gemm|nvjet|cutlass|sm90_xmma|cublas", name, re.IGNORECASE):
        return "gemm (cuBLAS)"
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"\(.*", "", name)
    return name[:60]


scheduler = llm.llm_engine.engine_core.engine_core.scheduler
steps: list[tuple[float, int]] = []  # (host time of each schedule() call, requests running then)
schedule = scheduler.schedule


def recorded_schedule():
    steps.append((time.perf_counter(), len(scheduler.running)))
    return schedule()


llm.generate(requests, params, use_tqdm=False)  # warm-up: the same run once
llm.reset_prefix_cache()  # the profiled run prefills its prompts again, as the benchmark's run does
torch.cuda.synchronize()
scheduler.schedule = recorded_schedule
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    start = time.perf_counter()
    llm.generate(requests, params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start

intervals, per_family = [], collections.defaultdict(lambda: [0, 0.0])
for event in prof.profiler.kineto_results.events():
    if event.device_type() != torch.autograd.DeviceType.CUDA or event.duration_ns() <= 0:
        continue
    begin, length = event.start_ns(), event.duration_ns()
    intervals.append((begin, begin + length))
    name = event.name() if callable(event.name) else event.name
    row = per_family[family(name)]
    row[0] += 1
    row[1] += length / 1e9
intervals.sort()
busy, cur_begin, cur_end = 0, None, None
gaps: list[int] = []  # ns between one busy stretch and the next
for begin, end in intervals:  # the union of intervals: overlapping kernels count once
    if cur_end is None or begin > cur_end:
        if cur_end is not None:
            busy += cur_end - cur_begin
            gaps.append(begin - cur_end)
        cur_begin, cur_end = begin, end
    else:
        cur_end = max(cur_end, end)
if cur_end is not None:
    busy += cur_end - cur_begin
GAP_EDGES_US = [2, 10, 50, 200, 1000, float("inf")]
gap_buckets, lower = [], 0
for upper in GAP_EDGES_US:
    inside = [g for g in gaps if lower * 1e3 <= g < upper * 1e3]
    gap_buckets.append({"from_us": lower, "to_us": upper if upper != float("inf") else None,  # JSON has no inf
                        "count": len(inside), "seconds": sum(inside) / 1e9})
    lower = upper
busy_s = busy / 1e9
span_s = (intervals[-1][1] - intervals[0][0]) / 1e9 if intervals else 0.0
# Per window of the run: the GPU's busy share (kernel intervals clipped to the window; the GPU
# clock starts at the first kernel, the host clock at generate(): a millisecond apart at most).
gpu0, window_s = intervals[0][0] if intervals else 0, wall / args.windows
windows = []
for w in range(args.windows):
    lo, hi = gpu0 + int(w * window_s * 1e9), gpu0 + int((w + 1) * window_s * 1e9)
    covered, last_end = 0, lo
    for begin, end in intervals:
        if end <= lo or begin >= hi:
            continue
        begin, end = max(begin, last_end), min(end, hi)
        if end > begin:
            covered += end - begin
            last_end = end
    batch = [n for t, n in steps if w * window_s <= t - start < (w + 1) * window_s]
    windows.append({"start_s": w * window_s, "gpu_busy": covered / (window_s * 1e9), "steps": len(batch),
                    "mean_running": sum(batch) / max(len(batch), 1)})
rows = sorted(({"family": k, "launches": v[0], "seconds": v[1]} for k, v in per_family.items()), key=lambda r: -r["seconds"])
result = {"shape": args.shape, "async_scheduling": args.async_scheduling, "wall_s": wall, "gpu_busy_s": busy_s,
          "gpu_span_s": span_s, "output_tokens": sum(output_lens), "rows": rows, "windows": windows, "gaps": gap_buckets}
print(f"\n== {args.shape} async={args.async_scheduling}: wall {wall:.3f} s (profiled), GPU busy {busy_s:.3f} s "
      f"({busy_s / wall:.0%}), first-to-last kernel {span_s:.3f} s, {sum(output_lens) / wall:.0f} tok/s")
print(f"{'kernel family':60s} {'launches':>9s} {'s':>7s} {'share':>6s}")
for r in rows[: args.top]:
    print(f"{r['family']:60s} {r['launches']:9d} {r['seconds']:7.3f} {r['seconds'] / wall:6.1%}")
print(f"{'from s':>7s} {'GPU busy':>8s} {'steps':>6s} {'ms/step':>8s} {'running':>8s}")
for w in windows:
    print(f"{w['start_s']:7.2f} {w['gpu_busy']:8.0%} {w['steps']:6d} {window_s * 1e3 / max(w['steps'], 1):8.2f} "
          f"{w['mean_running']:8.0f}")
print(f"{'idle gap':>16s} {'count':>8s} {'s':>7s}")
for b in gap_buckets:
    print(f"{b['from_us']:>6} - {b['to_us'] or 'inf':>6} us {b['count']:8d} {b['seconds']:7.3f}")
if args.json:
    json.dump(result, open(args.json, "w"), indent=1)
