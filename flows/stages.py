"""One Prefect flow per stage. Each body calls the stage's `run` and publishes its manifest; no ML logic here.

A stage whose cache key (its config, the content hashes of the manifests it reads, the code version; never the
run id) equals the key of the manifest already at <output>/manifests/<stage>.json, and whose outputs still
exist (and, for a stage that commits its output with a marker, still hold this manifest's content), is skipped:
its manifest is returned as it is. A stage that did not finish wrote no manifest, so it runs
again (and the train stage resumes from its latest checkpoint).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from prefect import flow, get_run_logger

from slimeflow import code_version
from slimeflow.config.convert import ConvertConfig
from slimeflow.config.evaluate import EvaluateConfig
from slimeflow.config.export import ExportConfig
from slimeflow.config.model import ModelConfig
from slimeflow.config.pipeline import RunSettings
from slimeflow.config.preprocess import PreprocessConfig
from slimeflow.config.train import TrainConfig
from slimeflow.errors import StorageError
from slimeflow.flows.artifacts import publish
from slimeflow.flows.credentials import s3_config
from slimeflow.io.guard import exclusive
from slimeflow.io.manifest import MANIFEST_DIR, Manifest, config_hash
from slimeflow.io.storage import Storage, is_local, join
from slimeflow.io.tracking import Tracker
from slimeflow.stages import runner
from slimeflow.stages.base import StageContext


def tracker_for(settings: RunSettings) -> Tracker:
    """The run's MLflow experiment (artifacts under <workdir>/mlartifacts unless a server says otherwise)."""
    artifacts = (Path(settings.workdir).resolve() / "mlartifacts").as_uri()
    return Tracker(settings.tracking_uri(), settings.name, artifact_location=artifacts)


def cache_key(stage: str, config, upstream: list[dict] | None) -> str:
    """sha256 of the stage, its config, the content hashes of its inputs' manifests and the code version."""
    inputs = sorted((m["stage"], m.get("hashes", {}).get("content", "")) for m in upstream or [])
    payload = json.dumps([stage, config_hash(config), inputs, code_version()], separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


def cached_manifest(storage: Storage, output: str, stage: str, key: str) -> Manifest | None:
    """The manifest already written for `key`, if its outputs are all still there."""
    uri = join(output, MANIFEST_DIR, f"{stage}.json")
    if not storage.exists(uri):
        return None
    manifest = Manifest.read(storage, uri)
    if manifest.cache_key != key:
        return None
    paths = [v for v in manifest.outputs.values() if isinstance(v, str) and ("://" in v or v.startswith("/"))]
    if not all(storage.exists(p) for p in paths if is_local(p) or p.startswith("s3://")):
        return None
    return manifest if _still_committed(storage, manifest) else None


def _still_committed(storage: Storage, manifest: Manifest) -> bool:
    """A stage that commits its output with a small JSON (outputs["commit"]) is reused only while that JSON is
    complete and names this manifest's content: a later run, killed or with another config, may have replaced it."""
    uri = manifest.outputs.get("commit")
    if uri is None:
        return True
    try:
        marker = json.loads(storage.read_bytes(uri))
    except (StorageError, ValueError):
        return False
    content = marker.get("content", marker.get("hashes", {}).get("content"))
    return marker.get("state", "complete") == "complete" and content == manifest.hashes.get("content")


def execute_stage(stage: str, config, settings: RunSettings, parent_run_id: str | None,
                  upstream: list[dict] | None = None) -> dict:
    """Run one stage inside a nested MLflow run (or skip it when cached), write its manifest, link it in Prefect.

    The stage holds its work directory while it runs (io.guard): a second run on it is refused, not interleaved."""
    with exclusive(settings.workdir, f"{stage} stage of run {settings.name!r}"):
        return _execute(stage, config, settings, parent_run_id, upstream)


def _execute(stage: str, config, settings: RunSettings, parent_run_id: str | None,
             upstream: list[dict] | None) -> dict:
    s3 = s3_config(settings.infra, os.environ)  # the keys of the process that runs the stage
    storage = Storage(s3)
    workdir = Path(settings.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    key = cache_key(stage, config, upstream)
    cached = cached_manifest(storage, settings.output, stage, key)
    if cached is not None:
        get_run_logger().info("%s: inputs, config and code unchanged; reusing %s", stage,
                              join(settings.output, MANIFEST_DIR, f"{stage}.json"))
        return cached.model_dump(mode="json")
    tracker = tracker_for(settings)
    params = {stage: config.model_dump(mode="json")}
    custom = getattr(config, "custom_config", None)  # what --custom-config-path set, as the file said it
    if custom:
        params["custom_config"] = custom
    with tracker.run(stage, params, parent_run_id=parent_run_id) as run_id:
        context = StageContext(storage, workdir, settings.output, settings.show_progress,
                               log_metrics=lambda metrics, step: tracker.log_metrics(run_id, metrics, step),
                               ray_address=settings.infra.ray_address)
        manifest: Manifest = runner(stage)(config, context)
        manifest.cache_key = key
        uri, record = manifest.write(storage, settings.output)
        tracker.log_metrics(run_id, {**{f"{stage}.{k}": v for k, v in manifest.counts.items()}, **manifest.metrics})
        tracker.set_tags(run_id, {"manifest_uri": uri, "manifest_sha256": record.sha256,
                                  **{f"output.{k}": v for k, v in manifest.outputs.items()}})
    publish(stage, manifest, uri, storage, tracker, run_id, s3)
    get_run_logger().info("%s: manifest %s", stage, uri)
    return manifest.model_dump(mode="json")


@flow(name="slimeflow-model", log_prints=True)
def model_flow(config: ModelConfig, settings: RunSettings | None = None, parent_run_id: str | None = None) -> dict:
    """Resolve the base HF checkpoint, validate it and fingerprint every file."""
    return execute_stage("model", config, settings or RunSettings(), parent_run_id)


@flow(name="slimeflow-convert", log_prints=True)
def convert_flow(config: ConvertConfig, settings: RunSettings | None = None, parent_run_id: str | None = None,
                 upstream: list[dict] | None = None) -> dict:
    """HF <-> Megatron torch_dist conversion (hf-to-torch-dist or torch-dist-to-hf)."""
    return execute_stage("convert", config, settings or RunSettings(), parent_run_id, upstream)


@flow(name="slimeflow-preprocess", log_prints=True)
def preprocess_flow(config: PreprocessConfig, settings: RunSettings | None = None,
                    parent_run_id: str | None = None, upstream: list[dict] | None = None) -> dict:
    """Raw datasets -> prompt parquet per named set, with a quarantine of bad rows and a manifest."""
    return execute_stage("preprocess", config, settings or RunSettings(), parent_run_id, upstream)


@flow(name="slimeflow-train", log_prints=True)
def train_flow(config: TrainConfig, settings: RunSettings | None = None, parent_run_id: str | None = None,
               upstream: list[dict] | None = None) -> dict:
    """The Ray-hosted rollout/train loop; resumes from the latest checkpoint under --load (default --save)."""
    return execute_stage("train", config, settings or RunSettings(), parent_run_id, upstream)


@flow(name="slimeflow-evaluate", log_prints=True)
def evaluate_flow(config: EvaluateConfig, settings: RunSettings | None = None, parent_run_id: str | None = None,
                  upstream: list[dict] | None = None) -> dict:
    """A checkpoint on named eval sets (avg@n, pass@k)."""
    return execute_stage("evaluate", config, settings or RunSettings(), parent_run_id, upstream)


@flow(name="slimeflow-export", log_prints=True)
def export_flow(config: ExportConfig, settings: RunSettings | None = None, parent_run_id: str | None = None,
                upstream: list[dict] | None = None) -> dict:
    """A torch_dist checkpoint -> HF safetensors with config and tokenizer, uploaded with checksums."""
    return execute_stage("export", config, settings or RunSettings(), parent_run_id, upstream)
