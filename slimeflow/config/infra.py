"""Infrastructure endpoints: from the config, else from the environment, else the embedded defaults.

Credentials are not config: a config is a flow run's parameters, which Prefect stores and shows in its UI. S3 keys
come from the environment of the process that runs the stage (a worker's, or the CLI's) or from a Prefect Secret
block whose name the config holds (flows/credentials.py reads them there, when a stage opens its storage).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import model_validator

from slimeflow.config.base import ConfigModel, replace
from slimeflow.io.storage import S3Config

# The standard variables each tool already reads; slimeflow reads them once, at config load, and passes state on.
ENV = {
    "ray_address": "RAY_ADDRESS",
    "mlflow_tracking_uri": "MLFLOW_TRACKING_URI",
    "prefect_api_url": "PREFECT_API_URL",
}

CREDENTIAL_KEYS = ("s3_access_key_id", "s3_secret_access_key")
"""Keys (and, kebab-cased, flags) that earlier configs took, refused with where credentials go instead."""
CREDENTIALS_ELSEWHERE = (
    "credentials are not config (a flow run's parameters are stored and shown by Prefect); set AWS_ACCESS_KEY_ID "
    "and AWS_SECRET_ACCESS_KEY in the environment that runs the stage (the worker's), or save them in a Prefect "
    "Secret block and name it with --s3-credentials-block")


class InfraConfig(ConfigModel):
    """Where each component runs. Unset means the embedded default, noted per field."""

    ray_address: str | None = None
    """Ray cluster address (ray://host:10001 or host:6379); unset: a local Ray started in-process. Env: RAY_ADDRESS."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking server; unset: sqlite:///<workdir>/mlflow.db. Env: MLFLOW_TRACKING_URI."""
    prefect_api_url: str | None = None
    """Prefect server API (http://host:4200/api); unset: an ephemeral local server. Env: PREFECT_API_URL."""
    s3_endpoint_url: str | None = None
    """S3-compatible endpoint (MinIO, Ceph, moto); unset: AWS. Env: AWS_ENDPOINT_URL."""
    s3_region: str | None = None
    """S3 region. Env: AWS_DEFAULT_REGION."""
    s3_credentials_block: str | None = None
    """Name of a Prefect Secret block holding {"access_key_id": ..., "secret_access_key": ...}; unset: the keys in
    the environment of the process that runs the stage (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)."""

    @model_validator(mode="before")
    @classmethod
    def _no_credentials(cls, data: Any) -> Any:
        keys = [key for key in CREDENTIAL_KEYS if isinstance(data, dict) and key in data]
        if keys:
            raise ValueError(f"{', '.join(keys)}: {CREDENTIALS_ELSEWHERE}")
        return data

    def s3(self) -> S3Config:
        """Where S3 is; as whom is not here (see the module's docstring)."""
        return S3Config(endpoint_url=self.s3_endpoint_url, region=self.s3_region)

    def with_environment(self, environ: Mapping[str, str]) -> InfraConfig:
        """Fill every unset endpoint from `environ` (the config wins over the environment)."""
        filled = {name: environ[var] for name, var in ENV.items() if getattr(self, name) is None and environ.get(var)}
        s3 = self.s3().merged_over(S3Config.from_env(environ))
        filled.update(s3_endpoint_url=s3.endpoint_url, s3_region=s3.region)
        return replace(self, **filled)
