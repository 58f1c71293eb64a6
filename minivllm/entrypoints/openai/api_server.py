"""The OpenAI-compatible server: a FastAPI app over one `AsyncLLM` (chapter 11).

    minivllm serve [MODEL] --port 8000 --api-key secret

A request's path: uvicorn parses HTTP → the API-key check (for `/v1/*` and the tokenizer
routes; `/health`, `/metrics`, `/version` stay open) → pydantic checks the body's shape →
the serving class checks its meaning and builds `SamplingParams` → `AsyncLLM.generate` (which
tokenizes, validates and sends the request to the engine core in its own process) → DELTA
outputs come back → one JSON response, or one SSE event per delta ending `data: [DONE]`.
Every failure on the way is OpenAI's error object (`errors.py`); none of them reaches the core.

If the client disconnects, its request is aborted in the core and its KV blocks freed: a
stream notices when starlette cancels it; a plain request is raced against a watcher that
waits for the client's `http.disconnect` (vLLM's `with_cancellation`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import minivllm
from minivllm.config import EngineConfig
from minivllm.engine.async_llm import AsyncLLM
from minivllm.engine.core_client import CoreAddresses
from minivllm.engine.core_proc import run_engine_core
from minivllm.entrypoints.openai.errors import error_response, install_error_handlers
from minivllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from minivllm.entrypoints.openai.serving_chat import OpenAIServingChat
from minivllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from minivllm.entrypoints.openai.serving_engine import sse_events
from minivllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from minivllm.metrics import CONTENT_TYPE, MULTIPROC_DIR_ENV, ServerMetrics

logger = logging.getLogger(__name__)

# Routes that need the API key when one is set; the rest are for load balancers and scrapers.
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


# --8<-- [start:build-app]
def build_app(engine: AsyncLLM, served_model_names: list[str], api_key: str | None = None) -> FastAPI:
    """The app: routes, error handlers, the API-key check. `engine` is shared by every request."""
    app = FastAPI(title="minivllm OpenAI-compatible server", version=minivllm.__version__)
    metrics = ServerMetrics(served_model_names[0])
    completion = OpenAIServingCompletion(engine, served_model_names, metrics)
    chat = OpenAIServingChat(engine, served_model_names, metrics)
    tokenization = OpenAIServingTokenization(engine, served_model_names)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.state.engine, app.state.metrics = engine, metrics

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        if body.stream:
            return await until_disconnected(request, stream_response(completion.stream_chunks(body)))
        return await until_disconnected(request, json_response(completion.full_response(body)))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        if body.stream:
            return await until_disconnected(request, stream_response(chat.stream_chunks(body)))
        return await until_disconnected(request, json_response(chat.full_response(body)))
    # --8<-- [end:build-app]

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        root = engine.config.model_config.model
        max_model_len = engine.config.model_config.max_model_len
        return ModelList(data=[ModelCard(id=name, root=root, max_model_len=max_model_len) for name in served_model_names])

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return tokenization.detokenize(body)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if engine.errored else 200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": minivllm.__version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        if not engine.errored:
            metrics.refresh_engine_stats(await engine.get_stats())
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


async def json_response(work: Awaitable[Any]) -> JSONResponse:
    return JSONResponse((await work).model_dump())


async def stream_response(work: Awaitable[Any]) -> StreamingResponse:
    return StreamingResponse(sse_events(await work), media_type="text/event-stream")


# --8<-- [start:until-disconnected]
async def until_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Run `work`, unless the client hangs up first: then cancel it (which aborts its request)."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not work_task.done():
            work_task.cancel()
        watcher.cancel()
    if work_task.cancelled():
        return Response(status_code=499)  # nginx's "client closed request": nobody will read it
    return work_task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the client hanging up.
    while (await request.receive())["type"] != "http.disconnect":
        pass
# --8<-- [end:until-disconnected]


# --8<-- [start:api-key]
# exercise[ch11-validate-api-key]: expect "Bearer <key>"; compare with hmac.compare_digest on bytes, never ==
def api_key_matches(authorization: str | None, api_key: str) -> bool:
    """Whether an `Authorization` header value carries `api_key` as `Bearer <api_key>`.

    A missing header, another scheme, or another key is False. The key is compared in
    constant time (`hmac.compare_digest`, on UTF-8 bytes): with `==`, which stops at the first
    differing character, response times would leak how much of a guessed key is right.
    """
    if authorization is None:
        return False
    scheme, _, credentials = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(credentials.strip().encode(), api_key.encode())
# --8<-- [end:api-key]


class APIKeyMiddleware:
    """401 for a protected route without the right `Authorization: Bearer <key>` header."""

    def __init__(self, app: Callable, api_key: str) -> None:
        self.app, self.api_key = app, api_key

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith(PROTECTED_PREFIXES):
            headers = dict(scope["headers"])
            authorization = headers.get(b"authorization")
            if not api_key_matches(authorization.decode("latin-1") if authorization is not None else None, self.api_key):
                response = error_response("a valid API key is needed: Authorization: Bearer <key>", 401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def run_server(engine: AsyncLLM, served_model_names: list[str], host: str, port: int, api_key: str | None = None) -> None:
    """Serve until interrupted, then stop the engine core."""
    import uvicorn

    app = build_app(engine, served_model_names, api_key)
    logger.info("serving %s on http://%s:%d/v1", served_model_names, host, port)
    try:
        uvicorn.run(app, host=host, port=port, log_level="info", timeout_keep_alive=5)
    finally:
        engine.shutdown()


# --8<-- [start:api-servers]
def run_api_servers(
    config: EngineConfig, served_model_names: list[str], host: str, port: int, api_key: str | None, count: int
) -> int:
    """`--api-server-count N`: one engine core process and N API server processes.

    One API process turns every token of every stream into an event (output processing, JSON,
    an HTTP write): at some tens of thousands of tokens a second it is busy all the time, and
    the server's bottleneck. So, as vLLM does, this launcher starts the core with one pair of
    sockets per API process, then N processes that each run an `AsyncLLM` attached to that core
    and a uvicorn server on the same port: the kernel hands each new connection to one of them. The core sends each request's outputs back to the
    process that sent the request. Metrics are kept in files that every process writes
    (Prometheus' multiprocess mode), so `/metrics` counts the whole server whichever process
    answers. The launcher itself only waits: when any process ends, it stops the others.
    """
    # Every API process listens on its own socket bound to the same port (SO_REUSEPORT), and the
    # kernel spreads new connections evenly over them. (One shared listening socket would let
    # whichever process wakes first accept a whole burst.) This one, bound but never listening,
    # holds the port meanwhile and fails early if it is taken; it receives no connections.
    port_guard = reuse_port_socket(host, port)
    socket_dir = tempfile.mkdtemp(prefix="minivllm-engine-")
    # The metrics files: the user's folder if one is set (kept afterwards), else a fresh one.
    own_metrics_dir = not os.environ.get(MULTIPROC_DIR_ENV)
    metrics_dir = tempfile.mkdtemp(prefix="minivllm-metrics-") if own_metrics_dir else os.environ[MULTIPROC_DIR_ENV]
    os.environ[MULTIPROC_DIR_ENV] = metrics_dir  # inherited; read when a child imports prometheus_client
    clients = [(f"ipc://{socket_dir}/input-{i}.sock", f"ipc://{socket_dir}/output-{i}.sock") for i in range(count)]
    spawn = multiprocessing.get_context("spawn")
    core = spawn.Process(target=run_engine_core, args=(config, clients), name="MiniVllmEngineCore")
    core.start()
    servers = [
        spawn.Process(
            target=run_api_server_process, name=f"MiniVllmApiServer-{i}",
            args=(config, CoreAddresses(*clients[i], core.pid), host, port, served_model_names, api_key),
        )
        for i in range(count)
    ]
    for server in servers:
        server.start()
    logger.info("serving %s on http://%s:%d/v1 from %d API server processes", served_model_names, host, port, count)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    status = 0
    try:
        multiprocessing.connection.wait([core.sentinel] + [server.sentinel for server in servers])
        ended = next(p for p in [core, *servers] if not p.is_alive())
        logger.error("%s exited (code %s); stopping the server", ended.name, ended.exitcode)
        status = 1
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        for process in [*servers, core]:  # API processes first: they finish their responses
            process.terminate()
        for process in [*servers, core]:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        port_guard.close()
        shutil.rmtree(socket_dir, ignore_errors=True)
        if own_metrics_dir:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return status


def run_api_server_process(
    config: EngineConfig, attach_to: CoreAddresses, host: str, port: int,
    served_model_names: list[str], api_key: str | None,
) -> None:
    """The main function of one API server process: an AsyncLLM on the shared core, and uvicorn."""
    import uvicorn

    engine = AsyncLLM(config, attach_to=attach_to)
    app = build_app(engine, served_model_names, api_key)
    listen_socket = reuse_port_socket(host, port)
    listen_socket.listen(2048)
    server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_keep_alive=5))
    try:
        server.run(sockets=[listen_socket])
    finally:
        engine.shutdown()  # closes this process's sockets; the launcher stops the core
# --8<-- [end:api-servers]


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) that other processes of this user may bind too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
