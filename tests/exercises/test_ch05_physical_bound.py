"""Chapter 05 exercise: the physical bound of an offline workload.

However it is scheduled, every step reads every weight once, and every output token reads the
K/V of the context it is computed over once. Those bytes over the copy bandwidth are the
least time the workload can take; the throughput target is a share of it. The function is
called through its module, as `minivllm bench throughput` calls it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from minivllm.bench import throughput

DATA = Path(__file__).resolve().parents[2] / "docs" / "data"


@pytest.mark.exercise("ch05-physical-bound")
def test_one_request_by_hand():
    # A 3-token prompt and 2 output tokens: the first is computed over 3 tokens of context,
    # the second over 4. Two steps of 100 weight bytes, 10 K/V bytes a token: 200 + 70 bytes.
    sizes = {"weight_bytes_per_step": 100, "kv_bytes_per_token": 10}
    bound = throughput.physical_bound([3], [2], 2, sizes, copy_gbps=1e-6)  # 1,000 bytes/s
    assert bound["bound_bytes"] == 270, "steps × weight bytes + (3 + 4) context tokens × K/V bytes"
    assert bound["bound_seconds"] == pytest.approx(0.27)
    assert bound["bound_output_tokens_per_s"] == pytest.approx(2 / 0.27)


@pytest.mark.exercise("ch05-physical-bound")
def test_random_workloads_against_a_token_by_token_count():
    rng = random.Random(5)
    for _ in range(50):
        n = rng.randint(1, 8)
        prompt_lens = [rng.randint(1, 300) for _ in range(n)]
        output_lens = [rng.randint(1, 300) for _ in range(n)]
        num_steps = rng.randint(max(output_lens), sum(output_lens) + 10)
        sizes = {"weight_bytes_per_step": rng.randint(1, 10**9), "kv_bytes_per_token": rng.randint(1, 10**5)}
        context_tokens = sum(p + i for p, o in zip(prompt_lens, output_lens) for i in range(o))
        expected = num_steps * sizes["weight_bytes_per_step"] + context_tokens * sizes["kv_bytes_per_token"]
        bound = throughput.physical_bound(prompt_lens, output_lens, num_steps, sizes, copy_gbps=3000.0)
        assert bound["bound_bytes"] == expected
        assert isinstance(bound["bound_bytes"], int), "bytes are counted exactly, not in floating point"
        assert bound["bound_seconds"] == pytest.approx(expected / 3e12, rel=1e-12)


@pytest.mark.exercise("ch05-physical-bound")
def test_the_first_h200_runs_bound():
    # Chapter 05's first table after the warm-up: Qwen3-0.6B on the nano-vllm workload
    # (256 requests, lengths uniform in [100, 1024], seed 0), 1,033 steps, 38,590 tokens/s.
    run = json.loads((DATA / "executor-h200-2026-12-03-warm-up.json").read_text())["throughput-qwen3-graphs"]
    prompts, output_lens = throughput.random_workload(256, 100, 1024, 151936, seed=0)
    assert (sum(map(len, prompts)), sum(output_lens)) == (run["prompt_tokens"], run["output_tokens"])
    sizes = {key: run[key] for key in ("weight_bytes_per_step", "kv_bytes_per_token")}
    bound = throughput.physical_bound([len(p) for p in prompts], output_lens, run["engine_steps"], sizes, run["copy_GBps"])
    assert bound["bound_bytes"] == run["bound_bytes"]
    assert bound["bound_output_tokens_per_s"] == pytest.approx(run["bound_output_tokens_per_s"], rel=1e-12)
