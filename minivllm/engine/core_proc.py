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
        # Several front ends (API server processes, chapter 11) may share this core: each has
        # its own pair of sockets, and a request's outputs go back to the one that sent it.
        self.num_clients = 1
        self.request_clients: dict[str, int] = {}  # request id -> client index (2+ clients only)

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
        if outputs and self.num_clients == 1:
            self.output_queue.put_nowait(EngineCoreOutputs(outputs=outputs))
        elif outputs:
            self._send_to_clients(outputs)
    # --8<-- [end:busy-loop]

    # --8<-- [start:send-to-clients]
    # exercise[ch11-route-outputs]: group by self.request_clients.get(id, 0) in step order; forget finished ids; one EngineCoreOutputs(outputs=..., client_index=...) per front end
    def _send_to_clients(self, outputs: list[EngineCoreOutput]) -> None:
        """Several front ends: one message per front end, with the outputs of its requests.

        `self.request_clients` maps a request id to the index of the front end that sent it
        (absent: 0). Put on `self.output_queue` one `EngineCoreOutputs(outputs=...,
        client_index=...)` per front end that has outputs in this step, its outputs in the
        order of `outputs`. A finished output (`finish_reason` set) is the request's last:
        remove its id from `self.request_clients`.
        """
        by_client: dict[int, list[EngineCoreOutput]] = {}
        for output in outputs:
            client = self.request_clients.get(output.request_id, 0)
            by_client.setdefault(client, []).append(output)
            if output.finish_reason is not None:
                self.request_clients.pop(output.request_id, None)
        for client, client_outputs in by_client.items():
            self.output_queue.put_nowait(EngineCoreOutputs(outputs=client_outputs, client_index=client))
    # --8<-- [end:send-to-clients]

    # --8<-- [start:handle-client-request]
    def _handle_client_request(self, request_type: EngineCoreRequestType, payload: Any) -> None:
        if request_type == EngineCoreRequestType.ADD:
            try:
                self.engine_core.add_request(payload)
            except Exception as err:  # e.g. a duplicate id: this request fails, the engine goes on
                logger.warning("request %s rejected by the engine core: %s", payload.request_id, err)
                failed = error_outputs([payload.request_id], f"{type(err).__name__}: {err}")
                failed.client_index = self.request_clients.pop(payload.request_id, 0)
                self.output_queue.put_nowait(failed)
        elif request_type == EngineCoreRequestType.ABORT:
            self.engine_core.abort_requests(payload)
            for request_id in payload:
                self.request_clients.pop(request_id, None)
        elif request_type == EngineCoreRequestType.UTILITY:
            answer = EngineCoreOutputs(utility_output=self._call_utility(payload), client_index=payload.client_index)
            self.output_queue.put_nowait(answer)
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
    def process_input_sockets(self, ctx: zmq.Context, input_addresses: list[str], ready: EngineCoreReady) -> None:
        """Input thread: say READY to every front end, then turn each message into an input-queue item."""
        sockets = [make_socket(ctx, zmq.DEALER, address, bind=False, identity=ENGINE_IDENTITY) for address in input_addresses]
        poller = zmq.Poller()
        for socket in sockets:
            socket.send(encoder.encode(ready))  # the handshake; it also tells the ROUTER our identity
            poller.register(socket, zmq.POLLIN)
        while True:
            for socket, _ in poller.poll():
                client = sockets.index(socket)
                type_frame, payload = socket.recv_multipart(copy=False)
                self._queue_message(client, type_frame, payload)

    def _queue_message(self, client: int, type_frame: Any, payload: Any) -> None:
        try:
            request_type = EngineCoreRequestType(bytes(type_frame.buffer))
            if request_type == EngineCoreRequestType.ADD:
                wire_request = add_decoder.decode(payload.buffer)
                if self.num_clients > 1:  # where its outputs must go
                    self.request_clients[wire_request.request_id] = client
                try:  # rebuilding re-validates the sampling parameters: done here, off the loop
                    item = request_from_wire(wire_request)
                except (ValueError, TypeError) as err:
                    failed = error_outputs([wire_request.request_id], f"{type(err).__name__}: {err}")
                    failed.client_index = self.request_clients.pop(wire_request.request_id, client)
                    self.output_queue.put_nowait(failed)
                    return
            elif request_type == EngineCoreRequestType.ABORT:
                item = abort_decoder.decode(payload.buffer)
            elif request_type == EngineCoreRequestType.UTILITY:
                item = utility_decoder.decode(payload.buffer)
                item.client_index = client
            else:
                item = None  # SHUTDOWN
        except (ValueError, msgspec.DecodeError) as err:  # not a message we know: drop it, say so
            logger.error("engine core: dropped a malformed message: %s", err)
            return
        self.input_queue.put_nowait((request_type, item))

    def process_output_sockets(self, ctx: zmq.Context, output_addresses: list[str]) -> None:
        """Output thread: send what the busy loop produced, until the core's last words."""
        # linger: at exit, keep trying for a while to deliver what is queued (the last words).
        sockets = [make_socket(ctx, zmq.PUSH, address, bind=False, linger_ms=4000) for address in output_addresses]
        while True:
            outputs = self.output_queue.get()
            message = encoder.encode(outputs)
            for socket in sockets if outputs.client_index < 0 else [sockets[outputs.client_index]]:
                socket.send(message, copy=False)
            if outputs.engine_dead is not None:
                return
    # --8<-- [end:io-threads]

    def start_io_threads(self, ctx: zmq.Context, clients: list[tuple[str, str]], ready: EngineCoreReady) -> None:
        self.num_clients = len(clients)
        input_addresses, output_addresses = [c[0] for c in clients], [c[1] for c in clients]
        # Daemon threads: they block in recv/get forever and must not keep the process alive.
        threading.Thread(
            target=self.process_input_sockets, args=(ctx, input_addresses, ready), name="EngineCoreInput", daemon=True
        ).start()
        self.output_thread = threading.Thread(
            target=self.process_output_sockets, args=(ctx, output_addresses), name="EngineCoreOutput", daemon=True
        )
        self.output_thread.start()

    def send_engine_dead(self, error: str) -> None:
        """The loop failed: tell the front end why, and give the output thread time to send it."""
        self.output_queue.put_nowait(EngineCoreOutputs(engine_dead=error, client_index=-1))
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
def run_engine_core(config: EngineConfig, clients: list[tuple[str, str]]) -> None:
    """The main function of the engine-core process; `clients` are the front ends' (input,
    output) socket addresses: one pair, or one per API server process."""
    _exit_on_signals()
    ctx = zmq.Context()
    try:
        engine_core = EngineCore(config)  # loads the model and allocates the KV cache
    except BaseException:
        error = traceback.format_exc()
        for input_address, _ in clients:
            _report_startup_failure(ctx, input_address, error)
        raise SystemExit(1)
    proc = EngineCoreProc(engine_core)
    ready = EngineCoreReady(
        num_gpu_blocks=config.cache_config.num_gpu_blocks, max_model_len=config.model_config.max_model_len, pid=os.getpid()
    )
    proc.start_io_threads(ctx, clients, ready)
    _exit_when_parent_dies(proc, clients[0][0])
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
