"""The preprocess stage: raw datasets -> prompt parquet per named set, a quarantine and a manifest; the work is
the preprocess library's pipeline (slimeflow/preprocess/pipeline.py), which the train and evaluate stages also run
on raw data sets."""

from __future__ import annotations

from slimeflow.config.preprocess import PreprocessConfig
from slimeflow.io.manifest import Manifest
from slimeflow.io.storage import join
from slimeflow.preprocess.pipeline import preprocess
from slimeflow.stages.base import StageContext


def run(config: PreprocessConfig, ctx: StageContext) -> Manifest:
    """Process the training input and every eval input; raise StageInputError when a set yields no rows."""
    return preprocess(config, ctx.storage, ctx.workdir, config.output or join(ctx.output, "preprocess"))
