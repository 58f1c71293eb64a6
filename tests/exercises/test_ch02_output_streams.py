"""Chapter 02 exercises: fanning outputs out to per-request streams in `AsyncLLM`.

`fan_out` hands each `RequestOutput` to its request's `RequestOutputCollector`, and
`merge_delta_output` folds DELTA outputs together while a slow consumer is away.
"""

from __future__ import annotations

import asyncio

import pytest

from minivllm.engine import async_llm
from minivllm.engine.async_llm import RequestOutputCollector
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.sampling_params import RequestOutputKind


def completion(index: int, text: str, token_ids: list[int], logprobs=None, finish_reason=None, stop_reason=None):
    cumulative = sum(next(iter(p.values())).logprob for p in logprobs) if logprobs else None
    return CompletionOutput(index, text, token_ids, cumulative, logprobs, finish_reason, stop_reason)


def output(request_id: str, *completions: CompletionOutput, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, "prompt", [1, 2], list(completions), finished)


def lp(token_id: int, value: float) -> dict:
    return {token_id: Logprob(value, 1, None)}


@pytest.mark.exercise("ch02-merge-delta")
def test_two_deltas_merge_into_one():
    pending = output("r", completion(0, "Hel", [5, 6], [lp(5, -0.5), lp(6, -0.25)]))
    new = output("r", completion(0, "lo!", [7], [lp(7, -1.0)], "stop", "!"), finished=True)
    async_llm.merge_delta_output(pending, new)
    merged = pending.outputs[0]
    assert (merged.text, merged.token_ids) == ("Hello!", [5, 6, 7]), "text and token ids are appended"
    assert merged.logprobs == [lp(5, -0.5), lp(6, -0.25), lp(7, -1.0)], "logprobs are appended"
    assert (merged.finish_reason, merged.stop_reason, merged.cumulative_logprob) == ("stop", "!", -1.0)
    assert pending.finished, "the merged output is finished when the newer one is"
    assert new.outputs[0].text == "lo!" and new.outputs[0].token_ids == [7], "the newer output is not changed"


@pytest.mark.exercise("ch02-merge-delta")
def test_with_n_completions_each_index_merges_with_its_own():
    pending = output("r", completion(0, "a", [1]))
    async_llm.merge_delta_output(pending, output("r", completion(1, "x", [9])))
    async_llm.merge_delta_output(pending, output("r", completion(0, "b", [2])))
    by_index = {c.index: (c.text, c.token_ids) for c in pending.outputs}
    assert by_index == {0: ("ab", [1, 2]), 1: ("x", [9])}, "a completion not yet seen is added; others merge by index"
    assert pending.outputs[0].logprobs is None, "no logprobs asked for: none appear"


@pytest.mark.exercise("ch02-merge-delta")
def test_a_slow_delta_consumer_reads_everything_in_one_output():
    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    for i, word in enumerate(["The", " cat", " sat"]):
        collector.put(output("r", completion(0, word, [i]), finished=i == 2))
    got = asyncio.run(collector.get())
    assert (got.outputs[0].text, got.outputs[0].token_ids, got.finished) == ("The cat sat", [0, 1, 2], True)
    assert collector.get_nowait() is None, "nothing is left once read"
    cumulative = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
    cumulative.put(output("r", completion(0, "The", [0])))
    cumulative.put(output("r", completion(0, "The cat", [0, 1])))
    assert cumulative.get_nowait().outputs[0].text == "The cat", "a cumulative output replaces the older one"


@pytest.mark.exercise("ch02-fan-out")
def test_each_output_reaches_its_own_request_and_finished_ones_are_forgotten():
    collectors = {rid: RequestOutputCollector(RequestOutputKind.CUMULATIVE) for rid in ("a", "b", "c")}
    a, b = output("a", completion(0, "x", [1])), output("b", completion(0, "y", [2], finish_reason="length"), finished=True)
    async_llm.fan_out([a, b], collectors)
    assert collectors["a"].get_nowait() is a and collectors["c"].get_nowait() is None, "a's output goes to a only"
    assert "b" not in collectors, "a finished request's collector is removed: nothing more will come"
    assert set(collectors) == {"a", "c"}


@pytest.mark.exercise("ch02-fan-out")
def test_outputs_of_requests_nobody_waits_for_are_dropped():
    collectors = {"a": RequestOutputCollector(RequestOutputKind.DELTA)}
    async_llm.fan_out([output("gone", completion(0, "x", [1]), finished=True)], collectors)  # aborted meanwhile
    async_llm.fan_out([], collectors)
    assert list(collectors) == ["a"] and collectors["a"].get_nowait() is None


@pytest.mark.exercise("ch02-fan-out", "ch02-merge-delta")
def test_many_steps_fan_out_to_many_streams():
    collectors = {str(i): RequestOutputCollector(RequestOutputKind.DELTA) for i in range(50)}
    readers = dict(collectors)
    for step in range(3):
        outputs = [output(str(i), completion(0, f"{step}", [step]), finished=step == 2) for i in range(50)]
        async_llm.fan_out(outputs, collectors)
    assert not collectors, "every request finished"
    for rid, collector in readers.items():
        got = collector.get_nowait()
        assert got.outputs[0].text == "012" and got.finished, f"request {rid}: its three deltas, merged, in order"
