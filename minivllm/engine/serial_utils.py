"""The wire format between the front end and the engine-core process: typed msgpack (chapter 02).

Every message that crosses a socket is msgpack, decoded against a declared type with msgspec
(vLLM does the same in `vllm/v1/serial_utils.py`). Why not pickle, which would take any Python
object as it is? Unpickling runs code chosen by whoever wrote the bytes, so a socket that
accepts pickles is a remote shell for anyone who can reach it. A typed decoder builds only the
declared structs, lists, numbers and strings, and rejects a message that does not fit.

The frames on the two sockets:

    front end → core  (ROUTER → DEALER)   [request type: 1 byte, msgpack payload]
    core → front end  (DEALER → ROUTER)   [msgpack EngineCoreReady | EngineCoreStartupFailed], once
    core → front end  (PUSH → PULL)       [msgpack EngineCoreOutputs]

`EngineCoreOutput` (a dataclass in `types.py`) travels as it is: msgspec encodes and decodes
dataclasses by their annotations. `EngineCoreRequest` cannot, because it holds a
`SamplingParams`, whose `__post_init__` (which msgspec would call) rebuilds
`all_stop_token_ids` and would drop the eos ids the front end added. So requests travel as
`EngineCoreRequestStruct`, and the core rebuilds the `SamplingParams` itself, which validates
them again: bad parameters fail their own request in the core, not the engine.

This module imports msgspec, so only the multi-process modules import it (`types.py` must not).
"""

from __future__ import annotations

import enum
import typing
from dataclasses import fields
from typing import Any

import msgspec

from minivllm.engine.types import EngineCoreOutput, EngineCoreRequest
from minivllm.sampling_params import SamplingParams, StructuredOutputsParams


class EngineCoreRequestType(bytes, enum.Enum):
    """The first frame of every front end → core message: what the payload is."""

    ADD = b"\x00"  # payload: EngineCoreRequestStruct
    ABORT = b"\x01"  # payload: list of request ids
    UTILITY = b"\x02"  # payload: UtilityRequest
    SHUTDOWN = b"\x03"  # no payload: leave the busy loop and exit


# --8<-- [start:wire-types]
# The sampling parameters' wire type is derived from the dataclass, field by field, so the two
# cannot drift apart when SamplingParams grows a field. array_like: fields by position, no names.
# StructuredOutputsParams travels the same way, as a struct of its fields: decoded without its
# __post_init__, and rebuilt (so validated) in `request_from_wire`, where an error fails only
# its own request.
StructuredOutputsStruct = msgspec.defstruct(
    "StructuredOutputsStruct",
    [(f.name, t) for f, t in zip(fields(StructuredOutputsParams), typing.get_type_hints(StructuredOutputsParams).values())],
    array_like=True,
)
_PARAM_TYPES = typing.get_type_hints(SamplingParams) | {"structured_outputs": StructuredOutputsStruct | None}
SamplingParamsStruct = msgspec.defstruct(
    "SamplingParamsStruct", [(f.name, _PARAM_TYPES[f.name]) for f in fields(SamplingParams)], array_like=True
)


class EngineCoreRequestStruct(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParamsStruct  # type: ignore[valid-type]
    arrival_time: float
    cache_salt: str | None = None


class UtilityRequest(msgspec.Struct, array_like=True):
    """Call `method(*args)` on the engine-core process; the answer comes back as a UtilityOutput."""

    call_id: int
    method: str
    args: list[Any] = []
    # Which front end asked (several API server processes, chapter 11): set by the core's
    # input thread from the socket the call came in on, so the answer goes back there.
    client_index: int = 0


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    error: str | None = None  # set when the call raised; the engine carries on


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything the core sends back: one step's outputs, a utility answer, or its last words."""

    outputs: list[EngineCoreOutput] = []
    utility_output: UtilityOutput | None = None
    engine_dead: str | None = None  # why the core is going down (a traceback); nothing follows
    # The front end these are for, when several share the core; -1: every one (last words).
    client_index: int = 0


class EngineCoreReady(msgspec.Struct, tag=True):
    """The handshake: the model is loaded and the KV cache allocated; requests may come."""

    num_gpu_blocks: int
    max_model_len: int
    pid: int


class EngineCoreStartupFailed(msgspec.Struct, tag=True):
    error: str  # the traceback of what went wrong in the core, as text
# --8<-- [end:wire-types]


HandshakeMessage = EngineCoreReady | EngineCoreStartupFailed


# --8<-- [start:converters]
def request_to_wire(request: EngineCoreRequest) -> EngineCoreRequestStruct:
    params = request.sampling_params
    values = {f.name: getattr(params, f.name) for f in fields(SamplingParams)}
    if params.structured_outputs is not None:
        so = params.structured_outputs
        values["structured_outputs"] = StructuredOutputsStruct(*(getattr(so, f.name) for f in fields(so)))
    wire_params = SamplingParamsStruct(**values)
    return EngineCoreRequestStruct(
        request.request_id, request.prompt_token_ids, wire_params, request.arrival_time, request.cache_salt
    )


def request_from_wire(struct: EngineCoreRequestStruct) -> EngineCoreRequest:
    """Rebuild the request; raises ValueError (naming the field) if its parameters are invalid."""
    values = msgspec.structs.asdict(struct.sampling_params)
    all_stop_token_ids = values.pop("all_stop_token_ids")
    if values["structured_outputs"] is not None:
        values["structured_outputs"] = StructuredOutputsParams(**msgspec.structs.asdict(values["structured_outputs"]))
    params = SamplingParams(**values)  # __post_init__ validates again, here in the core
    params.all_stop_token_ids = set(all_stop_token_ids)  # the engine's own field: restore it
    return EngineCoreRequest(struct.request_id, struct.prompt_token_ids, params, struct.arrival_time, struct.cache_salt)
# --8<-- [end:converters]


# One encoder and one typed decoder per payload type, made once: msgspec caches the schema in them.
encoder = msgspec.msgpack.Encoder()
add_decoder = msgspec.msgpack.Decoder(EngineCoreRequestStruct)
abort_decoder = msgspec.msgpack.Decoder(list[str])
utility_decoder = msgspec.msgpack.Decoder(UtilityRequest)
outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
handshake_decoder = msgspec.msgpack.Decoder(HandshakeMessage)


def encode_request(request: EngineCoreRequest) -> list[bytes]:
    """The frames of an ADD message."""
    return [EngineCoreRequestType.ADD.value, encoder.encode(request_to_wire(request))]
