"""`minivllm bench throughput`: offline throughput, beside its physical bound (chapter 05).

Datasets (all random token ids from a fixed seed, `ignore_eos`, so every request produces
exactly its output length):

  * `random` (default, nano-vllm's workload): prompt and output lengths uniform in
    [min_len, max_len] = [100, 1024], 256 requests;
  * `fixed`: every prompt `--input-len` tokens, every output `--output-len`;
  * `shared-prefix`: every prompt starts with the same `--prefix-len` tokens, then a random
    suffix of [min_len, max_len] tokens (what prefix caching is for).

Throughput = output tokens / wall time of `LLM.generate`, after a warm-up request. The bound
is what the memory system allows: every step reads all the weights once, and every decoded
token reads the K/V of its whole context; those bytes over the copy bandwidth measured in the
same run give the shortest possible time. `--hf` runs Hugging Face transformers' `generate`
on the same model and prompts instead (`hf_baseline.py`).

    minivllm bench throughput --shape qwen3-0.6b --json out.json
    minivllm bench throughput --shape qwen3-0.6b --hf --json hf.json
"""

from __future__ import annotations

import argparse
import datetime
import random
import tempfile
import time
from pathlib import Path

from minivllm.bench import git_commit, report
from minivllm.config import CUDAGRAPH_MODES


# --8<-- [start:workload]
def random_workload(num_requests: int, min_len: int, max_len: int, vocab_size: int, seed: int):
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(num_requests):
        prompts.append([rng.randrange(vocab_size) for _ in range(rng.randint(min_len, max_len))])
        output_lens.append(rng.randint(min_len, max_len))
    return prompts, output_lens
# --8<-- [end:workload]


def make_workload(args: argparse.Namespace, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    n = args.num_requests
    if args.dataset == "random":
        return random_workload(n, args.min_len, args.max_len, vocab_size, args.seed)
    if args.dataset == "fixed":
        return [[rng.randrange(vocab_size) for _ in range(args.input_len)] for _ in range(n)], [args.output_len] * n
    if args.dataset == "shared-prefix":
        prefix = [rng.randrange(vocab_size) for _ in range(args.prefix_len)]
        suffixes, output_lens = random_workload(n, args.min_len, args.max_len, vocab_size, args.seed + 1)
        return [prefix + s for s in suffixes], output_lens
    raise ValueError(f"unknown dataset {args.dataset!r}; known: random, fixed, shared-prefix")


# --8<-- [start:bound]
def model_bytes(hf_config, dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes one forward step must read for weights, and the K/V bytes of one token of context.

    The embedding table is only gathered (a few rows per step), so it counts only when the
    output head shares it (tied weights): then the head reads all of it every step.
    """
    import torch

    from minivllm.models.registry import ModelRegistry

    with torch.device("meta"):
        model = ModelRegistry.resolve_model_cls(hf_config.architectures)(hf_config)
    params = {id(p): p for p in model.parameters()}  # tied weights once
    total = sum(p.numel() for p in params.values())
    if not getattr(hf_config, "tie_word_embeddings", False):
        total -= hf_config.vocab_size * hf_config.hidden_size  # the input embedding: gathered only
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    return {
        "weight_bytes_per_step": total * dtype_bytes,
        "kv_bytes_per_token": 2 * hf_config.num_hidden_layers * kv_heads * head_dim * dtype_bytes,
    }


# exercise[ch05-physical-bound]: bytes = num_steps * weight bytes + kv bytes * the contexts every output token attends to (token i of a request: prompt_len + i); seconds = bytes / (copy_gbps * 1e9)
def physical_bound(prompt_lens: list[int], output_lens: list[int], num_steps: int, sizes: dict[str, int], copy_gbps: float) -> dict:
    """The fastest this workload can run: weight reads of every step + every decoded token's
    K/V reads, over the copy bandwidth.

    `sizes` is `model_bytes`'s: `weight_bytes_per_step` and `kv_bytes_per_token`. Output token
    i of a request (i = 0, 1, ...) is computed over a context of `prompt_len + i` tokens, whose
    K/V it reads once. Returns `bound_bytes` (an int), `bound_seconds` and
    `bound_output_tokens_per_s` (all output tokens over those seconds).
    """
    context_tokens = sum(o * p + o * (o - 1) // 2 for p, o in zip(prompt_lens, output_lens))
    total_bytes = num_steps * sizes["weight_bytes_per_step"] + context_tokens * sizes["kv_bytes_per_token"]
    seconds = total_bytes / (copy_gbps * 1e9)
    return {"bound_bytes": total_bytes, "bound_seconds": seconds, "bound_output_tokens_per_s": sum(output_lens) / seconds}
# --8<-- [end:bound]


def run_info() -> dict:
    """When, where and on what code a result was measured."""
    import torch

    return {
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="qwen3-0.6b", help="random weights of this shape (see shapes.py)")
    parser.add_argument("--model", default=None, help="a real model folder instead of --shape")
    parser.add_argument("--dataset", default="random", choices=["random", "fixed", "shared-prefix"])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--input-len", type=int, default=1024, help="fixed dataset: prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="fixed dataset: output tokens")
    parser.add_argument("--prefix-len", type=int, default=512, help="shared-prefix dataset: shared tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--json", default=None, help="write the result here")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(parser)
    parser.add_argument("--hf", action="store_true", help="run HF transformers generate instead (hf_baseline.py)")
    parser.add_argument("--hf-batch-sizes", default="256,128,64", help="--hf: batch sizes to try, best kept")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--compilation-level", type=int, default=0)
    parser.add_argument("--cudagraph-mode", default="full_and_piecewise", choices=CUDAGRAPH_MODES,
                        help="which steps replay CUDA graphs (chapter 05)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--async-scheduling", action="store_true", help="schedule step n+1 while step n runs")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--no-bound", action="store_true", help="skip measuring the copy bandwidth")
    args = parser.parse_args(argv)

    model = args.model or str(write_shape(args.shape))
    if args.hf:
        from minivllm.bench.hf_baseline import hf_throughput

        result = hf_throughput(model, args, [int(b) for b in args.hf_batch_sizes.split(",")])
    else:
        result = minivllm_throughput(model, args)
    if not args.no_bound:
        import torch

        if torch.cuda.is_available() and "engine_steps" in result:
            from minivllm.bench.ceilings import copy_bandwidth_gbps
            from minivllm.engine.arg_utils import load_hf_config

            sizes = model_bytes(load_hf_config(Path(model)))
            result["copy_GBps"] = copy_bandwidth_gbps()
            result.update(sizes)
            # The steps are those minivllm's scheduler took: the weights are read once per step.
            result.update(physical_bound(result["_prompt_lens"], result["_output_lens"], result["engine_steps"], sizes,
                                         result["copy_GBps"]))
            result["fraction_of_bound"] = result["output_tokens_per_s"] / result["bound_output_tokens_per_s"]
    result.pop("_prompt_lens", None)
    result.pop("_output_lens", None)
    result.update(run_info())
    result["command"] = "minivllm bench throughput " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    report(result, args.json)
    return result


def write_shape(shape: str):
    from minivllm.bench.shapes import write_shape_folder

    return write_shape_folder(shape, tempfile.mkdtemp(prefix="minivllm-shape-"))


def num_kernel_variants() -> int:
    """Compiled Triton kernel variants so far (0 without a GPU): a benchmark wants none in its run."""
    import torch

    if not torch.cuda.is_available():
        return 0
    from minivllm.kernels import num_compiled_variants

    return num_compiled_variants()


def minivllm_throughput(model: str, args: argparse.Namespace) -> dict:
    from minivllm import LLM, SamplingParams

    engine_kwargs = dict(
        skip_tokenizer_init=True, max_model_len=args.max_model_len, enforce_eager=args.enforce_eager,
        compilation_level=args.compilation_level, max_num_seqs=args.max_num_seqs,
        cudagraph_mode=args.cudagraph_mode, gpu_memory_utilization=args.gpu_memory_utilization,
        async_scheduling=args.async_scheduling,
    )
    if args.model is None:
        engine_kwargs["load_format"] = "dummy"
    if args.attention_backend:
        engine_kwargs["attention_backend"] = args.attention_backend
    if args.max_num_batched_tokens:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    start = time.perf_counter()
    llm = LLM(model, **engine_kwargs)
    startup_seconds = time.perf_counter() - start
    config = llm.llm_engine.config
    prompts, output_lens = make_workload(args, config.model_config.vocab_size)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True, detokenize=False) for n in output_lens]
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, detokenize=False), use_tqdm=False)
    core = llm.llm_engine.engine_core
    steps_before, overlapped_before = core.num_steps, core.num_overlapped_steps
    compiles_before = num_kernel_variants()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    kernel_compiles = num_kernel_variants() - compiles_before
    worker = getattr(core.executor, "worker", None)
    graphs = worker.model_runner.cuda_graphs if worker is not None else None
    pieces = worker.model_runner.piecewise_graphs if worker is not None else None
    return {
        "engine": "minivllm",
        "model": args.model or args.shape,
        "dataset": args.dataset,
        "num_requests": args.num_requests,
        "output_tokens": sum(output_lens),
        "prompt_tokens": sum(len(p) for p in prompts),
        "seconds": round(seconds, 3),
        "output_tokens_per_s": round(sum(output_lens) / seconds, 1),
        "total_tokens_per_s": round((sum(output_lens) + sum(len(p) for p in prompts)) / seconds, 1),
        "engine_steps": core.num_steps - steps_before,
        "kernel_compiles_during_run": kernel_compiles,  # should be 0: the engine warms up at start
        "preemptions": core.scheduler.num_preemptions,
        "kv_blocks": config.cache_config.num_gpu_blocks,
        "attention_backend": config.attention_backend,
        "cuda_graphs": graphs is not None,
        "cuda_graph_capture_seconds": getattr(graphs, "capture_seconds", None),
        "cuda_graph_capture_GiB": (graphs.capture_bytes / 2**30) if graphs is not None else None,
        "cudagraph_mode": config.compilation_config.cudagraph_mode,
        "piecewise_capture_seconds": getattr(pieces, "capture_seconds", None),
        "piecewise_capture_GiB": (pieces.capture_bytes / 2**30) if pieces is not None else None,
        "memory_profile": worker.memory_profile if worker is not None else None,
        "compilation_level": args.compilation_level,
        "async_scheduling": args.async_scheduling,
        "overlapped_steps": core.num_overlapped_steps - overlapped_before,
        "startup_seconds": round(startup_seconds, 1),
        "dtype": str(config.model_config.dtype),
        "_prompt_lens": [len(p) for p in prompts],
        "_output_lens": output_lens,
    }


if __name__ == "__main__":
    main()
