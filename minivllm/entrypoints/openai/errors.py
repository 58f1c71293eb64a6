"""Every failure as OpenAI's error object, with the status code the `openai` client expects.

    {"error": {"message": "...", "type": "BadRequestError", "param": null, "code": 400}}

400 for a bad request (a `ValueError` from validation anywhere on the path, a body that is
not JSON or does not fit the schema), 401 for a missing or wrong API key, 404 for an unknown
model or path, 503 when the engine is dead. A bad request changes nothing in the engine: it
is refused before anything is sent to the core, so the server keeps serving (chapter 11).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.engine.exceptions import EngineDeadError, EngineGenerateError

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """An error the handlers answer with its status code and message."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status_code, self.param = message, status_code, param


def error_body(message: str, status_code: int, param: str | None = None) -> dict[str, Any]:
    error_type = _ERROR_TYPES.get(status_code) or HTTPStatus(status_code).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": error_type, "param": param, "code": status_code}}


def error_response(message: str, status_code: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status_code, param), status_code=status_code)


def status_of(err: BaseException) -> int:
    """The HTTP status an exception from the serving code stands for."""
    if isinstance(err, OpenAIError):
        return err.status_code
    if isinstance(err, (ValueError, TypeError)):  # validation, anywhere on the request path
        return 400
    if isinstance(err, EngineDeadError):
        return 503
    return 500


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, err: OpenAIError) -> JSONResponse:
        return error_response(err.message, err.status_code, err.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(_: Request, err: RequestValidationError) -> JSONResponse:
        # FastAPI says 422; OpenAI (and vLLM) say 400 for any invalid request.
        first = err.errors()[0] if err.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return error_response(message, 400, where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(str(err.detail), err.status_code)

    @app.exception_handler(ValueError)
    async def _value_error(_: Request, err: ValueError) -> JSONResponse:
        return error_response(str(err), 400)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, err: EngineDeadError) -> JSONResponse:
        return error_response(f"the engine is not running: {err}", 503)

    @app.exception_handler(EngineGenerateError)
    async def _engine_refused(_: Request, err: EngineGenerateError) -> JSONResponse:
        return error_response(str(err), 500)
