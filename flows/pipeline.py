"""The pipeline: model -> convert -> preprocess -> train -> evaluate -> export, each a subflow.

The chain grows as stages land; today it runs the stages listed in slimeflow.stages.RUNNERS.
"""

from __future__ import annotations

from prefect import flow

from slimeflow.config.pipeline import PipelineConfig
from slimeflow.flows.stages import convert_flow, model_flow, tracker_for


@flow(name="slimeflow-pipeline", log_prints=True)
def pipeline_flow(config: PipelineConfig) -> dict[str, dict]:
    """Run the configured stages in order under one MLflow run; returns each stage's manifest."""
    settings = config.settings()
    manifests: dict[str, dict] = {}
    with tracker_for(settings).run(config.name, {"stages": ",".join(config.stages)}) as run_id:
        if "model" in config.stages:
            manifests["model"] = model_flow(config.model, settings, parent_run_id=run_id)
        if "convert" in config.stages:
            convert = config.convert
            if convert.direction == "hf-to-torch-dist" and convert.hf_checkpoint is None and "model" in manifests:
                convert = convert.model_copy(update={"hf_checkpoint": manifests["model"]["outputs"]["hf_checkpoint"]})
            manifests["convert"] = convert_flow(convert, settings, parent_run_id=run_id)
    return manifests
