"""The messages between the front end and the engine core.

`EngineCoreRequest` goes in (already tokenized and validated); `EngineCoreOutput` comes out,
one per request per step, carrying only what is new. In the offline engine they are passed as
plain Python objects; with the core in its own process (chapter 02) they cross a ZMQ socket as
typed msgpack, through `minivllm/engine/serial_utils.py`. This module must import without
msgspec or pyzmq: the offline path runs with torch, transformers, safetensors and numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    # Prefix caching (chapter 04): requests with different salts never share cached blocks.
    cache_salt: str | None = None


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    # For the one new token, when logprobs were asked for: column 0 the sampled token, then
    # the top-N; `new_sampled_rank` is the sampled token's rank (1 = most likely).
    new_logprob_token_ids: list[int] | None = None
    new_logprobs: list[float] | None = None
    new_sampled_rank: int | None = None
    # Prompt tokens whose K/V the prefix cache supplied at admission (vLLM's field).
    num_cached_tokens: int = 0
    # Set (with finish_reason "error") when the core could not take this request; the other
    # requests carry on. The front end raises it in this request's stream.
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineCoreStats:
    """A snapshot of the core, answered by the `get_stats` utility call (tests, `minivllm run`)."""

    num_gpu_blocks: int
    num_free_blocks: int
    num_waiting: int
    num_running: int
    num_steps: int
    peak_num_blocks_used: int
    num_preemptions: int
    # Seconds spent inside EngineCore.step() since start: against the wall clock it says how
    # busy the core was (chapter 02 compares the two client modes with it).
    busy_seconds: float = 0.0
    # Prefix caching (chapter 04), in tokens since start-up: looked up at admission, found in
    # the cache (GPU or CPU tier), and of those copied back from the CPU tier.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_cpu_hits: int = 0
    num_cached_blocks: int = 0  # blocks in the GPU prefix cache now (held or free)
    num_offloaded_blocks: int = 0  # blocks in the CPU tier now

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
