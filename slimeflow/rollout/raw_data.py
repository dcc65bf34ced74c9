"""Raw --prompt-data and --eval-prompt-data (JSONL, JSON, CSV, parquet; local or s3://), as slime takes them:
preprocessed before the run with the preprocess stage's mapping, quarantine and manifest, from the train flags
--input-key, --label-key, --metadata-key, --tool-key, --apply-chat-template (with --hf-checkpoint) and
--rollout-max-prompt-len. The prompt parquet, the quarantine and the manifest of each set live under
<workdir>/train/data/ (keyed by content and mapping, so a resumed run trains on the same rows in the same order).

Unlike the preprocess stage's defaults, nothing is deduplicated: slime trains on every row of a raw file.
"""

from __future__ import annotations

import logging
from pathlib import Path

from slimeflow.config.base import replace
from slimeflow.config.preprocess import PreprocessConfig
from slimeflow.config.train import DataConfig, TrainConfig
from slimeflow.io.storage import Storage
from slimeflow.preprocess.inline import TRAIN, PreparedSet, is_raw, prepare_raw

logger = logging.getLogger(__name__)


def preprocess_config(data: DataConfig, hf_checkpoint: str | None) -> PreprocessConfig:
    """The preprocess mapping of slime's data flags (the tokenizer only when a template or a length filter needs it)."""
    config = PreprocessConfig(input_key=data.input_key, label_key=data.label_key, metadata_key=data.metadata_key,
                              tool_key=data.tool_key, apply_chat_template=data.apply_chat_template,
                              rollout_max_prompt_len=data.rollout_max_prompt_len, dedup=False)
    return replace(config, hf_checkpoint=hf_checkpoint) if config.needs_tokenizer() else config


def prepare_data(config: TrainConfig, storage: Storage, workdir: Path) -> tuple[TrainConfig, dict[str, PreparedSet]]:
    """`config` with each raw data set replaced by its prompt parquet, and the prepared sets by manifest prefix
    ("data.train", "data.eval.NAME"). Prompt parquet (ours) passes through untouched."""
    mapping = preprocess_config(config.data, config.checkpoint.hf_checkpoint)
    root = workdir / "train" / "data"
    prepared: dict[str, PreparedSet] = {}
    data = config.data
    # A --data-source-path class reads --prompt-data itself (args.prompt_data, as the user gave it).
    if data.prompt_data is not None and data.data_source_path is None and is_raw(data.prompt_data, storage):
        prepared["data.train"] = _prepare(TRAIN, data.prompt_data, mapping, storage, root)
        data = replace(data, prompt_data=prepared["data.train"].prompt_data)
    evals, prepared_evals = prepare_eval_sets(config.eval.eval_prompt_data, mapping, storage, root)
    ev = replace(config.eval, eval_prompt_data=evals)
    return replace(config, data=data, eval=ev), {**prepared, **prepared_evals}


def prepare_eval_sets(sets: dict[str, str], mapping: PreprocessConfig, storage: Storage,
                      root: Path) -> tuple[dict[str, str], dict[str, PreparedSet]]:
    """Named eval sets with each raw one replaced by its prompt parquet, and the prepared ones ("data.eval.NAME")."""
    sets, prepared = dict(sets), {}
    for name, uri in sets.items():
        if is_raw(uri, storage):
            prepared[f"data.eval.{name}"] = _prepare(name, uri, mapping, storage, root)
            sets[name] = prepared[f"data.eval.{name}"].prompt_data
    return sets, prepared


def _prepare(name: str, uri: str, mapping: PreprocessConfig, storage: Storage, root: Path) -> PreparedSet:
    result = prepare_raw(name, uri, mapping, storage, root)
    counts = result.manifest.counts
    logger.info("%s %s: %s rows in, %s out, %s quarantined (%s); prompt parquet %s", "reused" if result.reused
                else "preprocessed", uri, counts.get("rows_in"), counts.get("rows_out"),
                sum(v for k, v in counts.items() if k.startswith("quarantined.")), result.manifest.outputs["quarantine"],
                result.prompt_data)
    return result


def manifest_entries(prepared: dict[str, PreparedSet]) -> tuple[dict[str, int], dict[str, str]]:
    """(counts, outputs) of the prepared sets for the train manifest (and so for MLflow)."""
    counts: dict[str, int] = {}
    outputs: dict[str, str] = {}
    for prefix, result in prepared.items():
        counts.update(result.counts(prefix))
        outputs.update(result.outputs(prefix))
    return counts, outputs
