"""What one scheduling step decided (`SchedulerOutput`) and what the model made of it.

The scheduler sends the model runner *differences*, as vLLM v1 does: a request's prompt and
sampling parameters travel once, when it is first scheduled (`NewRequestData`); after that only
its new block ids and progress do (`CachedRequestData`). The model runner keeps its own copy
of each request's tokens. Chapter 03 explains the diff; chapter 05 the runner's side.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from minivllm.kv_cache.offload import KVTransfers
from minivllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    req_id: str
    # True when the request was preempted and is scheduled again: its block table is rebuilt
    # from `new_block_ids` instead of extended by them.
    resumed_from_preemption: bool
    new_block_ids: list[int]
    num_computed_tokens: int


# --8<-- [start:scheduler-output]
@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # request id -> tokens to compute this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished since the last step: the runner drops their state
    preempted_req_ids: set[str] = field(default_factory=set)
    # Structured output (chapter 11), filled by the engine core after scheduling: request id →
    # its row of `grammar_bitmask` ([rows, ceil(vocab_size / 32)] int32), for each structured
    # request that samples this step. Empty / None when no such request is scheduled.
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: torch.Tensor | None = None
    # KV offloading (chapter 04): block copies between the GPU cache and the CPU tier, which
    # the worker runs before the forward pass. None without a CPU tier.
    kv_transfers: KVTransfers | None = None
# --8<-- [end:scheduler-output]

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """Per scheduled request: the tokens sampled (none for a prompt chunk that is not the last)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Only when some request asked for logprobs: rows aligned with req_ids, column 0 the sampled
    # token, then the top-N by logprob; ranks of the sampled tokens.
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_token_ranks: torch.Tensor | None = None


class AsyncModelRunnerOutput:
    """A launched step's output, available once the device has finished the step (chapter 05).

    `get_output()` waits for the step's sampled tokens to reach the host and returns its
    `ModelRunnerOutput`; later calls return the same object.
    """

    def __init__(self, finish: Callable[[], ModelRunnerOutput]) -> None:
        self._finish: Callable[[], ModelRunnerOutput] | None = finish
        self._output: ModelRunnerOutput | None = None

    def get_output(self) -> ModelRunnerOutput:
        if self._finish is not None:
            self._output, self._finish = self._finish(), None
        return self._output

