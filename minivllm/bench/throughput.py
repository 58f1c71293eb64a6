"""Offline throughput on the nano-vllm-style workload (chapter 05 grows this into `minivllm bench`).

The workload: N requests of random token ids, prompt and output lengths drawn uniformly from
[min_len, max_len] with a fixed seed, ignore_eos so each request produces exactly its output
length. Throughput = output tokens / wall time of `LLM.generate`, after one warm-up request.

    python -m minivllm.bench.throughput --shape qwen3-0.6b --num-requests 256
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time


def random_workload(num_requests: int, min_len: int, max_len: int, vocab_size: int, seed: int):
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(num_requests):
        prompts.append([rng.randrange(vocab_size) for _ in range(rng.randint(min_len, max_len))])
        output_lens.append(rng.randint(min_len, max_len))
    return prompts, output_lens


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="qwen3-0.6b", help="random weights of this shape (see shapes.py)")
    parser.add_argument("--model", default=None, help="a real model folder instead of --shape")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)

    from minivllm import LLM, SamplingParams
    from minivllm.bench.shapes import write_shape_folder

    model = args.model or str(write_shape_folder(args.shape, tempfile.mkdtemp(prefix="minivllm-shape-")))
    engine_kwargs = dict(skip_tokenizer_init=True, max_model_len=args.max_model_len)
    if args.model is None:
        engine_kwargs["load_format"] = "dummy"
    if args.attention_backend:
        engine_kwargs["attention_backend"] = args.attention_backend
    llm = LLM(model, **engine_kwargs)
    vocab = llm.llm_engine.config.model_config.vocab_size
    prompts, output_lens = random_workload(args.num_requests, args.min_len, args.max_len, vocab, args.seed)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True, detokenize=False) for n in output_lens]
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, detokenize=False), use_tqdm=False)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    core = llm.llm_engine.engine_core
    result = {
        "model": args.model or args.shape,
        "num_requests": args.num_requests,
        "output_tokens": sum(output_lens),
        "prompt_tokens": sum(len(p) for p in prompts),
        "seconds": round(seconds, 2),
        "output_tokens_per_s": round(sum(output_lens) / seconds, 1),
        "engine_steps": core.num_steps,
        "preemptions": core.scheduler.num_preemptions,
        "kv_blocks": llm.llm_engine.config.cache_config.num_gpu_blocks,
        "attention_backend": llm.llm_engine.config.attention_backend,
        "dtype": str(llm.llm_engine.config.model_config.dtype),
        "device": llm.llm_engine.config.device_config.device,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
