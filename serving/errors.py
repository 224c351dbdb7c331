"""The OpenAI error envelope `{"error": {"message", "type", "param", "code"}}` for every failure: APIError for the
routes, and handlers turning FastAPI's validation errors (400), unknown routes (404, 405) and crashes (500) into it."""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answered with the envelope and `status` (with optional headers, e.g. Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
        self.headers = headers


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 naming the offending field."""
    return APIError(400, message, param=param, code=code)


MAX_MESSAGE_CHARS = 1024  # messages quote the offending value; an error answer stays small whatever was sent
MAX_PARAM_CHARS = 256


def clip(text: str, limit: int) -> str:
    """`text` cut in the middle to about `limit` characters (head and tail kept, the cut counted)."""
    if len(text) <= limit:
        return text
    head, tail = text[: limit * 2 // 3], text[-(limit // 4) :]
    return f"{head}...[{len(text) - len(head) - len(tail)} characters cut]...{tail}"


def envelope(
    status: int, message: str, param: str | None = None, code: str | None = None, type: str | None = None
) -> dict:
    t = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")
    message = clip(message, MAX_MESSAGE_CHARS)
    param = None if param is None else clip(param, MAX_PARAM_CHARS)
    return {"error": {"message": message, "type": t, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(envelope(err.status, err.message, err.param, err.code, err.type), err.status, err.headers)


def _loc(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p not in ("body",)]
    # pydantic names union members in the path (`stop.list[str].0`); keep the field path only
    parts = [p for p in parts if "[" not in p and p not in ("str", "int", "float", "bool")]
    return ".".join(parts) or None


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """A short message for pydantic errors: the first error, with its field path; unions report one line."""
    if not errors:
        return "invalid request", None
    e = errors[0]
    param = _loc(tuple(e.get("loc", ())))
    if e.get("type") == "extra_forbidden":
        return f"unrecognized request argument supplied: {param}", param
    if e.get("type") == "json_invalid":
        return f"request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    if e.get("type") == "missing":
        return f"missing required field: {param}", param
    msg = e.get("msg", "invalid value")
    return (f"{param}: {msg}" if param else msg), param


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None] | None = None) -> None:
    def count(status: int) -> None:
        if on_error is not None:
            on_error(status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        count(exc.status)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        count(400)
        msg, param = validation_message(list(exc.errors()))
        return JSONResponse(envelope(400, msg, param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        count(exc.status_code)
        msg = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        return JSONResponse(envelope(exc.status_code, msg), exc.status_code, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        count(500)
        return JSONResponse(envelope(500, f"internal error: {type(exc).__name__}"), 500)
