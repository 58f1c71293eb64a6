"""`OutputProcessor`: engine-core outputs (new token ids) → user-facing `RequestOutput`s.

The engine core deals in token ids only. Everything that needs the tokenizer happens here, in
the front end: incremental detokenization, stop strings (which may end a request the core
still thinks is running: those ids are returned so the caller can abort them in the core),
logprobs with decoded tokens, and timing metrics. A request with `n > 1` runs as n child
requests in the core; `ParentRequest` gathers their completions into one `RequestOutput`.
Chapter 02 (engine core: output processing).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from minivllm.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from minivllm.engine.types import EngineCoreOutput, EngineCoreRequest
from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput, SampleLogprobs
from minivllm.sample.logprobs import make_logprobs_dicts
from minivllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class ParentRequest:
    """One user request with n > 1: its children's completions, by index."""

    request_id: str
    n: int
    completions: dict[int, CompletionOutput] = field(default_factory=dict)

    def num_finished(self) -> int:
        return sum(1 for c in self.completions.values() if c.finished())


class RequestState:
    """The front end's view of one (child) request while it runs."""

    def __init__(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        tokenizer: Any | None,
        parent: ParentRequest | None,
        index: int,
    ) -> None:
        self.request_id = request.request_id
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.params: SamplingParams = request.sampling_params
        self.parent = parent
        self.index = index
        self.output_token_ids: list[int] = []
        self.tokenizer = tokenizer if self.params.detokenize else None
        self.detokenizer = (
            IncrementalDetokenizer(
                tokenizer, request.prompt_token_ids, self.params.skip_special_tokens,
                self.params.spaces_between_special_tokens,
            )
            if self.tokenizer is not None
            else None
        )
        self.text = ""
        self.sent_text_len = 0  # for DELTA outputs
        self.sent_token_len = 0
        self.logprobs: SampleLogprobs | None = [] if self.params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if self.params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)
        self.num_cached_tokens = 0  # prompt tokens the prefix cache supplied (from the core)

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}

    def add_request(
        self, request: EngineCoreRequest, prompt: str | None, parent: ParentRequest | None = None, index: int = 0
    ) -> None:
        if request.request_id in self.request_states:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.request_states[request.request_id] = RequestState(request, prompt, self.tokenizer, parent, index)
        if parent is not None:
            self.parents[parent.request_id] = parent

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget the requests (a parent id aborts all its children); return the core ids to abort."""
        core_ids = []
        for request_id in request_ids:
            if request_id in self.parents:
                parent = self.parents.pop(request_id)
                core_ids += [r for r, s in self.request_states.items() if s.parent is parent]
            elif request_id in self.request_states:
                core_ids.append(request_id)
        for core_id in core_ids:
            self.request_states.pop(core_id, None)
        return core_ids

    # --8<-- [start:process-outputs]
    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Return the RequestOutputs to deliver, and the ids the core must abort (stop strings)."""
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        now = time.time()
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is None:  # aborted by the user while the step ran
                continue
            if state.metrics.first_token_time is None and out.new_token_ids:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
            state.num_cached_tokens = out.num_cached_tokens
            state.output_token_ids += out.new_token_ids
            self._update_logprobs(state, out)
            state.finish_reason, state.stop_reason = out.finish_reason, out.stop_reason
            if state.detokenizer is not None:
                new_token_ids = out.new_token_ids
                if out.finish_reason == "stop" and not state.params.include_stop_str_in_output:
                    new_token_ids = new_token_ids[:-1]  # a stop token's text is not output (vLLM)
                new_text = state.detokenizer.update(new_token_ids)
                state.text = state.detokenizer.output_text
                if state.params.stop:
                    self._check_stop_strings(state, len(new_text), reqs_to_abort)
            if state.finish_reason is not None:
                state.metrics.finished_time = now
                del self.request_states[out.request_id]
            request_output = self._make_request_output(state)
            if request_output is not None:
                request_outputs.append(request_output)
        return request_outputs, reqs_to_abort
    # --8<-- [end:process-outputs]

    def _check_stop_strings(self, state: RequestState, new_char_count: int, reqs_to_abort: list[str]) -> None:
        hit = check_stop_strings(state.text, new_char_count, state.params.stop, state.params.include_stop_str_in_output)
        if hit is None:
            return
        stop_str, truncate_to = hit
        state.text = state.text[:truncate_to]
        if state.finish_reason is None:  # the core does not know yet: it must stop this request
            reqs_to_abort.append(state.request_id)
        state.finish_reason, state.stop_reason = "stop", stop_str

    def _update_logprobs(self, state: RequestState, out: EngineCoreOutput) -> None:
        if state.logprobs is None or out.new_logprob_token_ids is None:
            return
        entry = make_logprobs_dicts(
            out.new_logprob_token_ids, out.new_logprobs, out.new_sampled_rank,
            state.params.logprobs, state.decode_token if state.params.detokenize else None,
        )
        state.logprobs.append(entry)
        state.cumulative_logprob += out.new_logprobs[0]

    def _completion(self, state: RequestState, delta: bool) -> CompletionOutput:
        text, token_ids, logprobs = state.text, state.output_token_ids, state.logprobs
        if delta:
            text, token_ids = text[state.sent_text_len :], token_ids[state.sent_token_len :]
            logprobs = logprobs[state.sent_token_len :] if logprobs is not None else None
            state.sent_text_len, state.sent_token_len = len(state.text), len(state.output_token_ids)
        return CompletionOutput(
            index=state.index, text=text, token_ids=list(token_ids),
            cumulative_logprob=state.cumulative_logprob, logprobs=logprobs,
            finish_reason=state.finish_reason, stop_reason=state.stop_reason,
        )

    def _make_request_output(self, state: RequestState) -> RequestOutput | None:
        kind = state.params.output_kind
        finished = state.finish_reason is not None
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completion = self._completion(state, delta=kind == RequestOutputKind.DELTA)
        parent = state.parent
        if parent is None:
            return RequestOutput(
                state.request_id, state.prompt, state.prompt_token_ids, [completion], finished, state.metrics,
                num_cached_tokens=state.num_cached_tokens,
            )
        # n > 1: keep each child's latest completion; the parent finishes with its last child.
        parent.completions[state.index] = self._completion(state, delta=False) if kind == RequestOutputKind.DELTA else completion
        parent_finished = parent.num_finished() == parent.n
        if parent_finished:
            self.parents.pop(parent.request_id, None)
        elif kind == RequestOutputKind.FINAL_ONLY:
            return None
        outputs = [completion] if kind == RequestOutputKind.DELTA else [parent.completions[i] for i in sorted(parent.completions)]
        return RequestOutput(
            parent.request_id, state.prompt, state.prompt_token_ids, outputs, parent_finished, state.metrics,
            num_cached_tokens=state.num_cached_tokens,
        )
