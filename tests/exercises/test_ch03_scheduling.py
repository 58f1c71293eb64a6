"""Chapter 03 exercises: how many tokens a request gets, and admitting waiting requests.

`num_tokens_to_schedule` is the whole "no prefill phase" rule in three lines: a fresh prompt,
a chunk of a long one, a decode step and a resumed request are all "the tokens without K/V
yet, cut to the budget". `Scheduler._schedule_waiting` admits requests from the waiting queue,
first come, first served. Exercised functions are called through their module or class only
(exercises/README.md), so `minivllm exercise check 03` can swap a learner's version in.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import minivllm.scheduler.scheduler as sched
from minivllm.config import SchedulerConfig
from minivllm.engine.types import EngineCoreRequest
from minivllm.kv_cache.manager import KVCacheManager
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler.output import SchedulerOutput

BLOCK_SIZE = 4


def make_request(request_id: str = "r", prompt_len: int = 10, num_computed: int = 0, outputs: int = 0) -> Request:
    request = Request(request_id, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=64))
    for _ in range(outputs):
        request.append_output_token(7)
    request.num_computed_tokens = num_computed
    return request


def make_scheduler(budget: int = 16, max_seqs: int = 8, num_blocks: int = 100, chunked: bool = True) -> sched.Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked, max_model_len=budget if not chunked else 64
    )
    return sched.Scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE))


def add_waiting(scheduler: sched.Scheduler, *prompt_lens: int) -> None:
    """Requests "a", "b", ... with these prompt lengths join the waiting queue in that order."""
    for index, prompt_len in enumerate(prompt_lens):
        request_id = "abcdefgh"[index]
        scheduler.add_request(EngineCoreRequest(request_id, list(range(100, 100 + prompt_len)), SamplingParams(), 0.0))


def empty_output() -> SchedulerOutput:
    return SchedulerOutput([], [], {}, 0, set())


# -- ch03-num-new-tokens ------------------------------------------------------------------


@pytest.mark.exercise("ch03-num-new-tokens")
@pytest.mark.parametrize("chunked", [True, False])
def test_a_prompt_that_fits_is_scheduled_whole(chunked: bool) -> None:
    request = make_request(prompt_len=10)
    got = sched.num_tokens_to_schedule(request, 16, chunked)
    assert got == 10, f"a 10-token prompt with 16 tokens of budget left computes all 10 tokens, got {got}"


@pytest.mark.exercise("ch03-num-new-tokens")
@pytest.mark.parametrize("chunked", [True, False])
def test_a_prompt_of_exactly_the_budget_fits(chunked: bool) -> None:
    got = sched.num_tokens_to_schedule(make_request(prompt_len=16), 16, chunked)
    assert got == 16, f"a prompt of exactly the budget (16) fits, chunked prefill or not; got {got}"


@pytest.mark.exercise("ch03-num-new-tokens")
def test_with_chunked_prefill_a_long_prompt_is_cut_to_the_budget_chunk_by_chunk() -> None:
    request = make_request(prompt_len=40)
    chunks = []
    while request.num_computed_tokens < request.num_tokens:
        chunk = sched.num_tokens_to_schedule(request, 16, True)
        assert chunk > 0, "a request with tokens left and budget left must make progress"
        chunks.append(chunk)
        request.num_computed_tokens += chunk  # what the scheduler does once the step is planned
    assert chunks == [16, 16, 8], f"40 prompt tokens under a budget of 16 are computed as 16 + 16 + 8, got {chunks}"


@pytest.mark.exercise("ch03-num-new-tokens")
def test_without_chunked_prefill_a_prompt_longer_than_the_budget_gets_nothing() -> None:
    got = sched.num_tokens_to_schedule(make_request(prompt_len=17), 16, False)
    assert got == 0, (
        f"without chunked prefill a prompt is never split: 17 tokens do not fit in 16, so it gets 0 "
        f"and waits; got {got}"
    )


@pytest.mark.exercise("ch03-num-new-tokens")
@pytest.mark.parametrize("chunked", [True, False])
def test_a_decode_step_is_one_token_even_with_a_budget_of_one(chunked: bool) -> None:
    request = make_request(prompt_len=10, num_computed=10, outputs=1)  # prompt done, one token sampled
    got = sched.num_tokens_to_schedule(request, 1, chunked)
    assert got == 1, f"after its prompt, a request computes only its newest token (decode); got {got}"


@pytest.mark.exercise("ch03-num-new-tokens")
def test_a_resumed_request_recomputes_its_prompt_and_its_outputs() -> None:
    request = make_request(prompt_len=8, num_computed=0, outputs=3)  # preempted: its K/V are gone
    assert sched.num_tokens_to_schedule(request, 64, False) == 11, "8 prompt + 3 generated tokens have no K/V"
    assert sched.num_tokens_to_schedule(request, 5, True) == 5, "with chunked prefill the recompute is chunked too"


@pytest.mark.exercise("ch03-num-new-tokens")
@given(
    prompt_len=st.integers(1, 50),
    outputs=st.integers(0, 5),
    computed_share=st.floats(0, 1),
    budget=st.integers(1, 64),
    chunked=st.booleans(),
)
def test_never_more_than_the_budget_or_the_tokens_left(prompt_len, outputs, computed_share, budget, chunked) -> None:
    num_computed = int(computed_share * (prompt_len + outputs - 1))  # at least one token left
    request = make_request(prompt_len=prompt_len, num_computed=num_computed, outputs=outputs)
    left = request.num_tokens - num_computed
    got = sched.num_tokens_to_schedule(request, budget, chunked)
    assert 0 <= got <= min(left, budget), f"{got} tokens scheduled, but only {left} are left and the budget is {budget}"
    if chunked:
        assert got == min(left, budget), "with chunked prefill a request takes all it can: min(tokens left, budget)"
    else:
        assert got in (0, left), "without chunked prefill it is all the tokens left, or nothing"


@pytest.mark.exercise("ch03-num-new-tokens")
def test_the_scheduler_continues_a_chunked_prompt_in_the_next_step() -> None:
    scheduler = make_scheduler(budget=16)
    add_waiting(scheduler, 40)
    steps = [scheduler.schedule().num_scheduled_tokens for _ in range(3)]
    assert steps == [{"a": 16}, {"a": 16}, {"a": 8}], f"the prompt should be computed in chunks 16, 16, 8; got {steps}"


# -- ch03-schedule-waiting ----------------------------------------------------------------


@pytest.mark.exercise("ch03-schedule-waiting")
def test_waiting_requests_are_admitted_oldest_first_under_one_budget() -> None:
    scheduler = make_scheduler(budget=16)
    add_waiting(scheduler, 10, 10, 10)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 10, "b": 6}, "a fits whole, b gets the 6 tokens left (chunked), c nothing"
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a", "b"], "both are new to the model runner: NewRequestData"
    assert out.scheduled_cached_reqs == [], "no request here was seen by the model runner before"
    a, b = out.scheduled_new_reqs
    assert a.prompt_token_ids == list(range(100, 110)), "a new request carries its whole prompt to the runner"
    assert isinstance(a.sampling_params, SamplingParams), "... and its sampling parameters"
    assert (len(a.block_ids), len(b.block_ids)) == (3, 2), "10 tokens need 3 blocks of 4; 6 tokens need 2"
    assert [r.request_id for r in scheduler.running] == ["a", "b"], "admitted requests join the end of running"
    assert scheduler.requests["a"].status == RequestStatus.RUNNING, "an admitted request is RUNNING"
    assert [r.request_id for r in scheduler.waiting] == ["c"], "c stays waiting"


@pytest.mark.exercise("ch03-schedule-waiting")
def test_admission_stops_when_the_budget_is_exactly_used_up() -> None:
    scheduler = make_scheduler(budget=16)
    add_waiting(scheduler, 6, 10, 3)
    output = empty_output()
    left = scheduler._schedule_waiting(output, 16)
    assert output.num_scheduled_tokens == {"a": 6, "b": 10}, "6 + 10 tokens use the budget of 16 exactly"
    assert left == 0, f"_schedule_waiting returns the token budget left: 16 - 6 - 10 = 0, got {left}"
    assert [r.request_id for r in scheduler.waiting] == ["c"], "with no budget left c is not admitted, not even with 0 tokens"


@pytest.mark.exercise("ch03-schedule-waiting")
def test_no_seat_no_admission() -> None:
    scheduler = make_scheduler(max_seqs=2)
    add_waiting(scheduler, 3, 3, 3)
    out = scheduler.schedule()
    assert list(out.num_scheduled_tokens) == ["a", "b"], "max_num_seqs=2: only two requests may run at once"
    assert len(scheduler.waiting) == 1


@pytest.mark.exercise("ch03-schedule-waiting")
def test_without_chunked_prefill_a_prompt_that_does_not_fit_holds_the_queue() -> None:
    scheduler = make_scheduler(budget=64, chunked=False)
    add_waiting(scheduler, 40, 40, 5)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 40}, (
        "b (40 tokens) does not fit in the 24 left and may not be split, so admission stops there: "
        "c must not overtake b (first come, first served)"
    )
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]


@pytest.mark.exercise("ch03-schedule-waiting")
def test_a_request_without_free_blocks_holds_the_queue_and_takes_no_blocks() -> None:
    scheduler = make_scheduler(budget=64, num_blocks=4)  # 16 token slots
    add_waiting(scheduler, 12, 8, 2)  # a takes 3 blocks; b needs 2 but 1 is free; c would fit
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"a": 12}, "b finds too few free blocks; c must not overtake it"
    assert scheduler.kv_cache_manager.num_free_blocks == 1, "a request that was not admitted holds no blocks"
    assert scheduler.waiting[0].request_id == "b" and scheduler.waiting[0].status == RequestStatus.WAITING


@pytest.mark.exercise("ch03-schedule-waiting")
def test_a_resumed_request_is_sent_as_cached_data_marked_resumed() -> None:
    scheduler = make_scheduler(budget=64)
    add_waiting(scheduler, 8)
    request = scheduler.waiting[0]
    request.append_output_token(7)  # it ran, generated one token, then was preempted
    request.status = RequestStatus.PREEMPTED
    out = scheduler.schedule()
    assert out.scheduled_new_reqs == [], "the runner already knows a resumed request: no NewRequestData"
    assert [(c.req_id, c.resumed_from_preemption) for c in out.scheduled_cached_reqs] == [("a", True)], (
        "a resumed request is CachedRequestData with resumed_from_preemption=True, so the runner rebuilds its block table"
    )
    assert len(out.scheduled_cached_reqs[0].new_block_ids) == 3, "8 + 1 tokens are recomputed: 3 blocks of 4"
    assert out.num_scheduled_tokens == {"a": 9}
    assert request.status == RequestStatus.RUNNING
