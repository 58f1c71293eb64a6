"""Chapter 03 exercise: the stop check after each sampled token (`check_stop`).

A request ends on a stop token (the model's eos, or one of the user's `stop_token_ids`), but
not before it has `min_tokens` output tokens; or it ends at its length limit, `max_tokens`
output tokens or `max_model_len` tokens in all. The exercised function is called through its
module (exercises/README.md).
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

EOS = 2
MAX_MODEL_LEN = 64


def params(**kwargs) -> SamplingParams:
    """Sampling parameters as the engine completes them: eos joins the stop tokens unless ignore_eos."""
    kwargs.setdefault("max_tokens", 16)
    sp = SamplingParams(**kwargs)
    sp.all_stop_token_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else {EOS})
    return sp


def running(prompt_len: int = 4, **kwargs) -> Request:
    request = Request("r", list(range(100, 100 + prompt_len)), params(**kwargs))
    request.status = RequestStatus.RUNNING
    return request


def append(request: Request, token_id: int, max_model_len: int = MAX_MODEL_LEN) -> bool:
    """Append a sampled token and ask check_stop, as update_from_output does."""
    request.append_output_token(token_id)
    return sched.check_stop(request, max_model_len)


@pytest.mark.exercise("ch03-check-stop")
def test_an_ordinary_token_does_not_stop_the_request() -> None:
    request = running()
    assert append(request, 5) is False, "5 is no stop token and no limit is reached"
    assert request.status == RequestStatus.RUNNING, "an unfinished request keeps its status"


@pytest.mark.exercise("ch03-check-stop")
def test_eos_stops_with_no_stop_reason() -> None:
    request = running()
    assert append(request, EOS) is True
    assert request.status == RequestStatus.FINISHED_STOPPED, "eos ends the request as 'stop'"
    assert request.stop_reason is None, "vLLM reports stop_reason None for eos: it is not one of the user's stop tokens"


@pytest.mark.exercise("ch03-check-stop")
def test_a_user_stop_token_stops_with_its_id_as_the_stop_reason() -> None:
    request = running(stop_token_ids=[9, 11])
    assert append(request, 11) is True
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == 11, "for a user stop token, stop_reason is the token id that stopped it"


@pytest.mark.exercise("ch03-check-stop")
def test_min_tokens_defers_a_stop_token() -> None:
    request = running(min_tokens=3)
    assert append(request, EOS) is False, "eos as the 1st output token, with min_tokens=3, must not stop the request"
    assert append(request, EOS) is False, "... nor as the 2nd"
    assert request.status == RequestStatus.RUNNING
    assert append(request, EOS) is True, "the 3rd output token reaches min_tokens: now eos stops it"
    assert request.status == RequestStatus.FINISHED_STOPPED


@pytest.mark.exercise("ch03-check-stop")
def test_ignore_eos_means_eos_is_an_ordinary_token() -> None:
    request = running(ignore_eos=True, stop_token_ids=[9])
    assert append(request, EOS) is False, "with ignore_eos, eos is not among all_stop_token_ids"
    assert append(request, 9) is True, "a user stop token still stops it"


@pytest.mark.exercise("ch03-check-stop")
def test_max_tokens_caps_the_output_length() -> None:
    request = running(max_tokens=3)
    assert [append(request, 5) for _ in range(3)] == [False, False, True], "the 3rd output token reaches max_tokens=3"
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED, "a length limit ends the request as 'length'"
    assert request.stop_reason is None


@pytest.mark.exercise("ch03-check-stop")
def test_max_model_len_caps_prompt_plus_output() -> None:
    request = running(prompt_len=10, max_tokens=100)
    assert append(request, 5, max_model_len=12) is False, "11 tokens in all, below max_model_len=12"
    assert append(request, 5, max_model_len=12) is True, "10 prompt + 2 output tokens reach max_model_len=12"
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


@pytest.mark.exercise("ch03-check-stop")
def test_a_stop_token_on_the_last_allowed_token_is_a_stop_not_a_length_cap() -> None:
    request = running(max_tokens=1, stop_token_ids=[9])
    assert append(request, 9) is True
    assert (request.status, request.stop_reason) == (RequestStatus.FINISHED_STOPPED, 9), (
        "the token was a stop token: finish_reason 'stop' with its stop_reason, though max_tokens was reached too"
    )


@pytest.mark.exercise("ch03-check-stop")
def test_the_scheduler_reports_the_finish_and_frees_the_blocks() -> None:
    scheduler = sched.Scheduler(SchedulerConfig(max_model_len=MAX_MODEL_LEN), KVCacheManager(10, 4))
    scheduler.add_request(EngineCoreRequest("r", [100, 101, 102], params(min_tokens=1, stop_token_ids=[9]), 0.0))
    out = scheduler.schedule()
    (output,) = scheduler.update_from_output(out, ModelRunnerOutput(["r"], [[9]]))
    assert (output.finish_reason, output.stop_reason) == ("stop", 9), "update_from_output reports what check_stop decided"
    assert not scheduler.has_unfinished_requests() and scheduler.kv_cache_manager.num_free_blocks == 10
