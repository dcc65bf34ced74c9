"""The pipeline: model -> convert -> preprocess -> train -> evaluate -> export, each a subflow.

Each stage reads the outputs of the ones before it unless its own config names them: the model stage's local
checkpoint is everyone's --hf-checkpoint, the converted torch_dist is train's --ref-load, the preprocess stage's
parquet is train's --prompt-data and its eval sets everyone's --eval-prompt-data, the trained checkpoint is what
evaluate and export read. A rerun skips every stage whose inputs, config and code are unchanged (flows.stages).
"""

from __future__ import annotations

from prefect import flow

from slimeflow.config.pipeline import PipelineConfig
from slimeflow.flows import wiring
from slimeflow.flows.stages import (
    convert_flow,
    evaluate_flow,
    export_flow,
    model_flow,
    preprocess_flow,
    tracker_for,
    train_flow,
)
from slimeflow.io.guard import exclusive


@flow(name="slimeflow-pipeline", log_prints=True)
def pipeline_flow(config: PipelineConfig) -> dict[str, dict]:
    """Run the configured stages in order under one MLflow run; returns each stage's manifest. The run holds its
    work directory throughout: a second run on it is refused (io.guard), never interleaved with this one."""
    settings = config.settings()
    m: dict[str, dict] = {}
    with (exclusive(settings.workdir, f"pipeline run {config.name!r}"),
          tracker_for(settings).run(config.name, {"stages": ",".join(config.stages)}) as run_id):
        run = {"settings": settings, "parent_run_id": run_id}
        if "model" in config.stages:
            m["model"] = model_flow(config.model, **run)
        if "convert" in config.stages:
            m["convert"] = convert_flow(wiring.convert(config.convert, m), **run, upstream=wiring.inputs(m, "model"))
        if "preprocess" in config.stages:
            m["preprocess"] = preprocess_flow(wiring.preprocess(config.preprocess, m), **run,
                                              upstream=wiring.inputs(m, "model"))
        if "train" in config.stages:
            m["train"] = train_flow(wiring.train(config.train, m), **run,
                                    upstream=wiring.inputs(m, "model", "convert", "preprocess"))
        if "evaluate" in config.stages:
            m["evaluate"] = evaluate_flow(wiring.evaluate(config.evaluate, m), **run,
                                          upstream=wiring.inputs(m, "model", "preprocess", "train"))
        if "export" in config.stages:
            m["export"] = export_flow(wiring.export(config.export, m), **run,
                                      upstream=wiring.inputs(m, "model", "convert", "train"))
    return m
