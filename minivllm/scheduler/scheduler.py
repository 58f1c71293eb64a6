"""The scheduler: which requests run in the next step, and how many tokens each computes.

vLLM v1's rule, which minivllm keeps: there is no separate "prefill phase". Each request has
`num_computed_tokens`; a step gives it up to `num_tokens - num_computed_tokens` new tokens,
all requests share one token budget (`max_num_batched_tokens`) and a cap on requests
(`max_num_seqs`). Running requests are served first (decodes, or the next chunk of a long
prompt), then waiting ones in arrival order. When the KV cache runs out of blocks the most
recently admitted running request is preempted: its blocks are freed and it goes back to the
front of the queue. When it runs again, its prompt and the tokens it already generated are
recomputed in one prefill, and it continues exactly where it stopped. Chapter 03 walks through
`schedule()` and its helpers line by line.

With prefix caching (chapter 04) admission first asks the KV cache manager which leading
blocks of the request are already cached (`_find_cached_prefix`): those tokens count as
computed and only the rest is scheduled. A preempted request resumes the same way, so the
full blocks it had filled are usually found again instead of recomputed.

The `# exercise[ch03-...]` comments mark the functions chapter 03's exercises ask a learner to
rebuild (exercises/README.md). They are called through this module or `self` only, never
imported by name, so the exercise checker can swap a learner's version in.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from minivllm.config import SchedulerConfig
from minivllm.engine.types import EngineCoreOutput, EngineCoreRequest
from minivllm.kv_cache.block_hash import BlockHash
from minivllm.kv_cache.free_queue import KVCacheBlock
from minivllm.kv_cache.manager import KVCacheManager
from minivllm.request import Request, RequestStatus
from minivllm.scheduler.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

logger = logging.getLogger("minivllm")


@dataclass
class PrefixHit:
    """What admission found of a request's prefix: GPU blocks to share, CPU-tier blocks to load."""

    gpu_blocks: list[KVCacheBlock]
    cpu_hashes: list[BlockHash]
    num_tokens: int  # tokens the two together cover


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
        # Async scheduling: unfinished requests whose sampling reads their previous tokens on
        # the host (penalties, min_tokens, a grammar). While any exist, steps do not overlap.
        self.num_requests_needing_host_tokens = 0

    # -- requests in and out ------------------------------------------------------------

    def add_request(self, engine_request: EngineCoreRequest) -> Request:
        if engine_request.request_id in self.requests:
            raise ValueError(f"request id {engine_request.request_id!r} is already in use")
        request = Request(
            engine_request.request_id,
            engine_request.prompt_token_ids,
            engine_request.sampling_params,
            engine_request.arrival_time,
            cache_salt=engine_request.cache_salt,
        )
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if needs_host_tokens(request):
            self.num_requests_needing_host_tokens += 1
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
        output = SchedulerOutput(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=[],
            num_scheduled_tokens={},
            total_num_scheduled_tokens=0,
            finished_req_ids=self.finished_req_ids,
        )
        self.finished_req_ids = set()
        token_budget = self.config.max_num_batched_tokens
        # Structured output: a request whose grammar is still compiling sits this step out.
        held_back = self._hold_back_requests_waiting_for_grammar()

        # 1. Running requests first: each continues its prompt or decodes one token.
        token_budget = self._schedule_running(output, token_budget)
        # 2. Then waiting requests, oldest first, while budget, blocks and seats last.
        #    A step that had to preempt admits nobody: memory is already short.
        if not output.preempted_req_ids:
            self._schedule_waiting(output, token_budget)
        self.waiting.extendleft(reversed(held_back))  # back in their place, at the front

        # 3. The tokens scheduled now will have K/V once the step ran; count them as computed.
        #    With async scheduling, a request that samples in this step holds a placeholder
        #    for the token until `update_from_output` brings it, a step later.
        async_scheduling = self.config.async_scheduling
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            request = self.requests[request_id]
            request.num_computed_tokens += num_tokens
            if async_scheduling and request.num_computed_tokens >= request.num_tokens:
                request.num_output_placeholders += 1
        output.total_num_scheduled_tokens = sum(output.num_scheduled_tokens.values())
        # 4. KV offloading: the block copies this step's decisions need, run before the forward.
        output.kv_transfers = self.kv_cache_manager.take_kv_transfers()
        return output
    # --8<-- [end:schedule]

    # --8<-- [start:schedule-running]
    def _schedule_running(self, output: SchedulerOutput, token_budget: int) -> int:
        """Give each running request, in order, its next tokens; return the token budget left."""
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            if request.num_output_placeholders:
                # Async scheduling: the last step's token is still being sampled. Its decode is
                # the next step, unless that token is the request's last anyway.
                if will_finish_by_length(request, self.max_model_len):
                    req_index += 1
                    continue
                num_new_tokens = 1
            else:
                num_new_tokens = num_tokens_to_schedule(request, token_budget, self.config.enable_chunked_prefill)
            if num_new_tokens == 0:  # nothing of it fits in this step; the requests after it may
                req_index += 1
                continue
            new_block_ids = self._allocate_or_preempt(request, num_new_tokens, output.preempted_req_ids)
            if new_block_ids is None:  # the request preempted itself; nobody after it runs
                break
            output.scheduled_cached_reqs.append(
                CachedRequestData(request.request_id, False, new_block_ids, request.num_computed_tokens)
            )
            output.num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1
        return token_budget
    # --8<-- [end:schedule-running]

    # --8<-- [start:schedule-waiting]
    # exercise[ch03-schedule-waiting]: admit the head while seats, budget, blocks last; cached prefix first; NewRequestData, or CachedRequestData if resumed
    def _schedule_waiting(self, output: SchedulerOutput, token_budget: int) -> int:
        """Admit waiting requests, oldest first; return the token budget left.

        The head of `self.waiting` is admitted when there is a seat (fewer than `max_num_seqs`
        requests running), `num_tokens_to_schedule` gives it more than 0 tokens, and the KV
        cache manager finds blocks for them. Otherwise admission stops for this step: a later
        request never overtakes the head (first come, first served). Before counting its
        tokens, `self._find_cached_prefix(request)` looks its prefix up in the cache: the hit
        tokens become its `num_computed_tokens` and the hit blocks go to `allocate_slots` as
        `new_computed_blocks`; if it is not admitted after all, `num_computed_tokens` goes
        back to 0. Once admitted, `self._admit_cached_prefix(request, hit)` records the hit.
        An admitted request moves to the end of `self.running` with status RUNNING, and its
        tokens are recorded in `output.num_scheduled_tokens`. What the model runner is sent
        depends on whether it has seen the request: a new one goes into
        `output.scheduled_new_reqs` as `NewRequestData` (prompt, sampling params, all its
        block ids); one resumed after preemption into `output.scheduled_cached_reqs` as
        `CachedRequestData` with `resumed_from_preemption=True` and all its block ids, so the
        runner rebuilds its block table from them.
        """
        while self.waiting and token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit = self._find_cached_prefix(request)
            request.num_computed_tokens = hit.num_tokens
            num_new_tokens = num_tokens_to_schedule(request, token_budget, self.config.enable_chunked_prefill)
            new_block_ids = None
            if num_new_tokens > 0:  # 0: its prompt may not be split and does not fit
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new_tokens, hit.gpu_blocks)
            if new_block_ids is None:
                request.num_computed_tokens = 0
                break  # not enough free blocks or budget; try again next step
            self._admit_cached_prefix(request, hit)
            self.waiting.popleft()
            self.running.append(request)
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
            if request.status == RequestStatus.PREEMPTED:
                output.scheduled_cached_reqs.append(
                    CachedRequestData(request.request_id, True, block_ids, request.num_computed_tokens)
                )
            else:
                output.scheduled_new_reqs.append(
                    NewRequestData(
                        request.request_id,
                        request.prompt_token_ids,
                        request.sampling_params,
                        block_ids,
                        request.num_computed_tokens,
                    )
                )
            request.status = RequestStatus.RUNNING
            output.num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
        return token_budget
    # --8<-- [end:schedule-waiting]

    # --8<-- [start:cached-prefix]
    def _find_cached_prefix(self, request: Request) -> PrefixHit:
        """The request's leading full blocks in the GPU prefix cache, then in the CPU tier."""
        gpu_blocks, _ = self.kv_cache_manager.get_computed_blocks(request)
        cpu_hashes = self.kv_cache_manager.get_offloaded_prefix(request, len(gpu_blocks))
        return PrefixHit(gpu_blocks, cpu_hashes, (len(gpu_blocks) + len(cpu_hashes)) * self.kv_cache_manager.block_size)

    def _admit_cached_prefix(self, request: Request, hit: PrefixHit) -> None:
        """After admission: copy the CPU-tier hits into their new blocks; count the hit."""
        if hit.cpu_hashes:
            self.kv_cache_manager.load_offloaded_blocks(request, len(hit.gpu_blocks), hit.cpu_hashes)
        cpu_hit_tokens = len(hit.cpu_hashes) * self.kv_cache_manager.block_size
        self.kv_cache_manager.record_admission(request, hit.num_tokens, cpu_hit_tokens)
        if request.num_cached_tokens < 0:  # reported to the user: the first admission's hit
            request.num_cached_tokens = hit.num_tokens

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while a request holds blocks."""
        return self.kv_cache_manager.reset_prefix_cache()
    # --8<-- [end:cached-prefix]

    # --8<-- [start:preempt]
    # exercise[ch03-allocate-or-preempt]: retry allocate_slots; while it fails, preempt the last running request (None if it is this one)
    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, preempted_req_ids: set[str]
    ) -> list[int] | None:
        """Find blocks for `num_new_tokens` more tokens of the running `request`; preempt if needed.

        While `kv_cache_manager.allocate_slots` says no (None), preempt the running request of
        lowest priority: with first come, first served, the most recently admitted one, i.e.
        the last of `self.running`. Take it out of `self.running`, `self._preempt` it, add its
        id to `preempted_req_ids`, and try again. If the victim was `request` itself, return
        None: it gets nothing this step. Otherwise return the ids of the blocks added.
        """
        while True:
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_block_ids is not None:
                return new_block_ids
            victim = self.running.pop()
            self._preempt(victim)
            preempted_req_ids.add(victim.request_id)
            if victim is request:
                return None

    # exercise[ch03-preempt]: (swap mode: swap_out first) free its blocks; PREEMPTED; num_computed_tokens = 0, tokens kept; count it; front of waiting
    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop the request's K/V; keep its tokens; queue it first.

        `request` is already out of `self.running`. With `config.preemption_mode == "swap"`,
        first have the KV cache manager copy its blocks to the CPU tier
        (`kv_cache_manager.swap_out(request)`). Give its blocks back to the KV cache
        manager; set its status to PREEMPTED and `num_computed_tokens` to 0 (its prompt and the
        tokens it generated are recomputed when it resumes; its tokens themselves are kept);
        add one to `request.num_preemptions` and to `self.num_preemptions`; and put it at the
        front of `self.waiting`, so it is the first to resume.
        """
        if self.config.preemption_mode == "swap":
            self.kv_cache_manager.swap_out(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # a token still being sampled is dropped (async)
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
            if request.status != RequestStatus.RUNNING:
                continue  # async scheduling: preempted after this step was launched; it resamples
            if request.num_output_placeholders:  # async scheduling: the awaited token is here
                request.num_output_placeholders = max(request.num_output_placeholders - len(token_ids), 0)
            for token_id in token_ids:
                request.append_output_token(token_id)
                if check_stop(request, self.max_model_len):
                    break
            if request.structured_output_request is not None:
                self._advance_grammar(request, token_ids)
            output = EngineCoreOutput(request_id, token_ids, num_cached_tokens=max(request.num_cached_tokens, 0))
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

    # --8<-- [end:update-from-output]

    # -- structured output (chapter 11) ------------------------------------------------------

    def _hold_back_requests_waiting_for_grammar(self) -> list[Request]:
        """Take the waiting requests whose grammar is not compiled yet out of `self.waiting`.

        Those whose grammar is ready become ordinary WAITING requests, in their place.
        """
        held_back: list[Request] = []
        still_waiting: deque[Request] = deque()
        for request in self.waiting:
            if request.status == RequestStatus.WAITING_FOR_FSM:
                if not request.structured_output_request.is_grammar_ready():
                    held_back.append(request)
                    continue
                request.status = RequestStatus.WAITING
            still_waiting.append(request)
        if held_back:
            self.waiting = still_waiting
        return held_back

    def _advance_grammar(self, request: Request, token_ids: list[int]) -> None:
        """The request's matcher follows its new tokens; reaching the grammar's end is a stop."""
        grammar = request.structured_output_request.grammar
        if not grammar.accept_tokens(token_ids):
            logger.error("request %s sampled a token its grammar refuses: %s", request.request_id, token_ids)
        if grammar.is_terminated() and not request.is_finished():
            request.status = RequestStatus.FINISHED_STOPPED

    def _free_request(self, request: Request) -> None:
        if needs_host_tokens(request):
            self.num_requests_needing_host_tokens -= 1
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]


# --8<-- [start:num-new-tokens]
# exercise[ch03-num-new-tokens]: num_tokens - num_computed_tokens, cut to the budget; unchunked: 0 unless all fit
def num_tokens_to_schedule(request: Request, token_budget: int, enable_chunked_prefill: bool) -> int:
    """How many tokens `request` computes in this step, given the token budget left (> 0).

    A request computes the tokens that have no K/V in the cache yet,
    `num_tokens - num_computed_tokens`: a whole prompt, the rest of a chunked one, one decode
    token, or a resumed request's prompt and outputs. With chunked prefill they are cut to
    `token_budget`. Without it they are never cut: if they do not all fit, the answer is 0 and
    the request waits for a step with more room.
    """
    num_new_tokens = request.num_tokens - request.num_computed_tokens
    if num_new_tokens > token_budget and not enable_chunked_prefill:
        return 0
    return min(num_new_tokens, token_budget)
# --8<-- [end:num-new-tokens]


def will_finish_by_length(request: Request, max_model_len: int) -> bool:
    """Counting the tokens still being sampled, has the request reached max_tokens or max_model_len?"""
    num_pending = request.num_output_placeholders
    return (request.num_output_tokens + num_pending >= request.sampling_params.max_tokens
            or request.num_tokens + num_pending >= max_model_len)


def needs_host_tokens(request: Request) -> bool:
    """Does sampling this request read its previous tokens on the host? Then a step cannot be
    scheduled before the last one reported: penalties and min_tokens count the tokens so far,
    and a grammar's bitmask follows them."""
    params = request.sampling_params
    return (request.structured_output_request is not None or params.min_tokens > 0
            or params.repetition_penalty != 1.0 or bool(params.presence_penalty) or bool(params.frequency_penalty))


# --8<-- [start:check-stop]
# exercise[ch03-check-stop]: stop token only from min_tokens on (stop_reason: its id, None for eos); then max_tokens, max_model_len
def check_stop(request: Request, max_model_len: int) -> bool:
    """Right after a token was appended: is `request` finished? If so, set its status.

    - The last token is a stop token (`sampling_params.all_stop_token_ids`: the model's eos
      ids unless `ignore_eos`, plus the user's `stop_token_ids`) and the request has at least
      `min_tokens` output tokens: FINISHED_STOPPED. `request.stop_reason` is the token id when
      it is one of the user's `stop_token_ids`, and None for eos (as vLLM reports it).
    - Otherwise, when it has `max_tokens` output tokens, or `max_model_len` tokens in all:
      FINISHED_LENGTH_CAPPED.

    Returns True when the request finished.
    """
    params = request.sampling_params
    last_token_id = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens and last_token_id in params.all_stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id if last_token_id in params.stop_token_ids else None
        return True
    if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
# --8<-- [end:check-stop]
