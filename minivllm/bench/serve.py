"""`minivllm bench serve`: an async load generator for any OpenAI-compatible server (chapter 11).

    minivllm bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 4
    minivllm bench serve --backend offline --model /models/qwen3 ...   # same prompts, LLM.generate

Requests leave at a fixed rate or as a Poisson process (`--request-rate`, `--arrival`), at
most `--max-concurrency` at a time, each a streamed `/v1/completions` call with
`ignore_eos`, so every request generates exactly `--random-output-len` tokens. From the
stream it records, as `vllm bench serve` does: TTFT (time to the first text chunk), ITL (the
gaps between chunks), TPOT ((latency - TTFT) / (output tokens - 1)) and end-to-end latency,
and reports mean, median and p99 of each plus request and token throughput. Random prompts
are token-id lists (exact lengths, no tokenizer needed), so the same command measures vLLM.
`--backend offline` runs the same prompts through `LLM.generate` in this process: the
server's overhead is the ratio of the two output throughputs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from minivllm.bench import git_commit

# Random prompt tokens are drawn from this id range: ordinary tokens in any vocabulary of
# 30k+ (SmolLM2: 49k, Qwen3: 152k), away from the special tokens at either end.
RANDOM_TOKEN_RANGE = (1000, 30000)

# Above this share of the wall time spent on its own CPU, the generator warns that it, not the
# server, may be what was measured.
CLIENT_BUSY_FRACTION = 0.9


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def make_prompts(args: argparse.Namespace) -> list[str | list[int]]:
    rng = random.Random(args.seed)
    if args.dataset_name == "file":
        lines = [line.strip() for line in Path(args.dataset_path).read_text().splitlines() if line.strip()]
        prompts: list[str | list[int]] = [json.loads(line)["prompt"] if line.startswith("{") else line for line in lines]
        return [prompts[i % len(prompts)] for i in range(args.num_prompts)]
    low, high = RANDOM_TOKEN_RANGE
    # vLLM's --random-prefix-len: the same tokens open every prompt (a shared system prompt).
    prefix = [rng.randrange(low, high) for _ in range(args.random_prefix_len)]
    return [prefix + [rng.randrange(low, high) for _ in range(args.random_input_len)] for _ in range(args.num_prompts)]


# --8<-- [start:one-request]
async def send_request(session: Any, url: str, body: dict[str, Any], headers: dict[str, str], prompt_len: int) -> RequestResult:
    """One streamed completion; the clock starts when the request is sent."""
    result = RequestResult(ok=False, prompt_len=prompt_len)
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return result
            async for line in response.content:  # one SSE line at a time
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[len(b"data: "):])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                if choice.get("text") or choice.get("token_ids"):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.latency = time.perf_counter() - start
        result.ok = True
    except Exception as err:  # a failed request is counted, not fatal
        result.error = repr(err)
    return result
# --8<-- [end:one-request]


async def run_load(
    args: argparse.Namespace, prompts: list[str | list[int]], model: str, start_together: Any = None
) -> tuple[list[RequestResult], float, float, float]:
    """Send every prompt; return the results, the wall-clock start and end of the run, and this
    process's CPU time meanwhile. `start_together`: a barrier the workers of one run wait at."""
    import aiohttp

    url = args.base_url.rstrip("/") + args.endpoint
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed + 1)
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    def body(prompt: str | list[int]) -> dict[str, Any]:
        return {"model": model, "prompt": prompt, "max_tokens": args.random_output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                # Token ids as well as text, so that a server without a tokenizer is measurable too.
                "return_token_ids": True}

    async def limited(session: Any, prompt: str | list[int]) -> RequestResult:
        prompt_len = len(prompt) if isinstance(prompt, list) else 0
        if semaphore is None:
            return await send_request(session, url, body(prompt), headers, prompt_len)
        async with semaphore:
            return await send_request(session, url, body(prompt), headers, prompt_len)

    # aiohttp, as vLLM's benchmark: its C parser costs the client far less per event than
    # httpx, and a load generator must stay cheaper than the server it measures.
    timeout = aiohttp.ClientTimeout(total=None)
    # The warm-up on a connection of its own: a kept-alive one could sit idle at the barrier
    # longer than the server keeps it open, and the first request on it would fail.
    async with aiohttp.ClientSession(timeout=timeout) as session:
        warmup = await send_request(session, url, {**body(prompts[0]), "max_tokens": 4}, headers, 0)
        if not warmup.ok:
            raise RuntimeError(f"the warm-up request failed: {warmup.error}")
    if start_together is not None:
        start_together.wait()  # every worker has warmed up: start at once
    connector = aiohttp.TCPConnector(limit=0)  # no cap on connections: --max-concurrency caps
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = []
        start, cpu_start = time.time(), time.process_time()
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(session, prompt)))
            if args.request_rate != float("inf"):  # the gap to the next arrival
                gap = rng.expovariate(args.request_rate) if args.arrival == "poisson" else 1.0 / args.request_rate
                await asyncio.sleep(gap)
        results = await asyncio.gather(*tasks)
        return results, start, time.time(), time.process_time() - cpu_start


def run_load_in_workers(args: argparse.Namespace, prompts: list[str | list[int]], model: str) -> tuple[list[RequestResult], float, float]:
    """`--num-workers K`: K load-generator processes, each with every K-th prompt, a K-th of the
    request rate and of the concurrency cap, started together. One Python process can read
    only so many events a second; above that it measures itself, not the server."""
    workers = args.num_workers
    spawn = multiprocessing.get_context("spawn")
    start_together, answers = spawn.Barrier(workers), spawn.Queue()
    shares = []
    for i in range(workers):
        share = argparse.Namespace(**vars(args))
        share.request_rate = args.request_rate / workers
        share.max_concurrency = -(-args.max_concurrency // workers) if args.max_concurrency else None
        share.seed = args.seed + 1000 * i  # each worker its own arrival gaps
        shares.append(share)
    processes = [spawn.Process(target=_load_worker, args=(shares[i], prompts[i::workers], model, start_together, answers))
                 for i in range(workers)]
    for process in processes:
        process.start()
    runs = [answers.get() for _ in processes]
    for process in processes:
        process.join()
    results = [result for run in runs for result in run[0]]
    start, end = min(run[1] for run in runs), max(run[2] for run in runs)
    return results, end - start, sum(run[3] for run in runs) / workers  # CPU: the workers' mean


def _load_worker(args: argparse.Namespace, prompts: list[str | list[int]], model: str, start_together: Any, answers: Any) -> None:
    answers.put(asyncio.run(run_load(args, prompts, model, start_together)))


def run_offline(args: argparse.Namespace, prompts: list[str | list[int]]) -> tuple[list[RequestResult], float]:
    """The same prompts through `LLM.generate` in this process: the server-free reference."""
    from minivllm import LLM, SamplingParams
    from minivllm.engine.arg_utils import EngineArgs

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    params = SamplingParams(max_tokens=args.random_output_len, temperature=0.0, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    llm.generate(inputs[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    steps_before = llm.llm_engine.get_stats().num_steps
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    duration = time.perf_counter() - start
    args.offline_engine_steps = llm.llm_engine.get_stats().num_steps - steps_before
    results = [RequestResult(ok=True, prompt_len=len(o.prompt_token_ids), output_tokens=len(o.outputs[0].token_ids)) for o in outputs]
    return results, duration


# --8<-- [start:summarize]
def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """vLLM's report: throughput, and mean / median / p99 of TTFT, TPOT, ITL and latency (ms)."""
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    summary: dict[str, Any] = {
        "completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        # Chunks that carried tokens: fewer than the tokens when a lagging server merged some.
        "output_events": sum(len(r.itl) + 1 for r in done if r.ttft),
    }
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1 and r.latency]
    samples = {
        "ttft": [r.ttft for r in done if r.latency], "tpot": tpots,
        "itl": [gap for r in done for gap in r.itl], "e2el": [r.latency for r in done if r.latency],
    }
    for name, values in samples.items():
        values_ms = sorted(v * 1000 for v in values)
        if not values_ms:
            continue
        summary[f"mean_{name}_ms"] = statistics.fmean(values_ms)
        summary[f"median_{name}_ms"] = statistics.median(values_ms)
        summary[f"p99_{name}_ms"] = values_ms[min(len(values_ms) - 1, int(0.99 * len(values_ms)))]
    errors = [r.error for r in results if not r.ok]
    if errors:
        summary["first_error"] = errors[0]
    return summary
# --8<-- [end:summarize]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from minivllm.engine.arg_utils import EngineArgs

    parser = argparse.ArgumentParser(prog="minivllm bench serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=["openai", "offline"], default="openai",
                        help="openai: a running server; offline: LLM.generate here, on the same prompts")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--served-model-name", default=None, help="the request's `model` (default: the server's first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--dataset-name", choices=["random", "file"], default="random")
    parser.add_argument("--dataset-path", default=None, help="file: one prompt per line (text, or JSON with 'prompt')")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--random-input-len", type=int, default=128)
    parser.add_argument("--random-prefix-len", type=int, default=0, help="tokens shared by every prompt, before its random part")
    parser.add_argument("--random-output-len", type=int, default=128, help="tokens generated per request (ignore_eos)")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf: all at once")
    parser.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson", help="gaps between requests")
    parser.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    parser.add_argument("--num-workers", type=int, default=1,
                        help="load-generator processes sharing the prompts (when one is busy all the time)")
    parser.add_argument("--result-file", default=None, help="write the summary as JSON here")
    EngineArgs.add_cli_args(parser)  # for --backend offline: --model PATH and the engine flags
    args = parser.parse_args(argv)
    if args.dataset_name == "file" and not args.dataset_path:
        parser.error("--dataset-name file needs --dataset-path")
    if not 1 <= args.num_workers <= args.num_prompts:
        parser.error(f"--num-workers must be between 1 and --num-prompts ({args.num_prompts}), got {args.num_workers}")

    prompts = make_prompts(args)
    if args.backend == "offline":
        results, duration = run_offline(args, prompts)
    else:
        model = args.served_model_name or _first_served_model(args)
        if args.num_workers > 1:
            results, duration, client_cpu = run_load_in_workers(args, prompts, model)
        else:
            results, start, end, client_cpu = asyncio.run(run_load(args, prompts, model))
            duration = end - start
    summary = summarize(results, duration)
    if args.backend == "offline":
        summary["engine_steps"] = args.offline_engine_steps
    if args.backend == "openai":
        # A load generator that is busy all the time measures itself, not the server.
        summary["client_cpu_fraction"] = client_cpu / duration  # per worker, with --num-workers
        if client_cpu > CLIENT_BUSY_FRACTION * duration:
            print(f"warning: this load generator was busy {client_cpu / duration:.0%} of the run; the server may be "
                  "faster than these numbers (run several generators, or fewer streams)", file=sys.stderr)
    summary.update(
        backend=args.backend, date=datetime.now(timezone.utc).isoformat(timespec="seconds"), commit=git_commit(),
        command="minivllm bench serve " + " ".join(argv if argv is not None else sys.argv[1:]),
        num_prompts=args.num_prompts, num_workers=args.num_workers, request_rate=args.request_rate, arrival=args.arrival, max_concurrency=args.max_concurrency,
        random_input_len=args.random_input_len, random_output_len=args.random_output_len,
        random_prefix_len=args.random_prefix_len,
    )
    _print_summary(summary)
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(summary, indent=2))
    return summary


def _first_served_model(args: argparse.Namespace) -> str:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    request = urllib.request.Request(args.base_url.rstrip("/") + "/v1/models", headers=headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["data"][0]["id"]


def _print_summary(summary: dict[str, Any]) -> None:
    print(f"{' Serving Benchmark Result ':=^60}")
    for key, value in summary.items():
        if isinstance(value, float):
            print(f"{key:<40}{value:>20.2f}")
        elif key not in ("command",):
            print(f"{key:<40}{str(value):>20}")
    print("=" * 60)


if __name__ == "__main__":
    main()
