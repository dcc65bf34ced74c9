"""The pipeline: model -> convert -> preprocess -> train -> evaluate -> export, each a subflow.

The chain grows as stages land; today it runs the stages listed in slimeflow.stages.RUNNERS. A later stage that
is not given its own `--hf-checkpoint` uses the model stage's resolved local copy.
"""

from __future__ import annotations

from prefect import flow

from slimeflow.config.pipeline import PipelineConfig
from slimeflow.flows.stages import convert_flow, model_flow, preprocess_flow, tracker_for
from slimeflow.stages.convert.config import ConvertConfig
from slimeflow.stages.preprocess.config import PreprocessConfig


@flow(name="slimeflow-pipeline", log_prints=True)
def pipeline_flow(config: PipelineConfig) -> dict[str, dict]:
    """Run the configured stages in order under one MLflow run; returns each stage's manifest."""
    settings = config.settings()
    manifests: dict[str, dict] = {}
    with tracker_for(settings).run(config.name, {"stages": ",".join(config.stages)}) as run_id:
        if "model" in config.stages:
            manifests["model"] = model_flow(config.model, settings, parent_run_id=run_id)
        if "convert" in config.stages:
            convert = with_model_checkpoint(config.convert, manifests.get("model"))
            manifests["convert"] = convert_flow(convert, settings, parent_run_id=run_id)
        if "preprocess" in config.stages:
            preprocess = with_model_checkpoint(config.preprocess, manifests.get("model"))
            manifests["preprocess"] = preprocess_flow(preprocess, settings, parent_run_id=run_id)
    return manifests


def with_model_checkpoint(config: ConvertConfig | PreprocessConfig, model: dict | None):
    """`config` with the model stage's local checkpoint as its --hf-checkpoint, unless it names its own.

    Convert converts it (hf-to-torch-dist); preprocess takes its tokenizer (chat template, token counts).
    """
    if config.hf_checkpoint is not None or model is None:
        return config
    if isinstance(config, ConvertConfig) and config.direction != "hf-to-torch-dist":
        return config
    return config.model_copy(update={"hf_checkpoint": model["outputs"]["hf_checkpoint"]})
