"""The vLLM-compatible `LLM` API on the demo model: sampling options, outputs, bad input."""

from __future__ import annotations

import json

import pytest

from minivllm import LLM, RequestOutput, SamplingParams
from minivllm.sampling_params import RequestOutputKind

GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_outputs_have_vllm_fields_and_come_back_in_prompt_order(demo_llm):
    prompts = ["One, two, three,", "The alphabet starts with", "Hello"]
    outs = demo_llm.generate(prompts, SamplingParams(max_tokens=5, **GREEDY), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    for out in outs:
        assert isinstance(out, RequestOutput) and out.finished
        c = out.outputs[0]
        assert (c.index, len(c.token_ids), c.finish_reason, c.stop_reason) == (0, 5, "length", None)
        m = out.metrics
        assert m.arrival_time <= m.first_token_time <= m.finished_time


def test_stop_string_cuts_the_text_and_ends_the_request(demo_llm):
    prompt = "Count: 1, 2, 3, 4, 5,"
    full = demo_llm.generate(prompt, SamplingParams(max_tokens=24, **GREEDY), use_tqdm=False)[0].outputs[0]
    stop = full.text[5:8]
    assert stop.strip(), f"pick a non-blank stop string from {full.text!r}"
    cut = demo_llm.generate(prompt, SamplingParams(max_tokens=24, stop=[stop], **GREEDY), use_tqdm=False)[0].outputs[0]
    assert cut.text == full.text[: full.text.index(stop)]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    assert len(cut.token_ids) < len(full.token_ids), "the engine stopped generating at the stop string"
    kept = demo_llm.generate(
        prompt, SamplingParams(max_tokens=24, stop=[stop], include_stop_str_in_output=True, **GREEDY), use_tqdm=False
    )[0].outputs[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_stop_token_ids_and_min_tokens(demo_llm):
    prompt = "Count: 1, 2, 3, 4, 5,"
    first = demo_llm.generate(prompt, SamplingParams(max_tokens=1, **GREEDY), use_tqdm=False)[0].outputs[0].token_ids[0]
    stopped = demo_llm.generate(prompt, SamplingParams(max_tokens=8, stop_token_ids=[first], **GREEDY), use_tqdm=False)[0]
    assert stopped.outputs[0].token_ids == [first] and stopped.outputs[0].stop_reason == first
    held = demo_llm.generate(
        prompt, SamplingParams(max_tokens=8, stop_token_ids=[first], min_tokens=3, **GREEDY), use_tqdm=False
    )[0].outputs[0]
    assert len(held.token_ids) >= 3 and first not in held.token_ids[:3], "min_tokens masks stop tokens"


def test_seeded_sampling_is_reproducible_whatever_else_is_in_the_batch(demo_llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=12, ignore_eos=True)
    alone = demo_llm.generate("Once upon a time", seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowd = ["A story:", "Once upon a time", "Dear diary,"]
    params = [SamplingParams(temperature=1.0, max_tokens=12), seeded, SamplingParams(temperature=0.8, seed=7, max_tokens=5)]
    together = demo_llm.generate(crowd, params, use_tqdm=False)[1].outputs[0].token_ids
    assert alone == together


def test_n_gives_several_distinct_completions(demo_llm):
    out = demo_llm.generate("My favourite colour is", SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "three seeded samples should not all be equal"
    again = demo_llm.generate("My favourite colour is", SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8), use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_logprobs_in_vllm_format(demo_llm):
    out = demo_llm.generate("The sky is", SamplingParams(max_tokens=6, logprobs=3, **GREEDY), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    total = 0.0
    for token_id, position in zip(out.token_ids, out.logprobs):
        assert token_id in position, "the sampled token is always in its position's dict"
        assert position[token_id].rank == 1, "greedy picks the top-ranked token"
        assert len(position) == 3, "greedy: the sampled token is one of the top 3"
        assert all(isinstance(lp.decoded_token, str) for lp in position.values())
        assert sorted(lp.rank for lp in position.values()) == [1, 2, 3]
        total += position[token_id].logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_streamed_deltas_join_to_the_final_text(demo_llm):
    engine = demo_llm.llm_engine
    prompt = "用中文和表情写一句话：今天天气🌞"
    final = demo_llm.generate(prompt, SamplingParams(max_tokens=20, **GREEDY), use_tqdm=False)[0].outputs[0].text
    engine.add_request("delta-1", prompt, SamplingParams(max_tokens=20, output_kind=RequestOutputKind.DELTA, **GREEDY))
    pieces = []
    while engine.has_unfinished_requests():
        pieces += [o.outputs[0].text for o in engine.step()]
    assert "".join(pieces) == final
    assert "\ufffd" not in final


def test_chat_accepts_one_or_several_conversations(demo_llm):
    one = demo_llm.chat([{"role": "user", "content": "Say hi"}], SamplingParams(max_tokens=3), use_tqdm=False)
    two = demo_llm.chat([[{"role": "user", "content": "Say hi"}], [{"role": "user", "content": "Say bye"}]],
                        SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(one) == 1 and len(two) == 2


# -- bad input: a ValueError naming the problem, and the engine keeps working ---------------


@pytest.mark.parametrize(
    "make_params, message",
    [
        (lambda: SamplingParams(max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(max_tokens=-3), "max_tokens"),
        (lambda: SamplingParams(temperature=-0.5), "temperature"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_p=1.5), "top_p"),
    ],
)
def test_bad_sampling_params_raise_value_error_naming_the_field(make_params, message):
    with pytest.raises(ValueError, match=message):
        make_params()


def test_too_long_prompt_is_rejected_and_the_engine_keeps_serving(demo_llm):
    engine = demo_llm.llm_engine
    engine.add_request("ok-1", "Hello", SamplingParams(max_tokens=4, **GREEDY))
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        engine.add_request("too-long", {"prompt_token_ids": [5] * 1025}, SamplingParams(max_tokens=4))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["ok-1"]
    assert len(finished[0].outputs[0].token_ids) == 4
    # A batch with one bad prompt adds none of them.
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        demo_llm.generate(["fine", {"prompt_token_ids": [5] * 2000}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert demo_llm.generate("still alive", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_bad_prompts_are_named(demo_llm):
    with pytest.raises(ValueError, match="empty"):
        demo_llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="out of vocabulary"):
        demo_llm.generate({"prompt_token_ids": [10**7]}, use_tqdm=False)
    with pytest.raises(ValueError, match="2 prompts but 3 sampling params"):
        demo_llm.generate(["a", "b"], [SamplingParams()] * 3, use_tqdm=False)


def test_missing_path_and_unknown_architecture(tmp_path):
    with pytest.raises(ValueError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        LLM(str(tmp_path), skip_tokenizer_init=True)


def test_unknown_engine_argument_is_a_clear_error():
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(max_num_seq=4)


def test_the_engine_owns_a_copy_of_the_sampling_params():
    """`clone` copies what can change: the caller may reuse or edit its own object."""
    from minivllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(stop=["a"], stop_token_ids=[3],
                            structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": {}}))
    copy = params.clone()
    copy.stop.append("b")
    copy.stop_token_ids.append(9)
    copy.all_stop_token_ids.add(1)
    copy.structured_outputs.json["properties"]["x"] = {}
    assert params.stop == ["a"] and params.stop_token_ids == [3] and params.all_stop_token_ids == {3}
    assert params.structured_outputs.json["properties"] == {}
    assert copy.stop == ["a", "b"] and copy.max_tokens == params.max_tokens
