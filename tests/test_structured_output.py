"""Structured output (chapter 11): every output obeys its JSON schema, regex, choice or grammar.

Most tests run a tiny random Llama with the demo model's tokenizer and a *padded* vocabulary
(37 more logits than the tokenizer has tokens). A random model left alone writes garbage, so
an output that validates shows the mask did the work; the padded columns show the mask covers
logits the tokenizer has no token for. The demo model checks a real model's JSON and that
unconstrained requests in the same batch are untouched.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path

import pytest

xgr = pytest.importorskip("xgrammar", reason="structured output needs xgrammar")
jsonschema = pytest.importorskip("jsonschema")

import torch  # noqa: E402

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.config import SchedulerConfig  # noqa: E402
from minivllm.engine.types import EngineCoreRequest  # noqa: E402
from minivllm.kv_cache.manager import KVCacheManager  # noqa: E402
from minivllm.request import RequestStatus  # noqa: E402
from minivllm.sampling_params import StructuredOutputsParams  # noqa: E402
from minivllm.scheduler.output import SchedulerOutput  # noqa: E402
from minivllm.scheduler.scheduler import Scheduler  # noqa: E402
from minivllm.structured_output import validate_structured_outputs  # noqa: E402
from minivllm.structured_output.bitmask import apply_grammar_bitmask  # noqa: E402

ENGINE_KWARGS = dict(max_model_len=256, device="cpu", dtype="float32", num_gpu_blocks_override=512)
NUM_PADDING_LOGITS = 37
SEEDS = range(6)

# Bounded on purpose: every string and array has a maximum length and every number a range,
# so even a random model reaches the end within max_tokens.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "tags", "member"],
    "additionalProperties": False,
}
EMAIL_REGEX = r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"
CHOICES = ["positive", "negative", "neutral ☺"]
# Sums of small numbers, with parentheses: an EBNF grammar that no regex can express.
ARITHMETIC_GRAMMAR = r"""
root ::= expr
expr ::= term ("+" term){0,3}
term ::= [1-9] | "(" expr ")"
"""


def parses_as_arithmetic(text: str) -> bool:
    """A tiny recursive-descent check of ARITHMETIC_GRAMMAR (the test's own, independent parser)."""

    def expr(i: int) -> int:
        i = term(i)
        for _ in range(3):
            if i < len(text) and text[i] == "+":
                i = term(i + 1)
        return i

    def term(i: int) -> int:
        if i < len(text) and text[i] in "123456789":
            return i + 1
        if i < len(text) and text[i] == "(":
            i = expr(i + 1)
            if i < len(text) and text[i] == ")":
                return i + 1
        raise ValueError(f"bad term at {i}")

    try:
        return expr(0) == len(text)
    except ValueError:
        return False


def make_padded_tiny_model(folder: Path, tokenizer_dir: Path) -> Path:
    """A 2-layer random Llama whose logits are wider than the demo tokenizer's vocabulary."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer) + NUM_PADDING_LOGITS, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        initializer_range=0.2, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # make the padding logits the likeliest: unmasked, they would win
        model.lm_head.weight[len(tokenizer):] = model.lm_head.weight[: NUM_PADDING_LOGITS] * 0 + 1.0
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def padded_model(tmp_path_factory, demo_model_dir) -> Path:
    return make_padded_tiny_model(tmp_path_factory.mktemp("padded-llama"), demo_model_dir)


@pytest.fixture(scope="module")
def padded_llm(padded_model):
    llm = LLM(str(padded_model), enable_multiprocessing=False, **ENGINE_KWARGS)
    yield llm
    llm.llm_engine.shutdown()


def sampled(structured: StructuredOutputsParams, seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=120, structured_outputs=structured, **kwargs)


def check_valid(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), f"json_object must give a JSON object, got {text!r}"
    elif kind == "regex":
        assert re.fullmatch(EMAIL_REGEX, text), f"{text!r} does not match {EMAIL_REGEX}"
    elif kind == "choice":
        assert text in CHOICES, f"{text!r} is not one of {CHOICES}"
    else:
        assert parses_as_arithmetic(text), f"{text!r} is not in the arithmetic grammar"


ALL_KINDS = {
    "json": StructuredOutputsParams(json=PERSON_SCHEMA),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=EMAIL_REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=ARITHMETIC_GRAMMAR),
}


# -- the parameters --------------------------------------------------------------------------


def test_exactly_one_kind_must_be_set():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object; got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=["a", ""])
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})  # a dict is not the params object


@pytest.mark.parametrize(
    "params, reason",
    [
        (StructuredOutputsParams(json='{"type": "objekt"}'), r"invalid structured output json: Unsupported type \"objekt\""),
        (StructuredOutputsParams(json="{not json"), "invalid structured output json: Failed to parse JSON"),
        (StructuredOutputsParams(regex="(ab"), "invalid structured output regex: .*parenthesis is not closed"),
        (StructuredOutputsParams(grammar='start ::= "a"'), 'invalid structured output grammar: .*root rule with name "root" is not found'),
    ],
)
def test_a_spec_that_cannot_compile_is_a_value_error_naming_the_problem(params, reason):
    with pytest.raises(ValueError, match=reason):
        validate_structured_outputs(params, tokenizer=object())


# -- the pieces: bitmask rows, the scheduler's wait ---------------------------------------------


def test_only_the_rows_of_structured_requests_are_masked():
    logits = torch.randn(3, 40)
    original = logits.clone()
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = 1 << 4  # the structured request may only say token 4
    so = SchedulerOutput([], [], {}, 0, set(), structured_output_request_ids={"json-req": 0}, grammar_bitmask=bitmask)
    apply_grammar_bitmask(logits, ["plain-a", "json-req", "plain-b"], so)
    assert torch.equal(logits[[0, 2]], original[[0, 2]]), "unconstrained rows in the same batch must not change"
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [4], "the structured row keeps only its allowed token"


def test_a_request_waits_for_its_grammar_without_blocking_the_queue():
    from concurrent.futures import Future

    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True, max_model_len=64)
    scheduler = Scheduler(config, KVCacheManager(100, 4))
    structured = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    first = scheduler.add_request(EngineCoreRequest("structured", [5, 6, 7], structured, 0.0))
    scheduler.add_request(EngineCoreRequest("plain", [8, 9], SamplingParams(), 1.0))
    compiling: Future = Future()
    first.structured_output_request.compiled_grammar = compiling
    assert first.status == RequestStatus.WAITING_FOR_FSM

    step = scheduler.schedule()
    assert list(step.num_scheduled_tokens) == ["plain"], "a later request runs while the earlier one's grammar compiles"
    assert list(scheduler.waiting) == [first], "the compiling request stays queued"

    compiling.set_result("compiled")
    step = scheduler.schedule()
    assert list(step.num_scheduled_tokens) == ["structured"], "once compiled, the request is admitted"
    assert first.status == RequestStatus.RUNNING


# -- end to end: the tiny model with padded logits ------------------------------------------------


@pytest.mark.slow
def test_every_sampled_output_validates(padded_llm):
    tokenizer_size = len(padded_llm.get_tokenizer())
    # json_object allows strings of any length, which a random model may never close: the
    # demo model's test covers it.
    bounded = [kind for kind in ALL_KINDS if kind != "json_object"]
    kinds = [kind for kind in bounded for _ in SEEDS]
    params = [sampled(ALL_KINDS[kind], seed) for kind in bounded for seed in SEEDS]
    outputs = padded_llm.generate(["Answer:"] * len(params), params, use_tqdm=False)
    for kind, out in zip(kinds, outputs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", f"{kind}: a bounded grammar must end before max_tokens: {completion.text!r}"
        assert max(completion.token_ids) < tokenizer_size, f"{kind}: a padding logit (no token) was sampled"
        check_valid(kind, completion.text)


def test_the_end_of_the_grammar_stops_the_request_even_with_ignore_eos(padded_llm):
    params = [sampled(ALL_KINDS["choice"], seed, ignore_eos=True) for seed in range(3)]
    for out in padded_llm.generate(["Mood:"] * 3, params, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop", "reaching the grammar's end finishes the request"
        assert out.outputs[0].text in CHOICES


def test_a_repeated_schema_is_compiled_once(padded_llm):
    manager = padded_llm.llm_engine.engine_core.structured_output_manager
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    hits, misses = manager.num_cache_hits, manager.num_cache_misses
    params = [sampled(StructuredOutputsParams(json=schema), seed) for seed in range(4)]
    outputs = padded_llm.generate(["Is it?"] * 4, params, use_tqdm=False)
    assert manager.num_cache_misses == misses + 1, "the first request compiles the schema"
    assert manager.num_cache_hits == hits + 3, "the three others reuse it (or wait for the same compile)"
    assert all(json.loads(o.outputs[0].text) in ({"ok": True}, {"ok": False}) for o in outputs)


def test_a_bad_spec_is_refused_before_the_engine_and_the_engine_keeps_serving(padded_llm):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[unclosed"))
    with pytest.raises(ValueError, match="invalid structured output regex"):
        padded_llm.generate(["x"], bad, use_tqdm=False)
    assert not padded_llm.llm_engine.has_unfinished_requests(), "nothing of the bad request may reach the engine"
    out = padded_llm.generate(["x"], sampled(ALL_KINDS["choice"], 0), use_tqdm=False)[0]
    assert out.outputs[0].text in CHOICES


@pytest.mark.slow
def test_structured_output_through_the_engine_core_process(padded_model, monkeypatch):
    """The params cross the ZMQ socket as msgpack; the core process loads its own tokenizer."""
    pytest.importorskip("zmq")
    from minivllm.engine.arg_utils import AsyncEngineArgs
    from minivllm.engine.async_llm import AsyncLLM

    monkeypatch.setenv("MINIVLLM_ENABLE_MULTIPROCESSING", "1")
    llm = LLM(str(padded_model), **ENGINE_KWARGS)
    try:
        kinds = ["json", "regex", "grammar"]
        outputs = llm.generate(["A:"] * 3, [sampled(ALL_KINDS[k], 1) for k in kinds], use_tqdm=False)
        for kind, out in zip(kinds, outputs):
            check_valid(kind, out.outputs[0].text)
    finally:
        llm.llm_engine.shutdown()

    async def run_async() -> list[str]:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(padded_model), **ENGINE_KWARGS))
        try:
            async def one(i: int) -> str:
                final = None
                async for final in engine.generate("B:", sampled(ALL_KINDS["json"], i), f"async-{i}"):
                    pass
                return final.outputs[0].text

            return await asyncio.gather(*(one(i) for i in range(3)))
        finally:
            engine.shutdown()
            await asyncio.sleep(0)

    for text in asyncio.run(run_async()):
        check_valid("json", text)


# -- the demo model ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_model_json_validates_and_unconstrained_neighbours_are_unchanged(demo_llm):
    prompts = ["The capital of France is", "List three fruits:"]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    alone = demo_llm.generate(prompts, greedy, use_tqdm=False)

    json_prompt = "Describe a person as JSON with name, age, color, tags and member:"
    object_prompt = "Write a JSON object about a cat:"
    mixed_prompts = prompts + [json_prompt] * 3 + [object_prompt]
    structured_kinds = ["json", "json", "json", "json_object"]
    # json_object allows strings of any length; sampled at temperature 1 the 135M model may
    # not close one within max_tokens, so that request is greedy.
    object_params = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=ALL_KINDS["json_object"])
    mixed_params = [greedy, greedy] + [sampled(ALL_KINDS["json"], seed) for seed in range(3)] + [object_params]
    mixed = demo_llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    for before, after in zip(alone, mixed[:2]):
        assert after.outputs[0].token_ids == before.outputs[0].token_ids, (
            "an unconstrained request must generate exactly the same tokens when structured requests share its batch"
        )
    for kind, out in zip(structured_kinds, mixed[2:]):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        check_valid(kind, out.outputs[0].text)
