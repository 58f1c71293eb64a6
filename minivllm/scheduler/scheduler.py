"""The scheduler: which requests run in the next step, and how many tokens each computes.

vLLM v1's rule, which minivllm keeps: there is no separate "prefill phase". Each request has
`num_computed_tokens`; a step gives it up to `num_tokens - num_computed_tokens` new tokens,
all requests share one token budget (`max_num_batched_tokens`) and a cap on requests
(`max_num_seqs`). Running requests are served first (decodes, or the next chunk of a long
prompt), then waiting ones in arrival order. When the KV cache runs out of blocks the most
recently admitted running request is preempted: its blocks are freed and it goes back to the
front of the queue. When it runs again, its prompt and the tokens it already generated are
recomputed in one prefill, and it continues exactly where it stopped. Chapter 03 walks through `schedule()` line by line.
"""

from __future__ import annotations

from collections import deque

from minivllm.config import SchedulerConfig
from minivllm.engine.types import EngineCoreOutput, EngineCoreRequest
from minivllm.kv_cache.manager import KVCacheManager
from minivllm.request import Request, RequestStatus
from minivllm.scheduler.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.max_model_len = config.max_model_len
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # reported to the runner in the next step
        self.num_preemptions = 0  # total, for statistics

    # -- requests in and out ------------------------------------------------------------

    def add_request(self, engine_request: EngineCoreRequest) -> Request:
        if engine_request.request_id in self.requests:
            raise ValueError(f"request id {engine_request.request_id!r} is already in use")
        request = Request(
            engine_request.request_id,
            engine_request.prompt_token_ids,
            engine_request.sampling_params,
            engine_request.arrival_time,
        )
        self.requests[request.request_id] = request
        self.waiting.append(request)
        return request

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, or a stop string the front end saw)."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step -------------------------------------------------------------------------

    # --8<-- [start:schedule]
    def schedule(self) -> SchedulerOutput:
        token_budget = self.config.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted_req_ids: set[str] = set()

        # 1. Running requests first: each continues its prompt or decodes one token.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, token_budget)
            while True:
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
                if new_block_ids is not None:
                    break
                # Out of blocks: preempt the most recently admitted request and retry.
                victim = self.running.pop()
                self._preempt(victim)
                preempted_req_ids.add(victim.request_id)
                if victim is request:
                    break
            if new_block_ids is None:  # the request preempted itself; nobody after it runs
                break
            cached_reqs.append(
                CachedRequestData(request.request_id, False, new_block_ids, request.num_computed_tokens)
            )
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1

        # 2. Then waiting requests, oldest first, while budget, blocks and seats last.
        # A step that had to preempt admits nobody: memory is already short.
        while self.waiting and token_budget > 0 and not preempted_req_ids:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            num_new_tokens = request.num_tokens - request.num_computed_tokens
            if not self.config.enable_chunked_prefill and num_new_tokens > token_budget:
                break  # must wait for a step with room for its whole prompt
            num_new_tokens = min(num_new_tokens, token_budget)
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_block_ids is None:
                break  # not enough free blocks; try again next step
            self.waiting.popleft()
            self.running.append(request)
            if request.status == RequestStatus.PREEMPTED:
                cached_reqs.append(
                    CachedRequestData(request.request_id, True, new_block_ids, request.num_computed_tokens)
                )
            else:
                new_reqs.append(
                    NewRequestData(
                        request.request_id,
                        request.prompt_token_ids,
                        request.sampling_params,
                        new_block_ids,
                        request.num_computed_tokens,
                    )
                )
            request.status = RequestStatus.RUNNING
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens

        # 3. The tokens scheduled now will have K/V once the step ran; count them as computed.
        for request_id, num_tokens in num_scheduled_tokens.items():
            self.requests[request_id].num_computed_tokens += num_tokens

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=sum(num_scheduled_tokens.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted_req_ids,
        )
        self.finished_req_ids = set()
        return output
    # --8<-- [end:schedule]

    # --8<-- [start:preempt]
    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop the request's K/V; keep its tokens; queue it first."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
    # --8<-- [end:preempt]

    # --8<-- [start:update-from-output]
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, decide who stopped, free their blocks."""
        outputs: list[EngineCoreOutput] = []
        for row, (request_id, token_ids) in enumerate(
            zip(runner_output.req_ids, runner_output.sampled_token_ids)
        ):
            request = self.requests.get(request_id)
            if request is None or not token_ids:  # aborted meanwhile, or a prompt chunk that is not the last
                continue
            for token_id in token_ids:
                request.append_output_token(token_id)
                if self._check_stop(request):
                    break
            output = EngineCoreOutput(request_id, token_ids)
            if runner_output.logprobs is not None and request.sampling_params.logprobs is not None:
                n = request.sampling_params.logprobs + 1
                output.new_logprob_token_ids = runner_output.logprob_token_ids[row, :n].tolist()
                output.new_logprobs = runner_output.logprobs[row, :n].tolist()
                output.new_sampled_rank = int(runner_output.sampled_token_ranks[row])
            if request.is_finished():
                output.finish_reason = request.get_finished_reason()
                output.stop_reason = request.stop_reason
                self.running.remove(request)
                self._free_request(request)
            outputs.append(output)
        return outputs

    def _check_stop(self, request: Request) -> bool:
        params = request.sampling_params
        last_token_id = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens and last_token_id in params.all_stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            # vLLM reports the token only for user stop_token_ids; eos has stop_reason None.
            request.stop_reason = last_token_id if last_token_id in params.stop_token_ids else None
            return True
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
    # --8<-- [end:update-from-output]

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
