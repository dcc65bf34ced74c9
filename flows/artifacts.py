"""What a stage's flow run shows in the Prefect UI, read from the manifest the stage wrote: its outputs and figures,
links to the manifest and to the stage's MLflow run, the reward curve as an image, eval scores as a table.

Artifacts carry no data of their own: the image is the manifest's reward_curve file inlined as a data: URL (a UI
on another machine can show neither a local path nor, without credentials, an s3:// object). Links are only what
a person at another machine can open: an s3:// object as its HTTP URL at the store's endpoint (path-style for MinIO,
Ceph and moto; AWS's virtual-hosted URL otherwise), the MLflow UI's run page when the tracking URI is a server. A
path on the worker's disk, or a file/sqlite MLflow store, is shown as text (a file:// link opens nothing elsewhere).
"""

from __future__ import annotations

import base64
from typing import Any
from urllib.parse import quote

from prefect.artifacts import (
    create_image_artifact,
    create_link_artifact,
    create_markdown_artifact,
    create_table_artifact,
)

from slimeflow.io.manifest import Manifest
from slimeflow.io.storage import S3Config, Storage
from slimeflow.io.tracking import Tracker

MAX_INLINE_IMAGE = 512 * 1024
"""A larger curve is linked, not inlined (Prefect's docs keep artifacts small)."""


def publish(stage: str, manifest: Manifest, uri: str, storage: Storage, tracker: Tracker, run_id: str,
            s3: S3Config | None = None) -> None:
    """Every artifact of one stage's manifest at `uri`, whose MLflow run is `run_id` in `tracker`'s store; `s3`
    says where s3:// objects are served (their links' host)."""
    s3 = s3 or S3Config()
    values = {**manifest.outputs, **manifest.counts, **manifest.metrics, **manifest.hashes}
    rows = [f"| {k} | `{v}` |" for k, v in values.items()]
    manifest_url = browser_url(uri, s3)
    mlflow_run = mlflow_run_url(tracker.tracking_uri, tracker.experiment_id, run_id)
    markdown = "\n".join([f"### {stage}", f"manifest: {markdown_link(uri, manifest_url)}",
                          f"MLflow run: {markdown_link(run_id, mlflow_run)} in `{tracker.tracking_uri}`",
                          "", "| | |", "|---|---|", *rows])
    create_markdown_artifact(key=f"slimeflow-{stage}", markdown=markdown, description=f"{stage} manifest")
    if manifest_url is not None:
        create_link_artifact(key=f"slimeflow-{stage}-manifest", link=manifest_url, link_text=uri,
                             description=f"the {stage} stage's manifest")
    else:
        create_markdown_artifact(key=f"slimeflow-{stage}-manifest", markdown=markdown_link(uri, None),
                                 description=f"the {stage} stage's manifest, on the worker's disk")
    if mlflow_run is not None:
        create_link_artifact(key=f"slimeflow-{stage}-mlflow", link=mlflow_run, link_text=mlflow_run,
                             description=f"the {stage} stage's MLflow run")
    curve = manifest.outputs.get("reward_curve")
    if curve:
        _publish_curve(stage, curve, storage, s3)
    scores = eval_rows(manifest)
    if scores:
        create_table_artifact(table=scores, key=f"slimeflow-{stage}-eval",
                              description=f"{stage}: eval scores per set and metric")


def _publish_curve(stage: str, curve: str, storage: Storage, s3: S3Config) -> None:
    """The reward curve inlined; one too large to inline is linked where it is served, else named as text."""
    key, description = f"slimeflow-{stage}-reward-curve", f"rollout reward mean and eval avg@n per rollout ({curve})"
    image = storage.read_bytes(curve)
    url = (f"data:image/png;base64,{base64.b64encode(image).decode()}" if len(image) <= MAX_INLINE_IMAGE
           else browser_url(curve, s3))
    if url is not None:
        create_image_artifact(image_url=url, key=key, description=description)
    else:
        create_markdown_artifact(key=key, markdown=f"reward curve: {markdown_link(curve, None)} (too large to inline)",
                                 description=description)


def eval_rows(manifest: Manifest) -> list[dict[str, Any]]:
    """One row per eval set and metric (`eval/<set>/<metric>`): the evaluate stage's metrics, or for the train
    stage its first and last evaluation."""
    if manifest.stage == "train":
        columns = {"first": manifest.facts.get("eval_first", {}), "last": manifest.facts.get("eval_last", {})}
    else:
        columns = {"score": manifest.metrics}
    keys = sorted({k for scores in columns.values() for k in scores if k.startswith("eval/")})
    rows = []
    for key in keys:
        _, name, metric = key.split("/", 2)
        rows.append({"set": name, "metric": metric, **{c: scores.get(key) for c, scores in columns.items()}})
    return rows


def browser_url(uri: str, s3: S3Config) -> str | None:
    """A URL a person at another machine can open, or None: an s3:// object at the store's HTTP endpoint, an
    http(s) URL as it is; a local path (on the worker's disk) or any other scheme has none. (An object opens in a
    browser when the store serves it: public, or to a signed-in console.)"""
    if uri.startswith(("http://", "https://")):
        return uri
    if not uri.startswith("s3://"):
        return None
    bucket, _, key = uri[len("s3://"):].partition("/")
    if s3.endpoint_url:
        return f"{s3.endpoint_url.rstrip('/')}/{bucket}/{quote(key)}"
    host = f"s3.{s3.region}.amazonaws.com" if s3.region else "s3.amazonaws.com"
    return f"https://{bucket}.{host}/{quote(key)}"


def markdown_link(text: str, url: str | None) -> str:
    """`[text](url)`, or `text` as code where there is no URL to open (the UI renders markdown)."""
    return f"[{text}]({url})" if url else f"`{text}`"


def mlflow_run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str | None:
    """The run's page in an MLflow UI served at `tracking_uri` (None for a file or sqlite store: no UI serves it)."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
