"""Plain ASGI middlewares (they keep `request.is_disconnected()` and streaming intact): bearer API-key check on
every route but /health, and a request-body cap checked on Content-Length and on the bytes actually received."""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from netra_jax.serving.errors import envelope

OPEN_PATHS = frozenset({"/health"})


async def send_error(
    send: Send, status: int, message: str, headers: dict[str, str] | None = None, code: str | None = None
) -> None:
    body = json.dumps(envelope(status, message, code=code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` matches (constant-time compare). CORS preflights pass through."""

    def __init__(self, app: ASGIApp, api_key: str, on_error: Callable[[int], None] | None = None) -> None:
        self.app = app
        self.key = api_key.encode()
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        auth = b""
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                auth = v
                break
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        if self.on_error:
            self.on_error(401)
        await send_error(
            send,
            401,
            "invalid or missing API key (send 'Authorization: Bearer <key>')",
            {"WWW-Authenticate": "Bearer"},
            code="invalid_api_key",
        )


class BodyLimitMiddleware:
    """413 for bodies over `max_bytes`: at once when Content-Length says so, otherwise once the received bytes
    pass the cap (the body is buffered here, then replayed to the app, so the app never sees a partial body)."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_error: Callable[[int], None] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_error = on_error

    async def _reject(self, send: Send) -> None:
        if self.on_error:
            self.on_error(413)
        await send_error(
            send,
            413,
            f"request body exceeds the limit of {self.max_bytes} bytes",
            {"Connection": "close"},
            code="request_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    declared = -1
                if declared > self.max_bytes:
                    return await self._reject(send)
        chunks: list[bytes] = []
        total = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            total += len(body)
            if total > self.max_bytes:
                return await self._reject(send)
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
