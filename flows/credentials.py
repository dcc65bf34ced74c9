"""S3 credentials for a stage's storage, read where the stage runs: never from its parameters.

A flow run's parameters are stored by Prefect and shown in its UI, so the config says only where S3 is and, at
most, the name of a Prefect Secret block. The keys come from that block, else from the environment of the process
that runs the flow (the worker's, or the CLI's), else botocore's own chain (~/.aws, an instance role).
"""

from __future__ import annotations

from collections.abc import Mapping

from prefect.blocks.system import Secret
from pydantic import SecretStr

from slimeflow.config.base import replace
from slimeflow.config.infra import InfraConfig
from slimeflow.errors import ConfigError
from slimeflow.io.storage import S3Config

BLOCK_KEYS = ("access_key_id", "secret_access_key")


def s3_config(infra: InfraConfig, environ: Mapping[str, str]) -> S3Config:
    """Endpoint and region from the config over `environ`; the keys from the named Secret block, else `environ`."""
    found = infra.s3().merged_over(S3Config.from_env(environ))
    if infra.s3_credentials_block is None:
        return found
    key_id, secret = _block_keys(infra.s3_credentials_block)
    return replace(found, access_key_id=key_id, secret_access_key=SecretStr(secret))


def _block_keys(name: str) -> tuple[str, str]:
    where = f"infra.s3_credentials_block {name!r}"
    try:
        # The sync loader whatever the caller's context (a stage flow is sync; `load` alone picks by context).
        secret: Secret = Secret.load(name, _sync=True)  # type: ignore[call-arg,assignment]  # async_dispatch
        value = secret.get()
    except ValueError as err:  # Prefect's "Unable to find block document named ..."
        raise ConfigError([f"{where}: no Secret block of that name on the Prefect server ({err}); create it: "
                           f"Secret(value={{'access_key_id': ..., 'secret_access_key': ...}}).save({name!r}) "
                           "or in the UI under Blocks"]) from None
    if not isinstance(value, dict) or any(not isinstance(value.get(key), str) or not value[key] for key in BLOCK_KEYS):
        shown = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise ConfigError([f"{where}: the Secret's value must be a JSON object with {' and '.join(BLOCK_KEYS)} "
                           f"(strings); it holds {shown}"])
    return value["access_key_id"], value["secret_access_key"]
