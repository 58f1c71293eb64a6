"""Chapter 11 exercise: the engine core routes each step's outputs to several front ends.

With `--api-server-count`, one engine core serves several API processes, without processes here.

`EngineCoreProc` remembers which front end sent each request and sends every step's outputs
back split by front end; a refused request's error and a utility answer go to the asker. A
fake core stands in for `EngineCore`, so each test sees exactly what was queued for whom.
"""

from __future__ import annotations

import pytest

pytest.importorskip("zmq", reason="the engine-core process needs pyzmq")
msgspec = pytest.importorskip("msgspec")

from minivllm.engine.core_proc import EngineCoreProc  # noqa: E402
from minivllm.engine.serial_utils import (  # noqa: E402
    EngineCoreRequestType,
    UtilityRequest,
    encoder,
    request_to_wire,
)
from minivllm.engine.types import EngineCoreOutput, EngineCoreRequest  # noqa: E402
from minivllm.sampling_params import SamplingParams  # noqa: E402


class Frame:
    """What `recv_multipart(copy=False)` hands the input thread: an object with `.buffer`."""

    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)


class FakeCore:
    def __init__(self) -> None:
        self.requests: set[str] = set()
        self.next_outputs: list[EngineCoreOutput] = []

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests.add(request.request_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.requests -= set(request_ids)

    def step(self) -> list[EngineCoreOutput]:
        outputs, self.next_outputs = self.next_outputs, []
        return outputs

    def get_stats(self) -> str:
        return "stats"


def two_front_ends() -> tuple[EngineCoreProc, FakeCore]:
    core = FakeCore()
    proc = EngineCoreProc(core)
    proc.num_clients = 2  # what start_io_threads sets for two socket pairs
    return proc, core


def receive(proc: EngineCoreProc, client: int, request_type: EngineCoreRequestType, payload: object) -> None:
    """The input thread's part for one message, then the busy loop's."""
    proc._queue_message(client, Frame(request_type.value), Frame(encoder.encode(payload)))
    proc.process_input_queue()


def add(proc: EngineCoreProc, client: int, request_id: str) -> None:
    request = EngineCoreRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=4), 0.0)
    receive(proc, client, EngineCoreRequestType.ADD, request_to_wire(request))


def queued(proc: EngineCoreProc) -> list:
    items = []
    while not proc.output_queue.empty():
        items.append(proc.output_queue.get_nowait())
    return items


@pytest.mark.exercise("ch11-route-outputs")
def test_each_front_end_gets_the_outputs_of_its_own_requests():
    proc, core = two_front_ends()
    add(proc, 0, "a")
    add(proc, 1, "b")
    add(proc, 0, "c")
    core.next_outputs = [EngineCoreOutput("a", [7]), EngineCoreOutput("b", [8]), EngineCoreOutput("c", [9], finish_reason="length")]
    proc.process_engine_step()
    by_client = {message.client_index: [o.request_id for o in message.outputs] for message in queued(proc)}
    assert by_client == {0: ["a", "c"], 1: ["b"]}
    assert "c" not in proc.request_clients, "a finished request is forgotten"
    receive(proc, 1, EngineCoreRequestType.ABORT, ["b"])
    assert proc.request_clients == {"a": 0}, "an aborted request is forgotten"


def test_a_refused_request_and_a_utility_answer_go_to_the_asker():  # not the exercise: the input side
    proc, _ = two_front_ends()
    add(proc, 1, "dup")
    add(proc, 1, "dup")  # the fake core refuses a duplicate id, as the scheduler does
    (refused,) = queued(proc)
    assert refused.client_index == 1 and refused.outputs[0].error and refused.outputs[0].finish_reason == "error"
    receive(proc, 0, EngineCoreRequestType.UTILITY, UtilityRequest(5, "ping", []))
    (answer,) = queued(proc)
    assert answer.client_index == 0 and answer.utility_output.result == "pong"


def test_one_front_end_needs_no_map():
    proc = EngineCoreProc(FakeCore())  # num_clients 1: the common case keeps no per-request state
    add(proc, 0, "a")
    assert proc.request_clients == {}
    proc.engine_core.next_outputs = [EngineCoreOutput("a", [1])]
    proc.process_engine_step()
    (message,) = queued(proc)
    assert message.client_index == 0 and [o.request_id for o in message.outputs] == ["a"]
