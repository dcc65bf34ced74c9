"""`slimeflow deploy`: create the process work pool (if missing) and apply slimeflow's deployments.

Runs from any install of slimeflow (the deployments are declared in slimeflow.deployments.definitions, with
module-path entrypoints) and is idempotent: a second run updates the deployments and leaves the pool as it is.
A worker runs them: `prefect worker start --pool slimeflow`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from prefect import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound, PrefectHTTPStatusError
from prefect.schedules import Cron
from prefect.settings import PREFECT_API_URL
from prefect.types.entrypoint import EntrypointType
from prefect.workers.process import ProcessWorker

from slimeflow.deployments.definitions import POOL, specs

if TYPE_CHECKING:
    from slimeflow.deployments.definitions import DeploymentSpec

EXIT_ERROR = 1


class DeployError(Exception):
    """What stopped the deploy, and how to fix it."""


def ensure_pool(client, name: str) -> bool:
    """Create the process work pool `name` unless it exists; True when this call created it."""
    try:
        pool = client.read_work_pool(name)
    except ObjectNotFound:
        # The process worker's own job template, as `prefect work-pool create --type process` gives it:
        # without it the pool would ignore the deployments' job variables (working_dir).
        template = ProcessWorker.get_default_base_job_template()
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type="process", base_job_template=template))
        except ObjectAlreadyExists:  # created by someone else since we looked
            return False
        return True
    if pool.type != "process":
        raise DeployError(f"work pool {name!r} exists with type {pool.type!r}, not 'process'; "
                          f"pass --pool with another name, or delete it (`prefect work-pool delete {name}`)")
    return False


def apply(chosen: Sequence[DeploymentSpec], pool: str, working_dir: Path) -> list[tuple[str, str]]:
    """Ensure the pool, then create or update each deployment; returns [(full name, id)]."""
    with get_client(sync_client=True) as client:
        if ensure_pool(client, pool):
            print(f"created work pool {pool!r} (process)")
    applied = []
    for spec in chosen:
        deployment = spec.flow.to_deployment(
            name=spec.name, description=spec.description, parameters=spec.parameters, tags=list(spec.tags),
            schedules=[Cron(spec.cron, timezone="UTC", active=False)] if spec.cron else None,
            work_pool_name=pool, job_variables={"working_dir": str(working_dir)},
            entrypoint_type=EntrypointType.MODULE_PATH,
        )
        full_name = f"{spec.flow.name}/{spec.name}"
        try:
            applied.append((full_name, str(deployment.apply())))
        except PrefectHTTPStatusError as err:
            raise DeployError(f"the server refused deployment {full_name}: {err}") from None
    return applied


def _api_url() -> str:
    url = PREFECT_API_URL.value()
    if not url:
        raise DeployError("no Prefect server to deploy to: PREFECT_API_URL is not set. Start one "
                          "(`prefect server start`) and point at it: "
                          "`prefect config set PREFECT_API_URL=http://127.0.0.1:4200/api`")
    return url


def main(argv: Sequence[str] = ()) -> int:
    every = specs()
    known = [s.name for s in every]
    parser = argparse.ArgumentParser(prog="slimeflow deploy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"deployments to apply (default: all of {', '.join(known)})")
    parser.add_argument("--pool", default=POOL, help=f"process work pool name (default: {POOL})")
    parser.add_argument("--working-dir", type=Path, default=Path.cwd(),
                        help="directory the worker runs flows in; relative paths such as runs/<name> resolve "
                             "there; it must exist on the worker's machine (default: this directory)")
    args = parser.parse_args(list(argv))
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown deployment {', '.join(map(repr, unknown))}; "
                     f"the deployments are {', '.join(known)}")
    try:
        url = _api_url()
        print(f"deploying to {url}")
        chosen = [s for s in every if not args.names or s.name in args.names]
        for name, deployment_id in apply(chosen, args.pool, args.working_dir.resolve()):
            print(f"applied {name} ({deployment_id})")
    except httpx.TransportError as err:
        print(f"slimeflow deploy: cannot reach the Prefect server at {url}: {err}; is `prefect server start` "
              "running there?", file=sys.stderr)
        return EXIT_ERROR
    except DeployError as err:
        print(f"slimeflow deploy: {err}", file=sys.stderr)
        return EXIT_ERROR
    print(f"run them with a worker: prefect worker start --pool {args.pool}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
