"""The evaluate stage: a checkpoint on named eval sets (avg@n, pass@k) through the same rollout engine and
rollout code as training. A torch_dist checkpoint is converted to HF first (the convert stage's reader); with no
`--load`, the HF checkpoint's own weights are evaluated."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoTokenizer

from slimeflow.checkpoint.hf_write import write_hf
from slimeflow.config.evaluate import EvaluateConfig
from slimeflow.config.train import DataConfig, TrainConfig
from slimeflow.engine.client import EngineClient
from slimeflow.engine.launch import ENGINE_READY_TIMEOUT_S, EngineProcess, launch_engine_thread, start_engine
from slimeflow.errors import CheckpointError, StageInputError
from slimeflow.io import checkpoints
from slimeflow.io.manifest import Manifest
from slimeflow.io.prompts import open_prompt_sets
from slimeflow.io.storage import join, local_path
from slimeflow.rollout.evaluation import EvalSettings, evaluate_sets
from slimeflow.rollout.raw_data import PreparedSet, manifest_entries, prepare_eval_sets, preprocess_config
from slimeflow.rollout.rewards import RewardScorer
from slimeflow.rollout.rollout import RolloutContext, sampling_params
from slimeflow.stages.base import StageContext

if TYPE_CHECKING:
    from slimeflow.engine.server import EngineThread


def run(config: EvaluateConfig, ctx: StageContext) -> Manifest:
    """Evaluate; the manifest's metrics hold eval/<set>/avg_at_<n> and eval/<set>/pass_at_<k> for every set."""
    sets, prepared = _eval_sets(config, ctx)
    model_dir, source = _model_dir(config, ctx)
    with _serving(str(model_dir), config.engine_in_process) as engine:
        metrics = asyncio.run(_evaluate(config, str(model_dir), EngineClient(engine.url, api_key=engine.api_key), sets))
    results = join(ctx.output, "evaluate", "results.json")
    ctx.storage.write_text(results, json.dumps({"checkpoint": source, "metrics": metrics}, indent=2))
    data_counts, data_outputs = manifest_entries(prepared)
    return Manifest(stage="evaluate", outputs={"results": results, "checkpoint": source, **data_outputs},
                    counts={"sets": len(sets), "prompts": sum(len(p) for p in sets.values()), **data_counts},
                    metrics=metrics, config=config.model_dump(mode="json"))


@contextmanager
def _serving(model_dir: str, in_process: bool) -> Iterator[EngineProcess | EngineThread]:
    """The engine for the evaluation: a thread of this process (the train stage's default for one engine: no second
    interpreter importing torch and transformers) or a process of its own."""
    if not in_process:
        with start_engine(model_dir) as engine:
            yield engine
        return
    threads = torch.get_num_threads()  # the engine's set-up sets this thread's to 1 (engine.server.build_server)
    engine = launch_engine_thread(model_dir)
    try:
        engine.wait_ready("/health", ENGINE_READY_TIMEOUT_S)
        yield engine
    finally:
        engine.stop()
        torch.set_num_threads(threads)


async def _evaluate(config: EvaluateConfig, model_dir: str, client: EngineClient, sets: dict) -> dict[str, float]:
    train = TrainConfig.model_validate({
        "batch": {"rollout_batch_size": 1, "num_rollout": 1},
        "data": {"apply_chat_template": config.apply_chat_template, "rollout_seed": config.rollout_seed},
        "reward": {"rm_type": config.rm_type, "custom_rm_path": config.custom_rm_path,
                   "eval_reward_key": config.eval_reward_key},
        "rollout": {"rollout_max_response_len": config.eval_max_response_len or 1024},
    })
    params = sampling_params(train.rollout, temperature=config.eval_temperature, top_p=config.eval_top_p,
                             top_k=config.eval_top_k)
    scorer = RewardScorer(train.reward, seed=config.rollout_seed)
    try:
        ctx = RolloutContext(train, AutoTokenizer.from_pretrained(model_dir), client, scorer)
        return await evaluate_sets(ctx, sets, EvalSettings(config.n_samples_per_eval_prompt, params))
    finally:
        scorer.close()


def _eval_sets(config: EvaluateConfig, ctx: StageContext) -> tuple[dict[str, list], dict[str, PreparedSet]]:
    """The prompts of each eval set (a raw set preprocessed first, as in training), and the prepared raw sets."""
    if not config.eval_prompt_data:
        raise StageInputError("the evaluate stage has no eval set", ["--eval-prompt-data is empty"],
                              "Pass --eval-prompt-data NAME PATH [NAME PATH ...] (raw datasets or the preprocess "
                              "stage's eval sets).")
    data = DataConfig(input_key=config.input_key, label_key=config.label_key, metadata_key=config.metadata_key,
                      tool_key=config.tool_key, apply_chat_template=config.apply_chat_template)
    uris, prepared = prepare_eval_sets(config.eval_prompt_data, preprocess_config(data, config.hf_checkpoint),
                                       ctx.storage, ctx.workdir / "evaluate" / "data")
    sets, problems = open_prompt_sets(uris, ctx.storage)
    if problems:
        raise StageInputError("--eval-prompt-data", problems, "Point each set at a raw dataset (JSONL, JSON, CSV, "
                              "parquet) or at prompt parquet (a file or directory).")
    return {name: list(dataset) for name, dataset in sets.items()}, prepared


def _model_dir(config: EvaluateConfig, ctx: StageContext) -> tuple[Path, str]:
    """The HF directory the engine serves, and what it came from."""
    if config.hf_checkpoint is None or not Path(config.hf_checkpoint, "config.json").is_file():
        raise StageInputError("--hf-checkpoint", [f"{config.hf_checkpoint!r} is not an HF directory with config.json"],
                              "Give the HF directory of the tokenizer and config (the model stage's checkpoint).")
    if config.load is None:
        return Path(config.hf_checkpoint), config.hf_checkpoint
    try:
        ref = checkpoints.resolve(ctx.storage, config.load)
    except CheckpointError as err:
        raise StageInputError(f"--load {config.load}", [str(err)],
                              "Point it at a checkpoint root, release/ or an iter_XXXXXXX/ directory.") from None
    target = ctx.workdir / "evaluate" / "hf"
    write_hf(local_path(ref.uri), target, Path(config.hf_checkpoint))
    return target, ref.uri
