"""What the engine hands back to the user: `RequestOutput` and `CompletionOutput`.

Same names and fields as vLLM, so `out.outputs[0].text` means the same thing in both.
`logprobs` follows vLLM's format: one dict per generated position, mapping token id to
`Logprob(logprob, rank, decoded_token)`; the sampled token is always in the dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# vLLM's types: one dict per position.
LogprobsDict = dict[int, "Logprob"]
SampleLogprobs = list[LogprobsDict]


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: None = field(default=None, repr=False)  # not computed by minivllm

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"outputs={self.outputs!r}, finished={self.finished})"
        )
