"""The messages between the front end and the engine core.

`EngineCoreRequest` goes in (already tokenized and validated); `EngineCoreOutput` comes out,
one per request per step, carrying only what is new. Chapter 02 sends these over ZMQ; in the
offline engine they are passed as plain Python objects.
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


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    # For the one new token, when logprobs were asked for: column 0 the sampled token, then
    # the top-N; `new_sampled_rank` is the sampled token's rank (1 = most likely).
    new_logprob_token_ids: list[int] | None = None
    new_logprobs: list[float] | None = None
    new_sampled_rank: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
