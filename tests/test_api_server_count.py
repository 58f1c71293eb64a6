"""`minivllm serve --api-server-count 2` (chapter 11): two API processes, one engine core.

The server runs as a real command in its own process group. Streams through it must each get
their own tokens (the core sends every request's outputs back to the API process that sent
it), both API processes must have served some (their metrics files say which processes
counted tokens), `/metrics` must sum the processes, and stopping the launcher must stop
everything.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the server needs the serve extra")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

sys.path.insert(0, str(Path(__file__).parent))
from test_openai_server import free_port, make_tiny_chat_model  # noqa: E402

MODEL_NAME = "tiny-chat"


@pytest.fixture(scope="module")
def two_api_servers(tmp_path_factory, demo_model_dir):
    model_dir = make_tiny_chat_model(tmp_path_factory.getbasetemp() / "tiny-text-llama", demo_model_dir)
    metrics_dir = tmp_path_factory.mktemp("metrics")
    port = free_port()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "minivllm.cli.main", "serve", str(model_dir), "--port", str(port),
               "--served-model-name", MODEL_NAME, "--api-server-count", "2", "--device", "cpu", "--dtype", "float32",
               "--max-model-len", "256", "--num-gpu-blocks-override", "1024"]
    log = open(tmp_path_factory.getbasetemp() / "two-api-servers.log", "w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the server did not start; its log:\n{Path(log.name).read_text()[-3000:]}")
        time.sleep(0.3)
    yield process, base_url, metrics_dir
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    log.close()


def scrape(base_url: str, name: str) -> float:
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"minivllm:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics")


def counting_pids(metrics_dir: Path) -> set[str]:
    """The processes that wrote counters: one file per process, named counter_<pid>.db."""
    return {path.stem.split("_")[1] for path in metrics_dir.glob("counter_*.db")}


def test_streams_through_two_api_processes_get_their_own_tokens(two_api_servers):
    process, base_url, metrics_dir = two_api_servers
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    prompts = [f"Count to {i}:" for i in range(24)]
    expected = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text for p in prompts]

    async def one_stream(aclient, prompt: str) -> str:
        stream = await aclient.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def all_streams() -> list[str]:
        # A client per round, so each round opens new connections for the kernel to hand out.
        async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as aclient:
            return await asyncio.gather(*(one_stream(aclient, p) for p in prompts))

    tokens_before = scrape(base_url, "generation_tokens_total")
    rounds = 0
    while True:  # until both processes served some; the kernel decides who accepts a connection
        rounds += 1
        assert asyncio.run(all_streams()) == expected, "a stream got another request's tokens, or lost some"
        if len(counting_pids(metrics_dir)) >= 2 or rounds == 5:
            break
    assert len(counting_pids(metrics_dir)) == 2, f"one API process served every connection in {rounds} rounds"
    # The sum of both processes, whichever one answers the scrape: every round's 24 × 8 tokens.
    for _ in range(4):
        assert scrape(base_url, "generation_tokens_total") - tokens_before == rounds * 24 * 8
    assert scrape(base_url, "num_requests_running") == 0


def test_stopping_the_launcher_stops_every_process(two_api_servers):
    process, base_url, _ = two_api_servers
    children = [int(pid) for pid in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()]
    # multiprocessing's resource tracker is a child too; the others are the core and the API processes.
    workers = [pid for pid in children if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(workers) == 3, f"expected the engine core and two API processes, got {workers}"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0

    def alive(pid: int) -> bool:
        try:
            return "zombie" not in Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return False

    for pid in workers:  # the launcher waits for these before it exits
        assert not alive(pid), f"process {pid} outlived the launcher"
    # The resource tracker ends when it reads EOF on its pipe, which the launcher's exit closes:
    # a moment after the launcher, so it gets a few seconds.
    deadline = time.monotonic() + 10
    for pid in set(children) - set(workers):
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid), f"the resource tracker {pid} outlived the launcher by 10 s"
