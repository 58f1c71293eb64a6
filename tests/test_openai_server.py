"""The OpenAI-compatible server, tested through the official `openai` client (chapter 11).

A real uvicorn server runs on 127.0.0.1 (a free port) in a thread of this process, over a
tiny random Llama with the demo model's tokenizer and chat template; its engine core runs in
its own process, as in production. The test thread reaches the engine's stats through the
server's event loop (`RunningServer.stats`), to check that aborted requests free their blocks.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the server needs the serve extra")
pytest.importorskip("zmq", reason="the server's engine core runs in its own process")
openai = pytest.importorskip("openai", reason="the server is tested with the official client")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from minivllm.engine.types import EngineCoreStats  # noqa: E402

API_KEY = "test-key"
MODEL_NAME = "tiny-chat"
# 1024 blocks of 16 tokens: 100 concurrent streams fit at once, so nobody is preempted.
ENGINE_KWARGS = dict(max_model_len=256, device="cpu", dtype="float32", num_gpu_blocks_override=1024)


def make_tiny_chat_model(folder: Path, tokenizer_dir: Path) -> Path:
    """A 2-layer random Llama with the demo model's tokenizer and chat template."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_engine_clients import make_tiny_text_model

    make_tiny_text_model(folder, tokenizer_dir)
    template = tokenizer_dir / "chat_template.jinja"
    if template.exists() and not (folder / template.name).exists():
        shutil.copy(template, folder / template.name)
    return folder


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RunningServer:
    def __init__(self, model_dir: Path, api_key: str | None = API_KEY, **engine_kwargs: object) -> None:
        import uvicorn

        from minivllm.engine.arg_utils import AsyncEngineArgs
        from minivllm.engine.async_llm import AsyncLLM
        from minivllm.entrypoints.openai.api_server import build_app

        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(model_dir), **{**ENGINE_KWARGS, **engine_kwargs}))
        self.app = build_app(self.engine, [MODEL_NAME], api_key)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def _serve(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    def stats(self) -> EngineCoreStats:
        return asyncio.run_coroutine_threadsafe(self.engine.get_stats(), self.loop).result(timeout=30)

    def wait_until_idle(self, timeout: float = 20.0) -> EngineCoreStats:
        """The stats once no request runs or waits and every block is free (or the last seen)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            idle = stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == stats.num_gpu_blocks
            if idle or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.shutdown()


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory, demo_model_dir):
    model_dir = make_tiny_chat_model(tmp_path_factory.getbasetemp() / "tiny-text-llama", demo_model_dir)
    running = RunningServer(model_dir)
    yield running
    running.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def assert_still_serving(client: openai.OpenAI) -> None:
    """After a bad request, a good one must still be answered in full."""
    out = client.completions.create(model=MODEL_NAME, prompt="Still there?", max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3, "the server stopped answering good requests after a bad one"


# -- completions and chat --------------------------------------------------------------------


def test_models_version_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/version").json()["version"]


def test_streamed_completion_joins_to_the_full_text(client):
    kwargs = dict(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    joined = "".join(c.choices[0].text for c in chunks if c.choices)
    assert joined == full.choices[0].text, "greedy: the streamed deltas must join to the non-streamed text"
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_streamed_chat_joins_to_the_full_text(client):
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=20, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    joined = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert joined == full.choices[0].message.content
    assert full.usage.prompt_tokens > 5, "the prompt went through the chat template"


def test_token_id_prompts_and_several_prompts(client):
    one = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7], max_tokens=4, temperature=0)
    both = client.completions.create(model=MODEL_NAME, prompt=[[5, 6, 7], [9, 10]], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3], "choice i*n + j: completion j of prompt i"
    assert both.choices[0].text == both.choices[1].text == one.choices[0].text
    assert both.usage.prompt_tokens == 3 + 2, "usage counts each prompt once, whatever n"
    texts = client.completions.create(model=MODEL_NAME, prompt=["Hello", "World"], max_tokens=4, temperature=0)
    assert [c.index for c in texts.choices] == [0, 1] and texts.choices[0].text != texts.choices[1].text


def test_n_2_gives_two_sampled_choices(client):
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=12, temperature=1.0, seed=7,
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.choices[0].message.content != out.choices[1].message.content, "two samples from distinct seeds"
    streamed = list(client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=12, temperature=1.0, seed=7, stream=True,
    ))
    for index in (0, 1):
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices[0].index == index)
        assert text == out.choices[index].message.content, "the same seed gives the same sample, streamed or not"


def test_stop_string_ends_the_text_before_it(client):
    base = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2 : len(base) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {base!r}"
    out = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=24, temperature=0, stop=[stop])
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    assert choice.text == base[: base.index(stop)]


def test_completion_logprobs_and_echo(client):
    out = client.completions.create(model=MODEL_NAME, prompt="Logprobs please", max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text
    assert len(lp.token_logprobs) == 6 and all(v <= 0 for v in lp.token_logprobs)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4, "top 3, plus the sampled token when it is not among them"
        assert logprob == max(top.values()), "greedy: the sampled token is the most likely one"
    echoed = client.completions.create(model=MODEL_NAME, prompt="Logprobs please", max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == "Logprobs please" + out.choices[0].text


def test_chat_top_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 5
    for position in content:
        assert len(position.top_logprobs) == 2
        assert position.top_logprobs[0].logprob >= position.top_logprobs[1].logprob
        assert position.token == position.top_logprobs[0].token, "greedy picks the top token"


def test_json_schema_output_validates(client):
    pytest.importorskip("xgrammar", reason="structured output needs xgrammar")
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False,
    }
    for _ in range(2):
        out = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "A person as JSON"}], max_tokens=60, temperature=1.0,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
        )
        choice = out.choices[0]
        assert choice.finish_reason == "stop", f"the grammar must end the object within 60 tokens: {choice.message.content!r}"
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_unknown_fields_are_ignored(client):
    out = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, extra_body={"not_a_field": 1, "another": "x"})
    assert out.usage.completion_tokens <= 2


def test_tokenize_and_detokenize(server, client):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokens = httpx.post(server.base_url + "/tokenize", json={"prompt": "Hello world"}, headers=headers).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 256
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=headers).json()["prompt"]
    assert text.endswith("Hello world")
    chat = httpx.post(server.base_url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}, headers=headers).json()
    full = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert chat["count"] == full.usage.prompt_tokens, "/tokenize renders messages as the chat endpoint does"


# -- errors ----------------------------------------------------------------------------------

BAD_REQUESTS = {
    "max_tokens 0": ("/v1/completions", {"prompt": "x", "max_tokens": 0}),
    "max_tokens -3": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}),
    "prompt longer than max_model_len": ("/v1/completions", {"prompt": [5] * 300, "max_tokens": 1}),
    "prompt plus output too long": ("/v1/completions", {"prompt": [5] * 250, "max_tokens": 10}),
    "n 0": ("/v1/completions", {"prompt": "x", "n": 0}),
    "n 129": ("/v1/completions", {"prompt": "x", "n": 129}),
    "invalid json schema": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}},
    }),
    "two constraints": ("/v1/completions", {"prompt": "x", "guided_regex": "a+", "guided_choice": ["a"]}),
    "temperature below 0": ("/v1/completions", {"prompt": "x", "temperature": -1}),
    "empty stop string": ("/v1/completions", {"prompt": "x", "stop": [""]}),
    "token id out of vocabulary": ("/v1/completions", {"prompt": [10**8]}),
    "empty prompt": ("/v1/completions", {"prompt": []}),
    "no messages": ("/v1/chat/completions", {"messages": []}),
    "top_logprobs without logprobs": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
    "too many logprobs": ("/v1/completions", {"prompt": "x", "logprobs": 21}),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_requests_get_400_and_the_server_keeps_serving(server, client, case):
    path, body = BAD_REQUESTS[case]
    for stream in (False, True):
        response = httpx.post(server.base_url + path, json={"model": MODEL_NAME, **body, "stream": stream},
                              headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
        assert response.status_code == 400, f"{case} (stream={stream}): {response.status_code} {response.text}"
        error = response.json()["error"]
        assert error["code"] == 400 and error["type"] == "BadRequestError" and error["message"]
    assert_still_serving(client)


def test_bad_requests_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}], stream=True)
    assert_still_serving(client)


@pytest.mark.parametrize("raw_body", [b"{not json", b"", b"[1, 2]", b'{"prompt": "x", "max_tokens": "many"}'])
def test_malformed_bodies_get_400(server, client, raw_body):
    response = httpx.post(server.base_url + "/v1/completions", content=raw_body,
                          headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "BadRequestError"
    assert_still_serving(client)


def test_api_key_is_required_on_v1_but_not_on_health_and_metrics(server, client):
    for key in (None, "wrong-key", API_KEY + "x"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.post(server.base_url + "/v1/completions", json={"prompt": "x"}, headers=headers)
        assert response.status_code == 401, f"key {key!r}: {response.status_code}"
        assert response.json()["error"]["code"] == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/metrics").status_code == 200
    assert_still_serving(client)


# -- load, disconnects, metrics ---------------------------------------------------------------


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server, client):
    body = {"model": MODEL_NAME, "prompt": "Disconnect me " * 10, "max_tokens": 200, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.base_url + "/v1/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            events = response.iter_lines()
            received = [line for line, _ in zip(events, range(6)) if line.startswith("data: ")]
            assert received, "the stream started"
            busy = server.stats()
            assert busy.num_running + busy.num_waiting == 1 and busy.num_free_blocks < busy.num_gpu_blocks
        # Leaving the block closes the connection long before 200 tokens are generated.
    stats = server.wait_until_idle()
    assert stats.num_running == 0 and stats.num_waiting == 0, f"the request was not aborted: {stats}"
    assert stats.num_free_blocks == stats.num_gpu_blocks, f"KV blocks not freed: {stats}"
    assert_still_serving(client)


def test_a_client_that_disconnects_before_a_full_response_frees_its_blocks(server, client):
    body = {"model": MODEL_NAME, "prompt": "Wait for me", "max_tokens": 240, "ignore_eos": True}
    generated_before = scrape_metrics(server)["minivllm:generation_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=0.3)
    stats = server.wait_until_idle()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_gpu_blocks, f"not aborted: {stats}"
    generated = scrape_metrics(server)["minivllm:generation_tokens_total"] - generated_before
    assert generated < 240, "the request ran to its end: it was not aborted when the client left"


@pytest.mark.slow
def test_100_concurrent_streams_all_complete_with_every_token_once(server, client):
    num_streams, max_tokens = 100, 16
    prompts = [f"Request number {i} says" for i in range(num_streams)]
    expected = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=max_tokens, temperature=0,
                                         extra_body={"ignore_eos": True})
    expected_texts = [c.text for c in sorted(expected.choices, key=lambda c: c.index)]

    async def one_stream(aclient: openai.AsyncOpenAI, prompt: str) -> tuple[str, int, int]:
        stream = await aclient.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        text, tokens, usage = "", 0, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                tokens += len(chunk.choices[0].logprobs.tokens)  # one entry per generated token
            else:
                usage = chunk.usage.completion_tokens
        return text, tokens, usage

    async def all_streams() -> list[tuple[str, int, int]]:
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as aclient:
            return await asyncio.gather(*(one_stream(aclient, p) for p in prompts))

    results = asyncio.run(all_streams())
    for i, (text, tokens, usage) in enumerate(results):
        assert tokens == usage == max_tokens, f"stream {i}: {tokens} tokens streamed, usage says {usage}"
        assert text == expected_texts[i], f"stream {i}: tokens lost or repeated:\n{text!r}\nvs {expected_texts[i]!r}"
    stats = server.wait_until_idle()
    assert stats.num_free_blocks == stats.num_gpu_blocks


def scrape_metrics(server: RunningServer) -> dict[str, float]:
    """/metrics as {name: value}; the finished-request counter keyed as name{"reason"}."""
    values = {}
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        if line.startswith("minivllm:"):
            name, value = line.rsplit(" ", 1)
            reason = name.split('finished_reason="')[1].split('"')[0] if "finished_reason" in name else None
            values[name.split("{")[0] + (f'{{"{reason}"}}' if reason else "")] = float(value)
    return values


def test_metrics_count_requests_and_latencies(server, client):
    def scrape() -> dict[str, float]:
        return scrape_metrics(server)

    before = scrape()
    client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7, 8], max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    after = scrape()
    assert after["minivllm:prompt_tokens_total"] - before.get("minivllm:prompt_tokens_total", 0) == 4
    assert after["minivllm:generation_tokens_total"] - before.get("minivllm:generation_tokens_total", 0) == 5
    assert after["minivllm:time_to_first_token_seconds_count"] - before.get("minivllm:time_to_first_token_seconds_count", 0) == 1
    assert after["minivllm:inter_token_latency_seconds_count"] - before.get("minivllm:inter_token_latency_seconds_count", 0) == 4
    assert after["minivllm:e2e_request_latency_seconds_count"] - before.get("minivllm:e2e_request_latency_seconds_count", 0) == 1
    assert after['minivllm:request_success_total{"length"}'] - before.get('minivllm:request_success_total{"length"}', 0) == 1
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "prefix_cache_queries_total", "prefix_cache_hits_total"):
        assert "minivllm:" + name in after, f"{name} missing from /metrics"
    assert after["minivllm:kv_cache_usage_perc"] == 0.0 and after["minivllm:num_requests_running"] == 0
    # 5 tokens from a 4-token prompt: one prefill step and four decode steps at least.
    assert after["minivllm:engine_steps_total"] - before.get("minivllm:engine_steps_total", 0) >= 5
    assert after["minivllm:engine_busy_seconds_total"] > before.get("minivllm:engine_busy_seconds_total", 0)


# -- fuzzing -----------------------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
          "n", "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs",
          "top_logprobs", "echo", "ignore_eos", "min_tokens", "stream", "stream_options", "response_format",
          "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"]
SMALL_VALUES = {  # plausible values, so that bodies get past the first check often
    "max_tokens": st.integers(-2, 8), "max_completion_tokens": st.integers(-2, 8), "n": st.integers(-1, 3),
    "prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(-5, 60000), max_size=5)),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                                "content": st.text(max_size=10)}), max_size=2),
    "temperature": st.floats(-1, 3), "top_k": st.integers(-2, 100), "logprobs": st.integers(-1, 22),
    "stop": st.lists(st.text(max_size=3), max_size=2), "min_tokens": st.integers(-1, 10),
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"}, {"type": "xml"}]),
}


@st.composite
def request_bodies(draw):
    names = draw(st.lists(st.sampled_from(FIELDS), unique=True, max_size=6))
    body = {name: draw(SMALL_VALUES.get(name, JSON_VALUES) if draw(st.booleans()) else JSON_VALUES) for name in names}
    body.setdefault("max_tokens", 4)  # keep generation short
    return body


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]), body=request_bodies())
def test_fuzzed_bodies_never_get_a_5xx(server, path, body):
    response = httpx.post(server.base_url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert response.status_code < 500, f"{path} {body!r} → {response.status_code} {response.text}"
    if response.status_code >= 400:
        assert response.json()["error"]["code"] == response.status_code
    elif body.get("stream") is True and path.startswith("/v1/"):
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert not any('"error"' in e for e in events), f"a stream failed midway: {events}"


def test_after_fuzzing_the_engine_is_healthy(server, client):
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert_still_serving(client)
    assert server.wait_until_idle().num_free_blocks == server.stats().num_gpu_blocks
