"""Metric sinks beside MLflow (--use-wandb, --use-tensorboard): the train stage's metrics, same names and steps.

slime logs to Weights & Biases and TensorBoard; a slime user's dashboards keep working when the same metric names
arrive there. MLflow stays the record (the flows log to it); these are extra copies, opened when the stage starts
(a missing package or setting is refused before any work) and closed when it ends, whatever happens.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import secrets
import string
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from slimeflow.config.train import LoggingConfig
from slimeflow.errors import StageInputError

LogMetrics = Callable[[dict[str, float], int], None]


class Sink(Protocol):
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class WandbSink:
    """One W&B run: a rollout's metrics (rollout/*, the trainer's, time/*) against rollout/step, evaluations against
    eval/step, as slime defines its step metrics."""

    def __init__(self, config: LoggingConfig, directory: Path, run_config: Mapping[str, Any]):
        import wandb  # an optional dependency (--use-wandb)

        if config.wandb_key and config.wandb_mode != "offline":
            wandb.login(key=config.wandb_key, host=config.wandb_host)
        suffix = "" if config.disable_wandb_random_suffix else "_" + "".join(
            secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(entity=config.wandb_team, project=config.wandb_project,
                              group=f"{config.wandb_group}{suffix}", name=f"{config.wandb_group}{suffix}",
                              dir=str(directory), mode=config.wandb_mode, id=config.wandb_run_id,
                              resume="allow" if config.wandb_run_id else None, config=dict(run_config))
        for prefix in ("rollout", "eval"):
            self.run.define_metric(f"{prefix}/step")
        self.defined: set[str] = set()

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """A rollout's metrics at rollout/step = its id; an evaluation's at eval/step = the weights' version. Each
        metric's step metric is defined by its exact name when first logged: with overlapping globs ("eval/*" and
        "*") W&B picked either one, now and then giving an evaluation row a rollout/step too (1 run in 15)."""
        evaluation = all(key.startswith("eval/") for key in metrics)
        step_metric = "eval/step" if evaluation else "rollout/step"
        for key in metrics.keys() - self.defined:
            self.run.define_metric(key, step_metric=step_metric)
            self.defined.add(key)
        self.run.log({**metrics, step_metric: step})

    def close(self) -> None:
        import wandb  # an optional dependency (--use-wandb)

        self.run.finish()
        wandb.teardown()  # stops the wandb-core process this run started


class TensorboardSink:
    def __init__(self, directory: Path):
        from torch.utils.tensorboard import SummaryWriter  # an optional dependency (--use-tensorboard)

        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.writer = SummaryWriter(str(directory))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def tensorboard_dir(config: LoggingConfig, workdir: Path, environ: Mapping[str, str] = os.environ) -> Path:
    """$TENSORBOARD_DIR, else <workdir>/train/tensorboard_log/<project>/<experiment> (slime's layout)."""
    if environ.get("TENSORBOARD_DIR"):
        return Path(environ["TENSORBOARD_DIR"])
    if config.tb_project_name is None:
        raise StageInputError("--use-tensorboard", ["no log directory: neither --tb-project-name nor "
                                                    "TENSORBOARD_DIR is set"],
                              "Pass --tb-project-name NAME (and --tb-experiment-name), or set TENSORBOARD_DIR.")
    experiment = config.tb_experiment_name or datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    return workdir / "train" / "tensorboard_log" / config.tb_project_name / experiment


def open_sinks(config: LoggingConfig, workdir: Path, run_config: Mapping[str, Any]) -> list[Sink]:
    """The sinks the flags ask for, opened (a missing package is refused here, naming the extra to install)."""
    wanted = [name for name, on in (("wandb", config.use_wandb), ("tensorboard", config.use_tensorboard)) if on]
    missing = [name for name in wanted if not _importable(name)]
    if missing:
        raise StageInputError(" ".join(f"--use-{name}" for name in missing), [f"{name} is not installed"
                                                                            for name in missing],
                              "Install the tracking extra: pip install 'slimeflow[tracking]'.")
    sinks: list[Sink] = []
    try:
        if config.use_tensorboard:
            sinks.append(TensorboardSink(tensorboard_dir(config, workdir)))
        if config.use_wandb:
            directory = Path(config.wandb_dir) if config.wandb_dir else workdir / "train" / "wandb"
            sinks.append(WandbSink(config, directory, run_config))
    except BaseException:
        close_sinks(sinks)
        raise
    return sinks


def fan_out(first: LogMetrics | None, sinks: list[Sink]) -> LogMetrics | None:
    """One log_metrics that feeds MLflow's (the flows') and every sink."""
    if not sinks:
        return first

    def log(metrics: dict[str, float], step: int) -> None:
        if first is not None:
            first(metrics, step)
        for sink in sinks:
            sink.log(metrics, step)

    return log


def close_sinks(sinks: list[Sink]) -> None:
    for sink in sinks:
        sink.close()


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None
