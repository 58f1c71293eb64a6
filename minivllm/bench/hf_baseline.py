"""The Hugging Face transformers baseline for `minivllm bench throughput --hf` (chapter 05).

The same model (same config; random weights for a `--shape`), the same prompts and output
lengths, run through `model.generate` in bf16 with SDPA attention. `generate` works on static
batches: a batch of left-padded prompts decodes until its longest output is done, so every
request of a batch runs as many steps as the longest one. Only the tokens each request asked
for count as output; the rest is the price of static batching. Batch sizes are tried from the
largest down and the first that fits in memory is kept. Greedy decoding (cheaper than
sampling, so the baseline is, if anything, flattered).
"""

from __future__ import annotations

import argparse
import time


def hf_throughput(model_dir: str, args: argparse.Namespace, batch_sizes: list[int]) -> dict:
    import torch
    import transformers

    from minivllm.bench.throughput import make_workload

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        if args.model is None:  # a shape: random weights, as minivllm's load_format="dummy"
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch.bfloat16, attn_implementation="sdpa", device_map="cuda"
            )
    model.eval()
    model.generation_config.eos_token_id = None  # ignore_eos: every batch runs its full length
    prompts, output_lens = make_workload(args, config.vocab_size)
    pad_id = 0
    _generate(model, [[1, 2, 3]], 4, pad_id)  # warm-up
    errors = {}
    for batch_size in sorted(batch_sizes, reverse=True):
        try:
            torch.cuda.synchronize()
            start = time.perf_counter()
            steps = 0
            for i in range(0, len(prompts), batch_size):
                longest_output = max(output_lens[i : i + batch_size])
                _generate(model, prompts[i : i + batch_size], longest_output, pad_id)
                steps += longest_output
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        except torch.OutOfMemoryError as err:
            errors[batch_size] = str(err).splitlines()[0][:120]
            torch.cuda.empty_cache()
            continue
        return {
            "engine": "hf-transformers",
            "transformers": transformers.__version__,
            "model": args.model or args.shape,
            "dataset": args.dataset,
            "num_requests": len(prompts),
            "batch_size": batch_size,
            "out_of_memory_at": errors,
            "output_tokens": sum(output_lens),
            "prompt_tokens": sum(len(p) for p in prompts),
            "decode_steps": steps,
            "seconds": round(seconds, 3),
            "output_tokens_per_s": round(sum(output_lens) / seconds, 1),
            "dtype": "torch.bfloat16",
            "attention": "sdpa",
        }
    raise RuntimeError(f"HF generate ran out of memory at every batch size tried: {errors}")


def _generate(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int, device: str = "cuda"):
    import torch

    longest = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.inference_mode():
        return model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
            do_sample=False, pad_token_id=pad_id,
        )
