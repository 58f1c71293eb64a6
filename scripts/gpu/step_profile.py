"""Where an engine step's time goes: cProfile over `LLM.generate` on a random-weight shape.

    python scripts/gpu/step_profile.py --workload prefill --caching on
    python scripts/gpu/step_profile.py --workload decode --batch 256

`prefill`: 200 unique 640-token prompts, 10 output tokens each (the prefix-caching benchmark's
0 %-hit workload); `decode`: `--batch` 16-token prompts decoding `--tokens` tokens;
`one-prompt` (with `--caching off`): one 128-token prompt generating one token, 20 times, so
every step is one small prefill step, the kind a server runs whenever a request arrives
(eager with `--cudagraph-mode full_decode_only`, pieces with the default); `nano`: the
throughput benchmark's own workload (256 requests, prompt and output lengths uniform in
[100, 1024], temperature 0.6), to see where its steps' time goes.
Prints the steps, the seconds, per-part milliseconds per step (`runner.forward` is the host's
time to launch an eager forward pass: graph replays do not go through it), and the top
functions by own time.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pstats
import random
import tempfile
import time

from minivllm import LLM, SamplingParams
from minivllm.bench.shapes import write_shape_folder
from minivllm.bench.throughput import random_workload

parser = argparse.ArgumentParser()
parser.add_argument("--workload", choices=["prefill", "decode", "one-prompt", "nano"], default="prefill")
parser.add_argument("--caching", choices=["on", "off"], default="on")
parser.add_argument("--eager", action="store_true")
parser.add_argument("--batch", type=int, default=256)
parser.add_argument("--tokens", type=int, default=64)
parser.add_argument("--top", type=int, default=25)
parser.add_argument("--async-scheduling", action="store_true")
parser.add_argument("--shape", default="qwen3-0.6b", help="a shape of minivllm/bench/shapes.py, e.g. llama-3.2-1b")
parser.add_argument("--cudagraph-mode", default="full_and_piecewise")
args = parser.parse_args()

model = str(write_shape_folder(args.shape, tempfile.mkdtemp()))
llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, enforce_eager=args.eager, max_model_len=2048,
          cudagraph_mode=args.cudagraph_mode, async_scheduling=args.async_scheduling,
          enable_prefix_caching=args.caching == "on", gpu_memory_utilization=0.5, max_num_seqs=max(256, args.batch))
rng = random.Random(0)
vocab_size = llm.llm_engine.config.model_config.vocab_size
if args.workload == "prefill":
    prompts = [[rng.randrange(vocab_size) for _ in range(640)] for _ in range(200)]
    params = SamplingParams(max_tokens=10, ignore_eos=True, detokenize=False)
elif args.workload == "one-prompt":
    prompts = [[rng.randrange(vocab_size) for _ in range(128)]]
    params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
elif args.workload == "nano":
    prompts, output_lens = random_workload(256, 100, 1024, vocab_size, seed=0)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True, detokenize=False) for n in output_lens]
else:
    prompts = [[rng.randrange(vocab_size) for _ in range(16)] for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)

acc: collections.Counter = collections.Counter()


def wrap(obj, name, key):
    f = getattr(obj, name)

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t

    setattr(obj, name, timed)


core = llm.llm_engine.engine_core.engine_core
runner = core.executor.worker.model_runner
wrap(core.scheduler, "schedule", "scheduler.schedule")
wrap(core.scheduler, "update_from_output", "scheduler.update_from_output")
wrap(core.executor, "execute_model", "executor.execute_model")
wrap(core.executor, "execute_model_async", "executor.execute_model_async (launch)")
wrap(runner, "_prepare_inputs", "runner._prepare_inputs")
wrap(runner, "_finish_step", "runner._finish_step (waits for the tokens)")
wrap(runner, "forward", "runner.forward (eager launches)")
if runner.piecewise_graphs is not None:
    wrap(runner.piecewise_graphs, "replay", "piecewise replay (pieces + eager attention)")
wrap(llm.llm_engine.output_processor, "process_outputs", "output_processor.process_outputs")


def run():
    for _ in range(20 if args.workload == "one-prompt" else 1):
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


run()  # warm-up: compiles, first-touch allocations
if args.caching == "on":
    llm.reset_prefix_cache()
acc.clear()
steps0 = llm.llm_engine.get_stats().num_steps
start = time.perf_counter()
run()
seconds = time.perf_counter() - start
steps = llm.llm_engine.get_stats().num_steps - steps0
print(f"== {vars(args)}: {steps} steps, {seconds:.3f} s, {seconds / steps * 1e3:.2f} ms/step")
for key, value in sorted(acc.items(), key=lambda kv: -kv[1]):
    print(f"   {key:36s} {value / steps * 1e3:8.3f} ms/step")
if args.caching == "on":
    llm.reset_prefix_cache()
profile = cProfile.Profile()
profile.enable()
run()
profile.disable()
text = io.StringIO()
pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.top)
print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:6000])
