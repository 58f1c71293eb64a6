"""Chapter 02 exercise: the engine-core process's busy loop, `EngineCoreProc.process_input_queue`.

A fake core stands in for `EngineCore`, so the tests see exactly what the loop did and when.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest

pytest.importorskip("zmq", reason="the engine-core process needs pyzmq")

from minivllm.engine.core_proc import EngineCoreProc  # noqa: E402
from minivllm.engine.serial_utils import EngineCoreRequestType, UtilityRequest  # noqa: E402
from minivllm.engine.types import EngineCoreRequest  # noqa: E402
from minivllm.sampling_params import SamplingParams  # noqa: E402

ADD, ABORT, UTILITY = EngineCoreRequestType.ADD, EngineCoreRequestType.ABORT, EngineCoreRequestType.UTILITY


class FakeCore:
    """Records what the busy loop asked of it; refuses a duplicate id like the real scheduler."""

    def __init__(self, running: tuple[str, ...] = ()) -> None:
        self.requests = set(running)
        self.log: list[tuple[str, str]] = []

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests.add(request.request_id)
        self.log.append(("add", request.request_id))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.requests -= set(request_ids)
        self.log += [("abort", request_id) for request_id in request_ids]

    def step(self) -> list:
        self.log.append(("step", ""))
        return []


def add(request_id: str) -> tuple:
    return ADD, EngineCoreRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=4), 0.0)


class LoopThread(threading.Thread):
    """Runs `process_input_queue` once; `join` re-raises what it raised, so no error hides in the thread."""

    def __init__(self, proc: EngineCoreProc) -> None:
        super().__init__(daemon=True)
        self.proc, self.error = proc, None

    def run(self) -> None:
        try:
            self.proc.process_input_queue()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            self.error = err

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error


def run_in_thread(proc: EngineCoreProc) -> LoopThread:
    thread = LoopThread(proc)
    thread.start()
    return thread


@pytest.mark.exercise("ch02-busy-loop")
def test_everything_queued_is_applied_in_order_before_returning():
    proc = EngineCoreProc(FakeCore())
    for item in (add("a"), add("b"), (ABORT, ["a"]), (UTILITY, UtilityRequest(1, "ping"))):
        proc.input_queue.put(item)
    thread = run_in_thread(proc)
    thread.join(timeout=5)
    assert not thread.is_alive(), "with messages queued and then work to do, it must return, not wait for more"
    assert proc.engine_core.log == [("add", "a"), ("add", "b"), ("abort", "a")], "inputs in arrival order, and no step"
    assert proc.input_queue.empty(), "every queued message must be taken before the step"
    answer = proc.output_queue.get_nowait()
    assert answer.utility_output.result == "pong", "a utility call is answered through the output queue"


@pytest.mark.exercise("ch02-busy-loop")
def test_with_work_to_do_it_never_waits_for_input():
    proc = EngineCoreProc(FakeCore(running=("r",)))
    thread = run_in_thread(proc)
    thread.join(timeout=2)
    if thread.is_alive():
        proc.input_queue.put((ABORT, []))  # unblock it, then fail
        pytest.fail("the core has a running request: waiting on an empty queue would stall every step")


@pytest.mark.exercise("ch02-busy-loop")
def test_when_idle_it_sleeps_on_the_queue_until_a_message_comes():
    proc = EngineCoreProc(FakeCore())
    thread = run_in_thread(proc)
    time.sleep(0.3)
    assert thread.is_alive(), "with nothing to do it must block on the queue (returning at once would spin the CPU)"
    proc.input_queue.put(add("late"))
    thread.join(timeout=5)
    assert not thread.is_alive(), "the message that arrived must wake it up"
    assert proc.engine_core.log == [("add", "late")]


@pytest.mark.exercise("ch02-busy-loop")
def test_a_refused_request_fails_alone_and_the_rest_are_applied():
    proc = EngineCoreProc(FakeCore())
    for item in (add("a"), add("a"), add("b")):
        proc.input_queue.put(item)
    proc.process_input_queue()
    assert proc.engine_core.log == [("add", "a"), ("add", "b")], "the requests after the refused one still get in"
    error = proc.output_queue.get_nowait().outputs[0]
    assert (error.request_id, error.finish_reason) == ("a", "error") and "already in use" in error.error
    with pytest.raises(queue.Empty):
        proc.output_queue.get_nowait()
