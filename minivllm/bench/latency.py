"""`minivllm bench latency`: the time of one decode step, beside the weights-read floor.

For each batch size B, B random prompts of `--input-len` tokens are generated twice: once for
one token (the prefill step), once for 1 + `--output-len` tokens. The difference over
`--output-len` is one decode step of the whole engine — scheduling, input preparation, the
forward pass (a CUDA graph replay unless `--enforce-eager`), sampling. The two runs alternate,
and each pair gives one difference: a GPU whose clocks are still rising, or a slow moment of
the host, then lands in both runs of a pair instead of in all the prefills only (which once
made a step look shorter than its own replay). Median of `--num-iters` pairs, with the
pairs' range beside it.

With CUDA graphs, the replay alone is also timed (CUDA events): the GPU's share of the step.

The floor: a decode step must read every weight once (and, far smaller at these lengths, the
K/V of each context), so weight bytes over the copy bandwidth measured in the same run is the
least time a step can take. Chapter 05 plots eager against CUDA graphs with it.

    minivllm bench latency --shape qwen3-0.6b --batch-sizes 1,8,64 --json graphs.json
    minivllm bench latency --shape qwen3-0.6b --batch-sizes 1,8,64 --enforce-eager --json eager.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from minivllm.bench import report
from minivllm.config import CUDAGRAPH_MODES


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-0.6b", help="random weights of this shape (see shapes.py)")
    parser.add_argument("--model", default=None, help="a real model folder instead of --shape")
    parser.add_argument("--batch-sizes", default="1", help="comma-separated, e.g. 1,8,64")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--compilation-level", type=int, default=0)
    parser.add_argument("--cudagraph-mode", default="full_and_piecewise", choices=CUDAGRAPH_MODES,
                        help="which steps replay CUDA graphs (chapter 05)")
    parser.add_argument("--async-scheduling", action="store_true", help="schedule step n+1 while step n runs")
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from minivllm import LLM, SamplingParams
    from minivllm.bench.throughput import model_bytes, run_info, write_shape

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    model = args.model or str(write_shape(args.shape))
    engine_kwargs = dict(
        skip_tokenizer_init=True, max_model_len=args.max_model_len, max_num_seqs=max(batch_sizes),
        enforce_eager=args.enforce_eager, compilation_level=args.compilation_level,
        cudagraph_mode=args.cudagraph_mode, gpu_memory_utilization=args.gpu_memory_utilization,
        async_scheduling=args.async_scheduling,
        enable_prefix_caching=False,  # repeated prompts must be computed again, not found
    )
    if args.model is None:
        engine_kwargs["load_format"] = "dummy"
    if args.attention_backend:
        engine_kwargs["attention_backend"] = args.attention_backend
    llm = LLM(model, **engine_kwargs)
    config = llm.llm_engine.config
    rng = random.Random(args.seed)

    def timed_generate(prompts: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start

    points = []
    for batch_size in batch_sizes:
        prompts = [[rng.randrange(config.model_config.vocab_size) for _ in range(args.input_len)] for _ in range(batch_size)]
        timed_generate(prompts, 1 + args.output_len)  # warm-up
        pairs = [(timed_generate(prompts, 1), timed_generate(prompts, 1 + args.output_len))
                 for _ in range(args.num_iters)]
        points.append({"batch_size": batch_size, **decode_step_from_pairs(pairs, args.output_len)})

    graphs = getattr(llm.llm_engine.engine_core.executor, "worker", None)
    graphs = graphs.model_runner.cuda_graphs if graphs is not None else None
    if graphs is not None:
        # The replay alone, timed with CUDA events on whatever the buffers hold from the last
        # step: the GPU's share of a step, against the whole engine step above.
        import triton.testing

        for point in points:
            size = graphs.padded_size(point["batch_size"])
            if size is not None:
                point["graph_replay_ms"] = triton.testing.do_bench(lambda: graphs.replay(size), warmup=20, rep=200,
                                                                   return_mode="median")
                if point["decode_step_ms"] < point["graph_replay_ms"]:
                    # A step contains its replay, so one shorter than it is a timing error.
                    point["warning"] = "decode step below its own replay: rerun with more --num-iters"
                    print(f"warning: batch {point['batch_size']}: {point['warning']}")

    result = {"model": args.model or args.shape, "mode": _mode(args), "input_len": args.input_len,
              "output_len": args.output_len, "points": points}
    import torch

    if torch.cuda.is_available():
        from minivllm.bench.ceilings import copy_bandwidth_gbps
        from minivllm.engine.arg_utils import load_hf_config

        sizes = model_bytes(load_hf_config(__import__("pathlib").Path(model)))
        copy_gbps = copy_bandwidth_gbps()
        result.update(sizes, copy_GBps=copy_gbps)
        for point in points:
            # Weights once, plus each sequence's context K/V at the middle of the decode.
            context = args.input_len + args.output_len // 2
            floor_bytes = sizes["weight_bytes_per_step"] + point["batch_size"] * context * sizes["kv_bytes_per_token"]
            point["floor_ms"] = floor_bytes / (copy_gbps * 1e9) * 1e3
            point["times_floor"] = point["decode_step_ms"] / point["floor_ms"]
    result.update(run_info())
    result["command"] = "minivllm bench latency " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    report(result, args.json)
    return result


def decode_step_from_pairs(pairs: list[tuple[float, float]], output_len: int) -> dict:
    """Decode step (ms) from (prefill-only, prefill + output_len decodes) timings in seconds.

    Each pair gives its own difference; the median of those, not the difference of the two
    medians, so that a pair run while the machine was slow shifts both of its timings.
    """
    if not pairs or output_len < 1:
        raise ValueError("need at least one timing pair and output_len >= 1")
    steps = [(full - prefill) / output_len * 1e3 for prefill, full in pairs]
    return {"decode_step_ms": statistics.median(steps), "decode_step_range_ms": [min(steps), max(steps)],
            "prefill_ms": statistics.median(prefill for prefill, _ in pairs) * 1e3}


def _mode(args: argparse.Namespace) -> str:
    mode = "eager" if args.enforce_eager or args.cudagraph_mode == "none" else args.cudagraph_mode
    return mode + ("+compile" if args.compilation_level else "") + ("+async" if args.async_scheduling else "")


if __name__ == "__main__":
    main()
