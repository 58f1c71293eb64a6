"""The server's latency metrics when stream deltas arrive merged (chapter 11)."""

import pytest

pytest.importorskip("prometheus_client")

from minivllm.metrics import ServerMetrics  # noqa: E402
from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402


def delta(token_ids: list[int], times: RequestMetrics, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(0, "", token_ids, None, None, "length" if finished else None)
    return RequestOutput("r", None, [1, 2], [completion], finished, metrics=times)


def sample_count(metrics: ServerMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(f"minivllm:{name}_count", {"model_name": "m"})


def test_merged_deltas_count_one_inter_token_gap_per_token_after_the_first():
    metrics = ServerMetrics("m")
    observer = metrics.observe_request(num_prompt_tokens=2)
    # The first output already holds two tokens (the reader was slow): one TTFT, one gap.
    observer.on_output(delta([5, 6], RequestMetrics(arrival_time=10.0, first_token_time=10.5, last_token_time=10.7)))
    # Then three tokens merged: three gaps sharing 0.3 s.
    observer.on_output(delta([7, 8, 9], RequestMetrics(arrival_time=10.0, first_token_time=10.5, last_token_time=11.0), True))
    assert sample_count(metrics, "time_to_first_token_seconds") == 1
    assert metrics.registry.get_sample_value("minivllm:time_to_first_token_seconds_sum", {"model_name": "m"}) == pytest.approx(0.5)
    assert sample_count(metrics, "inter_token_latency_seconds") == 4  # 5 tokens, 4 gaps
    assert metrics.registry.get_sample_value("minivllm:inter_token_latency_seconds_sum", {"model_name": "m"}) == pytest.approx(0.5)
