"""Who may call the engine and how much they may send: an ASGI layer in front of the routes.

The API key works as SGLang's `--api-key`: every request but `/health*` must carry `Authorization: Bearer <key>`
(401 otherwise), so one client serves the embedded engine, sglang-router started with `--api-key` and SGLang
servers alike. Request bodies are capped (413) from their Content-Length before anything is read, and while they
stream when they have none, so an oversized body costs neither memory nor parsing.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

API_KEY_ENV = "SLIMEFLOW_ENGINE_API_KEY"
"""How a launcher hands the key to an engine process: the environment is readable by the same user only, where a
command line (`--api-key`) shows in every local user's `ps`."""


class BodyTooLargeError(Exception):
    """A request body grew past its limit while streaming (the app's handler answers 413 with this message)."""


class Guard:
    """Wraps `app`: the API key check, then the body limit (`limits[path]`, else `max_body_bytes`)."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int,
                 limits: dict[str, tuple[int, str]] | None = None) -> None:
        """`limits`: per-path (bytes, how to fix) overriding the default, whose fix is --max-request-body-mb."""
        self.app = app
        self._expected = f"Bearer {api_key}".encode() if api_key else None
        self._default = (max_body_bytes, "raise the engine's --max-request-body-mb or send fewer prompts per request")
        self._limits = limits or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self._expected is not None and not path.startswith("/health") and not self._authorised(scope):
            await _reject(send, 401, f"{path} needs the engine's API key: send 'Authorization: Bearer <key>' "
                                     "(EngineClient(api_key=...)), the key the engine was started with (--api-key)")
            return
        limit, fix = self._limits.get(path, self._default)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _reject(send, 413, _too_large(path, f"{declared} bytes", limit, fix))
            return
        await self.app(scope, _capped(receive, limit, _too_large(path, f"over {limit} bytes", limit, fix)), send)

    def _authorised(self, scope: Scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return hmac.compare_digest(given, self._expected)


def _too_large(path: str, size: str, limit: int, fix: str) -> str:
    return f"the {path} request body is {size}, more than the engine's limit of {limit} bytes; {fix}"


def _content_length(scope: Scope) -> int | None:
    for key, value in scope["headers"]:
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _capped(receive: Receive, limit: int, message: str) -> Receive:
    """`receive` that raises BodyTooLargeError once the body read so far passes `limit`."""
    seen = 0

    async def capped() -> Message:
        nonlocal seen
        event = await receive()
        if event["type"] == "http.request":
            seen += len(event.get("body", b""))
            if seen > limit:
                raise BodyTooLargeError(message)
        return event

    return capped


async def _reject(send: Send, status: int, message: str) -> None:
    body = orjson.dumps({"error": {"message": message, "code": status}, "message": message, "success": False})
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
