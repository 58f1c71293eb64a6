"""Chapter 11 exercises on the server: the SSE stream writer, the max_tokens check, the API key.

`sse_events` turns response chunks into server-sent events; `resolve_max_tokens` decides how
many tokens a request may generate or refuses it (a 400); `api_key_matches` checks the
`Authorization` header in constant time.
"""

from __future__ import annotations

import asyncio
import hmac
import json

import pytest

pytest.importorskip("fastapi", reason="the server needs the serve extra")

from minivllm.entrypoints.openai import api_server, serving_engine  # noqa: E402


def collect(chunks) -> list[str]:
    async def run() -> list[str]:
        return [event async for event in serving_engine.sse_events(chunks)]

    return asyncio.run(run())


async def from_list(items, fail_with: Exception | None = None):
    for item in items:
        yield item
    if fail_with is not None:
        raise fail_with


@pytest.mark.exercise("ch11-sse-stream")
def test_each_chunk_is_one_data_event_and_the_stream_ends_with_done():
    chunks = [{"id": "c1", "choices": [{"text": "Hel"}]}, {"id": "c1", "choices": [{"text": "lo é"}]}]
    events = collect(from_list(chunks))
    assert len(events) == 3, f"one event per chunk plus [DONE], got {events!r}"
    for event, chunk in zip(events, chunks):
        assert event.startswith("data: ") and event.endswith("\n\n"), f"an event is 'data: <json>' and a blank line: {event!r}"
        assert json.loads(event[len("data: "):]) == chunk, "the event carries the chunk as JSON"
        assert "\n" not in event[:-2], "a JSON payload on one line: a newline inside would split the event"
    assert events[-1] == "data: [DONE]\n\n", "clients wait for data: [DONE] to know the stream is complete"


@pytest.mark.exercise("ch11-sse-stream")
def test_an_empty_stream_still_ends_with_done():
    assert collect(from_list([])) == ["data: [DONE]\n\n"]


@pytest.mark.exercise("ch11-sse-stream")
def test_a_failure_midway_becomes_an_error_event_then_done():
    events = collect(from_list([{"choices": []}], fail_with=ValueError("max_tokens must be at least 1")))
    assert len(events) == 3, f"the chunk, one error event, [DONE]; got {events!r}"
    error = json.loads(events[1][len("data: "):])["error"]
    assert error["message"] == "max_tokens must be at least 1" and error["code"] == 400, (
        "a ValueError is the client's fault: the error object says 400 (use error_body and status_of)"
    )
    assert events[2] == "data: [DONE]\n\n"


@pytest.mark.exercise("ch11-sse-stream")
def test_a_cancelled_stream_is_not_reported_as_an_error():
    async def cancelled():
        yield {"choices": []}
        raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        collect(cancelled())


@pytest.mark.exercise("ch11-validate-max-tokens")
@pytest.mark.parametrize("requested, prompt_len, max_model_len, allowed", [
    (16, 10, 100, 16),
    (90, 10, 100, 90),  # exactly fills the context
    (None, 10, 100, 90),  # None: all the room that is left
    (None, 99, 100, 1),
])
def test_max_tokens_that_fit_are_granted(requested, prompt_len, max_model_len, allowed):
    got = serving_engine.resolve_max_tokens(requested, prompt_len, max_model_len)
    assert got == allowed, f"requested={requested}, prompt {prompt_len} of {max_model_len}: expected {allowed}, got {got}"


@pytest.mark.exercise("ch11-validate-max-tokens")
@pytest.mark.parametrize("requested, prompt_len, max_model_len, must_mention", [
    (0, 10, 100, ["0"]),
    (-5, 10, 100, ["-5"]),
    (91, 10, 100, ["100", "10", "91"]),  # one token too many
    (1, 100, 100, ["100"]),  # the prompt fills the context
    (None, 120, 100, ["120", "100"]),  # the prompt alone is too long
])
def test_max_tokens_that_cannot_be_served_are_value_errors(requested, prompt_len, max_model_len, must_mention):
    with pytest.raises(ValueError) as info:
        serving_engine.resolve_max_tokens(requested, prompt_len, max_model_len)
    for number in must_mention:
        assert number in str(info.value), f"the message should name {number} so the client can fix it: {info.value}"


@pytest.mark.exercise("ch11-validate-api-key")
@pytest.mark.parametrize("header, ok", [
    ("Bearer s3cret-key", True),
    ("bearer s3cret-key", True),  # the scheme is case-insensitive (RFC 9110)
    ("Bearer s3cret-kez", False),
    ("Bearer s3cret-key2", False),
    ("Bearer ", False),
    ("s3cret-key", False),
    ("Basic s3cret-key", False),
    (None, False),
    ("Bearer ключ", False),  # non-ASCII must not crash the check
])
def test_the_api_key_check(header, ok):
    assert api_server.api_key_matches(header, "s3cret-key") is ok, f"header {header!r} should {'pass' if ok else 'fail'}"


@pytest.mark.exercise("ch11-validate-api-key")
def test_the_api_key_is_compared_in_constant_time(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert api_server.api_key_matches("Bearer s3cret-key", "s3cret-key")
    assert calls, "compare the keys with hmac.compare_digest: == returns sooner the earlier the first difference"
