"""What a stage's flow run shows in the Prefect UI, read from the manifest the stage wrote: its outputs and figures,
links to the manifest and to the stage's MLflow run, the reward curve as an image, eval scores as a table.

Artifacts carry no data of their own: the image is the manifest's reward_curve file inlined as a data: URL (a UI
on another machine can show neither a local path nor, without credentials, an s3:// object).
"""

from __future__ import annotations

import base64
from typing import Any

from prefect.artifacts import (
    create_image_artifact,
    create_link_artifact,
    create_markdown_artifact,
    create_table_artifact,
)

from slimeflow.io.manifest import Manifest
from slimeflow.io.storage import Storage, is_local, local_path
from slimeflow.io.tracking import Tracker

MAX_INLINE_IMAGE = 512 * 1024
"""A larger curve is linked, not inlined (Prefect's docs keep artifacts small)."""


def publish(stage: str, manifest: Manifest, uri: str, storage: Storage, tracker: Tracker, run_id: str) -> None:
    """Every artifact of one stage's manifest at `uri`, whose MLflow run is `run_id` in `tracker`'s store."""
    values = {**manifest.outputs, **manifest.counts, **manifest.metrics, **manifest.hashes}
    rows = [f"| {k} | `{v}` |" for k, v in values.items()]
    mlflow_run = mlflow_run_url(tracker.tracking_uri, tracker.experiment_id, run_id)
    markdown = "\n".join([f"### {stage}", f"manifest: `{uri}`",
                          f"MLflow run: `{run_id}` in `{tracker.tracking_uri}`", "", "| | |", "|---|---|", *rows])
    create_markdown_artifact(key=f"slimeflow-{stage}", markdown=markdown, description=f"{stage} manifest")
    create_link_artifact(key=f"slimeflow-{stage}-manifest", link=link(uri), link_text=uri,
                         description=f"the {stage} stage's manifest")
    if mlflow_run is not None:
        create_link_artifact(key=f"slimeflow-{stage}-mlflow", link=mlflow_run, link_text=mlflow_run,
                             description=f"the {stage} stage's MLflow run")
    curve = manifest.outputs.get("reward_curve")
    if curve:
        image = storage.read_bytes(curve)
        source = (f"data:image/png;base64,{base64.b64encode(image).decode()}" if len(image) <= MAX_INLINE_IMAGE
                  else link(curve))
        create_image_artifact(image_url=source, key=f"slimeflow-{stage}-reward-curve",
                              description=f"rollout reward mean and eval avg@n per rollout ({curve})")
    scores = eval_rows(manifest)
    if scores:
        create_table_artifact(table=scores, key=f"slimeflow-{stage}-eval",
                              description=f"{stage}: eval scores per set and metric")


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


def link(uri: str) -> str:
    """A URI a browser can follow: local paths as file:// URLs, anything with a scheme as it is."""
    return local_path(uri).resolve().as_uri() if is_local(uri) else uri


def mlflow_run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str | None:
    """The run's page in an MLflow UI served at `tracking_uri` (None for a file or sqlite store: no UI serves it)."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
