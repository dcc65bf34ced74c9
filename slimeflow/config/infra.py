"""Infrastructure endpoints: from the config, else from the environment, else the embedded defaults."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import SecretStr

from slimeflow.config.base import ConfigModel, replace
from slimeflow.io.storage import S3Config

# The standard variables each tool already reads; slimeflow reads them once, at config load, and passes state on.
ENV = {
    "ray_address": "RAY_ADDRESS",
    "mlflow_tracking_uri": "MLFLOW_TRACKING_URI",
    "prefect_api_url": "PREFECT_API_URL",
}


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
    s3_access_key_id: str | None = None
    """S3 access key. Env: AWS_ACCESS_KEY_ID."""
    s3_secret_access_key: SecretStr | None = None
    """S3 secret key. Env: AWS_SECRET_ACCESS_KEY."""
    s3_region: str | None = None
    """S3 region. Env: AWS_DEFAULT_REGION."""

    def s3(self) -> S3Config:
        return S3Config(
            endpoint_url=self.s3_endpoint_url,
            access_key_id=self.s3_access_key_id,
            secret_access_key=self.s3_secret_access_key,
            region=self.s3_region,
        )

    def with_environment(self, environ: Mapping[str, str]) -> InfraConfig:
        """Fill every unset endpoint from `environ` (the config wins over the environment)."""
        filled = {name: environ[var] for name, var in ENV.items() if getattr(self, name) is None and environ.get(var)}
        s3 = self.s3().merged_over(S3Config.from_env(environ))
        filled.update(
            s3_endpoint_url=s3.endpoint_url,
            s3_access_key_id=s3.access_key_id,
            s3_secret_access_key=s3.secret_access_key,
            s3_region=s3.region,
        )
        return replace(self, **filled)
