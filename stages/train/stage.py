"""The train stage: the Ray-hosted rollout/train loop, resumable from its latest checkpoint.

`--save` defaults to <workdir>/checkpoints and `--load` to `--save`, so running the stage again after a crash
resumes at the rollout after the latest checkpoint, with the same data order; a finished run reruns nothing.
Per-rollout metrics go to MLflow (through the context) and to `<output>/train/rollouts.jsonl` (each rollout once,
a resumed run included: RolloutLog), the reward and eval curves to `<output>/train/reward_curve.png`.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slimeflow.checkpoint.hf_source import fingerprint, is_source_spec, materialise
from slimeflow.cluster import init_ray, local_ray_stopped, scratch_dir, stopping_local_ray_on_termination
from slimeflow.config.base import replace
from slimeflow.config.model import ModelConfig
from slimeflow.config.model_args import check_model_args
from slimeflow.config.train import TrainConfig
from slimeflow.config.train_validation import (
    data_source_problems,
    slime_megatron_differences,
    unbuilt_problems,
)
from slimeflow.engine.sglang_launch import installed_server_args
from slimeflow.errors import StageInputError
from slimeflow.io import checkpoints
from slimeflow.io.guard import claim_root
from slimeflow.io.manifest import Manifest, content_hash
from slimeflow.io.prompts import PromptDataset, open_prompt_sets
from slimeflow.io.sinks import close_sinks, fan_out, open_sinks
from slimeflow.io.storage import join
from slimeflow.progress import step_progress
from slimeflow.rollout.raw_data import PreparedSet, manifest_entries, prepare_data
from slimeflow.stages.base import StageContext
from slimeflow.stages.train import async_loop, loop
from slimeflow.stages.train.placement import create_placement
from slimeflow.stages.train.placement_plan import flag_problems
from slimeflow.stages.train.plots import plot_curves
from slimeflow.stages.train.preflight import check_plugins, checkpoint_problems, replay_problems
from slimeflow.stages.train.progress import ProgressReporter
from slimeflow.stages.train.rollout_manager import RolloutSetup
from slimeflow.train.backends import backend_spec

log = logging.getLogger("slimeflow.train")


def run(config: TrainConfig, ctx: StageContext) -> Manifest:
    """Train; returns the manifest of the latest checkpoint with the run's figures."""
    config = with_local_model(with_defaults(config, ctx), ctx)
    for note in slime_megatron_differences(config):
        log.warning(note)
    config, prepared = prepare_data(config, ctx.storage, ctx.workdir)  # raw data sets -> prompt parquet
    setup = rollout_setup(config, ctx)
    num_rollout = resolve_num_rollout(config, setup.prompt_data, ctx)
    assert config.batch.num_steps_per_rollout is not None  # BatchConfig derives it
    total_steps = num_rollout * config.batch.num_steps_per_rollout
    sinks = open_sinks(config.logging, ctx.workdir, config.model_dump(mode="json"))  # W&B, TensorBoard
    try:
        history = RolloutLog(ctx.workdir / "train" / "rollouts.jsonl", fan_out(ctx.log_metrics, sinks))
        run_token = claim_root(config.checkpoint.save)  # from now on, an earlier run on this root commits nothing
        placement = None
        try:
            with (stopping_local_ray_on_termination(),  # a cancel: Ray's processes killed first, then the rest
                  step_progress("train", num_rollout, ctx.show_progress) as update):
                init_ray(ctx.ray_address)  # inside: a signal while Ray starts must not leave it to ray.shutdown
                placement = create_placement(config, setup, total_steps, scratch_dir(ctx.workdir), run_token)
                reporter = ProgressReporter(history, update)
                result = (async_loop if config.placement.async_ else loop).train(placement, num_rollout, reporter)
                unused = placement.unused_settings()
                if unused:
                    log.warning("--custom-config-path %s: no plug-in read %s; check the spelling against what "
                                "your plug-ins read from args", config.custom_config_path, ", ".join(unused))
        finally:
            if placement is not None and not local_ray_stopped():  # killed: nothing left to stop or ask
                with stopping_local_ray_on_termination():
                    placement.shutdown()
    finally:
        close_sinks(sinks)
    return manifest(config, ctx, result, history, prepared, unused)


def with_defaults(config: TrainConfig, ctx: StageContext) -> TrainConfig:
    """--save <workdir>/checkpoints, --load = --save (resume), a save at the end when no --save-interval."""
    ckpt = config.checkpoint
    save = ckpt.save or str((ctx.workdir / "checkpoints").resolve())
    update = {"save": save, "load": ckpt.load or save}
    return replace(config, checkpoint=replace(ckpt, **update))


def with_local_model(config: TrainConfig, ctx: StageContext) -> TrainConfig:
    """--hf-checkpoint as the model stage takes it (a tiny spec, a GGUF file, an s3:// URI), resolved the same way to
    a local HF directory under <workdir>/model, so that `slimeflow train` alone starts from what a pipeline would
    (in a pipeline it is the model stage's output, a directory already)."""
    hf = config.checkpoint.hf_checkpoint
    if hf is None or not is_source_spec(hf):
        return config
    local = materialise(ModelConfig(hf_checkpoint=hf), ctx.storage, ctx.workdir, ctx.show_progress)
    return replace(config, checkpoint=replace(config.checkpoint, hf_checkpoint=str(local)))


def rollout_setup(config: TrainConfig, ctx: StageContext) -> RolloutSetup:
    problems = []
    hf_config = Path(config.checkpoint.hf_checkpoint or "", "config.json")
    if config.checkpoint.hf_checkpoint is None:
        problems.append("--hf-checkpoint is not set (the HF model: tokenizer, config and starting weights)")
    elif not hf_config.is_file():
        problems.append(f"--hf-checkpoint {config.checkpoint.hf_checkpoint} has no config.json")
    else:
        problems += check_model_args(config.megatron, json.loads(hf_config.read_text()), config.placement.train_backend)
    if config.debug.load_debug_rollout_data is not None:  # else a --debug-train-only rollout function reads the data
        problems += replay_problems(config)
    elif config.data.data_source_path is not None:
        problems += data_source_problems(config)
    elif config.data.prompt_data is None:
        problems.append("--prompt-data is not set (a raw dataset, or the preprocess stage's train parquet)")
    problems += data_problems(config, ctx)
    # SGLang's server arguments are read only when some are given: importing SGLang takes seconds (and torch)
    problems += flag_problems(config, installed_server_args() if config.sglang.server_args() else None)
    problems += unbuilt_problems(config)
    problems += checkpoint_problems(config)
    backend_check = backend_spec(config.placement.train_backend).preflight
    if backend_check is not None:
        problems += backend_check(config)
    if problems:
        raise StageInputError("the train stage cannot start", problems,
                              "In a pipeline these come from the model and preprocess stages; alone, pass them "
                              "(the data flags: a raw JSONL, JSON, CSV or parquet dataset, or the preprocess stage's "
                              "prompt parquet, a file or a set's directory).")
    check_plugins(config)
    num_engines = max(1, (config.placement.rollout_num_gpus or 1) // config.placement.rollout_num_gpus_per_engine)
    return RolloutSetup(hf_checkpoint=config.checkpoint.hf_checkpoint, prompt_data=config.data.prompt_data,
                        eval_prompt_data=dict(config.eval.eval_prompt_data), num_engines=num_engines,
                        # as slime: --sglang-server-concurrency requests in flight per engine
                        concurrency=int(config.sglang.args.get("server_concurrency", 512)) * num_engines)


def data_problems(config: TrainConfig, ctx: StageContext) -> list[str]:
    """--prompt-data and every --eval-prompt-data set (raw ones already preprocessed): there, readable, prompt
    parquet, not empty (before Ray, where a bad one would only show as a dead actor)."""
    sets = {f"--eval-prompt-data {name}": uri for name, uri in config.eval.eval_prompt_data.items()}
    if config.data.prompt_data is not None and config.data.data_source_path is None:  # else the class reads it
        sets = {"--prompt-data": config.data.prompt_data, **sets}
    return open_prompt_sets(sets, ctx.storage)[1]


def resolve_num_rollout(config: TrainConfig, prompt_data: str, ctx: StageContext) -> int:
    """--num-rollout, else --num-epoch epochs over the prompts (as slime: ceil(prompts / rollout_batch_size))."""
    if config.batch.num_rollout is not None:
        return config.batch.num_rollout

    prompts = len(PromptDataset(prompt_data, ctx.storage))
    assert config.batch.num_epoch is not None  # BatchConfig asks for --num-rollout or --num-epoch
    return config.batch.num_epoch * math.ceil(prompts / config.batch.rollout_batch_size)


class RolloutLog:
    """The loop's reporter: rollouts.jsonl (a line per rollout and per evaluation), row_ids.jsonl (the prompt row
    ids of each rollout) and `log_metrics` (MLflow) as they come.

    Each rollout is on record once: when the loop starts, lines for what it is about to redo (reported by a killed
    run after its last checkpoint) are dropped, and the lines kept are logged to `log_metrics` again, so that the
    MLflow run of this attempt (the flows open a new one per attempt) holds the whole history, each step once;
    the killed attempt's run keeps what it had logged.
    """

    def __init__(self, path: Path, log_metrics: Callable[[dict[str, float], int], None] | None = None):
        self.path = path
        self.log_metrics = log_metrics
        path.parent.mkdir(parents=True, exist_ok=True)

    def started(self, start_rollout_id: int, evaluates_first: bool, saved: dict[str, float] | None = None) -> None:
        def is_eval(record: dict[str, Any]) -> bool:
            return all(key.startswith("eval/") for key in record if key != "step")

        def kept(record: dict[str, Any]) -> bool:
            step = record["step"]
            return step < start_rollout_id or (is_eval(record) and step == start_rollout_id and not evaluates_first)

        records = [r for r in _read_jsonl(self.path) if kept(r)]
        last = start_rollout_id - 1
        if saved and not any(r["step"] == last and not is_eval(r) for r in records):
            # The killed run saved this rollout but died before its line: the metrics it had at the save.
            records.append({"step": last, **saved})
        _rewrite(self.path, records)
        ids = self.path.with_name("row_ids.jsonl")
        _rewrite(ids, [r for r in _read_jsonl(ids) if r["rollout_id"] < start_rollout_id])
        if self.log_metrics is not None:
            for record in records:
                self.log_metrics({k: v for k, v in record.items() if k != "step"}, record["step"])

    def generated(self, rollout_id: int, row_ids: list[list[str]]) -> None:
        self._append(self.path.with_name("row_ids.jsonl"),
                     {"rollout_id": rollout_id, "row_ids": [group[0] for group in row_ids]})

    def rollout(self, rollout_id: int, metrics: dict[str, float]) -> None:
        self._append(self.path, {"step": rollout_id, **metrics})
        if self.log_metrics is not None:
            self.log_metrics(metrics, rollout_id)

    def evaluation(self, version: int, metrics: dict[str, float]) -> None:
        if not metrics:
            return  # nothing was evaluated (no eval set, or --debug-train-only: no engine)
        self._append(self.path, {"step": version, **metrics})
        if self.log_metrics is not None:
            self.log_metrics(metrics, version)

    @staticmethod
    def _append(path: Path, record: dict[str, Any]) -> None:
        with path.open("a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")

    def read(self) -> list[dict[str, Any]]:
        return _read_jsonl(self.path)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a jsonl file ([] when absent); a last line cut short by a kill is left out."""
    if not path.exists():
        return []
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise ValueError(f"{path}, line {number}: not JSON ({line[:80]!r}); fix or delete the line") from None
    return records


def _rewrite(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace `path` with `records`, atomically (a kill leaves the old file or the new one)."""
    if not path.exists() and not records:
        return
    staged = path.with_name(f".{path.name}.tmp")
    staged.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    os.replace(staged, path)


def manifest(config: TrainConfig, ctx: StageContext, result: loop.LoopResult, history: RolloutLog,
             prepared: dict[str, PreparedSet] | None = None, unused_settings: list[str] | None = None) -> Manifest:
    """The latest checkpoint with the run's figures (with --debug-rollout-only, no trainer: the figures alone); raw
    data sets add their counts (data.SET.rows_in, .quarantined, ...) and where their prompt parquet, quarantine and
    preprocess manifest are (outputs data.SET.*). What --custom-config-path set is fact `custom_config`, with the
    settings no plug-in read (`unused`)."""
    root = config.checkpoint.save
    outputs = {"hf_checkpoint": config.checkpoint.hf_checkpoint, "rollouts": str(history.path),
               "row_ids": str(history.path.with_name("row_ids.jsonl"))}
    records, latest = [], None
    if not config.debug.debug_rollout_only:
        latest = checkpoints.find_latest(ctx.storage, root)
        if latest is None:
            raise RuntimeError(f"training finished but {root} holds no complete checkpoint")
        records = fingerprint(Path(latest.uri), ctx.storage)
        outputs.update({"checkpoint": latest.uri, "checkpoint_root": root})
    data_counts, data_outputs = manifest_entries(prepared or {})
    outputs.update(data_outputs)
    curve = plot_curves(history.read(), ctx.workdir / "train" / "reward_curve.png")
    if curve is not None:
        uri = join(ctx.output, "train", "reward_curve.png")
        ctx.storage.put_file(curve, uri)
        outputs["reward_curve"] = uri
    evals = sorted(result.eval_history.items())
    return Manifest(
        stage="train", outputs=outputs, artifacts=records, artifact_root=latest and latest.uri,
        counts={"num_rollout": result.num_rollout, "start_rollout_id": result.start_rollout_id,
                "rollouts_run": len(result.row_ids), **({"iteration": int(latest.iteration)} if latest else {}),
                **data_counts},
        hashes={"content": content_hash(records)},
        facts={"eval_first": evals[0][1] if evals else {}, "eval_last": evals[-1][1] if evals else {},
               "last_metrics": result.last_metrics,
               **({"custom_config": {**config.custom_config, "unused": unused_settings or []}}
                  if config.custom_config_path else {})},
        config=config.model_dump(mode="json"),
    )
