"""slime.utils.http_utils: `post` and `get` as slime's plug-ins call them (async, JSON, slime's retries).

`post` retries any failure (connection refused, HTTP error status) up to `max_retries` times, one second apart, and
then raises the last error, as slime's; an answer that is not JSON comes back as text. One httpx client per event
loop (a client's connections belong to the loop that opened them); it never goes through a system proxy.
`init_http_client(args)` (slime's name; slimeflow's rollout calls it) registers the API key of the engines
slimeflow started for the router's address, so a plug-in's `post` to it is authorised without knowing the key.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx

logger = logging.getLogger(__name__)
RETRY_DELAY_S = 1.0
_clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
_auth: dict[str, dict[str, str]] = {}
"""'http://host:port' -> the headers every request to it carries."""


def get_rollout_num_engines(args: Any) -> int:
    """The number of engines behind the router: args.rollout_num_engines (slimeflow sets it for plug-ins), else
    rollout_num_gpus // rollout_num_gpus_per_engine (at least 1; 0 without rollout GPUs), as slime."""
    if getattr(args, "rollout_num_engines", None) is not None:
        return int(args.rollout_num_engines)
    gpus = getattr(args, "rollout_num_gpus", None) or 0
    return 0 if gpus <= 0 else max(1, gpus // (getattr(args, "rollout_num_gpus_per_engine", None) or 1))


def init_http_client(args: Any) -> None:
    """Authorise requests to args' router with its API key (`args.sglang_api_key`), when it has one."""
    key = getattr(args, "sglang_api_key", None)
    if key and getattr(args, "sglang_router_ip", None):
        _auth[f"http://{args.sglang_router_ip}:{args.sglang_router_port}"] = {"Authorization": f"Bearer {key}"}


def _headers(url: str, headers: dict[str, str] | None) -> dict[str, str] | None:
    parts = httpx.URL(url)
    auth = _auth.get(f"{parts.scheme}://{parts.host}:{parts.port}")
    return {**auth, **(headers or {})} if auth else headers


def _client() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        for old in [old for old in _clients if old.is_closed()]:
            del _clients[old]
        client = _clients[loop] = httpx.AsyncClient(timeout=httpx.Timeout(None), trust_env=False)
    return client


async def post(url: str, payload: Any, max_retries: int = 60, headers: dict[str, str] | None = None) -> Any:
    """POST `payload` as JSON to `url`; the decoded JSON answer (text if it is not JSON)."""
    for attempt in range(1, max_retries + 1):
        try:
            response = await _client().post(url, json=payload or {}, headers=_headers(url, headers))
            response.raise_for_status()
            try:
                return json.loads(response.content)
            except json.JSONDecodeError:
                return response.text
        except Exception as exc:
            body = exc.response.text if isinstance(exc, httpx.HTTPStatusError) else None
            logger.info("Error: %s, retrying... (attempt %d/%d, url=%s, response=%s)", exc, attempt, max_retries,
                        url, body)
            if attempt >= max_retries:
                raise
            await asyncio.sleep(RETRY_DELAY_S)
    raise ValueError(f"post({url!r}): max_retries must be >= 1, got {max_retries}")


async def get(url: str) -> Any:
    """GET `url`; the decoded JSON answer (no retries, as slime's)."""
    response = await _client().get(url, headers=_headers(url, None))
    response.raise_for_status()
    return response.json()
