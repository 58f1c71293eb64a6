"""The scheduler's rules, one small case each (chapter 03).

No model runs here: a fake model runner output stands in for sampling, so each test shows
exactly what `schedule()` and `update_from_output()` decide.
"""

from __future__ import annotations

import pytest

from minivllm.config import SchedulerConfig
from minivllm.engine.types import EngineCoreRequest
from minivllm.kv_cache.manager import KVCacheManager
from minivllm.request import RequestStatus
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler.output import ModelRunnerOutput, SchedulerOutput
from minivllm.scheduler.scheduler import Scheduler


def make_scheduler(budget=64, max_seqs=8, num_blocks=100, block_size=4, chunked=True, max_model_len=64):
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                             enable_chunked_prefill=chunked, max_model_len=max_model_len)
    return Scheduler(config, KVCacheManager(num_blocks, block_size))


def add(scheduler, request_id, prompt_len, **params):
    params.setdefault("max_tokens", 16)
    sp = SamplingParams(**params)
    sp.all_stop_token_ids = set(sp.stop_token_ids) | ({2} if not sp.ignore_eos else set())  # eos id 2
    scheduler.add_request(EngineCoreRequest(request_id, list(range(10, 10 + prompt_len)), sp, 0.0))


def run_step(scheduler, token=7) -> SchedulerOutput:
    """Schedule, then pretend the model sampled `token` for every request that finished its prompt."""
    so = scheduler.schedule()
    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for r in req_ids:
        request = scheduler.requests[r]
        sampled.append([token] if request.num_computed_tokens >= request.num_tokens else [])
    scheduler.update_from_output(so, ModelRunnerOutput(req_ids, sampled))
    return so


def test_waiting_requests_share_one_token_budget_and_the_last_is_chunked():
    s = make_scheduler(budget=16)
    for rid in "abc":
        add(s, rid, 10)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 10, "b": 6}, "a fits whole, b gets the 6 tokens left, c nothing"
    assert [r.req_id for r in so.scheduled_new_reqs] == ["a", "b"]
    assert len(s.waiting) == 1 and s.waiting[0].request_id == "c"


def test_a_chunked_prompt_continues_before_new_requests_are_admitted():
    s = make_scheduler(budget=16)
    for rid in "abc":
        add(s, rid, 10)
    run_step(s)
    so = run_step(s)
    # Running first: a decodes (1 token), b finishes its prompt (4 tokens), then c gets the rest.
    assert so.num_scheduled_tokens == {"a": 1, "b": 4, "c": 10}
    assert s.requests["b"].num_output_tokens == 1, "b sampled its first token once its prompt was complete"


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    s = make_scheduler(budget=64, chunked=False, max_model_len=64)
    add(s, "a", 40)
    add(s, "b", 40)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 40}, "b does not fit in the remaining 24 tokens and may not be split"


def test_max_num_seqs_caps_the_batch():
    s = make_scheduler(max_seqs=2)
    for rid in "abc":
        add(s, rid, 3)
    assert set(s.schedule().num_scheduled_tokens) == {"a", "b"}


def test_preemption_takes_the_last_running_request_and_queues_it_first():
    # 5 blocks of 4 tokens. a and b take 2 blocks each (prompt 8); decoding, each needs a 3rd.
    s = make_scheduler(num_blocks=5, block_size=4)
    add(s, "a", 8)
    add(s, "b", 8)
    run_step(s)
    assert s.kv_cache_manager.num_free_blocks == 1
    so = run_step(s)  # a takes the last free block; b finds none and is preempted
    assert so.preempted_req_ids == {"b"}
    assert so.num_scheduled_tokens == {"a": 1}
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [7], "a preempted request keeps the tokens it generated"
    assert s.waiting[0] is b, "the victim goes to the front of the queue"
    assert s.kv_cache_manager.get_block_ids("b") == [], "the victim's blocks are freed"


def test_a_preempted_request_is_resumed_with_its_outputs_recomputed():
    s = make_scheduler(num_blocks=5, block_size=4)
    add(s, "a", 8, max_tokens=2)
    add(s, "b", 8)
    run_step(s)
    run_step(s)  # b preempted; a finishes (max_tokens=2) and frees its 3 blocks
    assert "a" not in s.requests
    so = run_step(s)
    resumed = [r for r in so.scheduled_cached_reqs if r.req_id == "b"]
    assert resumed and resumed[0].resumed_from_preemption
    assert so.num_scheduled_tokens == {"b": 9}, "prompt (8) + the one generated token are recomputed"


def test_stop_on_eos_on_stop_token_and_on_max_tokens():
    s = make_scheduler()
    add(s, "eos", 3)
    add(s, "stop_id", 3, stop_token_ids=[7])
    add(s, "len", 3, max_tokens=1, ignore_eos=True)
    so = s.schedule()
    outs = s.update_from_output(so, ModelRunnerOutput(["eos", "stop_id", "len"], [[2], [7], [5]]))
    by_id = {o.request_id: o for o in outs}
    assert (by_id["eos"].finish_reason, by_id["eos"].stop_reason) == ("stop", None)
    assert (by_id["stop_id"].finish_reason, by_id["stop_id"].stop_reason) == ("stop", 7)
    assert by_id["len"].finish_reason == "length"
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.num_free_blocks == 100


def test_min_tokens_defers_eos():
    s = make_scheduler()
    add(s, "a", 3, min_tokens=2)
    so = s.schedule()
    out = s.update_from_output(so, ModelRunnerOutput(["a"], [[2]]))
    assert out[0].finish_reason is None, "eos before min_tokens must not stop the request"


def test_max_model_len_caps_generation():
    s = make_scheduler(max_model_len=12)
    add(s, "a", 10, max_tokens=100, ignore_eos=True)
    reasons = []
    while s.has_unfinished_requests():
        so = s.schedule()
        outs = s.update_from_output(so, ModelRunnerOutput(list(so.num_scheduled_tokens), [[5]]))
        reasons += [o.finish_reason for o in outs]
    assert reasons == [None, "length"], "10 prompt + 2 generated tokens reach max_model_len=12"


def test_abort_frees_blocks_of_waiting_and_running_requests():
    s = make_scheduler(budget=8)
    add(s, "run", 8)
    add(s, "wait", 8)
    s.schedule()
    s.finish_requests(["run", "wait"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.num_free_blocks == 100
    assert s.schedule().finished_req_ids == {"run", "wait"}, "the runner is told to drop their state"


def test_duplicate_request_id_is_rejected():
    s = make_scheduler()
    add(s, "a", 3)
    with pytest.raises(ValueError, match="already in use"):
        add(s, "a", 3)
