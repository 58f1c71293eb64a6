"""The server's Prometheus metrics, named like vLLM's under a `minivllm:` prefix (chapter 11).

Two kinds of numbers, from two places:

- **Per request**, seen by the front end as outputs stream back: time to first token, the
  time between tokens, end-to-end latency (histograms), and prompt / generation token and
  finished-request counters. `ServerMetrics.observe_request` returns a `RequestObserver` that
  the serving code feeds every output of one request.
- **Engine state**, which only the engine core knows: running and waiting requests, KV cache
  usage, preemptions, prefix-cache queries and hits. `/metrics` asks the core for its
  `EngineCoreStats` and `refresh_engine_stats` stores them just before the page is rendered.

Each `ServerMetrics` has its own registry, so several servers (tests) can live in one process.
With several API server processes (`--api-server-count`), prometheus_client's multiprocess mode
is on (`PROMETHEUS_MULTIPROC_DIR`): every process writes its counts to files there, and the
page sums them, so it describes the whole server whichever process answers.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from minivllm.engine.types import EngineCoreStats
from minivllm.outputs import RequestOutput

# vLLM's exposition has no `*_created` series; neither does ours (a process-wide switch).
disable_created_metrics()

PREFIX = "minivllm:"
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's switch for multiprocess mode
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets: TTFT from 1 ms, token gaps from 10 ms, whole requests from 0.3 s.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.engine_collector = EngineStatsCollector(model_name)
        self.registry.register(self.engine_collector)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between two output tokens.", ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.", E2E_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._request_success = Counter(
            PREFIX + "request_success", "Finished requests, by finish reason.", labels + ["finished_reason"], registry=self.registry
        )
        self.model_name = model_name

    def observe_request(self, num_prompt_tokens: int) -> RequestObserver:
        self.prompt_tokens.inc(num_prompt_tokens)
        return RequestObserver(self)

    def refresh_engine_stats(self, stats: EngineCoreStats) -> None:
        self.engine_collector.stats = stats

    def render(self) -> bytes:
        if os.environ.get(MULTIPROC_DIR_ENV):  # several API processes: the sum of their files
            from prometheus_client.multiprocess import MultiProcessCollector

            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            registry.register(self.engine_collector)
            return generate_latest(registry)
        return generate_latest(self.registry)


# --8<-- [start:observer]
class RequestObserver:
    """Latency of one request, from the timestamps the output processor puts on its outputs."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.last_token_time: float | None = None

    def on_output(self, output: RequestOutput) -> None:
        times = output.metrics
        num_new_tokens = sum(len(completion.token_ids) for completion in output.outputs)
        if times is not None and num_new_tokens and times.last_token_time is not None:
            # Deltas that waited for a slow reader arrive merged: the tokens of one output share
            # the gap since the previous token, so every token after the first counts once.
            num_gaps = num_new_tokens
            if self.last_token_time is None:
                first = times.first_token_time or times.last_token_time
                self.metrics.time_to_first_token.observe(first - times.arrival_time)
                self.last_token_time = first
                num_gaps -= 1
            if num_gaps:
                gap = (times.last_token_time - self.last_token_time) / num_gaps
                for _ in range(num_gaps):
                    self.metrics.inter_token_latency.observe(gap)
            self.last_token_time = times.last_token_time
        self.metrics.generation_tokens.inc(num_new_tokens)
        if output.finished:
            if times is not None:
                end = times.finished_time or times.last_token_time or times.arrival_time
                self.metrics.e2e_request_latency.observe(end - times.arrival_time)
            reason = next((c.finish_reason for c in output.outputs if c.finish_reason), "abort")
            self.metrics._request_success.labels(self.metrics.model_name, reason).inc()
# --8<-- [end:observer]


class EngineStatsCollector(Collector):
    """Gauges and counters read from the latest `EngineCoreStats` snapshot."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineCoreStats | None = None

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self.stats
        if stats is None:
            return

        def family(kind, name: str, doc: str, value: float):
            metric = kind(PREFIX + name, doc, labels=["model_name"])
            metric.add_metric([self.model_name], value)
            return metric

        yield family(GaugeMetricFamily, "num_requests_running", "Requests in the running batch.", stats.num_running)
        yield family(GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        used = stats.num_gpu_blocks - stats.num_free_blocks
        usage = used / stats.num_gpu_blocks if stats.num_gpu_blocks else 0.0
        yield family(GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", usage)
        yield family(CounterMetricFamily, "num_preemptions", "Requests preempted by the scheduler.", stats.num_preemptions)
        # How often the core stepped and how long the steps took: against the wall clock, how
        # busy the core was (a core waiting on this process steps less than it could).
        yield family(CounterMetricFamily, "engine_steps", "Engine core steps since start-up.", stats.num_steps)
        yield family(CounterMetricFamily, "engine_busy_seconds", "Seconds the engine core spent in its steps.", stats.busy_seconds)
        # Prefix-cache counters exist once the KV cache manager counts them (chapter 04).
        queries = getattr(stats, "prefix_cache_queries", 0) or 0
        hits = getattr(stats, "prefix_cache_hits", 0) or 0
        yield family(CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries)
        yield family(CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)
