"""Every message between the front end and the engine-core process survives msgpack, typed.

Nothing is unpickled from a socket: each payload is decoded against its declared type, and a
payload of another shape is refused. Chapter 02 explains the wire format.
"""

from __future__ import annotations

import pickle
from dataclasses import fields

import pytest

msgspec = pytest.importorskip("msgspec", reason="the multi-process engine needs msgspec")

from minivllm.engine import serial_utils as su  # noqa: E402
from minivllm.engine.types import EngineCoreOutput, EngineCoreRequest, EngineCoreStats  # noqa: E402
from minivllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams  # noqa: E402


def every_field_set_params() -> SamplingParams:
    """Sampling parameters with no field left at its default, so a dropped field shows."""
    params = SamplingParams(
        n=3, presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2, temperature=0.7,
        top_p=0.9, top_k=40, min_p=0.05, seed=1234, stop=["\n\n", "END"], stop_token_ids=[7, 8],
        ignore_eos=True, max_tokens=77, min_tokens=3, logprobs=5, include_stop_str_in_output=True,
        skip_special_tokens=False, spaces_between_special_tokens=False, detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=StructuredOutputsParams(json={"type": "object", "required": ["a"]}),
    )
    params.all_stop_token_ids = {7, 8, 2}  # the engine adds the eos id (2) to the user's ids
    defaults = SamplingParams()
    same = [f.name for f in fields(SamplingParams) if getattr(params, f.name) == getattr(defaults, f.name)]
    assert not same, f"set these fields to non-default values too: {same}"
    return params


def test_add_request_round_trips_with_every_sampling_field():
    request = EngineCoreRequest("req-1", [5, 6, 7], every_field_set_params(), 1234.5)
    type_frame, payload = su.encode_request(request)
    assert su.EngineCoreRequestType(type_frame) is su.EngineCoreRequestType.ADD
    back = su.request_from_wire(su.add_decoder.decode(payload))
    assert back == request, "a field of EngineCoreRequest or SamplingParams was lost on the wire"
    assert back.sampling_params.all_stop_token_ids == {7, 8, 2}, "the eos ids the front end added must survive"
    assert isinstance(back.sampling_params.output_kind, RequestOutputKind)


def test_outputs_round_trip_with_logprobs_errors_and_utility_answers():
    outputs = su.EngineCoreOutputs(
        outputs=[
            EngineCoreOutput("a", [11], "stop", 11, [11, 3, 4], [-0.1, -1.5, -2.0], 1),
            EngineCoreOutput("b", [12, 13]),
            EngineCoreOutput("c", [], finish_reason="error", error="ValueError: bad top_p"),
        ]
    )
    assert su.outputs_decoder.decode(su.encoder.encode(outputs)) == outputs
    stats = EngineCoreStats(100, 90, 1, 2, 3, 10, 0)
    answer = su.EngineCoreOutputs(utility_output=su.UtilityOutput(4, result=stats))
    decoded = su.outputs_decoder.decode(su.encoder.encode(answer))
    assert msgspec.convert(decoded.utility_output.result, EngineCoreStats) == stats
    dead = su.EngineCoreOutputs(engine_dead="Traceback ...\nIndexError: index out of range")
    assert su.outputs_decoder.decode(su.encoder.encode(dead)) == dead


def test_abort_utility_and_handshake_messages_round_trip():
    assert su.abort_decoder.decode(su.encoder.encode(["1", "2"])) == ["1", "2"]
    call = su.UtilityRequest(7, "get_stats", [1, "x"])
    assert su.utility_decoder.decode(su.encoder.encode(call)) == call
    for message in (su.EngineCoreReady(num_gpu_blocks=64, max_model_len=256, pid=42), su.EngineCoreStartupFailed("boom")):
        decoded = su.handshake_decoder.decode(su.encoder.encode(message))
        assert decoded == message and type(decoded) is type(message), "the tagged union must keep the type"


def test_decoders_refuse_pickles_and_payloads_of_the_wrong_shape():
    pickled = pickle.dumps(EngineCoreRequest("x", [1], SamplingParams(), 0.0))
    with pytest.raises(msgspec.DecodeError):
        su.add_decoder.decode(pickled)
    with pytest.raises(msgspec.ValidationError):
        su.add_decoder.decode(su.encoder.encode({"request_id": "x"}))
    with pytest.raises(msgspec.ValidationError):
        su.abort_decoder.decode(su.encoder.encode([1, 2]))


def test_invalid_sampling_params_are_caught_when_the_core_rebuilds_them():
    params = SamplingParams(max_tokens=4)
    params.top_p = 5.0  # set after construction: SamplingParams never checked it
    wire = su.add_decoder.decode(su.encode_request(EngineCoreRequest("x", [1], params, 0.0))[1])
    assert wire.request_id == "x", "the request id must be readable, to fail that request alone"
    with pytest.raises(ValueError, match="top_p"):
        su.request_from_wire(wire)
