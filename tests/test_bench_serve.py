"""`minivllm bench serve`: the prompts it makes, the report it computes, and a run against a
real server (chapter 11)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from minivllm.bench.serve import RequestResult, main, make_prompts, summarize


def args(**overrides) -> argparse.Namespace:
    base = dict(seed=0, dataset_name="random", dataset_path=None, num_prompts=5, random_input_len=7, random_prefix_len=0)
    return argparse.Namespace(**{**base, **overrides})


def test_random_prompts_share_exactly_the_prefix_asked_for():
    prompts = make_prompts(args(random_prefix_len=12))
    assert all(len(p) == 12 + 7 for p in prompts)
    assert len({tuple(p[:12]) for p in prompts}) == 1, "every prompt opens with the same prefix"
    assert len({tuple(p[12:]) for p in prompts}) == 5, "the rest is random per prompt"
    assert make_prompts(args(random_prefix_len=12)) == prompts, "a seed gives the same prompts"
    assert make_prompts(args(seed=1, random_prefix_len=12)) != prompts


def test_file_prompts_cycle_through_the_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text('plain text\n{"prompt": "from json"}\n\n')
    assert make_prompts(args(dataset_name="file", dataset_path=str(path))) == [
        "plain text", "from json", "plain text", "from json", "plain text"
    ]


def test_summary_follows_the_definitions():
    # Two requests of 5 output tokens over 2 s, one failure. TPOT = (latency - ttft) / 4.
    results = [
        RequestResult(ok=True, prompt_len=10, output_tokens=5, ttft=0.2, latency=1.0, itl=[0.2, 0.2, 0.2, 0.2]),
        RequestResult(ok=True, prompt_len=30, output_tokens=5, ttft=0.4, latency=2.0, itl=[0.1, 0.5, 0.5, 0.5]),
        RequestResult(ok=False, prompt_len=20, error="HTTP 500"),
    ]
    s = summarize(results, duration=2.0)
    assert (s["completed"], s["failed"], s["first_error"]) == (2, 1, "HTTP 500")
    assert s["output_throughput"] == pytest.approx(5.0) and s["request_throughput"] == pytest.approx(1.0)
    assert s["total_token_throughput"] == pytest.approx((40 + 10) / 2.0)
    assert s["mean_ttft_ms"] == pytest.approx(300.0) and s["median_ttft_ms"] == pytest.approx(300.0)
    assert s["mean_tpot_ms"] == pytest.approx((200.0 + 400.0) / 2)
    assert s["median_itl_ms"] == pytest.approx(200.0) and s["p99_itl_ms"] == pytest.approx(500.0)
    assert s["p99_e2el_ms"] == pytest.approx(2000.0)
    assert s["output_events"] == 2 * 5, "each request: a first chunk and four gaps"


@pytest.fixture(scope="module")
def server(tmp_path_factory, demo_model_dir):
    pytest.importorskip("fastapi", reason="the server needs the serve extra")
    pytest.importorskip("aiohttp", reason="the load generator needs the serve extra")
    sys.path.insert(0, str(Path(__file__).parent))
    from test_openai_server import RunningServer, make_tiny_chat_model

    running = RunningServer(make_tiny_chat_model(tmp_path_factory.mktemp("bench-serve") / "tiny", demo_model_dir), api_key=None)
    yield running
    running.close()


def test_a_load_run_against_the_server_completes_every_request(server, tmp_path):
    result_file = tmp_path / "result.json"
    summary = main([
        "--base-url", server.base_url, "--num-prompts", "8", "--random-input-len", "16", "--random-prefix-len", "16",
        "--random-output-len", "6", "--request-rate", "40", "--arrival", "fixed", "--max-concurrency", "3",
        "--result-file", str(result_file),
    ])
    assert (summary["completed"], summary["failed"]) == (8, 0)
    assert summary["total_output_tokens"] == 8 * 6 and summary["total_input_tokens"] == 8 * 32
    assert summary["duration_s"] >= 7 / 40, "fixed arrivals: 8 requests 1/40 s apart"
    assert 0 < summary["median_ttft_ms"] <= summary["median_e2el_ms"]
    assert "mean_itl_ms" in summary and result_file.exists()
    assert 8 <= summary["output_events"] <= 8 * 6, "at least one event per request, at most one per token"
    # The generator's own CPU share is measured (process time over wall time; its few helper
    # threads can push it a little above 1 on a busy machine, never to 2).
    assert 0 < summary["client_cpu_fraction"] < 2
    # The shared 16-token prefix is one full block: the later requests found it cached.
    assert server.stats().prefix_cache_hits > 0


def test_several_load_generator_processes_share_the_prompts(server):
    summary = main([
        "--base-url", server.base_url, "--num-prompts", "6", "--random-input-len", "8", "--random-output-len", "4",
        "--num-workers", "2",
    ])
    assert (summary["completed"], summary["failed"]) == (6, 0)
    assert summary["total_output_tokens"] == 6 * 4 and summary["num_workers"] == 2
    assert summary["duration_s"] > 0 and 0 < summary["client_cpu_fraction"] < 2


def test_more_workers_than_prompts_is_refused():
    with pytest.raises(SystemExit):
        main(["--num-prompts", "2", "--num-workers", "3"])



def test_the_offline_backend_runs_the_same_prompts_through_llm_generate(tmp_path, demo_model_dir):
    sys.path.insert(0, str(Path(__file__).parent))
    from test_openai_server import make_tiny_chat_model

    model_dir = make_tiny_chat_model(tmp_path / "tiny", demo_model_dir)
    summary = main(["--backend", "offline", "--model", str(model_dir), "--num-prompts", "3", "--random-input-len", "8",
                    "--random-output-len", "4", "--device", "cpu", "--dtype", "float32", "--max-model-len", "64"])
    assert (summary["completed"], summary["total_output_tokens"]) == (3, 12)
    assert summary["engine_steps"] >= 4, "one prefill step and three decode steps at least"
