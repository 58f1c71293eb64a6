"""The engine core behind its three clients, and `AsyncLLM` streaming (chapter 02).

One tiny random Llama with the demo model's tokenizer (so text, stop strings and incremental
detokenization are real) runs in three engines shared by the module: `LLM` in-process
(`InprocClient`), `LLM` with the core in its own process (`SyncMPClient`), and `AsyncLLM`
(`AsyncMPClient`). Tests that kill or break an engine are in test_engine_failures.py.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

pytest.importorskip("zmq", reason="the multi-process engine needs pyzmq")
pytest.importorskip("msgspec", reason="the multi-process engine needs msgspec")

from minivllm import LLM, SamplingParams  # noqa: E402
from minivllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from minivllm.engine.async_llm import AsyncLLM  # noqa: E402
from minivllm.engine.core_client import (  # noqa: E402
    ENABLE_MULTIPROCESSING_ENV,
    InprocClient,
    SyncMPClient,
    multiprocessing_enabled,
)
from minivllm.engine.exceptions import EngineGenerateError  # noqa: E402
from minivllm.sampling_params import RequestOutputKind  # noqa: E402

# 1024 blocks of 16 tokens: 200 short requests fit at once; max_model_len bounds the long ones.
ENGINE_KWARGS = dict(max_model_len=256, device="cpu", dtype="float32", num_gpu_blocks_override=1024)
GREEDY = dict(temperature=0.0)
DELTA = RequestOutputKind.DELTA


def make_tiny_text_model(folder: Path, tokenizer_dir: Path) -> Path:
    """A 2-layer random Llama whose vocabulary is the demo tokenizer's, with that tokenizer.

    Written once per session (a second caller finds the folder complete).
    """
    if (folder / "model.safetensors").exists():
        return folder
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        # A wide init makes the next-token distribution peaked: greedy choices are not decided
        # by rounding noise, so different batchings give the same tokens.
        initializer_range=0.2, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    staging = folder.with_name(folder.name + ".partial")
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(staging)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, staging / name)
    staging.rename(folder)
    return folder


@pytest.fixture(scope="module")
def text_model(tmp_path_factory, demo_model_dir) -> Path:
    return make_tiny_text_model(tmp_path_factory.getbasetemp() / "tiny-text-llama", demo_model_dir)


@pytest.fixture(scope="module")
def offline_llm(text_model):
    llm = LLM(str(text_model), enable_multiprocessing=False, **ENGINE_KWARGS)
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def mp_llm(text_model):
    with pytest.MonkeyPatch.context() as env:  # switched on as a user would: the environment
        env.setenv(ENABLE_MULTIPROCESSING_ENV, "1")
        llm = LLM(str(text_model), **ENGINE_KWARGS)
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module: an AsyncLLM is bound to the loop that first uses it."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def async_engine(text_model, loop):
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(text_model), **ENGINE_KWARGS))
    yield engine

    async def shutdown() -> None:
        engine.shutdown()
        await asyncio.sleep(0)  # let the cancelled output handler finish

    loop.run_until_complete(shutdown())


async def collect(engine: AsyncLLM, request_id: str, prompt, params: SamplingParams) -> list:
    return [out async for out in engine.generate(prompt, params, request_id)]


def prompts(count: int) -> list[str]:
    topics = ["the sea", "a dragon", "prime numbers", "Paris", "tea", "rain", "a robot"]
    return [f"Story {i} about {topics[i % len(topics)]}:" for i in range(count)]


# -- the three client modes ---------------------------------------------------------------------


def test_the_switch_picks_the_client(offline_llm, mp_llm, monkeypatch):
    assert isinstance(offline_llm.llm_engine.engine_core, InprocClient)
    assert isinstance(mp_llm.llm_engine.engine_core, SyncMPClient), f"{ENABLE_MULTIPROCESSING_ENV}=1 starts a core process"
    monkeypatch.delenv(ENABLE_MULTIPROCESSING_ENV, raising=False)
    assert multiprocessing_enabled() is False, "off by default"
    assert multiprocessing_enabled(True) is True, "the engine argument wins over the environment"
    monkeypatch.setenv(ENABLE_MULTIPROCESSING_ENV, "maybe")
    with pytest.raises(ValueError, match=ENABLE_MULTIPROCESSING_ENV):
        multiprocessing_enabled()


def test_three_client_modes_give_identical_outputs(offline_llm, mp_llm, async_engine, loop):
    texts = prompts(6)
    params = [
        SamplingParams(max_tokens=12, **GREEDY),
        SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7),
        SamplingParams(max_tokens=12, logprobs=3, **GREEDY),
        SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=2),
        SamplingParams(max_tokens=12, stop=[" the"], **GREEDY),
        SamplingParams(max_tokens=12, ignore_eos=True, **GREEDY),
    ]
    inproc = offline_llm.generate(texts, params, use_tqdm=False)
    sync_mp = mp_llm.generate(texts, params, use_tqdm=False)

    async def run_all():
        return await asyncio.gather(*[collect(async_engine, f"three-{i}", t, p) for i, (t, p) in enumerate(zip(texts, params))])

    async_mp = [outs[-1] for outs in loop.run_until_complete(run_all())]  # CUMULATIVE: the last holds all
    for i, (a, b, c) in enumerate(zip(inproc, sync_mp, async_mp)):
        for name, other in (("SyncMPClient", b), ("AsyncMPClient", c)):
            got = [(o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in other.outputs]
            want = [(o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in a.outputs]
            assert got == want, f"prompt {i}: {name} differs from the in-process engine"
    # The same top tokens at every position, with the same logprobs up to float32 rounding: the
    # engine-core process runs the forward pass with its own threads, and a different order of
    # summation moves a logprob near -6 by a few ulps (2.9e-6 seen). Rounding both to 4
    # decimals instead would fail whenever a value sits on a rounding boundary.
    want, got = inproc[2].outputs[0].logprobs, sync_mp[2].outputs[0].logprobs
    assert [list(pos) for pos in got] == [list(pos) for pos in want], "the top tokens differ"
    worst = max(abs(a[t].logprob - b[t].logprob) for a, b in zip(want, got) for t in a)
    assert worst < 1e-5, f"logprobs differ by up to {worst:.2e}"


def test_stats_are_a_utility_call_in_every_mode(offline_llm, mp_llm, async_engine, loop):
    for llm in (offline_llm, mp_llm):
        stats = llm.llm_engine.get_stats()
        assert (stats.num_gpu_blocks, stats.num_free_blocks, stats.num_running) == (1024, 1024, 0)
    stats = loop.run_until_complete(async_engine.get_stats())
    assert stats.num_free_blocks == stats.num_gpu_blocks == 1024


def test_core_internals_are_readable_in_process_only(offline_llm, mp_llm):
    assert offline_llm.llm_engine.engine_core.scheduler is offline_llm.llm_engine.engine_core.engine_core.scheduler
    with pytest.raises(AttributeError, match=f"another process.*{ENABLE_MULTIPROCESSING_ENV}=0"):
        mp_llm.llm_engine.engine_core.scheduler  # what `minivllm run --trace` reads


def test_a_request_refused_by_the_core_fails_alone_in_llm(mp_llm):
    bad = SamplingParams(max_tokens=6, top_p=0.5, temperature=0.5)
    bad.top_p = 5.0  # set after construction, so no check saw it: the core's rebuild does
    good = SamplingParams(max_tokens=6, **GREEDY)
    outs = mp_llm.generate(prompts(3), [good, bad, good], use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error" and outs[1].finished
    assert [len(o.outputs[0].token_ids) for o in (outs[0], outs[2])] == [6, 6], "the other requests carry on"


# -- AsyncLLM ----------------------------------------------------------------------------------


def test_200_concurrent_delta_streams_match_the_offline_engine(offline_llm, async_engine, loop):
    texts = prompts(200)
    params = SamplingParams(max_tokens=8, output_kind=DELTA, **GREEDY)
    expected = offline_llm.generate(texts, SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)

    async def run_all():
        return await asyncio.gather(*[collect(async_engine, f"many-{i}", t, params) for i, t in enumerate(texts)])

    streams = loop.run_until_complete(run_all())
    for i, (stream, want) in enumerate(zip(streams, expected)):
        assert stream[-1].finished and not any(o.finished for o in stream[:-1]), f"stream {i}: only the last is finished"
        text = "".join(o.outputs[0].text for o in stream)
        token_ids = [t for o in stream for t in o.outputs[0].token_ids]
        assert (text, token_ids) == (want.outputs[0].text, want.outputs[0].token_ids), f"stream {i} differs from LLM"
    assert not async_engine.collectors, "every finished request's collector is gone"


def test_cumulative_and_final_only_streams(offline_llm, async_engine, loop):
    prompt = prompts(1)[0]
    want = offline_llm.generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True, **GREEDY), use_tqdm=False)[0]

    async def run():
        cumulative = SamplingParams(max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.CUMULATIVE, **GREEDY)
        final_only = SamplingParams(max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY, **GREEDY)
        return await asyncio.gather(collect(async_engine, "cum", prompt, cumulative), collect(async_engine, "fin", prompt, final_only))

    cumulative, final_only = loop.run_until_complete(run())
    lengths = [len(o.outputs[0].token_ids) for o in cumulative]
    assert lengths == sorted(lengths) and cumulative[-1].outputs[0].text == want.outputs[0].text
    assert len(final_only) == 1 and final_only[0].finished and final_only[0].outputs[0].text == want.outputs[0].text


def test_aborted_and_cancelled_requests_free_their_blocks(async_engine, loop):
    """A third finishes (8 tokens), a third is aborted, a third's consumer is cancelled: the
    last two would run 200 tokens, so a full pool right after the first third proves both ended."""
    texts = prompts(30)
    short = SamplingParams(max_tokens=8, ignore_eos=True, output_kind=DELTA, **GREEDY)
    long = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=DELTA, **GREEDY)

    async def aborted_after_first_output(i: int) -> list:
        outputs = []
        async for out in async_engine.generate(texts[i], long, f"abort-{i}"):
            outputs.append(out)
            if len(outputs) == 1:
                await async_engine.abort(f"abort-{i}")
        return outputs

    async def run():
        first_outputs = {i: asyncio.Event() for i in range(20, 30)}

        async def cancelled_consumer(i: int) -> None:
            async for _ in async_engine.generate(texts[i], long, f"cancel-{i}"):
                first_outputs[i].set()

        finishing = [asyncio.create_task(collect(async_engine, f"short-{i}", texts[i], short)) for i in range(10)]
        aborting = [asyncio.create_task(aborted_after_first_output(i)) for i in range(10, 20)]
        cancelling = {i: asyncio.create_task(cancelled_consumer(i)) for i in range(20, 30)}
        for i, task in cancelling.items():
            await first_outputs[i].wait()
            task.cancel()
        done = await asyncio.gather(*finishing, *aborting)
        cancelled = await asyncio.gather(*cancelling.values(), return_exceptions=True)
        return done[:10], done[10:], cancelled, await async_engine.get_stats()

    finished, aborted, cancelled, stats = loop.run_until_complete(run())
    assert all(len([t for o in s for t in o.outputs[0].token_ids]) == 8 for s in finished)
    for stream in aborted:
        assert stream[-1].finished and stream[-1].outputs[0].finish_reason == "abort", "abort() ends the stream"
        assert sum(len(o.outputs[0].token_ids) for o in stream) < 200
    assert all(isinstance(c, asyncio.CancelledError) for c in cancelled)
    assert (stats.num_running, stats.num_waiting) == (0, 0), "aborted and cancelled requests must leave the core"
    assert stats.num_free_blocks == stats.num_gpu_blocks, "their KV blocks must be back in the pool"
    assert not async_engine.collectors and not async_engine.output_processor.request_states


def test_a_request_refused_by_the_core_fails_alone_in_its_stream(async_engine, loop):
    bad = SamplingParams(max_tokens=6, output_kind=DELTA, **GREEDY)
    bad.temperature = -1.0  # set after construction: only the core's check sees it
    good = SamplingParams(max_tokens=6, ignore_eos=True, output_kind=DELTA, **GREEDY)

    async def run():
        return await asyncio.gather(
            collect(async_engine, "ok-1", "Hello", good),
            collect(async_engine, "bad", "Hello", bad),
            collect(async_engine, "ok-2", "World", good),
            return_exceptions=True,
        )

    ok_1, failed, ok_2 = loop.run_until_complete(run())
    assert isinstance(failed, EngineGenerateError) and "temperature" in str(failed), failed
    for stream in (ok_1, ok_2):
        assert sum(len(o.outputs[0].token_ids) for o in stream) == 6, "the other streams carry on"
    assert not async_engine.errored
    again = loop.run_until_complete(collect(async_engine, "after", "Hello", good))
    assert again[-1].finished, "the engine still serves new requests"
