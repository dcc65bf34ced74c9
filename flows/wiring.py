"""How each stage's config takes the outputs of the stages before it (a value the config sets itself wins).

Plain functions over manifests (dicts), used by the pipeline flow; no Prefect here.
"""

from __future__ import annotations

from typing import Any

from slimeflow.config.base import replace
from slimeflow.config.convert import ConvertConfig
from slimeflow.config.evaluate import EvaluateConfig
from slimeflow.config.export import ExportConfig
from slimeflow.config.preprocess import PreprocessConfig
from slimeflow.config.train import TrainConfig

Manifests = dict[str, dict[str, Any]]


def inputs(manifests: Manifests, *stages: str) -> list[dict[str, Any]]:
    """The manifests of `stages` that ran (their content hashes key the next stage's cache)."""
    return [manifests[s] for s in stages if s in manifests]


def _out(manifests: Manifests, stage: str, key: str) -> str | None:
    return manifests.get(stage, {}).get("outputs", {}).get(key)


def eval_sets(manifests: Manifests) -> dict[str, str]:
    """The preprocess stage's eval sets by name (outputs `eval.NAME`)."""
    outputs = manifests.get("preprocess", {}).get("outputs", {})
    return {key.removeprefix("eval."): uri for key, uri in outputs.items() if key.startswith("eval.")}


def convert(config: ConvertConfig, m: Manifests) -> ConvertConfig:
    """Convert converts the model stage's checkpoint (hf-to-torch-dist)."""
    if config.hf_checkpoint is not None or config.direction != "hf-to-torch-dist" or "model" not in m:
        return config
    return replace(config, hf_checkpoint=_out(m, "model", "hf_checkpoint"))


def preprocess(config: PreprocessConfig, m: Manifests) -> PreprocessConfig:
    """Preprocess takes the model stage's tokenizer (chat template, token counts)."""
    if config.hf_checkpoint is not None or "model" not in m:
        return config
    return replace(config, hf_checkpoint=_out(m, "model", "hf_checkpoint"))


def train(config: TrainConfig, m: Manifests) -> TrainConfig:
    """Train starts from the model, with the converted checkpoint as reference and the preprocessed prompts."""
    ckpt, data, ev = config.checkpoint, config.data, config.eval
    ckpt = replace(ckpt, **{
        "hf_checkpoint": ckpt.hf_checkpoint or _out(m, "model", "hf_checkpoint"),
        "ref_load": ckpt.ref_load or _out(m, "convert", "torch_dist"),
    })
    data = replace(data, prompt_data=data.prompt_data or _out(m, "preprocess", "train"))
    ev = replace(ev, eval_prompt_data=ev.eval_prompt_data or eval_sets(m))
    return replace(config, checkpoint=ckpt, data=data, eval=ev)


def evaluate(config: EvaluateConfig, m: Manifests) -> EvaluateConfig:
    """Evaluate reads the trained checkpoint (else the converted one) on the preprocess stage's eval sets."""
    return replace(config, **{
        "load": config.load or _out(m, "train", "checkpoint") or _out(m, "convert", "checkpoint"),
        "hf_checkpoint": config.hf_checkpoint or _out(m, "model", "hf_checkpoint"),
        "eval_prompt_data": config.eval_prompt_data or eval_sets(m),
    })


def export(config: ExportConfig, m: Manifests) -> ExportConfig:
    """Export writes the trained checkpoint (else the converted one) with the model's config and tokenizer."""
    return replace(config, **{
        "input_dir": config.input_dir or _out(m, "train", "checkpoint") or _out(m, "convert", "checkpoint"),
        "origin_hf_dir": config.origin_hf_dir or _out(m, "model", "hf_checkpoint"),
    })
