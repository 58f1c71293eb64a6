"""`EngineCoreClient`: how the front end talks to the engine core, in three modes (chapter 02).

| client          | where the core runs                    | who uses it                                    |
|-----------------|----------------------------------------|------------------------------------------------|
| `InprocClient`  | in this process; `get_output` steps it | `LLMEngine` with multiprocessing off (default) |
| `SyncMPClient`  | its own process; blocking calls        | `LLMEngine` with multiprocessing on            |
| `AsyncMPClient` | its own process; `async` calls         | `AsyncLLM`                                     |

A multi-process client makes a private folder (mode 0700), binds two sockets in it and starts
the core process (`core_proc.run_engine_core`), which connects to them:

    input   ROUTER (here, bind) ──▶ DEALER (core)   adds, aborts, utility calls
    output  PULL   (here, bind) ◀── PUSH   (core)   step outputs, utility answers, last words

One output thread per client reads the PULL socket and watches the core's process: outputs go
to a queue that `get_output` (or `get_output_async`) reads; if the process dies, an
`EngineDeadError` goes there instead, so whoever waits learns it at once. The sync and async
clients differ only in how that thread hands over: to a `queue.Queue`, or into the event loop.

pyzmq and msgspec are needed only by the multi-process clients. The offline path
(`InprocClient`) must run where they are not installed, so their import below may fail
quietly; asking for a multi-process client then raises an ImportError that says what to do.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import itertools
import logging
import multiprocessing
import multiprocessing.util  # registers multiprocessing's exit hook before ours (see MPClient)
import os
import queue
import select
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minivllm.config import EngineConfig
from minivllm.engine.core import EngineCore
from minivllm.engine.exceptions import EngineDeadError
from minivllm.engine.types import EngineCoreOutput, EngineCoreRequest, EngineCoreStats

try:  # Only the multi-process clients need pyzmq and msgspec; the offline path runs without them.
    import msgspec
    import zmq

    from minivllm.engine import serial_utils as wire
    from minivllm.engine.core_proc import ENGINE_IDENTITY, make_socket, run_engine_core
except ImportError as err:  # raised again, with advice, if a multi-process client is asked for
    _MP_IMPORT_ERROR: ImportError | None = err
else:
    _MP_IMPORT_ERROR = None

logger = logging.getLogger("minivllm")

ENABLE_MULTIPROCESSING_ENV = "MINIVLLM_ENABLE_MULTIPROCESSING"  # vLLM: VLLM_ENABLE_V1_MULTIPROCESSING
READY_TIMEOUT_ENV = "MINIVLLM_ENGINE_READY_TIMEOUT_S"
DEFAULT_READY_TIMEOUT_S = 300.0  # loading a large model onto a GPU takes minutes
# What EngineCore sets in __init__: readable through the client only when the core is in-process.
_CORE_ATTRIBUTES = frozenset({"config", "executor", "scheduler", "last_scheduler_output", "num_steps", "peak_num_blocks_used"})


def multiprocessing_enabled(override: bool | None = None) -> bool:
    """An explicit setting wins; otherwise MINIVLLM_ENABLE_MULTIPROCESSING (default: off)."""
    if override is not None:
        return override
    value = os.environ.get(ENABLE_MULTIPROCESSING_ENV, "0").strip().lower()
    if value not in ("0", "1", "false", "true", "no", "yes", "off", "on", ""):
        raise ValueError(f"{ENABLE_MULTIPROCESSING_ENV} must be 0 or 1, got {value!r}")
    return value in ("1", "true", "yes", "on")


# --8<-- [start:client-interface]
class EngineCoreClient:
    """What the front end needs from the engine core, wherever the core runs."""

    @staticmethod
    def make_client(
        multiprocess_mode: bool, asyncio_mode: bool, config: EngineConfig, attach_to: CoreAddresses | None = None
    ) -> EngineCoreClient:
        if asyncio_mode and not multiprocess_mode:
            raise ValueError("an asyncio front end needs the engine core in its own process, as in vLLM")
        if asyncio_mode:
            return AsyncMPClient(config, attach_to)
        return SyncMPClient(config) if multiprocess_mode else InprocClient(config)

    # Blocking calls: InprocClient, SyncMPClient.
    def get_output(self) -> list[EngineCoreOutput]:
        """The outputs of the core's next step (in-process: run that step now)."""
        raise NotImplementedError  # abstract: each client mode implements it

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError  # abstract: each client mode implements it

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError  # abstract: each client mode implements it

    def get_stats(self) -> EngineCoreStats:
        """A utility call: answered by the core between two steps."""
        raise NotImplementedError  # abstract: each client mode implements it

    def reset_prefix_cache(self) -> bool:
        """A utility call: forget every cached KV block; False while requests hold blocks."""
        raise NotImplementedError  # abstract: each client mode implements it

    # The same, for an event loop: AsyncMPClient.
    async def get_output_async(self) -> list[EngineCoreOutput]:
        raise NotImplementedError  # abstract: each client mode implements it

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError  # abstract: each client mode implements it

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        raise NotImplementedError  # abstract: each client mode implements it

    async def get_stats_async(self) -> EngineCoreStats:
        raise NotImplementedError  # abstract: each client mode implements it

    async def reset_prefix_cache_async(self) -> bool:
        raise NotImplementedError  # abstract: each client mode implements it

    def shutdown(self) -> None:
        raise NotImplementedError  # abstract: each client mode implements it
# --8<-- [end:client-interface]

    def __getattr__(self, name: str) -> Any:
        # Reached only for names the client lacks. The core's own attributes (read by
        # `minivllm run --trace` and tests) only InprocClient has: it overrides this.
        if name not in _CORE_ATTRIBUTES and not hasattr(EngineCore, name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise AttributeError(
            f"engine_core.{name} is not available: the engine core runs in another process "
            f"({ENABLE_MULTIPROCESSING_ENV}=1), so its scheduler and statistics cannot be read "
            f"from here (`minivllm run --trace` needs {ENABLE_MULTIPROCESSING_ENV}=0). "
            "The get_stats() utility call works in every mode."
        )


class InprocClient(EngineCoreClient):
    """The core in this process: each call is a method call, and `get_output` runs one step."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine_core = EngineCore(config)

    def get_output(self) -> list[EngineCoreOutput]:
        return self.engine_core.step()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_stats(self) -> EngineCoreStats:
        return self.engine_core.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine_core.shutdown()

    def __getattr__(self, name: str) -> Any:
        # In-process the client is transparent: `engine.engine_core.scheduler` is the core's.
        if name.startswith("_") or "engine_core" not in vars(self):
            raise AttributeError(name)
        return getattr(self.engine_core, name)


@dataclass
class BackgroundResources:
    """All an MP client must release. Kept apart from the client, so that the finalizer and the
    output thread can hold it without keeping the client alive (vLLM's pattern too)."""

    socket_dir: str | None = None
    ctx: Any = None  # zmq.Context
    process: Any = None  # multiprocessing.Process: the core this client started, and stops
    core: Any = None  # what is watched for the core's death: `process`, or an `AttachedCore`
    output_thread: threading.Thread | None = None
    wakeup_r: int = -1  # a pipe that wakes the output thread at shutdown
    wakeup_w: int = -1
    send_shutdown: Callable[[], None] | None = None  # asks the core to leave its busy loop
    engine_dead: EngineDeadError | None = None
    closing: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    # --8<-- [start:shutdown]
    def shutdown(self) -> None:
        """Stop the core process and remove every trace of it. Safe to call more than once."""
        with self.lock:
            if self.closing:
                return
            self.closing = True
        if self.wakeup_w >= 0:
            os.write(self.wakeup_w, b"x")
        if self.output_thread is not None and self.output_thread is not threading.current_thread():
            self.output_thread.join(timeout=2.0)
        process = self.process
        if process is not None:
            for stop in (self.send_shutdown, process.terminate):  # a SHUTDOWN message, then SIGTERM
                if process.is_alive() and stop is not None:
                    stop()
                    process.join(timeout=5.0)
            if process.is_alive():
                logger.warning("the engine core did not stop within 10 s; killing it")
                process.kill()
            process.join()
        if isinstance(self.core, AttachedCore):
            self.core.close()
        if self.ctx is not None:
            self.ctx.destroy(linger=0)  # closes both sockets
        for fd in (self.wakeup_r, self.wakeup_w):
            if fd >= 0:
                os.close(fd)
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)  # the socket files go with it
    # --8<-- [end:shutdown]


class AttachedCore:
    """An engine-core process this client did not start: several API server processes share one
    core, which their launcher owns (chapter 11). Its death is watched through a pidfd, a
    file descriptor that becomes readable when the process exits (Linux 5.3 and later)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.sentinel = os.pidfd_open(pid)
        self.exitcode = None  # only the parent learns it

    def is_alive(self) -> bool:
        return not select.select([self.sentinel], [], [], 0)[0]

    def join(self, timeout: float | None = None) -> None:
        select.select([self.sentinel], [], [], timeout)

    def close(self) -> None:
        os.close(self.sentinel)


@dataclass(frozen=True)
class CoreAddresses:
    """Where a front end finds a core it did not start: its two socket addresses (this front
    end binds them) and the core's pid."""

    input_address: str
    output_address: str
    core_pid: int


class MPClient(EngineCoreClient):
    """Start the core process (or attach to one), wait for its READY, and keep the sockets; the
    base of both MP clients."""

    def __init__(self, config: EngineConfig, attach_to: CoreAddresses | None = None) -> None:
        if _MP_IMPORT_ERROR is not None:
            raise ImportError(
                f"running the engine core in its own process needs pyzmq and msgspec ({_MP_IMPORT_ERROR}): "
                f"pip install pyzmq msgspec (the [mp] extra), or set {ENABLE_MULTIPROCESSING_ENV}=0"
            ) from _MP_IMPORT_ERROR
        self.resources = resources = BackgroundResources()
        # Shut down when the client is garbage-collected, or at interpreter exit. atexit runs
        # hooks last-registered-first, so this one runs before multiprocessing's own hook, which
        # would otherwise wait forever for the (non-daemon) core process to end by itself.
        self._finalizer = weakref.finalize(self, resources.shutdown)
        self._finalizer.atexit = False
        atexit.register(self._finalizer)
        if attach_to is None:
            # A private folder: only this user can reach the sockets (mkdtemp makes it 0700).
            resources.socket_dir = tempfile.mkdtemp(prefix="minivllm-engine-")
            input_address = f"ipc://{resources.socket_dir}/input.sock"
            output_address = f"ipc://{resources.socket_dir}/output.sock"
        else:  # the launcher made the folder and started the core, which connects to us
            input_address, output_address = attach_to.input_address, attach_to.output_address
        resources.ctx = zmq.Context()
        self.input_socket = make_socket(resources.ctx, zmq.ROUTER, input_address, bind=True)
        self.output_socket = make_socket(resources.ctx, zmq.PULL, output_address, bind=True)
        resources.wakeup_r, resources.wakeup_w = os.pipe()
        try:
            if attach_to is None:
                # spawn, not fork: a forked child would inherit this process's threads' locks and
                # any CUDA state, which is unsafe; spawn starts a fresh interpreter (as vLLM).
                resources.process = multiprocessing.get_context("spawn").Process(
                    target=run_engine_core, args=(config, [(input_address, output_address)]), name="MiniVllmEngineCore"
                )
                resources.process.start()
                resources.core = resources.process
            else:
                resources.core = AttachedCore(attach_to.core_pid)
            self.ready = self._wait_for_ready(float(os.environ.get(READY_TIMEOUT_ENV, DEFAULT_READY_TIMEOUT_S)))
        except BaseException:
            self.shutdown()
            raise
        if attach_to is None:
            # Not a bound method: the resources must not keep the client alive (see BackgroundResources).
            resources.send_shutdown = functools.partial(_send_shutdown, self.input_socket)
        self.utility_call_ids = itertools.count()
        self.pending_utility: dict[int, Any] = {}  # call id → the future its caller waits on

    # --8<-- [start:wait-for-ready]
    def _wait_for_ready(self, timeout_s: float) -> Any:
        """Wait for the core's handshake, its process's death, or the timeout, whichever is first."""
        process = self.resources.core
        poller = zmq.Poller()
        poller.register(self.input_socket, zmq.POLLIN)
        poller.register(process.sentinel, zmq.POLLIN)  # readable once the process has exited
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            events = dict(poller.poll(remaining * 1000))
            if process.sentinel in events and self.input_socket not in events:
                # It exited; its last message may still be on the way. Give it a moment.
                events = dict(poller.poll(500))
                if self.input_socket not in events:
                    process.join(timeout=1.0)
                    raise RuntimeError(
                        f"engine core failed to start: its process exited ({_describe_exit(process)}) "
                        "before it reported READY (its own error output, above, says why)"
                    )
            if self.input_socket in events:
                _identity, payload = self.input_socket.recv_multipart()
                message = wire.handshake_decoder.decode(payload)
                if isinstance(message, wire.EngineCoreStartupFailed):
                    last_line = message.error.strip().splitlines()[-1]
                    raise RuntimeError(
                        f"engine core failed to start: {last_line}\n\n"
                        f"--- traceback in the engine-core process ---\n{message.error}"
                    )
                return message
        raise RuntimeError(
            f"engine core failed to start: no READY within {timeout_s:g} s "
            f"(set {READY_TIMEOUT_ENV} to wait longer for a large model)"
        )
    # --8<-- [end:wait-for-ready]

    @property
    def process(self) -> Any:
        return self.resources.process

    def shutdown(self) -> None:
        self.resources.shutdown()
        self._finalizer.detach()
        atexit.unregister(self._finalizer)

    def ensure_alive(self) -> None:
        if self.resources.engine_dead is not None:
            raise EngineDeadError(str(self.resources.engine_dead))
        if self.resources.closing:
            raise EngineDeadError("the engine was shut down")

    def _send(self, request_type: Any, payload: Any) -> None:
        """Send one message to the core: [its identity, type, msgpack payload] on the ROUTER."""
        self.ensure_alive()
        try:
            self.input_socket.send_multipart([ENGINE_IDENTITY, request_type.value, wire.encoder.encode(payload)], copy=False)
        except zmq.ZMQError as err:  # ROUTER_MANDATORY: the core's socket is gone
            raise EngineDeadError(f"cannot reach the engine core: {err}") from err

    def _send_add(self, request: EngineCoreRequest) -> None:
        self._send(wire.EngineCoreRequestType.ADD, wire.request_to_wire(request))

    def _send_abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(wire.EngineCoreRequestType.ABORT, list(request_ids))

    def _send_utility(self, future: Any, method: str, args: tuple) -> None:
        """Ask the core to call `method(*args)`; the output thread will resolve `future`."""
        call_id = next(self.utility_call_ids)
        self.pending_utility[call_id] = future
        self._send(wire.EngineCoreRequestType.UTILITY, wire.UtilityRequest(call_id, method, list(args)))

    def _start_output_thread(self, deliver: Callable[[Any], None]) -> None:
        thread = threading.Thread(
            target=_read_outputs, args=(self.output_socket, self.resources, deliver), name="EngineCoreClientOutput", daemon=True
        )
        self.resources.output_thread = thread
        thread.start()


class SyncMPClient(MPClient):
    """Blocking calls to a core in another process: `LLMEngine` with multiprocessing on."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.outputs_queue: queue.Queue = queue.Queue()
        route = _make_router(self.outputs_queue, self.pending_utility, self.resources)
        self._start_output_thread(route)  # routes right in the output thread: all thread-safe

    def get_output(self) -> list[EngineCoreOutput]:
        item = self.outputs_queue.get()
        if isinstance(item, EngineDeadError):
            self.outputs_queue.put_nowait(item)  # every later call fails the same way
            raise EngineDeadError(str(item))
        return item

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send_add(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send_abort(request_ids)

    def call_utility(self, method: str, *args: Any) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send_utility(future, method, args)
        return _utility_result(method, future.result())

    def get_stats(self) -> EngineCoreStats:
        return msgspec.convert(self.call_utility("get_stats"), EngineCoreStats)

    def reset_prefix_cache(self) -> bool:
        return bool(self.call_utility("reset_prefix_cache"))


class AsyncMPClient(MPClient):
    """`async` calls to a core in another process: `AsyncLLM`. Use it from one event loop."""

    def __init__(self, config: EngineConfig, attach_to: CoreAddresses | None = None) -> None:
        super().__init__(config, attach_to)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.outputs_queue: asyncio.Queue | None = None

    def _ensure_started(self) -> None:
        """On the first call from the event loop: start the output thread, feeding this loop."""
        loop = asyncio.get_running_loop()
        if self.loop is loop:
            return
        if self.loop is not None:
            raise RuntimeError("this engine is already bound to another event loop")
        self.loop, self.outputs_queue = loop, asyncio.Queue()
        route = _make_router(self.outputs_queue, self.pending_utility, self.resources)
        self._start_output_thread(lambda item: loop.call_soon_threadsafe(route, item))

    async def get_output_async(self) -> list[EngineCoreOutput]:
        self._ensure_started()
        item = await self.outputs_queue.get()
        if isinstance(item, EngineDeadError):
            self.outputs_queue.put_nowait(item)
            raise EngineDeadError(str(item))
        return item

    def get_ready_outputs(self) -> list[EngineCoreOutput]:
        """The outputs of every step already delivered, without waiting (a dead core raises
        at the next `get_output_async`)."""
        outputs: list[EngineCoreOutput] = []
        while not self.outputs_queue.empty():
            item = self.outputs_queue.get_nowait()
            if isinstance(item, EngineDeadError):
                self.outputs_queue.put_nowait(item)
                break
            outputs += item
        return outputs

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._ensure_started()
        self._send_add(request)  # never blocks: the socket has no high-water mark

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self._ensure_started()
        self._send_abort(request_ids)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._ensure_started()
        future = self.loop.create_future()
        self._send_utility(future, method, args)
        return _utility_result(method, await future)

    async def get_stats_async(self) -> EngineCoreStats:
        return msgspec.convert(await self.call_utility_async("get_stats"), EngineCoreStats)

    async def reset_prefix_cache_async(self) -> bool:
        return bool(await self.call_utility_async("reset_prefix_cache"))


# --8<-- [start:read-outputs]
def _read_outputs(output_socket: Any, resources: BackgroundResources, deliver: Callable[[Any], None]) -> None:
    """The client's output thread: decode what the core sends; notice at once if it dies."""
    process = resources.core
    poller = zmq.Poller()
    poller.register(output_socket, zmq.POLLIN)
    poller.register(process.sentinel, zmq.POLLIN)  # readable once the process has exited
    poller.register(resources.wakeup_r, zmq.POLLIN)  # written by shutdown()
    try:
        while True:
            events = dict(poller.poll())
            if output_socket in events:  # read everything that arrived before looking further
                outputs = wire.outputs_decoder.decode(output_socket.recv(copy=False).buffer)
                if outputs.engine_dead is not None:
                    deliver(EngineDeadError(f"the engine core failed:\n{outputs.engine_dead}"))
                    return
                deliver(outputs.utility_output if outputs.utility_output is not None else outputs.outputs)
            elif resources.wakeup_r in events or resources.closing:
                return
            elif process.sentinel in events:
                deliver(EngineDeadError(f"the engine core process died unexpectedly ({_describe_exit(process)})"))
                return
    except RuntimeError:  # the event loop we deliver to was closed: nobody is listening
        return
# --8<-- [end:read-outputs]


def _make_router(outputs_queue: Any, pending_utility: dict[int, Any], resources: BackgroundResources) -> Callable[[Any], None]:
    """Where each delivered item goes: an answer to its utility caller; the rest to the queue."""

    def route(item: Any) -> None:
        if isinstance(item, wire.UtilityOutput):
            future = pending_utility.pop(item.call_id, None)
            if future is not None and not future.done():
                future.set_result(item)
            return
        if isinstance(item, EngineDeadError):
            resources.engine_dead = resources.engine_dead or item
            for future in list(pending_utility.values()):
                if not future.done():
                    future.set_exception(EngineDeadError(str(item)))
            pending_utility.clear()
        outputs_queue.put_nowait(item)

    return route


def _send_shutdown(input_socket: Any) -> None:
    try:
        input_socket.send_multipart([ENGINE_IDENTITY, wire.EngineCoreRequestType.SHUTDOWN.value, wire.encoder.encode(None)])
    except zmq.ZMQError:
        pass  # the core is already gone


def _utility_result(method: str, output: Any) -> Any:
    if output.error is not None:
        raise RuntimeError(f"utility call {method!r} failed in the engine core: {output.error}")
    return output.result


def _describe_exit(process: Any) -> str:
    process.join(timeout=1.0)
    if isinstance(process, AttachedCore):
        return f"pid {process.pid}; its launcher knows the exit code"
    code = process.exitcode
    if code is not None and code < 0:
        return f"exit code {code}: killed by {signal.Signals(-code).name}"
    return f"exit code {code}"

