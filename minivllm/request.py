"""`Request`: the engine core's record of one sequence being generated.

The scheduler reasons about a request with two numbers only: `num_tokens` (prompt + output
so far) and `num_computed_tokens` (how many of those already have K/V in the cache). Each step
gives a request up to `num_tokens - num_computed_tokens` new tokens. A fresh prompt, a prompt
split into chunks, a decode step (one new token) and a request resumed after preemption are
all the same rule. Chapter 03 (scheduler) is built on this file.

For prefix caching (chapter 04) a request also carries the hashes of its full blocks, kept
across preemption, and what else its K/V depend on (`block_hash_inputs`: LoRA, multimodal
inputs, `cache_salt`).
"""

from __future__ import annotations

import enum
import time

from minivllm.kv_cache.block_hash import BlockHash, BlockHashInputs
from minivllm.sampling_params import SamplingParams
from minivllm.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # structured output: its grammar is compiling (chapter 11)
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is finished; `is_finished` relies on that order.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


# --8<-- [start:request]
class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        # Async scheduling (chapter 05): tokens a launched step is sampling that have not
        # reached the scheduler yet (at most 1, since one step runs ahead).
        self.num_output_placeholders = 0
        self.num_preemptions = 0
        self.stop_reason: int | str | None = None
        # Prefix caching: the hashes of the full blocks so far (extended by the KV cache
        # manager), and the prompt tokens found in the cache at first admission (-1: not yet).
        self.block_hash_inputs = BlockHashInputs(cache_salt=cache_salt)
        self.block_hashes: list[BlockHash] = []
        self.num_cached_tokens = -1
        # Structured output (chapter 11): the grammar, and a wait until it is compiled.
        self.structured_output_request: StructuredOutputRequest | None = None
        if sampling_params.structured_outputs is not None:
            self.structured_output_request = StructuredOutputRequest(sampling_params.structured_outputs)
            self.status = RequestStatus.WAITING_FOR_FSM

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.finish_reason(self.status)
# --8<-- [end:request]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
