"""`EngineCoreProc`: the engine core in a process of its own, driven by a busy loop (chapter 02).

The front end (`SyncMPClient` or `AsyncMPClient` in `core_client.py`) starts this process with
`run_engine_core` as its main function. Three threads share the work, so that socket IO and
(de)serialization happen while the main thread is inside the model, where torch releases the
GIL:

    input thread   DEALER socket → decode msgpack → rebuild requests → input_queue
    main thread    the busy loop: apply inputs → EngineCore.step() → output_queue
    output thread  output_queue → encode msgpack → PUSH socket

Only the input thread touches the DEALER socket and only the output thread the PUSH socket:
ZMQ sockets must not be shared between threads. The queues between them are thread-safe.

Start-up is a handshake: the process builds its `EngineCore` (loads the model, sizes and
allocates the KV cache), then sends READY with the number of KV blocks on the input socket; if
building raised, it sends the traceback instead and exits. After that, a failure inside the
loop sends the traceback as the core's last words (`EngineCoreOutputs.engine_dead`).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import signal
import threading
import traceback
from typing import Any

import msgspec
import zmq

from minivllm.config import EngineConfig
from minivllm.engine.core import EngineCore
from minivllm.engine.serial_utils import (
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequestType,
    EngineCoreStartupFailed,
    UtilityOutput,
    UtilityRequest,
    abort_decoder,
    add_decoder,
    encoder,
    request_from_wire,
    utility_decoder,
)
from minivllm.engine.types import EngineCoreOutput

logger = logging.getLogger("minivllm")

# Every front end knows the core by this identity on its ROUTER socket (vLLM: the engine index).
ENGINE_IDENTITY = (0).to_bytes(2, "little")
# The utility calls a front end may make: a closed list, never an arbitrary attribute name.
UTILITY_METHODS = frozenset({"get_stats", "ping", "reset_prefix_cache"})


def error_outputs(request_ids: list[str], error: str) -> EngineCoreOutputs:
    """Fail these requests alone: finish_reason "error" and the reason, for their streams."""
    return EngineCoreOutputs(outputs=[EngineCoreOutput(rid, [], finish_reason="error", error=error) for rid in request_ids])


class EngineCoreProc:
    """The busy loop around one `EngineCore`, between an input queue and an output queue."""

    def __init__(self, engine_core: EngineCore) -> None:
        self.engine_core = engine_core
        self.input_queue: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
        self.output_queue: queue.Queue[EngineCoreOutputs] = queue.Queue()
        self.output_thread: threading.Thread | None = None

    # --8<-- [start:busy-loop]
    def run_busy_loop(self) -> None:
        """Forever: take in what the front end sent, then run one step if there is work."""
        while True:
            self.process_input_queue()
            self.process_engine_step()

    # exercise[ch02-busy-loop]: idle → block on input_queue.get() for one message; then drain with get_nowait until queue.Empty
    def process_input_queue(self) -> None:
        """Apply every message waiting in `self.input_queue`, in arrival order.

        Each queue item is a `(request_type, payload)` pair; apply it with
        `self._handle_client_request(request_type, payload)`. Two rules:

        - Never spin: if the core has no work (`self.engine_core.has_unfinished_requests()` is
          False), first block on the queue until one message arrives, and apply it.
        - Never wait while there is work: then take whatever else is queued *without blocking*
          (`get_nowait`, until `queue.Empty`) and return, so the next step runs at once.

        Everything queued before the call is applied before it returns, so a step always sees
        every add and abort that arrived before it.
        """
        if not self.engine_core.has_unfinished_requests():
            self._handle_client_request(*self.input_queue.get())  # idle: sleep until a message
        while True:
            try:
                request_type, payload = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle_client_request(request_type, payload)

    def process_engine_step(self) -> None:
        """One step of the core; its outputs go to the output thread (a step may have none)."""
        outputs = self.engine_core.step()
        if outputs:
            self.output_queue.put_nowait(EngineCoreOutputs(outputs=outputs))
    # --8<-- [end:busy-loop]

    # --8<-- [start:handle-client-request]
    def _handle_client_request(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        if request_type == EngineCoreRequestType.ADD:
            try:
                self.engine_core.add_request(payload)
            except Exception as err:  # e.g. a duplicate id: this request fails, the engine goes on
                logger.warning("request %s rejected by the engine core: %s", payload.request_id, err)
                self.output_queue.put_nowait(error_outputs([payload.request_id], f"{type(err).__name__}: {err}"))
        elif request_type == EngineCoreRequestType.ABORT:
            self.engine_core.abort_requests(payload)
        elif request_type == EngineCoreRequestType.UTILITY:
            self.output_queue.put_nowait(EngineCoreOutputs(utility_output=self._call_utility(payload)))
        elif request_type == EngineCoreRequestType.SHUTDOWN:
            raise SystemExit(0)  # leaves run_busy_loop; run_engine_core cleans up
        else:
            raise ValueError(f"unknown request type {request_type!r}")
    # --8<-- [end:handle-client-request]

    def _call_utility(self, call: UtilityRequest) -> UtilityOutput:
        if call.method not in UTILITY_METHODS:
            return UtilityOutput(call.call_id, error=f"unknown utility method {call.method!r}")
        try:
            return UtilityOutput(call.call_id, result=getattr(self, call.method)(*call.args))
        except Exception as err:
            return UtilityOutput(call.call_id, error=f"{type(err).__name__}: {err}")

    # -- utility methods (UTILITY_METHODS) ------------------------------------------------------

    def get_stats(self) -> Any:
        return self.engine_core.get_stats()

    def ping(self) -> str:
        return "pong"

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    # -- the IO threads -------------------------------------------------------------------------

    # --8<-- [start:io-threads]
    def process_input_socket(self, ctx: zmq.Context, input_address: str, ready: EngineCoreReady) -> None:
        """Input thread: say READY, then turn every message into an input-queue item."""
        socket = make_socket(ctx, zmq.DEALER, input_address, bind=False, identity=ENGINE_IDENTITY)
        socket.send(encoder.encode(ready))  # the handshake; it also tells the ROUTER our identity
        while True:
            type_frame, payload = socket.recv_multipart(copy=False)
            try:
                request_type = EngineCoreRequestType(bytes(type_frame.buffer))
                if request_type == EngineCoreRequestType.ADD:
                    wire_request = add_decoder.decode(payload.buffer)
                    try:  # rebuilding re-validates the sampling parameters: done here, off the loop
                        item = request_from_wire(wire_request)
                    except (ValueError, TypeError) as err:
                        self.output_queue.put_nowait(error_outputs([wire_request.request_id], f"{type(err).__name__}: {err}"))
                        continue
                elif request_type == EngineCoreRequestType.ABORT:
                    item = abort_decoder.decode(payload.buffer)
                elif request_type == EngineCoreRequestType.UTILITY:
                    item = utility_decoder.decode(payload.buffer)
                else:
                    item = None  # SHUTDOWN
            except (ValueError, msgspec.DecodeError) as err:  # not a message we know: drop it, say so
                logger.error("engine core: dropped a malformed message: %s", err)
                continue
            self.input_queue.put_nowait((request_type, item))

    def process_output_socket(self, ctx: zmq.Context, output_address: str) -> None:
        """Output thread: send what the busy loop produced, until the core's last words."""
        # linger: at exit, keep trying for a while to deliver what is queued (the last words).
        socket = make_socket(ctx, zmq.PUSH, output_address, bind=False, linger_ms=4000)
        while True:
            outputs = self.output_queue.get()
            socket.send(encoder.encode(outputs), copy=False)
            if outputs.engine_dead is not None:
                return
    # --8<-- [end:io-threads]

    def start_io_threads(self, ctx: zmq.Context, input_address: str, output_address: str, ready: EngineCoreReady) -> None:
        # Daemon threads: they block in recv/get forever and must not keep the process alive.
        threading.Thread(
            target=self.process_input_socket, args=(ctx, input_address, ready), name="EngineCoreInput", daemon=True
        ).start()
        self.output_thread = threading.Thread(
            target=self.process_output_socket, args=(ctx, output_address), name="EngineCoreOutput", daemon=True
        )
        self.output_thread.start()

    def send_engine_dead(self, error: str) -> None:
        """The loop failed: tell the front end why, and give the output thread time to send it."""
        self.output_queue.put_nowait(EngineCoreOutputs(engine_dead=error))
        if self.output_thread is not None:
            self.output_thread.join(timeout=5.0)


def make_socket(
    ctx: zmq.Context, socket_type: int, address: str, bind: bool, identity: bytes | None = None, linger_ms: int = 0
) -> zmq.Socket:
    """A socket with no high-water mark: never drop or block on a burst (vLLM does the same)."""
    socket = ctx.socket(socket_type)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.LINGER, linger_ms)
    if identity is not None:
        socket.setsockopt(zmq.IDENTITY, identity)
    if socket_type == zmq.ROUTER:
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished peer raises, not drops
    if bind:
        socket.bind(address)
    else:
        socket.connect(address)
    return socket


# --8<-- [start:run-engine-core]
def run_engine_core(config: EngineConfig, input_address: str, output_address: str) -> None:
    """The main function of the engine-core process."""
    _exit_on_signals()
    ctx = zmq.Context()
    try:
        engine_core = EngineCore(config)  # loads the model and allocates the KV cache
    except BaseException:
        _report_startup_failure(ctx, input_address, traceback.format_exc())
        raise SystemExit(1)
    proc = EngineCoreProc(engine_core)
    ready = EngineCoreReady(
        num_gpu_blocks=config.cache_config.num_gpu_blocks, max_model_len=config.model_config.max_model_len, pid=os.getpid()
    )
    proc.start_io_threads(ctx, input_address, output_address, ready)
    _exit_when_parent_dies(proc, input_address)
    try:
        proc.run_busy_loop()
    except SystemExit:  # the front end's SHUTDOWN message, or SIGTERM: a normal end
        pass
    except BaseException:
        logger.exception("the engine core failed")
        proc.send_engine_dead(traceback.format_exc())
        raise SystemExit(1)
    finally:
        engine_core.shutdown()
# --8<-- [end:run-engine-core]


def _report_startup_failure(ctx: zmq.Context, input_address: str, error: str) -> None:
    socket = make_socket(ctx, zmq.DEALER, input_address, bind=False, identity=ENGINE_IDENTITY, linger_ms=4000)
    socket.send(encoder.encode(EngineCoreStartupFailed(error)))
    socket.close()  # lingers until the message is out (or 4 s)


def _exit_on_signals() -> None:
    """SIGTERM ends the loop via SystemExit; SIGINT is left to the front end.

    SIGTERM is the front end's fallback: it asks with a SHUTDOWN message first, because a
    signal wakes the main thread only if the kernel delivers it to that thread, not to one of
    the others. Ctrl-C in a terminal sends SIGINT to every process of the group; the front end
    decides what it means (a REPL carries on), and stops the core if it exits.
    """

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _exit_when_parent_dies(proc: EngineCoreProc, input_address: str) -> None:
    """If the front end dies without shutting us down (e.g. SIGKILL), don't live on as an orphan.

    Its socket folder would stay behind too, so remove it on the way out.
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        shutil.rmtree(os.path.dirname(input_address.removeprefix("ipc://")), ignore_errors=True)
        proc.input_queue.put_nowait((EngineCoreRequestType.SHUTDOWN, None))

    threading.Thread(target=watch, name="EngineCoreParentWatch", daemon=True).start()
