"""`minivllm run`: load a model and answer several prompts at once (chapter 01).

With no arguments it loads the embedded demo model (SmolLM2-135M-Instruct) and answers a
handful of chat prompts of different lengths together: continuous batching in action. It
prints the answers, then tokens/s, engine steps, the peak number of KV blocks in use and the
number of preemptions. `--trace` adds a table per step of what the scheduler chose.
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
    from minivllm.entrypoints.llm import LLM

    start = time.perf_counter()
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    load_seconds = time.perf_counter() - start
    engine = llm.llm_engine
    config = engine.config
    print(
        f"model {config.model_config.model} ({config.model_config.architecture}, {config.model_config.dtype}) "
        f"on {config.device_config.device}: loaded in {load_seconds:.1f} s; "
        f"KV cache {config.cache_config.num_gpu_blocks} blocks × {config.cache_config.block_size} tokens"
    )
    prompts = args.prompt or DEFAULT_PROMPTS
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=config.model_config.seed)
    on_step = _print_trace_step if args.trace else None
    if args.trace:
        print(f"{'step':>4}  {'request':>7}  {'work':<24} {'tokens':>6}  {'blocks':>6}")
    start = time.perf_counter()
    if args.no_chat:
        outputs = llm.generate(prompts, params, use_tqdm=not args.trace, on_step=on_step)
    else:
        conversations = [[{"role": "user", "content": p}] for p in prompts]
        outputs = llm.chat(conversations, params, use_tqdm=not args.trace, on_step=on_step)
    seconds = time.perf_counter() - start
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        print(f"\n### {prompt}\n{completion.text.strip()}\n[{len(completion.token_ids)} tokens, {completion.finish_reason}]")
    core = engine.engine_core
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(
        f"\n{len(prompts)} requests, {num_tokens} tokens in {seconds:.2f} s: {num_tokens / seconds:.1f} tokens/s; "
        f"{core.num_steps} engine steps; peak KV blocks used {core.peak_num_blocks_used}/{config.cache_config.num_gpu_blocks}; "
        f"preemptions {core.scheduler.num_preemptions}"
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
