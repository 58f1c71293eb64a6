"""Chapter 03 exercises: preemption by recompute, and choosing whom to preempt.

When the KV cache has no free block for a running request, the scheduler takes blocks back
from the most recently admitted running request (`Scheduler._allocate_or_preempt`) and sends
it back to the front of the waiting queue (`Scheduler._preempt`): its K/V are dropped, its
tokens are kept, and it is recomputed when it resumes. Exercised functions are called through
their class only (exercises/README.md).
"""

from __future__ import annotations

import pytest

import minivllm.scheduler.scheduler as sched
from minivllm.config import SchedulerConfig
from minivllm.engine.types import EngineCoreRequest
from minivllm.kv_cache.manager import KVCacheManager
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler.output import ModelRunnerOutput

BLOCK_SIZE = 4


def make_scheduler(num_blocks: int) -> sched.Scheduler:
    return sched.Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), KVCacheManager(num_blocks, BLOCK_SIZE))


def add_running(scheduler: sched.Scheduler, request_id: str, prompt_len: int, num_computed: int | None = None, outputs: int = 0) -> Request:
    """A running request whose first `num_computed` tokens (default: the prompt) have blocks and K/V."""
    request = Request(request_id, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=32))
    num_computed = prompt_len if num_computed is None else num_computed
    assert scheduler.kv_cache_manager.allocate_slots(request, num_computed) is not None, "test setup: pool too small"
    request.num_computed_tokens = num_computed
    for _ in range(outputs):
        request.append_output_token(7)
    request.status = RequestStatus.RUNNING
    scheduler.requests[request_id] = request
    scheduler.running.append(request)
    return request


# -- ch03-allocate-or-preempt -------------------------------------------------------------


@pytest.mark.exercise("ch03-allocate-or-preempt")
def test_with_free_blocks_nobody_is_preempted() -> None:
    scheduler = make_scheduler(num_blocks=6)
    a = add_running(scheduler, "a", 8, outputs=1)  # 2 blocks, and its 9th token needs a 3rd
    preempted: set[str] = set()
    new_block_ids = scheduler._allocate_or_preempt(a, 1, preempted)
    assert new_block_ids is not None and len(new_block_ids) == 1, "one more block holds the 9th token"
    assert preempted == set() and scheduler.running == [a], "nobody is preempted while blocks are free"


@pytest.mark.exercise("ch03-allocate-or-preempt")
def test_no_new_block_needed_returns_an_empty_list() -> None:
    scheduler = make_scheduler(num_blocks=2)
    a = add_running(scheduler, "a", 6, outputs=1)  # 2 blocks hold 8 slots; token 7 fits in them
    new_block_ids = scheduler._allocate_or_preempt(a, 1, set())
    assert new_block_ids == [], f"the 7th token fits in a's second block: no block added, nobody preempted; got {new_block_ids}"


@pytest.mark.exercise("ch03-allocate-or-preempt")
def test_the_most_recently_admitted_request_is_the_victim() -> None:
    scheduler = make_scheduler(num_blocks=6)
    a, b, c = (add_running(scheduler, rid, 8, outputs=1) for rid in "abc")  # 2 blocks each: pool full
    preempted: set[str] = set()
    new_block_ids = scheduler._allocate_or_preempt(a, 1, preempted)
    assert preempted == {"c"}, f"the last of running (c, admitted last) is preempted first, got {preempted}"
    assert scheduler.running == [a, b], "the victim leaves running"
    assert list(scheduler.waiting) == [c] and c.status == RequestStatus.PREEMPTED, "the victim is preempted (self._preempt)"
    assert new_block_ids is not None and len(new_block_ids) == 1, "with c's blocks back, a gets its block"


@pytest.mark.exercise("ch03-allocate-or-preempt")
def test_as_many_requests_are_preempted_as_needed() -> None:
    scheduler = make_scheduler(num_blocks=6)
    a = add_running(scheduler, "a", 20, num_computed=4)  # a long prompt, 4 tokens done (1 block)
    add_running(scheduler, "b", 8)  # 2 blocks
    add_running(scheduler, "c", 8)  # 2 blocks; 1 block stays free
    preempted: set[str] = set()
    new_block_ids = scheduler._allocate_or_preempt(a, 16, preempted)  # 20 tokens: 4 more blocks
    assert preempted == {"b", "c"}, "1 free block + c's 2 are not enough; b must go too"
    assert new_block_ids is not None and len(new_block_ids) == 4
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"], (
        "c was preempted first and b second; each went to the front, so the older b resumes first"
    )


@pytest.mark.exercise("ch03-allocate-or-preempt")
def test_the_victim_can_be_the_request_itself() -> None:
    scheduler = make_scheduler(num_blocks=4)
    a = add_running(scheduler, "a", 8, outputs=1)
    b = add_running(scheduler, "b", 8, outputs=1)  # pool full; b is the last of running
    preempted: set[str] = set()
    got = scheduler._allocate_or_preempt(b, 1, preempted)
    assert got is None, "b needs a block and the only request after it is b itself: it is preempted, None says so"
    assert preempted == {"b"} and scheduler.running == [a], "a, admitted earlier, is never preempted for b"
    assert scheduler.kv_cache_manager.get_block_ids("a") != [], "a keeps its blocks"
    assert list(scheduler.waiting) == [b]


# -- ch03-preempt -------------------------------------------------------------------------


@pytest.mark.exercise("ch03-preempt")
def test_preempt_frees_the_blocks_and_forgets_the_kv_but_keeps_the_tokens() -> None:
    scheduler = make_scheduler(num_blocks=8)
    r = add_running(scheduler, "r", 8, outputs=2)
    r.num_computed_tokens = 9  # the first output token already has K/V too
    scheduler.kv_cache_manager.allocate_slots(r, 1)
    scheduler.running.remove(r)  # the caller takes the victim out of running
    tokens_before = list(r.all_token_ids)
    scheduler._preempt(r)
    assert scheduler.kv_cache_manager.num_free_blocks == 8, "every block of the victim goes back to the pool"
    assert scheduler.kv_cache_manager.get_block_ids("r") == [], "the victim holds no blocks"
    assert r.status == RequestStatus.PREEMPTED
    assert r.num_computed_tokens == 0, "its K/V are gone, so none of its tokens count as computed"
    assert r.all_token_ids == tokens_before and r.output_token_ids == [7, 7], (
        "preemption by recompute keeps the prompt and the generated tokens: they are recomputed, not regenerated"
    )


@pytest.mark.exercise("ch03-preempt")
def test_a_preempted_request_goes_to_the_front_of_the_waiting_queue() -> None:
    scheduler = make_scheduler(num_blocks=8)
    waiting = [Request(rid, [1, 2, 3], SamplingParams()) for rid in ("x", "y")]
    scheduler.waiting.extend(waiting)
    r = add_running(scheduler, "r", 4)
    scheduler.running.remove(r)
    scheduler._preempt(r)
    assert [q.request_id for q in scheduler.waiting] == ["r", "x", "y"], (
        "the victim ran before x and y arrived in the queue: it resumes first"
    )


@pytest.mark.exercise("ch03-preempt")
def test_preemptions_are_counted_on_the_request_and_the_scheduler() -> None:
    scheduler = make_scheduler(num_blocks=8)
    r = add_running(scheduler, "r", 4)
    scheduler.running.remove(r)
    scheduler._preempt(r)
    assert (r.num_preemptions, scheduler.num_preemptions) == (1, 1), "one preemption, counted in both places"
    scheduler.waiting.remove(r)
    r.status = RequestStatus.RUNNING
    scheduler._preempt(r)
    assert (r.num_preemptions, scheduler.num_preemptions) == (2, 2)


@pytest.mark.exercise("ch03-preempt", "ch03-allocate-or-preempt")
def test_a_preempted_request_resumes_and_finishes_with_all_its_tokens() -> None:
    # 5 blocks of 4. a and b prefill 8 tokens each (2 blocks); decoding, each soon needs a 3rd.
    scheduler = make_scheduler(num_blocks=5)
    for rid in "ab":
        scheduler.add_request(EngineCoreRequest(rid, list(range(100, 108)), SamplingParams(max_tokens=3, ignore_eos=True), 0.0))
    preempted, finished = [], {}
    for _ in range(10):
        out = scheduler.schedule()
        preempted += sorted(out.preempted_req_ids)
        req_ids = list(out.num_scheduled_tokens)
        sampled = [[7] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens else [] for r in req_ids]
        for o in scheduler.update_from_output(out, ModelRunnerOutput(req_ids, sampled)):
            if o.finished:
                finished[o.request_id] = o.finish_reason
        if not scheduler.has_unfinished_requests():
            break
    assert preempted == ["b"], f"b, admitted last, is the one preempted when a needs a block; got {preempted}"
    assert finished == {"a": "length", "b": "length"}, "both requests finish all 3 tokens despite the preemption"
    assert scheduler.kv_cache_manager.num_free_blocks == 5, "every block is back once both finished"
