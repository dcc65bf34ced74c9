"""One Prefect flow per stage. Each body calls the stage's `run` and publishes its manifest; no ML logic here."""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from slimeflow.config.pipeline import RunSettings
from slimeflow.io.storage import Storage
from slimeflow.io.tracking import Tracker
from slimeflow.manifest import Manifest
from slimeflow.stages import runner
from slimeflow.stages.base import StageContext
from slimeflow.stages.convert.config import ConvertConfig
from slimeflow.stages.model.config import ModelConfig
from slimeflow.stages.preprocess.config import PreprocessConfig


def tracker_for(settings: RunSettings) -> Tracker:
    """The run's MLflow experiment (artifacts under <workdir>/mlartifacts unless a server says otherwise)."""
    artifacts = (Path(settings.workdir).resolve() / "mlartifacts").as_uri()
    return Tracker(settings.tracking_uri(), settings.name, artifact_location=artifacts)


def execute_stage(stage: str, config, settings: RunSettings, parent_run_id: str | None) -> dict:
    """Run one stage inside a nested MLflow run, write its manifest, link it as a Prefect artifact."""
    storage = Storage(settings.infra.s3())
    workdir = Path(settings.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    context = StageContext(storage, workdir, settings.output, settings.show_progress)
    tracker = tracker_for(settings)
    with tracker.run(stage, {stage: config.model_dump(mode="json")}, parent_run_id=parent_run_id) as run_id:
        manifest: Manifest = runner(stage)(config, context)
        uri, record = manifest.write(storage, settings.output)
        tracker.log_metrics(run_id, {f"{stage}.{k}": v for k, v in manifest.counts.items()})
        tracker.set_tags(run_id, {"manifest_uri": uri, "manifest_sha256": record.sha256,
                                  **{f"output.{k}": v for k, v in manifest.outputs.items()}})
    publish(stage, manifest, uri)
    get_run_logger().info("%s: manifest %s", stage, uri)
    return manifest.model_dump(mode="json")


def publish(stage: str, manifest: Manifest, uri: str) -> None:
    """A Prefect artifact linking the manifest and listing the stage's outputs and counts."""
    rows = [f"| {k} | `{v}` |" for k, v in {**manifest.outputs, **manifest.counts, **manifest.hashes}.items()]
    markdown = "\n".join([f"### {stage}", f"manifest: `{uri}`", "", "| | |", "|---|---|", *rows])
    create_markdown_artifact(key=f"slimeflow-{stage}", markdown=markdown, description=f"{stage} manifest")


@flow(name="slimeflow-model", log_prints=True)
def model_flow(config: ModelConfig, settings: RunSettings | None = None, parent_run_id: str | None = None) -> dict:
    """Resolve the base HF checkpoint, validate it and fingerprint every file."""
    return execute_stage("model", config, settings or RunSettings(), parent_run_id)


@flow(name="slimeflow-convert", log_prints=True)
def convert_flow(config: ConvertConfig, settings: RunSettings | None = None, parent_run_id: str | None = None) -> dict:
    """HF <-> Megatron torch_dist conversion (hf-to-torch-dist or torch-dist-to-hf)."""
    return execute_stage("convert", config, settings or RunSettings(), parent_run_id)
@flow(name="slimeflow-preprocess", log_prints=True)
def preprocess_flow(config: PreprocessConfig, settings: RunSettings | None = None,
                    parent_run_id: str | None = None) -> dict:
    """Raw datasets -> prompt parquet per named set, with a quarantine of bad rows and a manifest."""
    return execute_stage("preprocess", config, settings or RunSettings(), parent_run_id)
