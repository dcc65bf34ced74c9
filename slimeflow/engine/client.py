"""An async client of SGLang's native HTTP API: the embedded engine, sglang-router and real SGLang servers alike.

Only SGLang endpoints are used, with one exception: `update_weights_from_tensor` sends the safetensors bytes of
HF-named tensors, which only the embedded engine reads (SGLang's endpoint takes pickled `serialized_named_tensors`
of handles, for processes on the sender's node: engine/tensor_ipc.py builds that body, sent with `control`).

With `api_key`, every request carries `Authorization: Bearer <key>`, as SGLang servers and sglang-router started
with `--api-key` (and the embedded engine started with one) require. Every call has a timeout. Connection failures (the request never reached a server) and 502/503 answers (a
router with no healthy worker) are retried `retries` times with backoff, then raise EngineUnavailableError.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import httpx
import orjson

if TYPE_CHECKING:
    import torch


class EngineUnavailableError(ConnectionError):
    """The engine URL did not answer (not running, wrong address, or too slow)."""


class EngineRequestError(RuntimeError):
    """The engine answered with an error status; `status` and the engine's `message` say why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"engine answered {status}: {message}")
        self.status = status
        self.message = message


_RETRY_STATUSES = (502, 503)


class EngineClient:
    """Calls one engine or router at `url` (e.g. http://127.0.0.1:30000); use as `async with` or call aclose()."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 600.0, retries: int = 3,
                 connect_timeout_s: float = 5.0, backoff_s: float = 0.5) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = httpx.Timeout(timeout_s, connect=min(connect_timeout_s, timeout_s))
        self.retries = retries
        self.backoff_s = backoff_s
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any] | None = None, *,
                       return_logprob: bool = True, rid: str | None = None) -> dict[str, Any]:
        """POST /generate for one prompt; SGLang's response dict (text, output_ids, meta_info)."""
        body: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params or {}),
                                "return_logprob": return_logprob}
        if rid is not None:
            body["rid"] = rid
        return await self._post_json("/generate", body)

    async def generate_batch(self, input_ids: list[list[int]], sampling_params: list[dict[str, Any]], *,
                             return_logprob: bool = True, rids: list[str] | None = None) -> list[dict[str, Any]]:
        """POST /generate for several prompts at once (SGLang's batch form: lists of input_ids, sampling_params
        and rid); one response dict per prompt, in order."""
        if len(sampling_params) != len(input_ids) or (rids is not None and len(rids) != len(input_ids)):
            raise ValueError(f"generate_batch: {len(input_ids)} prompts need as many sampling_params and rids")
        body: dict[str, Any] = {"input_ids": [list(ids) for ids in input_ids],
                                "sampling_params": [dict(p) for p in sampling_params],
                                "return_logprob": return_logprob}
        if rids is not None:
            body["rid"] = list(rids)
        return await self._post_json("/generate", body)

    async def health(self) -> bool:
        """True when GET /health answers 200; raises EngineUnavailableError when nothing answers."""
        await self._request("GET", "/health")
        return True

    async def weight_version(self) -> str:
        return (await self._request("GET", "/get_weight_version")).json()["weight_version"]

    async def abort(self, rid: str | None = None) -> dict[str, Any]:
        """Abort request `rid`, or every request when None; aborted requests return with finish_reason abort."""
        body = {"abort_all": True} if rid is None else {"rid": rid}
        response = await self._request("POST", "/abort_request", json=body)
        return response.json() if response.content else {}

    async def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> dict[str, Any]:
        """Load an HF safetensors directory that the engine can read at `path`."""
        body: dict[str, Any] = {"model_path": str(path)}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return (await self._request("POST", "/update_weights_from_disk", json=body)).json()

    async def update_weights_from_tensor(self, named_tensors: dict[str, torch.Tensor],
                                         weight_version: str) -> dict[str, Any]:
        """Send HF-named tensors (full or partial state dict) as safetensors bytes (embedded engine only)."""
        from safetensors.torch import save as save_safetensors  # here: the rollout side never needs torch

        payload = save_safetensors({name: t.detach().cpu().contiguous() for name, t in named_tensors.items()})
        return (await self._request("POST", "/update_weights_from_tensor", content=payload,
                                    params={"weight_version": weight_version},
                                    headers={"content-type": "application/octet-stream"})).json()

    async def weights_snapshot(self) -> tuple[dict[str, torch.Tensor], str]:
        """The HF-named tensors an embedded engine serves and their weight version (embedded engine only)."""
        from safetensors.torch import load as load_safetensors  # here: as in update_weights_from_tensor

        response = await self._request("GET", "/get_weights_snapshot")
        return load_safetensors(response.content), response.headers["x-weight-version"]

    async def control(self, path: str, body: dict[str, Any] | None = None) -> Any:
        """POST one of SGLang's control endpoints (/release_memory_occupation, /resume_memory_occupation,
        /pause_generation, /continue_generation, /init_weights_update_group, /update_weights_from_distributed,
        /destroy_weights_update_group, /flush_cache) with its JSON body; the JSON answer (None when empty)."""
        response = await self._request("POST", path, json=body or {})
        return orjson.loads(response.content) if response.content else None

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _post_json(self, path: str, body: Any) -> Any:
        """POST `body` as JSON and parse the JSON answer, with orjson both ways: httpx's `json=` and `.json()` use
        the standard library, which took ~1.5 ms of a 256-sample /generate round trip of ~10 ms."""
        response = await self._request("POST", path, content=orjson.dumps(body),
                                       headers={"content-type": "application/json"})
        try:
            return orjson.loads(response.content)
        except orjson.JSONDecodeError as err:
            raise EngineRequestError(response.status_code, f"{self.url}{path} answered with invalid JSON ({err}): "
                                     f"{response.text[:200]!r}") from None

    def _http(self) -> httpx.AsyncClient:
        # An httpx client is bound to the event loop it first ran on; a new loop (a new asyncio.run) gets a new one.
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            # Certificates matter to https URLs only: for http:// the client skips loading the CA bundle, which
            # took 20-50 ms of every new client (one per health probe, per event loop, per benchmark run).
            self._client = httpx.AsyncClient(timeout=self.timeout, limits=httpx.Limits(max_connections=None),
                                             verify=self.url.startswith("https://"), headers=self._headers)
            self._loop = loop
        return self._client

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                response = await self._http().request(method, self.url + path, **kwargs)
            except (httpx.ConnectError, httpx.ConnectTimeout) as err:
                last = f"{type(err).__name__}: {err}"
                continue
            except (httpx.TimeoutException, httpx.RemoteProtocolError, httpx.ReadError) as err:
                # The request may have reached the engine: retrying could run it twice, so give up now.
                raise self._unavailable(method, path, attempt + 1, f"{type(err).__name__}: {err}") from err
            if response.status_code in _RETRY_STATUSES:
                last = f"HTTP {response.status_code}: {response.text[:200]}"
                continue
            if response.status_code >= 400:
                raise EngineRequestError(response.status_code, _message(response))
            return response
        raise self._unavailable(method, path, self.retries + 1, last)

    def _unavailable(self, method: str, path: str, attempts: int, error: str) -> EngineUnavailableError:
        return EngineUnavailableError(
            f"rollout engine at {self.url} did not answer {method} {path} ({attempts} attempt(s), "
            f"timeout {self.timeout.read}s; last error: {error}). Is the engine (or sglang-router) running and "
            "listening there? Check --sglang-router-ip / --sglang-router-port, or the engine's log."
        )


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict):
        error = body.get("error")
        return str(error.get("message") if isinstance(error, dict) else body.get("message", body))
    return str(body)
