"""The Prefect deployments of slimeflow: the pipeline and one per stage, declared in Python.

They ship with the package (no prefect.yaml in a source tree to find) and their entrypoints are module paths
(`slimeflow.flows.pipeline.pipeline_flow`), so a worker runs them from any install of slimeflow. Each
deployment's default parameters are validated by the config models here and stored in their canonical nested
form, the form the server's parameter schema accepts (the YAML shorthand `hf_checkpoint: X` at the top of a
pipeline config is a convenience of our loader, not of the schema).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from slimeflow.config.pipeline import STAGE_CONFIGS, PipelineConfig, RunSettings
from slimeflow.flows import stages as stage_flows
from slimeflow.flows.pipeline import pipeline_flow

POOL = "slimeflow"
"""The process work pool that `slimeflow deploy` creates and every deployment runs on."""

TINY = "tiny:qwen3?seed=0"
DEMO_MODEL = "runs/demo/model/tiny-4098fb6187b4"  # where examples/demo.yaml's model stage puts its checkpoint


@dataclass(frozen=True)
class DeploymentSpec:
    """One deployment: its name, the flow it runs, what the UI shows and its default parameters."""

    name: str
    flow: Any
    description: str
    parameters: dict[str, Any]
    tags: tuple[str, ...]
    cron: str | None = None
    """An example schedule, created inactive: someone turns it on in the UI."""


def canonical(model: BaseModel) -> dict[str, Any]:
    """A validated config as the JSON that Prefect stores and the server's schema validates (what was set)."""
    return model.model_dump(mode="json", exclude_unset=True)


def _stage(stage: str, description: str, config: dict[str, Any], run_name: str) -> DeploymentSpec:
    parameters = {"config": canonical(STAGE_CONFIGS[stage].model_validate(config)),
                  "settings": canonical(RunSettings(name=run_name))}
    return DeploymentSpec(stage, getattr(stage_flows, f"{stage}_flow"), description, parameters,
                          ("slimeflow", "stage"))


def specs() -> list[DeploymentSpec]:
    """Every deployment, the pipeline first (defaults: the tiny demo model, paths of examples/demo.yaml)."""
    pipeline = PipelineConfig.model_validate({"name": "scheduled-tiny", "model": {"hf_checkpoint": TINY}})
    train = {
        "batch": {"rollout_batch_size": 16, "n_samples_per_prompt": 8, "num_rollout": 120},
        "checkpoint": {"hf_checkpoint": DEMO_MODEL, "save_interval": 40},
        "data": {"prompt_data": "runs/demo/preprocess/train", "rollout_shuffle": True},
        "rollout": {"rollout_max_response_len": 2},
        "reward": {"rm_type": "prefix_match"},
        "optimizer": {"lr": 0.0003},
    }
    evaluate = {
        "load": "runs/demo/checkpoints", "hf_checkpoint": DEMO_MODEL,
        "eval_prompt_data": {"increment": "runs/demo/preprocess/eval/increment"},
        "eval_temperature": 0.0, "eval_max_response_len": 2, "rm_type": "prefix_match",
    }
    return [
        DeploymentSpec("pipeline", pipeline_flow,
                       "The whole pipeline (the configured stages), on the tiny demo model by default.",
                       {"config": canonical(pipeline)}, ("slimeflow", "pipeline"), cron="0 3 * * *"),
        _stage("model", "Resolve, validate and fingerprint a base HF checkpoint "
               "(local path, s3:// URI or tiny:<family>).", {"hf_checkpoint": TINY}, "model-check"),
        _stage("convert", "Convert an HF checkpoint to Megatron torch_dist (release/) "
               "or a torch_dist checkpoint back to HF.",
               {"direction": "hf-to-torch-dist", "hf_checkpoint": TINY, "processes": 2}, "convert-check"),
        _stage("preprocess", "Raw datasets (JSONL, JSON, CSV, parquet; local or s3://) "
               "-> prompt parquet, quarantine, manifest.",
               {"input": ["examples/data/math-train.jsonl"],
                "eval_input": {"math-eval": "examples/data/math-eval.jsonl"},
                "input_key": "prompt", "label_key": "label"}, "preprocess-example"),
        _stage("train", "The Ray-hosted rollout/train loop (GRPO family), "
               "resumable from the latest checkpoint under --load.", train, "demo"),
        _stage("evaluate", "A checkpoint on named eval sets (avg@n, pass@k) "
               "through the embedded engine or SGLang.", evaluate, "demo"),
        _stage("export", "A torch_dist checkpoint -> HF safetensors (sharded, config, tokenizer) "
               "at a local or s3:// URI.",
               {"input_dir": "runs/demo/checkpoints", "origin_hf_dir": DEMO_MODEL,
                "output_dir": "runs/demo/export/hf"}, "demo"),
    ]
