"""`slimeflow deploy`: create the process work pool (if missing) and apply prefect.yaml's deployments.

It reads the prefect.yaml that ships with slimeflow and applies each deployment through `prefect deploy`'s own
code, so it makes exactly what `prefect deploy --all` makes from a checkout; it only adds the work pool, which
`prefect deploy` expects to exist. It is idempotent: a second run updates the deployments in place (same ids, same
schedules) and leaves the pool as it is. A worker runs them: `prefect worker start --pool slimeflow`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from prefect import get_client
from prefect.cli.deploy._core import _run_single_deploy
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound, PrefectHTTPStatusError
from prefect.flows import load_flow_from_entrypoint
from prefect.settings import PREFECT_API_URL
from prefect.workers.process import ProcessWorker
from rich.console import Console

from slimeflow.deployments.definitions import PREFECT_YAML, DefinitionError, load, names

EXIT_ERROR = 1
SET_WORKING_DIRECTORY = "prefect.deployments.steps.set_working_directory"


class DeployError(Exception):
    """What stopped the deploy, and how to fix it."""


async def ensure_pool(client, name: str) -> bool:
    """Create the process work pool `name` unless it exists; True when this call created it."""
    try:
        pool = await client.read_work_pool(name)
    except ObjectNotFound:
        # The process worker's own job template, as `prefect work-pool create --type process` gives it.
        template = ProcessWorker.get_default_base_job_template()
        try:
            await client.create_work_pool(WorkPoolCreate(name=name, type="process", base_job_template=template))
        except ObjectAlreadyExists:  # created by someone else since we looked
            return False
        return True
    if pool.type != "process":
        raise DeployError(f"work pool {name!r} exists with type {pool.type!r}, not 'process'; "
                          f"pass --pool with another name, or delete it (`prefect work-pool delete {name}`)")
    return False


def prepare(configs: list[dict[str, Any]], actions: dict[str, Any], pool: str | None,
            working_dir: Path | None) -> list[dict[str, Any]]:
    """The chosen configs with --pool and --working-dir applied (as `prefect deploy --pool` and a
    set_working_directory pull step would); without them, exactly as prefect.yaml has them."""
    prepared = []
    for config in configs:
        config = {**config, "work_pool": dict(config.get("work_pool") or {})}
        if pool is not None:
            config["work_pool"]["name"] = pool
        if working_dir is not None:
            if config.get("pull") or actions.get("pull"):
                raise DeployError(f"{PREFECT_YAML} declares pull steps for {config['name']!r}: they say where the "
                                  "worker runs it, so --working-dir cannot; drop --working-dir or the pull steps")
            config["pull"] = [{SET_WORKING_DIRECTORY: {"directory": str(working_dir.resolve())}}]
        if not config["work_pool"].get("name"):
            raise DeployError(f"{PREFECT_YAML}: deployment {config['name']!r} names no work pool; pass --pool")
        prepared.append(config)
    return prepared


async def apply(configs: list[dict[str, Any]], actions: dict[str, Any], console: Console) -> list[tuple[str, str]]:
    """Ensure each named pool, then create or update each deployment as `prefect deploy` does; [(full name, id)]."""
    applied = []
    async with get_client() as client:
        for pool in dict.fromkeys(config["work_pool"]["name"] for config in configs):
            if await ensure_pool(client, pool):
                print(f"created work pool {pool!r} (process)")
        for config in configs:
            full_name = f"{load_flow_from_entrypoint(config['entrypoint']).name}/{config['name']}"
            try:
                await _run_single_deploy(config, actions, client=client, prefect_file=PREFECT_YAML, console=console,
                                         is_interactive=lambda: False)
            except (ValueError, PrefectHTTPStatusError) as err:
                raise DeployError(f"deployment {full_name}: {err}\n{console.export_text().strip()}") from None
            applied.append((full_name, str((await client.read_deployment_by_name(full_name)).id)))
    return applied


def _api_url() -> str:
    url = PREFECT_API_URL.value()
    if not url:
        raise DeployError("no Prefect server to deploy to: PREFECT_API_URL is not set. Start one "
                          "(`prefect server start`) and point at it: "
                          "`prefect config set PREFECT_API_URL=http://127.0.0.1:4200/api`")
    return url


def _parse(argv: Sequence[str], known: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="slimeflow deploy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"deployments to apply (default: all of {', '.join(known)})")
    parser.add_argument("--pool", help="process work pool to run them on (default: prefect.yaml's, slimeflow)")
    parser.add_argument("--working-dir", type=Path,
                        help="directory the worker runs flows in; relative paths such as runs/<name> resolve "
                             "there; it must exist on the worker's machine (default: this directory, as "
                             "`prefect deploy` makes it)")
    args = parser.parse_args(list(argv))
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown deployment {', '.join(map(repr, unknown))}; "
                     f"the deployments are {', '.join(known)}")
    return args


def main(argv: Sequence[str] = ()) -> int:
    try:
        configs, actions = load()
    except DefinitionError as err:
        print(f"slimeflow deploy: {err}", file=sys.stderr)
        return EXIT_ERROR
    args = _parse(argv, names(configs))
    # Prefect's messages are kept, and shown when a deployment fails.
    console = Console(record=True, quiet=True, width=120)
    try:
        url = _api_url()
        print(f"deploying {PREFECT_YAML} to {url}")
        chosen = prepare([c for c in configs if not args.names or c["name"] in args.names], actions,
                         args.pool, args.working_dir)
        for name, deployment_id in asyncio.run(apply(chosen, actions, console)):
            print(f"applied {name} ({deployment_id})")
    except httpx.TransportError as err:
        print(f"slimeflow deploy: cannot reach the Prefect server at {url}: {err}; is `prefect server start` "
              "running there?", file=sys.stderr)
        return EXIT_ERROR
    except DeployError as err:
        print(f"slimeflow deploy: {err}", file=sys.stderr)
        return EXIT_ERROR
    for pool in dict.fromkeys(config["work_pool"]["name"] for config in chosen):
        print(f"run them with a worker: prefect worker start --pool {pool}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
