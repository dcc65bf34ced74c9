"""Start the embedded engine and sglang-router as subprocesses, wait until they answer, always clean them up.

Every process is stopped by `.stop()`, by leaving its `with` block, when its handle is garbage-collected, or
at interpreter exit (a `weakref.finalize` each). Engines are also given `--parent-pid`, so an engine whose
launcher was killed outright shuts itself down.

Every engine serves behind an API key (`.api_key` of its handle; one is made when none is given): its callers
send it as `Authorization: Bearer <key>`. Keys reach the processes through their environment, never their
command line, which any local user can read.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from slimeflow.engine.guard import API_KEY_ENV
from slimeflow.engine.sglang_launch import to_flags

if TYPE_CHECKING:
    from slimeflow.engine.server import EngineThread

ENGINE_MODULE = "slimeflow.engine.server"
_LOG_TAIL_CHARS = 4000
# The router's key variable, read by a launcher that appends it to sglang-router's own arguments.
_ROUTER_API_KEY_ENV = "SLIMEFLOW_ROUTER_API_KEY"
# One `--api-key=KEY` word: a key that starts with "-" (token_urlsafe draws one in 64) would be read as a flag.
_ROUTER_WITH_KEY = (f"import os, sys; sys.argv += ['--api-key=' + os.environ.pop('{_ROUTER_API_KEY_ENV}')]; "
                    "from sglang_router.launch_router import main; main()")


def new_api_key() -> str:
    """A fresh per-run key for the engines, the router and their callers."""
    return secrets.token_urlsafe(32)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (another process may still take it before you bind it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _terminate(process: subprocess.Popen, log_file: Any) -> None:
    """Stop a child: SIGTERM, then SIGKILL after 10 s. Must not reference its handle (a finalizer calls it).

    The log of a child stopped here goes with it; the log of one that had already ended (a crash, a kill) stays on
    disk, where the errors that quote its tail point.
    """
    running = process.poll() is None
    if running:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    log_file.close()
    if running:
        Path(log_file.name).unlink(missing_ok=True)


class _ManagedProcess:
    """A child process writing to a temporary log file, stopped on stop(), exit of a with block, or exit."""

    kind = "process"

    def __init__(self, command: list[str], url: str, api_key: str | None = None,
                 key_env: str = API_KEY_ENV) -> None:
        """`api_key`: handed to the process as `$key_env`; wait_ready sends it too."""
        self.url = url
        self.command = command
        self.api_key = api_key
        self._key_env = key_env
        self._spawn()

    def _spawn(self) -> None:
        self._log = tempfile.NamedTemporaryFile(prefix=f"slimeflow-{self.kind}-", suffix=".log", delete=False)
        self.log_path = Path(self._log.name)
        env = {**os.environ, self._key_env: self.api_key} if self.api_key else None
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env)
        self._finalizer = weakref.finalize(self, _terminate, self.process, self._log)

    def kill(self) -> None:
        """SIGKILL the process (it stays a handle: exit_report and log_tail still answer)."""
        if self.process.poll() is None:
            self.process.kill()

    def restart(self) -> None:
        """SIGKILL the process (a hung one too: SIGTERM would wait for it) and start the same command again, at the
        same URL (the server binds its port with SO_REUSEADDR), with a new log file; `wait_ready` before use."""
        self.kill()
        self.stop()
        self._spawn()

    def log_tail(self, chars: int = _LOG_TAIL_CHARS) -> str:
        """The end of the process's combined stdout/stderr."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError as err:
            return f"<log {self.log_path} unreadable: {err}>"

    def exit_report(self, wait_s: float = 0.0) -> str | None:
        """None while the process runs (after waiting up to `wait_s` for it to end: a killed process closes its
        sockets before it can be reaped); else what ended it (exit code or signal), its URL and its log tail."""
        try:
            code = self.process.wait(wait_s) if wait_s > 0 else self.process.poll()
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            return None
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return f"{self.kind} at {self.url} {how}.\nlog tail ({self.log_path}):\n{self.log_tail()}"

    def wait_ready(self, path: str, timeout_s: float, ready: Any = None) -> None:
        """Poll GET url+path until it answers 200 (and `ready(response)` holds); stop the process on failure.

        One client for every poll: `httpx.get` builds a client, TLS context included, per call (25 ms of CPU each,
        taken from the imports of the process being waited for).
        """
        deadline = time.monotonic() + timeout_s
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        with httpx.Client(timeout=2.0, verify=self.url.startswith("https://"), headers=headers) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError(
                        f"{self.kind} exited with code {self.process.returncode} before answering "
                        f"{self.url}{path}.\ncommand: {' '.join(self.command)}\n"
                        f"log tail ({self.log_path}):\n{self.log_tail()}"
                    )
                try:
                    response = client.get(self.url + path)
                    if response.status_code == 200 and (ready is None or ready(response)):
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(
            f"{self.kind} did not answer {self.url}{path} within {timeout_s:.0f} s; raise timeout_s if the model "
            f"is large.\ncommand: {' '.join(self.command)}\nlog tail ({self.log_path}):\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """Terminate the process (idempotent)."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EngineProcess(_ManagedProcess):
    """An embedded engine server; `.url` is its base URL (http://host:port)."""

    kind = "engine"


class RouterProcess(_ManagedProcess):
    """An sglang-router load-balancing over engine URLs; `.url` is its base URL."""

    kind = "router"


ENGINE_READY_TIMEOUT_S = 120.0
PORT_ATTEMPTS = 3
PORT_TAKEN = "address already in use"
"""How a server's log says that its port was taken (uvicorn: "[Errno 98] error while attempting to bind on address
(...): address already in use")."""


def start_engine(model_path: str | Path, *, port: int | None = None, host: str = "127.0.0.1",
                 timeout_s: float = ENGINE_READY_TIMEOUT_S, **options: Any) -> EngineProcess:
    """Start `python -m slimeflow.engine.server` on `model_path` and wait until /health answers.

    `options` are the server's flags in Python spelling (max_batch_size=8, dtype="bfloat16", num_threads=1,
    weight_version="v0", seed=0, weights_dir=DIR, api_key=KEY: a new key when not given, `.api_key`).
    Raises RuntimeError (the server died) or TimeoutError, with its log tail.

    A port chosen here (`port` None) was free when chosen, but another process on the machine can bind it before
    the server does: a server that exits for that reason is started again on another port, up to PORT_ATTEMPTS
    times. A port the caller gave is the caller's to fix.
    """
    for attempt in range(1, PORT_ATTEMPTS + 1):
        engine = launch_engine(model_path, port=port, host=host, **options)
        try:
            engine.wait_ready("/health", timeout_s)
            return engine
        except RuntimeError as err:
            if port is not None or attempt == PORT_ATTEMPTS or PORT_TAKEN not in str(err).lower():
                raise
    raise AssertionError("unreachable: the last attempt returns or raises")


def launch_engine(model_path: str | Path, *, port: int | None = None, host: str = "127.0.0.1",
                  api_key: str | None = None, **options: Any) -> EngineProcess:
    """start_engine without the wait: the process is starting when this returns; `wait_ready("/health", ...)`
    before sending it work (its start-up, seconds of imports and loading, can overlap the caller's)."""
    port = port or free_port(host)
    command = [sys.executable, "-m", ENGINE_MODULE, *_engine_flags(model_path, host, port, options),
               "--parent-pid", str(os.getpid())]
    return EngineProcess(command, f"http://{host}:{port}", api_key or new_api_key())


def launch_engine_thread(model_path: str | Path, *, port: int | None = None, host: str = "127.0.0.1",
                         api_key: str | None = None, **options: Any) -> EngineThread:
    """launch_engine's in-process twin: the engine serves from a thread of this process (server.EngineThread),
    loading while this returns; same flags, same `url`, `api_key`, `wait_ready` and `stop`."""
    from slimeflow.engine.server import (
        EngineThread,  # here: the server imports torch, the driver imports this module
    )

    return EngineThread(_engine_flags(model_path, host, port or free_port(host), options), api_key or new_api_key())


def _engine_flags(model_path: str | Path, host: str, port: int, options: dict[str, Any]) -> list[str]:
    flags = ["--model-path", str(model_path), "--host", host, "--port", str(port)]
    for name, value in options.items():
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def start_router(worker_urls: list[str], *, port: int | None = None, host: str = "127.0.0.1",
                 policy: str = "round_robin", timeout_s: float = 60.0, api_key: str | None = None,
                 options: Mapping[str, Any] | None = None) -> RouterProcess:
    """Start sglang-router over `worker_urls` and wait until it lists every worker as registered.

    With `api_key` (the workers' key) the router is started with `--api-key`: it then requires the same Bearer key
    of its own callers (except /health) and sends it to the workers. `options`: more of its options, by name
    (sglang_launch.router_options: slime's defaults and the --router-* flags), over `policy`."""
    if not worker_urls:
        raise ValueError("start_router needs at least one worker URL")
    port = port or free_port(host)
    launcher = ["-c", _ROUTER_WITH_KEY] if api_key else ["-m", "sglang_router.launch_router"]
    command = [sys.executable, *launcher, "--worker-urls", *worker_urls, "--host", host, "--port", str(port),
               # its metrics on a free port of its host (the router's default, 29000, is taken by a second router on
               # the same machine, which then exits at start-up); --router-prometheus-port overrides it
               *to_flags({"policy": policy, "log_level": "warn", "prometheus_host": host,
                          "prometheus_port": free_port(host), **(options or {})})]
    router = RouterProcess(command, f"http://{host}:{port}", api_key, key_env=_ROUTER_API_KEY_ENV)
    router.wait_ready("/workers", timeout_s, ready=lambda r: _router_has(r, worker_urls))
    return router


def _router_has(response: httpx.Response, worker_urls: list[str]) -> bool:
    try:
        listed = str(response.json())
    except ValueError:
        return False
    return all(url in listed for url in worker_urls)
