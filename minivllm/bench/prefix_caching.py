"""`python -m minivllm.bench.prefix_caching`: what prefix caching and KV offloading buy (chapter 04).

Three modes, one engine each (run them as separate processes, so that no engine's memory
or state leaks into another's numbers):

  * `--mode on` (prefix caching on): TTFT of a request whose `--prefix-len`-token prefix is
    cached vs uncached (the cache is reset before each uncached one); then the throughput of
    a shared-prefix workload (`--num-prefixes` prefixes of `--shared-len` tokens, each with
    `--requests-per-prefix` requests of `--suffix-len` own tokens) and of the same workload
    with every prompt unique (0 % hits: the cost of hashing and bookkeeping).
  * `--mode off`: the two throughput workloads with prefix caching off.
  * `--mode offload` (a small GPU cache and a CPU tier of `--offload-gib`): TTFT when the
    prefix must be recomputed vs when it comes back from the CPU tier (an unrelated request
    that needs the whole GPU cache evicts it first).

TTFT is the wall time of `LLM.generate` for one prompt with `max_tokens=1` (one engine step:
schedule, prefill, sample); the median of `--repeats` runs, after one untimed run of each
kind. Throughput is (prompt + output tokens) / wall time, `--output-len` tokens each
(vLLM's `benchmark_prefix_caching.py` uses 10 as well: the prefill is what caching changes).
Prompts are random token ids from a fixed seed; `--shape` gives random weights of a real
model's shape (`load_format="dummy"`), `--model` a real model folder (e.g. the demo model).

    python -m minivllm.bench.prefix_caching --mode on --json on.json
    python -m minivllm.bench.prefix_caching --summarize on.json off.json offload.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from minivllm.bench import report
from minivllm.bench.throughput import num_kernel_variants, run_info, write_shape


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["on", "off", "offload"])
    parser.add_argument("--summarize", nargs="+", default=None, help="JSON files of earlier runs: print one table")
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--model", default=None, help="a real model folder instead of --shape ('demo': the demo model)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--prefix-len", type=int, default=2048, help="TTFT: the cached prefix")
    parser.add_argument("--ttft-suffix-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-prefixes", type=int, default=5)
    parser.add_argument("--shared-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=128)
    parser.add_argument("--requests-per-prefix", type=int, default=50)
    parser.add_argument("--output-len", type=int, default=10)
    parser.add_argument("--offload-gib", type=float, default=2.0)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def make_llm(args: argparse.Namespace, **engine_args):
    from minivllm import LLM

    kwargs = dict(skip_tokenizer_init=True, device=args.device, enforce_eager=args.enforce_eager, **engine_args)
    if args.model == "demo":
        model = None
    elif args.model:
        model = args.model
    else:
        model, kwargs["load_format"] = str(write_shape(args.shape)), "dummy"
    return LLM(model, **kwargs)


def tokens(rng: random.Random, vocab_size: int, n: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def ttft(llm, prompt: list[int]) -> float:
    from minivllm import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - start


def median_ttft(llm, prompts: list[list[int]], before_each=None) -> tuple[float, list[int]]:
    """Median TTFT over `prompts` (the first is a warm-up), and each one's cached tokens."""
    times, cached = [], []
    for i, prompt in enumerate(prompts):
        if before_each is not None:
            before_each()
        seconds = ttft(llm, prompt)
        if i > 0:
            times.append(seconds)
        cached.append(llm.llm_engine.engine_core.get_stats().prefix_cache_hits)
    hits = [b - a for a, b in zip([0] + cached, cached)]
    return statistics.median(times), hits[1:]


# --8<-- [start:ttft]
def measure_ttft(llm, args, rng, vocab_size) -> dict:
    prefix = tokens(rng, vocab_size, args.prefix_len)
    prompts = lambda: [prefix + tokens(rng, vocab_size, args.ttft_suffix_len) for _ in range(args.repeats + 1)]  # noqa: E731
    uncached, uncached_hits = median_ttft(llm, prompts(), before_each=llm.reset_prefix_cache)
    ttft(llm, prefix + tokens(rng, vocab_size, args.ttft_suffix_len))  # fills the cache with the prefix
    cached, cached_hits = median_ttft(llm, prompts())
    return {
        "ttft_uncached_s": uncached, "ttft_cached_s": cached, "ttft_ratio": cached / uncached,
        "ttft_hit_tokens_uncached": uncached_hits, "ttft_hit_tokens_cached": cached_hits,
    }
# --8<-- [end:ttft]


# --8<-- [start:workload]
def shared_prefix_workload(args, rng, vocab_size, unique: bool) -> list[list[int]]:
    """`num_prefixes` × `requests_per_prefix` prompts, interleaved; `unique`: no prefix shared."""
    prefixes = [tokens(rng, vocab_size, args.shared_len) for _ in range(args.num_prefixes)]
    prompts = []
    for _ in range(args.requests_per_prefix):
        for prefix in prefixes:
            head = tokens(rng, vocab_size, args.shared_len) if unique else prefix
            prompts.append(head + tokens(rng, vocab_size, args.suffix_len))
    return prompts
# --8<-- [end:workload]


def measure_throughput(llm, args, vocab_size, unique: bool) -> dict:
    from minivllm import SamplingParams

    rng = random.Random(args.seed + 1)  # the same prompts in every mode
    prompts = shared_prefix_workload(args, rng, vocab_size, unique)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": prompts[0][:64]}], params, use_tqdm=False)  # warm-up
    if llm.llm_engine.config.cache_config.enable_prefix_caching:
        llm.reset_prefix_cache()
    before = llm.llm_engine.get_stats()
    compiles_before = num_kernel_variants()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    kernel_compiles = num_kernel_variants() - compiles_before
    after = llm.llm_engine.get_stats()
    num_tokens = sum(len(p) for p in prompts) + args.output_len * len(prompts)
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    return {
        "seconds": seconds, "tokens_per_s": num_tokens / seconds, "num_requests": len(prompts),
        "hit_rate": (after.prefix_cache_hits - before.prefix_cache_hits) / queries if queries else 0.0,
        "engine_steps": after.num_steps - before.num_steps,
        "kernel_compiles_during_run": kernel_compiles,
    }


# --8<-- [start:offload]
def measure_offload(args, rng) -> dict:
    """TTFT of a prefix recomputed vs brought back from the CPU tier, in one small-cache engine."""
    block_size = 16
    prompt_len = args.prefix_len + args.ttft_suffix_len
    max_model_len = -(-(prompt_len + 256) // block_size) * block_size
    # One block more than one max_model_len request: an evictor of that length needs every
    # free block, so it evicts the cached prefix (all but its first block) to the CPU tier.
    num_blocks = max_model_len // block_size + 1
    llm = make_llm(args, max_model_len=max_model_len, num_gpu_blocks_override=num_blocks,
                   kv_offloading_size=args.offload_gib, max_num_batched_tokens=max(8192, max_model_len))
    vocab_size = llm.llm_engine.config.model_config.vocab_size
    prefix = tokens(rng, vocab_size, args.prefix_len)
    prompts = lambda: [prefix + tokens(rng, vocab_size, args.ttft_suffix_len) for _ in range(args.repeats + 1)]  # noqa: E731
    recompute, recompute_hits = median_ttft(llm, prompts(), before_each=llm.reset_prefix_cache)
    ttft(llm, prefix + tokens(rng, vocab_size, args.ttft_suffix_len))  # the prefix, cached
    evict = lambda: ttft(llm, tokens(rng, vocab_size, max_model_len - 1))  # noqa: E731
    stats_before = llm.llm_engine.get_stats()
    from_cpu, cpu_hits = median_ttft(llm, prompts(), before_each=evict)
    stats = llm.llm_engine.get_stats()
    return {
        "ttft_recompute_s": recompute, "ttft_cpu_tier_s": from_cpu, "ttft_ratio": from_cpu / recompute,
        "hit_tokens_recompute": recompute_hits, "hit_tokens_cpu_tier_runs": cpu_hits,
        "cpu_hit_tokens": stats.prefix_cache_cpu_hits - stats_before.prefix_cache_cpu_hits,
        "num_cpu_blocks": llm.llm_engine.config.cache_config.num_cpu_blocks, "num_gpu_blocks": num_blocks,
    }
# --8<-- [end:offload]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.summarize:
        return summarize(args.summarize)
    rng = random.Random(args.seed)
    result: dict = {"mode": args.mode, "model": args.model or args.shape, **vars(args)}
    if args.mode == "offload":
        result.update(measure_offload(args, rng))
    else:
        caching = args.mode == "on"
        max_model_len = max(args.prefix_len + args.ttft_suffix_len, args.shared_len + args.suffix_len) + args.output_len + 16
        llm = make_llm(args, enable_prefix_caching=caching, max_model_len=max_model_len)
        vocab_size = llm.llm_engine.config.model_config.vocab_size
        if caching:
            result.update(measure_ttft(llm, args, rng, vocab_size))
        result["shared"] = measure_throughput(llm, args, vocab_size, unique=False)
        result["unique"] = measure_throughput(llm, args, vocab_size, unique=True)
        result["kv_blocks"] = llm.llm_engine.config.cache_config.num_gpu_blocks
    result.update(run_info())
    result["command"] = "python -m minivllm.bench.prefix_caching " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
    report(result, args.json)
    return result


def summarize(paths: list[str]) -> dict:
    runs = {}
    for path in paths:
        with open(path) as f:
            run = json.load(f)
        runs[run["mode"]] = run
    rows = []
    on, off, offload = runs.get("on"), runs.get("off"), runs.get("offload")
    if on:
        rows.append(("TTFT, %d-token prefix uncached" % on["prefix_len"], f"{on['ttft_uncached_s'] * 1e3:.1f} ms", ""))
        rows.append(("TTFT, prefix cached", f"{on['ttft_cached_s'] * 1e3:.1f} ms", f"{on['ttft_ratio']:.3f}x (target <= 0.2x)"))
    if on and off:
        for kind, label in (("shared", "shared prefixes"), ("unique", "0 % hits")):
            ratio = on[kind]["tokens_per_s"] / off[kind]["tokens_per_s"]
            target = "target >= 2x" if kind == "shared" else "target >= 0.97x"
            rows.append((f"throughput, {label}, caching off", f"{off[kind]['tokens_per_s']:.0f} tok/s", ""))
            rows.append((f"throughput, {label}, caching on (hit rate {on[kind]['hit_rate']:.2f})",
                         f"{on[kind]['tokens_per_s']:.0f} tok/s", f"{ratio:.3f}x ({target})"))
    if offload:
        rows.append(("TTFT, prefix recomputed (small cache)", f"{offload['ttft_recompute_s'] * 1e3:.1f} ms", ""))
        rows.append(("TTFT, prefix from the CPU tier", f"{offload['ttft_cpu_tier_s'] * 1e3:.1f} ms", f"{offload['ttft_ratio']:.3f}x"))
    width = max(len(r[0]) for r in rows) if rows else 0
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>14}  {note}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
