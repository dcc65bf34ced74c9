"""The command lines slimeflow starts SGLang servers and sglang-router with, from slime's flags.

SGLang server: `python -m sglang.launch_server` with what slime sets itself (model path, host, port, tp_size,
base GPU id, NCCL port, seed, ...) and every other `--sglang-X` flag passed as `--X`. Flags slime does not define
because it sets them (`--sglang-tp-size`, `--sglang-port`, ...) are refused by name (`SET_BY_SLIMEFLOW`).

sglang-router: every `--router-X` flag passed as `--X` over slime's defaults for a router in front of RL engines;
the few that would fight how slimeflow runs it are refused by name (`ROUTER_REFUSED`).

The API key never goes on a command line (any local user can read it): the launchers append it from the
environment, as launch.py does for the router.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
from collections.abc import Mapping
from typing import Any

SGLANG_API_KEY_ENV = "SLIMEFLOW_SGLANG_API_KEY"
# One `--api-key=KEY` word, as for the router (launch.py): a key starting with "-" would be read as a flag.
_SGLANG_WITH_KEY = (f"import os, runpy, sys; sys.argv += ['--api-key=' + os.environ.pop('{SGLANG_API_KEY_ENV}')]; "
                    "runpy.run_module('sglang.launch_server', run_name='__main__')")
SGLANG_READY_PATH = "/health_generate"
"""What slime waits for: the server has loaded the model and generated a token."""
SGLANG_READY_TIMEOUT_S = 1800.0
"""A large model loads for many minutes (slime waits without limit); a dead server is noticed at once."""

_FROM = "set by slimeflow"
SET_BY_SLIMEFLOW: dict[str, str] = {
    "model_path": f"{_FROM} from --hf-checkpoint",
    "tp_size": f"{_FROM} from --rollout-num-gpus-per-engine (divided by --sglang-pp-size)",
    "tensor_parallel_size": f"{_FROM} from --rollout-num-gpus-per-engine (divided by --sglang-pp-size)",
    "port": f"{_FROM}: a free port on the engine's node",
    "host": f"{_FROM}: the engine's node address",
    "nccl_port": f"{_FROM}: a free port on the engine's node",
    "base_gpu_id": f"{_FROM}: the first GPU of the engine's placement-group bundles",
    "gpu_id_step": f"{_FROM}: 1 (an engine's GPUs are consecutive)",
    "random_seed": f"{_FROM} from --seed, as slime: seed + engine rank x --num-gpus-per-node",
    "nnodes": "engines spanning several nodes are not supported yet",
    "node_rank": "engines spanning several nodes are not supported yet",
    "dist_init_addr": "engines spanning several nodes are not supported yet",
    "trust_remote_code": f"{_FROM}: always on, as slime",
    "skip_server_warmup": f"{_FROM}: always on, as slime",
    "enable_memory_saver": f"{_FROM} from --offload-rollout, as slime",
    "enable_return_routed_experts": "rollout routing replay is not supported yet",
    "config": "slime's --sglang-config (server groups from a YAML file) is not supported yet; give the server "
              "arguments as --sglang-* flags",
}
"""SGLang server arguments that are refused as --sglang-X flags, with the reason (slime does not define them)."""

_PD = "prefill/decode disaggregation is not supported yet"
_OWN_WORKERS = "the router's workers are the engines slimeflow starts (or --rollout-external-engine-addrs)"
ROUTER_REFUSED: dict[str, str] = {
    "api_key": "the router takes the engines' key: the run's own, or --sglang-api-key for external servers",
    "request_timeout_secs": "slime sets the router's timeout from --sglang-router-request-timeout-secs (default "
                            "14400), which overrides this one; use that flag",
    "pd_disaggregation": _PD, "prefill": _PD, "decode": _PD, "prefill_policy": _PD, "decode_policy": _PD,
    "prefill_selector": _PD, "decode_selector": _PD,
    "service_discovery": _OWN_WORKERS, "selector": _OWN_WORKERS, "service_discovery_port": _OWN_WORKERS,
    "service_discovery_namespace": _OWN_WORKERS,
}

ROUTER_DEFAULTS: dict[str, Any] = {
    # slime's, for a router in front of RL engines: quiet logs, earlier rebalancing, and no circuit breaker or
    # health check of the router's own (a slow engine under a long rollout is not a dead one).
    "log_level": "warn",
    "balance_abs_threshold": 10,
    "balance_rel_threshold": 1.2,
    "disable_circuit_breaker": True,
    "disable_health_check": True,
    # slimeflow's default before these flags existed; slime's is sglang-router's own, cache_aware.
    "policy": "round_robin",
}
ROUTER_TIMEOUT_DEFAULT_S = 14400
"""slime's --sglang-router-request-timeout-secs default."""


def to_flags(options: Mapping[str, Any]) -> list[str]:
    """`{"mem_fraction_static": 0.8, "enable_x": True, "buckets": ["1", "2"]}` -> `--mem-fraction-static 0.8
    --enable-x --buckets 1 2`: True is a bare flag, False and None leave the flag out, a list gives each value."""
    flags: list[str] = []
    for name, value in options.items():
        if value is None or value is False:
            continue
        flags.append("--" + name.replace("_", "-"))
        if value is not True:
            flags += [str(v) for v in value] if isinstance(value, list | tuple) else [str(value)]
    return flags


def sglang_server_command(python: str, model_path: str, *, host: str, port: int, nccl_port: int, num_gpus: int,
                          base_gpu_id: int, seed: int, server_args: Mapping[str, Any],
                          memory_saver: bool = False) -> list[str]:
    """`python -m sglang.launch_server` (through the key-appending launcher) for one engine of `num_gpus` GPUs
    starting at `base_gpu_id`: slime's settings, then `server_args` (the --sglang-* pass-through, e.g.
    mem_fraction_static). tp_size is num_gpus / pp_size, as slime computes it. `memory_saver`: --enable-memory-saver
    (slimeflow's, for --offload-rollout: the server can release its memory)."""
    bad = sorted(set(server_args) & set(SET_BY_SLIMEFLOW))
    if bad:
        raise ValueError(f"SGLang arguments that slimeflow sets itself: {', '.join(bad)}")
    pp_size = int(server_args.get("pp_size", 1))
    if num_gpus % pp_size:
        raise ValueError(f"--rollout-num-gpus-per-engine {num_gpus} is not a multiple of --sglang-pp-size {pp_size}")
    own = {"model_path": model_path, "host": host, "port": port, "nccl_port": nccl_port,
           "tp_size": num_gpus // pp_size, "base_gpu_id": base_gpu_id, "gpu_id_step": 1, "random_seed": seed,
           "trust_remote_code": True, "skip_server_warmup": True, **({"enable_memory_saver": True} if memory_saver else {})}
    return [python, "-c", _SGLANG_WITH_KEY, *to_flags(own), *to_flags(server_args)]


def router_options(router_args: Mapping[str, Any], request_timeout_secs: Any = None) -> dict[str, Any]:
    """sglang-router's options (names without the `router_` prefix): slime's defaults, then `router_args` (the
    --router-* flags); the request timeout from --sglang-router-request-timeout-secs."""
    return {**ROUTER_DEFAULTS, **router_args,
            "request_timeout_secs": request_timeout_secs if request_timeout_secs is not None
            else ROUTER_TIMEOUT_DEFAULT_S}


def router_flag_problems(router_args: Mapping[str, Any]) -> list[str]:
    """Each --router-X flag that sglang-router does not define (with the closest ones) or that is refused."""
    from sglang_router.launch_router import RouterArgs  # ~1 s of import: only when --router-* flags are given

    parser = argparse.ArgumentParser(add_help=False)
    RouterArgs.add_cli_args(parser, use_router_prefix=False, exclude_host_port=True)
    known = {action.option_strings[0].removeprefix("--").replace("-", "_") for action in parser._actions}
    problems = []
    for name in sorted(router_args):
        flag = "--router-" + name.replace("_", "-")
        if name in ROUTER_REFUSED:
            problems.append(f"{flag}: not supported ({ROUTER_REFUSED[name]}); remove it")
        elif name not in known:
            close = difflib.get_close_matches(name, sorted(known - set(ROUTER_REFUSED)), n=3, cutoff=0.75)
            hint = f"; did you mean {' or '.join('--router-' + c.replace('_', '-') for c in close)}?" if close else ""
            problems.append(f"{flag}: sglang-router has no --{name.replace('_', '-')} option{hint}")
    return problems


def installed_server_args() -> set[str] | None:
    """The argument names of the installed SGLang's server (its ServerArgs fields); None where SGLang is not
    installed (the engines are then the embedded engine)."""
    if importlib.util.find_spec("sglang") is None:
        return None
    from sglang.srt.server_args import ServerArgs  # an optional dependency (GPU machines only)

    return {f.name for f in dataclasses.fields(ServerArgs)}


def server_arg_problems(server_args: Mapping[str, Any], known: set[str]) -> list[str]:
    """Each --sglang-X flag that is not an argument of the SGLang server (`known`: installed_server_args()), with the
    closest ones (slime drops such flags with a warning)."""
    problems = []
    for name in sorted(set(server_args) - known - set(SET_BY_SLIMEFLOW)):
        close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.75)
        hint = f"; did you mean {' or '.join('--sglang-' + c.replace('_', '-') for c in close)}?" if close else ""
        problems.append(f"--sglang-{name.replace('_', '-')}: the installed SGLang's server has no "
                        f"--{name.replace('_', '-')} argument{hint}")
    return problems
