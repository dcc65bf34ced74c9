"""The pipeline config: one section per stage, loaded from YAML and overridden by slime-spelled flags.

`slimeflow run demo.yaml --rollout-batch-size 32` routes each flag to the stage section that defines it. A flag
that several stages define with one meaning (SHARED, e.g. --input-key) goes to each configured section; any other
flag that several stages define must say which: `--train.save DIR`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from slimeflow.config.base import ConfigModel, replace
from slimeflow.config.convert import ConvertConfig
from slimeflow.config.evaluate import EvaluateConfig
from slimeflow.config.export import ExportConfig
from slimeflow.config.flags import FlagIndex, merge, nest_keys, parse_flags, validate
from slimeflow.config.infra import InfraConfig
from slimeflow.config.model import ModelConfig
from slimeflow.config.model_args import TRAINING_ONLY
from slimeflow.config.preprocess import PreprocessConfig
from slimeflow.config.slime_flags import deferred, explain_unknown
from slimeflow.config.train import MegatronConfig, TrainConfig
from slimeflow.errors import ConfigError

PIPELINE_ORDER: tuple[str, ...] = ("model", "convert", "preprocess", "train", "evaluate", "export")
"""The stages, in the order a pipeline runs them."""

STAGE_CONFIGS: dict[str, type[ConfigModel]] = {
    "model": ModelConfig,
    "convert": ConvertConfig,
    "preprocess": PreprocessConfig,
    "train": TrainConfig,
    "evaluate": EvaluateConfig,
    "export": ExportConfig,
}

SHARED = frozenset({
    "input_key", "label_key", "metadata_key", "tool_key", "apply_chat_template", "rollout_max_prompt_len",
    "eval_prompt_data", "n_samples_per_eval_prompt", "eval_max_response_len", "eval_temperature", "eval_top_p",
    "eval_top_k", "rm_type", *MegatronConfig.model_fields,  # slime's MODEL_ARGS: convert and train read them alike
})
"""Flags that mean the same in every stage that defines them."""

PIPELINE_OWNED = {"--hf-checkpoint": "model"}
"""In a pipeline, the base checkpoint is the model stage's input; later stages get its resolved local copy."""

STAGE_OUTPUT = {"preprocess": "output"}
"""A stage's own flag for where it writes. Run alone (`slimeflow preprocess --output DIR`) with no --workdir or
--output of the run, the stage's run files (manifests, MLflow store, lock) go there too, not to ./runs/<name>."""

log = logging.getLogger("slimeflow.config")

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class RunSettings(ConfigModel):
    """What every stage flow needs besides its config: the run's name, directories and infrastructure."""

    name: str = "slimeflow"
    """Run name: the MLflow experiment and the default work directory runs/<name>."""
    workdir: str | None = None
    """Local directory for scratch files and the embedded MLflow database (default: runs/<name>)."""
    output: str | None = None
    """Artifact root: a local path or s3:// URI (default: the work directory)."""
    show_progress: bool = False
    """Draw progress bars for long work (the CLI turns this on at a terminal)."""
    infra: InfraConfig = Field(default_factory=InfraConfig)

    @model_validator(mode="after")
    def _directories(self) -> RunSettings:
        if not _NAME.match(self.name):
            raise ValueError(f"--name {self.name!r}: use letters, digits, '.', '_' and '-' (it names a directory)")
        workdir = self.workdir or str(Path("runs") / self.name)
        self.__dict__.update(workdir=workdir, output=self.output or workdir)
        return self

    def tracking_uri(self) -> str:
        """The MLflow tracking URI: the configured server, else sqlite inside the work directory."""
        return self.infra.mlflow_tracking_uri or f"sqlite:///{Path(self.workdir).resolve() / 'mlflow.db'}"


class PipelineConfig(RunSettings):
    """The whole pipeline: the run settings, which stages run, and one config per stage."""

    stages: list[str] | None = None
    """Stages to run, in pipeline order (default: every available stage that is configured)."""
    model: ModelConfig | None = None
    convert: ConvertConfig | None = None
    preprocess: PreprocessConfig | None = None
    train: TrainConfig | None = None
    evaluate: EvaluateConfig | None = None
    export: ExportConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        """`hf_checkpoint: X` at the top is the model stage's input (in YAML files and Prefect parameters alike)."""
        if isinstance(data, Mapping) and "hf_checkpoint" in data:
            data = dict(data)
            model = dict(data.get("model") or {})
            model.setdefault("hf_checkpoint", data.pop("hf_checkpoint"))
            data["model"] = model
        return data

    @model_validator(mode="after")
    def _stages(self) -> PipelineConfig:
        configured = [s for s in PIPELINE_ORDER if getattr(self, s) is not None]
        chosen = self.stages if self.stages is not None else configured
        unknown = [s for s in chosen if s not in PIPELINE_ORDER]
        if unknown:
            raise ValueError(f"--stages {unknown}: unknown stage; the stages are {', '.join(PIPELINE_ORDER)}")
        unconfigured = [s for s in chosen if getattr(self, s) is None]
        if unconfigured:
            raise ValueError(f"--stages: {', '.join(unconfigured)} selected but has no config section")
        if not chosen:
            raise ValueError(f"no stage to run: configure at least one of {', '.join(PIPELINE_ORDER)}")
        self.__dict__["stages"] = [s for s in PIPELINE_ORDER if s in chosen]
        return self

    def settings(self) -> RunSettings:
        return RunSettings.model_validate(self.model_dump(include=set(RunSettings.model_fields)))


class _TopLevel(RunSettings):
    """The pipeline's own flags (not a stage's): run settings and the stage list."""

    stages: list[str] | None = None
    """Stages to run, in pipeline order."""


TOP_INDEX = FlagIndex(_TopLevel)
STAGE_INDEX = {name: FlagIndex(cls) for name, cls in STAGE_CONFIGS.items()}


def load_pipeline_config(
    data: Mapping[str, Any] | None = None,
    argv: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
    *,
    only_stage: str | None = None,
    where: str = "config",
) -> PipelineConfig:
    """YAML data, then flags, then the environment for unset endpoints -> a validated PipelineConfig.

    With `only_stage`, every stage flag goes to that stage and only that stage runs (a stage subcommand).
    """
    tree = _nest_sections(dict(data or {}), where)
    tree = merge(tree, _route_flags(argv, tree, only_stage))
    if only_stage is not None:
        tree["stages"] = [only_stage]
        tree.setdefault(only_stage, {})
        tree = _run_files_under_stage_output(tree, only_stage)
    problems: list[str] = []
    for name in STAGE_CONFIGS:  # sections first, so that errors name the stage's own flags
        if tree.get(name) is not None:
            try:
                section = validate(STAGE_CONFIGS[name], tree[name], STAGE_INDEX[name], f"{where}: {name}")
                _log_overrides(name, section)
            except ConfigError as err:
                problems += [f"{name}: {problem}" for problem in err.problems]
    if problems:  # every broken section at once, not one per attempt
        raise ConfigError(problems, where)
    config = validate(PipelineConfig, tree, TOP_INDEX, where)
    if environ is not None:
        config = replace(config, infra=config.infra.with_environment(environ))
    return config


def _log_overrides(stage: str, section: ConfigModel) -> None:
    """Each flag a --custom-config-path file overrides, once, with its old and new value, as slime prints them
    (here, where the section is first validated from the flags: a copy validated from its values sees no change)."""
    for key, (old, new) in getattr(section, "custom_overrides", {}).items():
        log.warning("%s: --custom-config-path %s: %s overrides the flag: %r -> %r", stage,
                    section.custom_config_path, key, old, new)


def _run_files_under_stage_output(tree: dict[str, Any], stage: str) -> dict[str, Any]:
    """The run's work directory (a local stage output) or output root (a remote one) defaults to the stage's own
    output flag (STAGE_OUTPUT), where the run sets neither."""
    own = (tree.get(stage) or {}).get(STAGE_OUTPUT.get(stage, ""))
    if own is None or tree.get("workdir") is not None or tree.get("output") is not None:
        return tree
    remote = "://" in str(own) and not str(own).startswith("file://")
    return {**tree, ("output" if remote else "workdir"): str(own).removeprefix("file://")}


def load_stage_config(stage: str, data: Mapping[str, Any] | None = None, argv: Sequence[str] = ()) -> ConfigModel:
    """One stage's config from a YAML section and flags (no pipeline around it)."""
    index = STAGE_INDEX[stage]
    tree = merge(nest_keys(data or {}, index, stage), parse_flags(argv, index, prog=f"slimeflow {stage}"))
    return validate(STAGE_CONFIGS[stage], tree, index, stage)


def _nest_sections(data: dict[str, Any], where: str) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in data.items():
        try:
            if key in STAGE_CONFIGS:
                tree[key] = None if value is None else nest_keys(value, STAGE_INDEX[key], f"{where}: {key}")
            elif key == "hf_checkpoint":
                tree.setdefault("model", {})["hf_checkpoint"] = value
            else:
                tree = merge(tree, nest_keys({key: value}, TOP_INDEX, where))
        except ConfigError as err:
            problems += err.problems
    if problems:
        raise ConfigError(problems, where)
    return tree


def _split(argv: Sequence[str]) -> list[tuple[str, list[str]]]:
    """argv -> [(flag, values)]; values are the tokens up to the next `--flag`."""
    out: list[tuple[str, list[str]]] = []
    for token in argv:
        if token.startswith("--"):
            flag, eq, value = token.partition("=")
            out.append((flag, [value] if eq else []))
        elif out:
            out[-1][1].append(token)
        else:
            raise ConfigError([f"{token!r}: a value with no flag before it; flags are spelled --name value"])
    return out


def _route_flags(argv: Sequence[str], tree: Mapping[str, Any], only_stage: str | None) -> dict[str, Any]:
    """Send each flag to the pipeline's own section or to the stage section(s) that define it."""
    per_section: dict[str, list[str]] = {}
    problems: list[str] = []
    for flag, values in _split(argv):
        targets = _targets(flag, tree, only_stage)
        if isinstance(targets, str):
            problems.append(targets)
            continue
        for section, spelled in targets:
            per_section.setdefault(section, []).extend([spelled, *values])
    if problems:
        raise ConfigError(problems, "command line")
    routed: dict[str, Any] = {}
    for section, args in per_section.items():
        if section == "":
            routed = merge(routed, parse_flags(args, TOP_INDEX))
        else:
            routed = merge(routed, {section: parse_flags(args, STAGE_INDEX[section], prog=f"slimeflow {section}")})
    return routed


def _targets(flag: str, tree: Mapping[str, Any], only_stage: str | None) -> list[tuple[str, str]] | str:
    """Where one flag goes, as [(section, flag spelling)], or a message saying why it cannot be placed."""
    stage, dot, bare = flag.removeprefix("--").partition(".")
    if dot:
        if stage not in STAGE_INDEX:
            return f"{flag}: {stage!r} is not a stage; the stages are {', '.join(STAGE_INDEX)}"
        return [(stage, "--" + bare)]
    if only_stage is not None:  # a stage subcommand: the stage's own flag wins (preprocess --output)
        own = STAGE_INDEX[only_stage]
        if own.takes(flag) or (flag.startswith(("--sglang-", "--router-")) and own.passthrough):
            return [(only_stage, flag)]
        if flag in TOP_INDEX.by_flag:
            return [("", flag)]
        return [] if deferred(flag) else explain_unknown(flag, [*own.by_flag, *TOP_INDEX.by_flag])
    if flag in TOP_INDEX.by_flag:
        return [("", flag)]
    if flag in PIPELINE_OWNED:
        return [(PIPELINE_OWNED[flag], flag)]
    if flag.startswith(("--sglang-", "--router-")):
        return [("train", flag)]
    owners = [name for name, index in STAGE_INDEX.items() if index.takes(flag)]
    if len(owners) == 1:
        return [(owners[0], flag)]
    if not owners:
        known = sorted({f for index in STAGE_INDEX.values() for f in index.by_flag} | set(TOP_INDEX.by_flag))
        return [] if deferred(flag) else explain_unknown(flag, known)
    field = flag.removeprefix("--").replace("-", "_")
    if field in SHARED:
        if field in TRAINING_ONLY:  # a training setting: the converter writes one checkpoint for every layout
            owners = [name for name in owners if name != "convert"]
        present = [name for name in owners if tree.get(name) is not None]
        if not present:
            return f"{flag}: no configured stage takes it (defined by {', '.join(owners)}); add that stage's section"
        return [(name, flag) for name in present]
    spelled = " or ".join(f"--{name}.{flag.removeprefix('--')}" for name in owners)
    return f"{flag}: stages {', '.join(owners)} each define it with their own meaning; say which: {spelled}"
