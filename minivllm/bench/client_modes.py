"""The engine core in-process vs in its own process: `LLM.generate` throughput in each mode,
with where the time went (chapter 02).

    python -m minivllm.bench.client_modes --mode inproc --workload nano      # on a GPU
    python -m minivllm.bench.client_modes --mode mp --workload nano
    python -m minivllm.bench.client_modes --mode mp --workload text --model DIR --device cpu

One mode per process, so each run starts from a clean device. Beside the output tokens/s it
reports two clocks: `core_busy_s`, the time the core spent inside `EngineCore.step()` (its own
stats), and `front_end_wait_s`, the time the front end spent in the client's `get_output()`.
In-process the two overlap (get_output runs the step); with a core process the front end
waits only when it has caught up with the core.

Workloads: `nano` — the nano-vllm one (256 random-token prompts, prompt and output lengths
uniform in [100, 1024], ignore_eos, no detokenization) on a random-weight Qwen3-0.6B shape;
`short` — 256 prompts of 16 tokens decoding 128 each (short steps, where per-step costs show);
`text` — N text prompts through the tokenizer, T tokens each, detokenized (needs --model with
tokenizer files).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["inproc", "mp"], required=True)
    parser.add_argument("--workload", choices=["nano", "short", "text"], default="nano")
    parser.add_argument("--model", default=None, help="a model folder (random weights of its shape); default Qwen3-0.6B's shape")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128, help="short/text workloads")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from minivllm import LLM, SamplingParams
    from minivllm.bench.shapes import write_shape_folder
    from minivllm.bench.throughput import random_workload

    model = args.model or str(write_shape_folder("qwen3-0.6b", tempfile.mkdtemp(prefix="minivllm-shape-")))
    kwargs = dict(load_format="dummy", device=args.device, max_model_len=4096)
    if args.device == "cpu":
        kwargs["dtype"] = "float32"
    if args.workload != "text":
        kwargs["skip_tokenizer_init"] = True
    start = time.perf_counter()
    llm = LLM(model, enable_multiprocessing=args.mode == "mp", **kwargs)
    startup_s = time.perf_counter() - start
    vocab = llm.llm_engine.config.model_config.vocab_size
    rng = random.Random(0)
    if args.workload == "nano":
        token_prompts, output_lens = random_workload(args.num_prompts, 100, 1024, vocab, seed=0)
        prompts = [{"prompt_token_ids": p} for p in token_prompts]
        params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True, detokenize=False) for n in output_lens]
    elif args.workload == "short":
        prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(16)]} for _ in range(args.num_prompts)]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
        output_lens = [args.max_tokens] * args.num_prompts
    else:
        prompts = [f"Question {i}: write a short story about the number {i}." for i in range(args.num_prompts)]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        output_lens = [args.max_tokens] * args.num_prompts
    warm_prompt = prompts[0] if args.workload == "text" else {"prompt_token_ids": [1, 2, 3]}
    llm.generate([warm_prompt], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)

    client = llm.llm_engine.engine_core
    waited = [0.0]
    get_output = client.get_output

    def timed_get_output():
        t0 = time.perf_counter()
        try:
            return get_output()
        finally:
            waited[0] += time.perf_counter() - t0

    client.get_output = timed_get_output
    before = llm.llm_engine.get_stats()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    after = llm.llm_engine.get_stats()
    llm.llm_engine.shutdown()
    steps = after.num_steps - before.num_steps
    result = {
        "mode": args.mode, "workload": args.workload, "device": args.device, "num_prompts": args.num_prompts,
        "output_tokens": sum(output_lens), "seconds": round(seconds, 3),
        "output_tokens_per_s": round(sum(output_lens) / seconds, 1), "engine_steps": steps,
        "core_busy_s": round(after.busy_seconds - before.busy_seconds, 3), "front_end_wait_s": round(waited[0], 3),
        "ms_per_step": round(seconds / max(steps, 1) * 1e3, 3), "startup_s": round(startup_s, 2),
    }
    print(json.dumps(result))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
