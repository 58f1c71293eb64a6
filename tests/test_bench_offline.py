"""`minivllm bench throughput` and `bench latency` on the CPU, with a tiny random-weight shape.

The H200 numbers come from these same entry points; here they must run end to end, produce
their JSON, and count the work they timed correctly.
"""

from __future__ import annotations

import json

import pytest

from minivllm.bench import latency, throughput
from minivllm.bench.shapes import SHAPES

TINY = dict(SHAPES["qwen3-0.6b"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=512,
            bos_token_id=1, eos_token_id=2)


@pytest.fixture
def tiny_shape(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    monkeypatch.setattr(throughput, "write_shape", lambda shape: str(tmp_path))
    return tmp_path


def test_bench_throughput_counts_every_output_token(tiny_shape, tmp_path):
    out = tmp_path / "t.json"
    result = throughput.main(["--num-requests", "5", "--min-len", "3", "--max-len", "12",
                              "--max-model-len", "64", "--json", str(out)])
    prompts, output_lens = throughput.random_workload(5, 3, 12, TINY["vocab_size"], seed=0)
    assert result["output_tokens"] == sum(output_lens)
    assert result["prompt_tokens"] == sum(len(p) for p in prompts)
    # Every request decodes its own length: at least the longest output's worth of steps.
    assert result["engine_steps"] >= max(output_lens)
    assert result["kernel_compiles_during_run"] == 0  # no GPU: nothing is compiled
    assert json.loads(out.read_text())["output_tokens_per_s"] == result["output_tokens_per_s"]


def test_bench_latency_reports_one_point_per_batch_size(tiny_shape, tmp_path):
    out = tmp_path / "l.json"
    result = latency.main(["--batch-sizes", "1,3", "--input-len", "8", "--output-len", "4", "--num-iters", "1",
                           "--max-model-len", "64", "--json", str(out)])
    assert [p["batch_size"] for p in result["points"]] == [1, 3]
    # The decode step is a difference of two timings, so only the prefill's sign is certain.
    assert all(p["prefill_ms"] > 0 and isinstance(p["decode_step_ms"], float) for p in result["points"])
    assert json.loads(out.read_text())["points"] == result["points"]


def test_decode_step_is_the_median_of_each_pairs_difference():
    # The second pair ran while everything was slow (both of its runs 20 ms longer): it
    # moves neither the median step nor, differenced within its pair, its own step.
    pairs = [(0.005, 0.069), (0.025, 0.089), (0.005, 0.0714)]
    got = latency.decode_step_from_pairs(pairs, output_len=64)
    assert got["decode_step_ms"] == pytest.approx(1.0)
    assert got["decode_step_range_ms"] == pytest.approx([1.0, 1.0375])
    assert got["prefill_ms"] == pytest.approx(5.0)
    with pytest.raises(ValueError):
        latency.decode_step_from_pairs([], output_len=64)
