"""`minivllm run`: load a model and answer several prompts at once (chapter 01).

With no arguments it loads the embedded demo model (SmolLM2-135M-Instruct) and answers a
handful of chat prompts of different lengths together: continuous batching in action. It
prints the answers, then tokens/s, engine steps, the peak number of KV blocks in use, the
number of preemptions and the prompt tokens found in the prefix cache (chapter 04).
`--trace` adds a table per step of what the scheduler chose.
"""

from __future__ import annotations

import argparse
import time

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "You are a patient teacher. A student asks: what is the difference between a list and a "
    "tuple in Python, and when should I use each? Answer with a short example of both.",
    "Translate 'good morning' into Spanish, French and German.",
]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from minivllm.engine.arg_utils import EngineArgs

    parser = subparsers.add_parser("run", help="answer a few prompts with continuous batching (the demo)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for several); default: a demo set")
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--no-chat", action="store_true", help="send prompts as plain text, not through the chat template")
    parser.add_argument("--trace", action="store_true", help="print what the scheduler chose at every step")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from minivllm import SamplingParams
    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.entrypoints.llm import LLM, chat_prompt

    start = time.perf_counter()
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    engine = llm.llm_engine
    config = engine.config
    print(
        f"model {config.model_config.model} ({config.model_config.architecture}, {config.model_config.dtype}) "
        f"on {config.device_config.device}: loaded in {time.perf_counter() - start:.1f} s; "
        f"KV cache {config.cache_config.num_gpu_blocks} blocks × {config.cache_config.block_size} tokens"
    )
    prompts = args.prompt or DEFAULT_PROMPTS
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=config.model_config.seed)
    # What LLM.generate does, spelled out: add every request, then step the engine until all
    # are done. Each answer is printed the moment its request finishes: short answers leave
    # the batch early while long ones keep decoding (continuous batching).
    for request_id, prompt in enumerate(prompts):
        if not args.no_chat:
            prompt = chat_prompt(engine.get_tokenizer(), [{"role": "user", "content": prompt}])
        engine.add_request(str(request_id), prompt, params)
    if args.trace:
        print(f"{'step':>4}  {'request':>7}  {'work':<24} {'tokens':>6}  {'blocks':>6}")
    start = time.perf_counter()
    num_tokens = 0
    while engine.has_unfinished_requests():
        finished = [out for out in engine.step() if out.finished]
        if args.trace:
            _print_trace_step(engine)
        for out in finished:
            completion = out.outputs[0]
            num_tokens += len(completion.token_ids)
            print(
                f"\n### [{out.request_id}] {prompts[int(out.request_id)]}\n{completion.text.strip()}\n"
                f"[{len(completion.token_ids)} tokens, {completion.finish_reason}, "
                f"done after {time.perf_counter() - start:.1f} s]",
                flush=True,
            )
    seconds = time.perf_counter() - start
    stats = engine.get_stats()  # works whether the core runs here or in its own process
    print(
        f"\n{len(prompts)} requests, {num_tokens} tokens in {seconds:.2f} s: {num_tokens / seconds:.1f} tokens/s; "
        f"{stats.num_steps} engine steps; peak KV blocks used {stats.peak_num_blocks_used}/{stats.num_gpu_blocks}; "
        f"preemptions {stats.num_preemptions}; prefix cache hits {stats.prefix_cache_hits}/"
        f"{stats.prefix_cache_queries} prompt tokens"
    )
    return 0


def _print_trace_step(engine) -> None:
    """One line per request scheduled in the step that just ran."""
    core = engine.engine_core
    so = core.last_scheduler_output
    manager = core.scheduler.kv_cache_manager
    computed_before = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    computed_before.update({r.req_id: r.num_computed_tokens for r in so.scheduled_cached_reqs})
    for req_id, num_tokens in so.num_scheduled_tokens.items():
        request = core.scheduler.requests.get(req_id)
        start = computed_before[req_id]
        if request is None:
            work = "decode, finished"
        elif start + num_tokens <= request.num_prompt_tokens:
            work = f"prefill {start}:{start + num_tokens} of {request.num_prompt_tokens}"
        elif num_tokens == 1 and start >= request.num_prompt_tokens:
            work = "decode"
        else:  # resumed after preemption: prompt and earlier output tokens in one pass
            work = f"recompute {start}:{start + num_tokens}"
        blocks = len(manager.get_block_ids(req_id))
        print(f"{core.num_steps:>4}  {req_id:>7}  {work:<24} {num_tokens:>6}  {blocks:>6}")
    if so.preempted_req_ids:
        print(f"{'':>4}  preempted: {', '.join(sorted(so.preempted_req_ids))}")
