"""slime.backends.sglang_utils.external: SGLang servers started outside the run (--rollout-external-engine-addrs),
sized from their own /server_info as slime sizes them.

`discover_external_engines` and `apply_external_engine_info_to_args` are slime's: what each server reports (tensor,
pipeline, expert parallel sizes, its prefill/decode role) becomes slime's `args.rollout_external_engine_infos`,
`rollout_num_engines` and `rollout_num_gpus`. slimeflow's train stage talks to external servers itself (one HTTP
client per server URL, see stages/train/engines.py); it starts no Ray actor per server, so
`start_external_rollout_servers` says so instead of starting slime's SGLangEngine actors.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any
from urllib.parse import urlsplit

import requests

__all__ = ["ExternalEngineInfo", "ExternalRolloutServer", "apply_external_engine_info_to_args",
           "discover_external_engines", "external_engine_infos_from_args", "get_server_info",
           "normalize_external_engine_addr", "start_external_rollout_servers"]

logger = logging.getLogger(__name__)
SERVER_INFO_TIMEOUT_S = 30.0
SERVER_INFO_ENDPOINTS = ("/server_info", "/get_server_info")
"""The newer SGLang name first, then the older one (slimeflow's embedded engine answers both)."""
PD_ROLES = ("prefill", "decode")


def _size(info: dict[str, Any], *names: str) -> int | None:
    """The first of `names` that `info` gives a non-zero value for, as an int (None when none does)."""
    for name in names:
        if info.get(name):
            return int(info[name])
    return None


@dataclasses.dataclass(frozen=True)
class ExternalEngineInfo:
    """One external server: its base URL, host and port, role (regular, prefill, decode, encoder), devices, the
    prefill server's bootstrap port, and its /server_info answer."""

    url: str
    host: str
    port: int
    worker_type: str
    num_gpus: int
    disaggregation_bootstrap_port: int | None = None
    server_info: dict = dataclasses.field(default_factory=dict)

    @property
    def is_pd_worker(self) -> bool:
        return self.worker_type in PD_ROLES

    @property
    def parallel_config(self) -> dict[str, int]:
        """tp_size, pp_size, ep_size and moe_dp_size (missing ones 1; tp from the devices when not reported)."""
        info = self.server_info
        pp = _size(info, "pp_size", "pipeline_parallel_size") or 1
        return {"tp_size": _size(info, "tp_size", "tensor_parallel_size") or self.num_gpus // pp,
                "pp_size": pp,
                "ep_size": _size(info, "ep_size", "expert_parallel_size") or 1,
                "moe_dp_size": _size(info, "moe_dp_size", "moe_data_parallel_size") or 1}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def normalize_external_engine_addr(addr: str) -> str:
    """'host:port' or 'http://host:port' (trailing slash allowed) -> 'http://host:port'."""
    url = (addr if "://" in addr else f"http://{addr}").rstrip("/")
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None:
        raise ValueError(f"--rollout-external-engine-addrs: {addr!r} is not an SGLang server address; give "
                         "host:port or http://host:port (an IPv6 host in brackets)")
    return url


def get_server_info(url: str, timeout: float = SERVER_INFO_TIMEOUT_S) -> dict[str, Any]:
    """The server's /server_info answer (/get_server_info on older SGLang); RuntimeError naming both failures."""
    errors = []
    for endpoint in SERVER_INFO_ENDPOINTS:
        try:
            response = requests.get(f"{url}{endpoint}", timeout=timeout)
            response.raise_for_status()
            return response.json()
        except Exception as exc:  # any failure: try the other name, then report both
            errors.append(f"{endpoint}: {exc}")
    raise RuntimeError(f"external SGLang server {url} did not describe itself ({'; '.join(errors)}); check that it "
                       "is running and that --rollout-external-engine-addrs names its HTTP port")


def _worker_type(server_info: dict[str, Any]) -> str:
    if server_info.get("encoder_only"):
        return "encoder"
    mode = server_info.get("disaggregation_mode")
    return mode if mode in PD_ROLES else "regular"


def _engine_info(addr: str, timeout: float) -> ExternalEngineInfo:
    url = normalize_external_engine_addr(addr)
    parts = urlsplit(url)
    info = get_server_info(url, timeout=timeout)
    devices = _size(info, "num_gpus", "num_gpus_per_engine") or (
        (_size(info, "tp_size", "tensor_parallel_size") or 1) * (_size(info, "pp_size", "pipeline_parallel_size") or 1))
    bootstrap = info.get("disaggregation_bootstrap_port")
    return ExternalEngineInfo(url=url, host=str(parts.hostname), port=int(parts.port or 0),
                              worker_type=_worker_type(info), num_gpus=devices,
                              disaggregation_bootstrap_port=None if bootstrap is None else int(bootstrap),
                              server_info=info)


def discover_external_engines(addrs: list[str], timeout: float = SERVER_INFO_TIMEOUT_S) -> list[ExternalEngineInfo]:
    """One ExternalEngineInfo per address, in order, from each server's /server_info."""
    return [_engine_info(addr, timeout) for addr in addrs]


def apply_external_engine_info_to_args(args: Any, logger: logging.Logger | None = None) -> None:
    """Ask every server of args.rollout_external_engine_addrs and set args.rollout_external_engine_infos (dicts),
    rollout_num_engines and rollout_num_gpus (their devices, summed); the other flags are left as given."""
    addrs = getattr(args, "rollout_external_engine_addrs", None)
    if not addrs:
        raise ValueError("apply_external_engine_info_to_args needs --rollout-external-engine-addrs: the host:port of "
                         "every SGLang server started outside the run")
    infos = discover_external_engines(addrs)
    args.rollout_external_engine_infos = [info.to_dict() for info in infos]
    args.rollout_num_engines = len(infos)
    args.rollout_num_gpus = sum(info.num_gpus for info in infos)
    if logger is not None:
        logger.info("external SGLang servers: %s", [(info.url, info.worker_type, info.num_gpus) for info in infos])


def external_engine_infos_from_args(args: Any) -> list[ExternalEngineInfo]:
    """args.rollout_external_engine_infos back as ExternalEngineInfo records."""
    raw = getattr(args, "rollout_external_engine_infos", None)
    if raw is None:
        raise RuntimeError("args.rollout_external_engine_infos is not set: call apply_external_engine_info_to_args "
                           "first")
    return [info if isinstance(info, ExternalEngineInfo) else ExternalEngineInfo(**info) for info in raw]


@dataclasses.dataclass
class ExternalRolloutServer:
    """slime's record of a rollout server over external engines (its fields, for plug-ins that read them)."""

    engines: list
    engine_gpu_counts: list[int]
    engine_gpu_offsets: list[int]
    engine_parallel_configs: list[dict[str, int]]
    router_ip: str | None = None
    router_port: int | None = None
    model_name: str = "default"
    update_weights: bool = True
    num_new_engines: int = 0
    server_groups: list = dataclasses.field(default_factory=list)

    @property
    def all_engines(self) -> list:
        return self.engines


def start_external_rollout_servers(args: Any, *, start_router: Any) -> tuple[dict[str, ExternalRolloutServer], list]:
    """Refused: slime starts one Ray actor of its SGLangEngine per external server here; slimeflow's train stage
    reaches external servers over HTTP itself and has no such actor class."""
    raise NotImplementedError(
        "slime.backends.sglang_utils.external.start_external_rollout_servers starts slime's SGLangEngine Ray actors, "
        "which slimeflow does not have: give the servers to the run instead (--rollout-external-engine-addrs "
        "host:port ... with --sglang-weights-dir DIR), and slimeflow's train stage registers them with its router")
