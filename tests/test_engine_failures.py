"""When the engine-core process fails: at start-up, in a step, or killed (chapter 02).

Each test builds and breaks its own engine, and checks what a user relies on: a clear error,
raised promptly in every waiting stream, and nothing left behind (no process, no socket file).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("zmq", reason="the multi-process engine needs pyzmq")
pytest.importorskip("msgspec", reason="the multi-process engine needs msgspec")

from test_engine_clients import ENGINE_KWARGS, make_tiny_text_model  # noqa: E402

from minivllm import SamplingParams  # noqa: E402
from minivllm.engine.arg_utils import AsyncEngineArgs, EngineArgs  # noqa: E402
from minivllm.engine.async_llm import AsyncLLM  # noqa: E402
from minivllm.engine.core_client import READY_TIMEOUT_ENV, EngineCoreClient  # noqa: E402
from minivllm.engine.exceptions import EngineDeadError  # noqa: E402
from minivllm.engine.types import EngineCoreRequest  # noqa: E402
from minivllm.sampling_params import RequestOutputKind  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def text_model(tmp_path_factory, demo_model_dir) -> Path:
    return make_tiny_text_model(tmp_path_factory.getbasetemp() / "tiny-text-llama", demo_model_dir)


@pytest.fixture
def private_tmp(tmp_path, monkeypatch) -> Path:
    """Socket folders are made here, so a test can see that none is left behind."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def engine_processes() -> list:
    return [p for p in multiprocessing.active_children() if p.name == "MiniVllmEngineCore"]


def process_exists(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


@pytest.mark.slow  # starts a Python process that imports torch
def test_startup_failure_in_the_core_is_a_clear_error_and_leaves_nothing(text_model, private_tmp):
    # One block cannot hold a request of max_model_len tokens: EngineCore refuses to start,
    # inside the core process, after loading the model.
    args = AsyncEngineArgs(model=str(text_model), **{**ENGINE_KWARGS, "num_gpu_blocks_override": 1})
    with pytest.raises(RuntimeError, match=r"^engine core failed to start: ValueError: the KV cache has 1 blocks") as info:
        AsyncLLM.from_engine_args(args)
    assert "traceback in the engine-core process" in str(info.value), "the core's traceback travels with the error"
    assert not engine_processes(), "the failed core process must be gone"
    assert not list(private_tmp.iterdir()), "the socket folder must be removed"


def test_a_core_that_does_not_report_ready_in_time_is_stopped(text_model, private_tmp, monkeypatch):
    monkeypatch.setenv(READY_TIMEOUT_ENV, "0.2")  # far less than a process needs to import torch
    config = EngineArgs(model=str(text_model), **ENGINE_KWARGS).create_engine_config()
    with pytest.raises(RuntimeError, match=f"no READY within 0.2 s.*{READY_TIMEOUT_ENV}"):
        EngineCoreClient.make_client(multiprocess_mode=True, asyncio_mode=False, config=config)
    assert not engine_processes() and not list(private_tmp.iterdir())


@pytest.mark.slow  # starts a Python process that imports torch
def test_an_exception_in_a_step_kills_the_engine_with_its_traceback(text_model, private_tmp):
    config = EngineArgs(model=str(text_model), skip_tokenizer_init=True, **ENGINE_KWARGS).create_engine_config()
    client = EngineCoreClient.make_client(multiprocess_mode=True, asyncio_mode=False, config=config)
    try:
        # A token id far outside the vocabulary, sent past the Processor that would refuse it:
        # the embedding lookup raises inside the step, which no request can survive.
        client.add_request(EngineCoreRequest("bad", [10**7], SamplingParams(max_tokens=2), time.time()))
        with pytest.raises(EngineDeadError, match="IndexError"):
            client.get_output()
        with pytest.raises(EngineDeadError):
            client.add_request(EngineCoreRequest("next", [1], SamplingParams(max_tokens=2), time.time()))
    finally:
        client.shutdown()
    assert not client.process.is_alive() and not list(private_tmp.iterdir())


@pytest.mark.slow  # starts a Python process that imports torch
def test_killing_the_core_mid_stream_fails_every_stream_within_5_s(text_model, private_tmp):
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(text_model), **ENGINE_KWARGS))
    pid = engine.engine_core.process.pid
    params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA)

    async def stream(i: int, started: asyncio.Event) -> None:
        async for _ in engine.generate(f"Stream {i}:", params, str(i)):
            started.set()

    async def run() -> tuple[list, float]:
        started = [asyncio.Event() for _ in range(20)]
        tasks = [asyncio.create_task(stream(i, started[i])) for i in range(20)]
        for event in started:
            await event.wait()
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=10)
        seconds = time.monotonic() - killed_at
        with pytest.raises(EngineDeadError):  # a new call fails at once
            await asyncio.wait_for(engine.generate("late", params, "late").__anext__(), timeout=1)
        engine.shutdown()
        return results, seconds

    results, seconds = asyncio.run(run())
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert "SIGKILL" in str(results[0]), "the error says what happened to the process"
    assert seconds < 5, f"streams learned of the death after {seconds:.1f} s"
    assert not process_exists(pid) and not engine_processes(), "no engine-core process may be left"
    assert not list(private_tmp.iterdir()), "no socket file may be left"


@pytest.mark.slow  # starts a Python process that imports torch
def test_the_offline_path_runs_without_pyzmq_and_msgspec(text_model):
    script = textwrap.dedent(f"""
        import sys
        sys.modules["zmq"] = sys.modules["msgspec"] = None  # `import zmq` now fails, as if not installed
        from minivllm import LLM, SamplingParams
        llm = LLM({str(text_model)!r}, skip_tokenizer_init=True, **{ENGINE_KWARGS!r})
        out = llm.generate([{{"prompt_token_ids": [1, 2, 3]}}], SamplingParams(max_tokens=3, detokenize=False), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
        try:
            LLM({str(text_model)!r}, skip_tokenizer_init=True, enable_multiprocessing=True, **{ENGINE_KWARGS!r})
        except ImportError as err:
            print("IMPORT ERROR:", err)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "MINIVLLM_ENABLE_MULTIPROCESSING": "0"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, f"the offline path needed pyzmq or msgspec:\n{result.stderr[-3000:]}"
    assert "IMPORT ERROR" in result.stdout and "pip install pyzmq msgspec" in result.stdout, result.stdout
