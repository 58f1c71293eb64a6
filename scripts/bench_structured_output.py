"""Structured output costs on the CPU (chapter 11): grammar compile time, cold and cached, and
the per-step cost of the token bitmask on the demo model's vocabulary.

    OMP_NUM_THREADS=1 python scripts/bench_structured_output.py
"""

from __future__ import annotations

import statistics
import time

import torch
import xgrammar as xgr

from minivllm.config import EngineConfig
from minivllm.engine.arg_utils import EngineArgs
from minivllm.models.demo import demo_model_path
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams, StructuredOutputsParams
from minivllm.structured_output.bitmask import apply_token_bitmask
from minivllm.structured_output.manager import StructuredOutputManager

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
}
SPECS = {
    "json schema (4 properties)": StructuredOutputsParams(json=SCHEMA),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex (e-mail)": StructuredOutputsParams(regex=r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"),
    "choice (3)": StructuredOutputsParams(choice=["positive", "negative", "neutral"]),
    "EBNF (arithmetic)": StructuredOutputsParams(grammar='root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9]+ | "(" expr ")"'),
}


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def main() -> None:
    config: EngineConfig = EngineArgs(model=str(demo_model_path()), device="cpu", dtype="float32").create_engine_config()
    manager = StructuredOutputManager(config)
    start = time.perf_counter()
    backend = manager.backend
    print(f"vocab {backend.vocab_size}; tokenizer + TokenizerInfo: {ms(time.perf_counter() - start)}")

    print("| spec | cold compile | cached (grammar_init, hit) |")
    print("|---|---|---|")
    for name, spec in SPECS.items():
        request = Request("r", [1], SamplingParams(structured_outputs=spec))
        start = time.perf_counter()
        manager.grammar_init(request)
        request.structured_output_request.compiled_grammar.result()
        cold = time.perf_counter() - start
        hits = []
        for _ in range(50):
            again = Request("r", [1], SamplingParams(structured_outputs=spec))
            start = time.perf_counter()
            manager.grammar_init(again)
            again.structured_output_request.compiled_grammar.result()
            hits.append(time.perf_counter() - start)
        print(f"| {name} | {ms(cold)} | {statistics.median(hits) * 1e6:.1f} µs |")

    print("\n| rows | fill bitmask (xgrammar matchers, mean over one answer) | apply: apply_token_bitmask (ours) | apply: xgrammar cpu kernel |")
    print("|---|---|---|---|")
    compiled = manager.grammar_cache[("json", StructuredOutputsParams(json=SCHEMA).spec)].result()
    from transformers import AutoTokenizer

    answer = '{"name": "Alice Smith", "age": 31, "color": "red", "tags": ["tea", "rain"]}'
    answer_ids = AutoTokenizer.from_pretrained(config.model_config.tokenizer).encode(answer)
    for rows in (1, 8, 32):
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(rows)]
        bitmask = backend.allocate_bitmask(rows)
        logits = torch.randn(rows, backend.vocab_size)

        def timed(fn, repeat: int = 30) -> float:
            fn()
            samples = []
            for _ in range(repeat):
                start = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - start)
            return statistics.median(samples)

        # Fill along a real output: the cost depends on the grammar state (inside a string
        # almost every token is allowed), so walk every matcher through one JSON answer.
        fills = []
        for token_id in answer_ids:
            start = time.perf_counter()
            for i, matcher in enumerate(matchers):
                matcher.fill_next_token_bitmask(bitmask, i)
            fills.append(time.perf_counter() - start)
            assert all(matcher.accept_token(token_id) for matcher in matchers)
        fill = statistics.mean(fills)
        ours = timed(lambda: apply_token_bitmask(logits.clone(), bitmask))
        theirs = timed(lambda: xgr.apply_token_bitmask_inplace(logits.clone(), bitmask))
        clone = timed(lambda: logits.clone())
        print(f"| {rows} | {ms(fill)} | {ms(ours - clone)} | {ms(theirs - clone)} |")
    manager.shutdown()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
