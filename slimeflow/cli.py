"""`slimeflow`: a subcommand per stage, `run` for the whole pipeline, `deploy` for Prefect deployments.

    slimeflow run examples/tiny.yaml [--flag value ...]      the pipeline, flags routed to the stages
    slimeflow <stage> [section.yaml] [--flag value ...]      one stage (model, convert, preprocess, train, ...)
    slimeflow <command> --help                               every flag under slime's name
    ... --print-config                                       validate and print the resolved config as YAML
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import nullcontext

import yaml

from slimeflow import __version__, stages
from slimeflow.config.base import replace
from slimeflow.config.flags import add_flags
from slimeflow.config.pipeline import (
    STAGE_CONFIGS,
    STAGE_INDEX,
    TOP_INDEX,
    load_pipeline_config,
    load_stage_config,
)
from slimeflow.config.slime_flags import deferring_refusals
from slimeflow.config.train import TrainConfig
from slimeflow.config.train_validation import slime_megatron_differences
from slimeflow.config.yaml_file import read_yaml
from slimeflow.errors import ConfigError, StageInputError
from slimeflow.supervise import kill_descendants, reaped_with_this_process

EXIT_CONFIG = 2
STOP_DEADLINE_S = 8.0
"""How long a run stopped by SIGTERM or SIGHUP may take to unwind before the driver kills what it started and
exits anyway."""
CONVERT_DIRECTIONS = ("hf-to-torch-dist", "torch-dist-to-hf")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_overview())
        return 0
    if argv[0] == "--version":
        print(__version__)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "deploy":
        from slimeflow.deployments.deploy import main as deploy_main

        return deploy_main(rest)
    if command != "run" and command not in STAGE_CONFIGS:
        print(f"slimeflow: unknown command {command!r}; commands: run, {', '.join(STAGE_CONFIGS)}, deploy",
              file=sys.stderr)
        return EXIT_CONFIG
    only_stage = None if command == "run" else command
    if command == "convert" and rest and rest[0] in CONVERT_DIRECTIONS:
        rest = ["--direction", *rest]  # `slimeflow convert hf-to-torch-dist ...`, as the direction positional
    if "-h" in rest or "--help" in rest:
        _help_parser(command, only_stage).print_help()
        return 0
    printing = "--print-config" in rest
    try:
        with deferring_refusals() if printing else nullcontext({}) as refused:
            config, section = _load(command, rest, only_stage)
    except (ConfigError, OSError) as err:
        print(f"slimeflow {command}: {err}", file=sys.stderr)
        return EXIT_CONFIG
    if printing:
        dumped = config.model_dump(mode="json", exclude_none=True)
        print(yaml.safe_dump({section: dumped} if section else dumped, sort_keys=False), end="")
        if refused:
            lines = [f"  {flag}: {reason}" for flag, reason in refused.items()]
            print(f"slimeflow {command}: the config above leaves out {len(refused)} slime flag(s) that slimeflow "
                  "does not support yet; a run with them is refused before any work:", *lines, sep="\n",
                  file=sys.stderr)
        for note in slime_megatron_differences(_train_section(config)):
            print(f"slimeflow {command}: note: {note}", file=sys.stderr)
        return 0
    problems = [f"{stage}: {problem}" for stage in config.stages if stage in stages.available()
                for problem in stages.preflight(stage, getattr(config, stage))]
    if problems:  # before Prefect, Ray or an engine starts: in seconds, not after them
        error = StageInputError("the run cannot start", problems, "Nothing was started.")
        print(f"slimeflow: the run failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return _execute(config)


def _train_section(config):
    """The train stage's config in what --print-config resolved (a pipeline, or the train stage alone), else None."""
    return config if isinstance(config, TrainConfig) else getattr(config, "train", None)


def _load(command: str, rest: list[str], only_stage: str | None):
    data, flags = {}, [a for a in rest if a != "--print-config"]
    if flags and not flags[0].startswith("--"):
        path, flags = flags[0], flags[1:]
        data = read_yaml(path)
        if only_stage is not None and only_stage not in data:
            data = {only_stage: data}  # a bare stage section
        where = path
    else:
        if command == "run":
            raise ConfigError(["give a pipeline YAML file: slimeflow run CONFIG.yaml [--flag value ...]"])
        where = "command line"
    if only_stage is not None:
        data = {k: v for k, v in data.items() if k not in STAGE_CONFIGS or k == only_stage}
        if only_stage not in stages.available() and "--print-config" in rest:
            # Translate and validate a stage that cannot run yet: its section alone.
            return load_stage_config(only_stage, data.get(only_stage), flags), only_stage
    config = load_pipeline_config(data, flags, os.environ, only_stage=only_stage, where=where)
    return replace(config, show_progress=sys.stderr.isatty()), None



class Stopped(KeyboardInterrupt):
    """The driver got SIGTERM, SIGHUP or SIGINT: raised where it runs (a KeyboardInterrupt, as Python's own SIGINT
    is), so that every `finally` of the run stops what it started (Ray, engines, Prefect's ephemeral server) before
    the driver exits, within STOP_DEADLINE_S (SIGINT too: a fresh-clone run under load 7 was still unwinding 15 s
    after Python's own KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signal = signum


def _stop_run(signum: int, frame) -> None:
    signal.signal(signum, signal.SIG_DFL)  # a second one ends the driver at once (its children die with it)
    _exit_by_deadline(128 + signum)
    raise Stopped(signum)


def _exit_by_deadline(code: int) -> None:
    """End the driver STOP_DEADLINE_S from now if the unwinding has not: an exception raised from a signal handler
    can land inside a library's own locking (it was seen inside MLflow's first migrations) and hang there."""

    def deadline() -> None:
        time.sleep(STOP_DEADLINE_S)
        print(f"slimeflow: the run did not stop within {STOP_DEADLINE_S:g} s; killing what it started",
              file=sys.stderr)
        kill_descendants()
        os._exit(code)

    threading.Thread(target=deadline, name="stop-deadline", daemon=True).start()


def _execute(config) -> int:
    from prefect.exceptions import TerminationSignal

    from slimeflow.flows.runner import run_pipeline

    stops = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    previous = {signum: signal.signal(signum, _stop_run) for signum in stops}
    try:
        with reaped_with_this_process():  # a SIGKILLed driver: what its children started is killed too
            manifests = run_pipeline(config)
    except Exception as err:  # the flow already logged the traceback; the user gets one clear line
        print(f"slimeflow: the run failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, TerminationSignal) as err:
        # SIGINT, ours (Stopped), or Prefect's TerminationSignal: its SIGTERM handler is in place while a flow runs.
        # The run's own `finally`s stopped what they knew of; a process Ray was still starting, say, is left.
        kill_descendants()
        signum = getattr(err, "signal", signal.SIGINT)
        print(f"slimeflow: the run was stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    except SystemExit:  # Ray's SIGTERM handler, in place while ray.init runs, exits
        kill_descendants()
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for stage, manifest in manifests.items():
        outputs = ", ".join(f"{k}={v}" for k, v in manifest["outputs"].items())
        print(f"{stage}: {outputs}")
    if "train" in manifests:
        for change in held_out_change(manifests["train"]):
            print(f"train: held-out {change}")
    print(f"manifests under {config.output}/manifests; MLflow: {config.tracking_uri()}")
    return 0


def held_out_change(train_manifest: dict) -> list[str]:
    """'eval/SET/avg_at_1: FIRST -> LAST (N prompts)' for each held-out set the train stage evaluated: whether the run
    made the model better is the line a user looks for first."""
    facts = train_manifest.get("facts") or {}
    first, last = facts.get("eval_first") or {}, facts.get("eval_last") or {}
    lines = []
    for key in sorted(first):
        if key.endswith("/avg_at_1") and key in last:
            prompts = last.get(key.removesuffix("avg_at_1") + "prompts")
            counted = f" ({prompts:g} prompts)" if prompts is not None else ""
            lines.append(f"{key}: {first[key]:.3f} -> {last[key]:.3f}{counted}")
    return lines


def _help_parser(command: str, only_stage: str | None) -> argparse.ArgumentParser:
    description = (
        stages.__doc__ if only_stage is None else (STAGE_CONFIGS[only_stage].__doc__ or "")
    )
    usage = (f"slimeflow {command} CONFIG.yaml [--flag value ...] [--print-config]" if only_stage is None
             else f"slimeflow {command} [SECTION.yaml] [--flag value ...] [--print-config]")
    parser = argparse.ArgumentParser(prog=f"slimeflow {command}", usage=usage, description=description,
                                     allow_abbrev=False, add_help=False)
    own = frozenset(STAGE_INDEX[only_stage].by_flag) if only_stage else frozenset()
    add_flags(parser, TOP_INDEX, "run.", skip=own)
    if only_stage is not None:
        add_flags(parser, STAGE_INDEX[only_stage])
        if only_stage not in stages.available():
            parser.epilog = (f"The {only_stage} stage is not available in this version; --print-config validates "
                             "and translates a slime flag list into its YAML section.")
    else:
        for name, index in STAGE_INDEX.items():
            group = parser.add_argument_group(f"{name} stage", f"flags of `slimeflow {name}` (see its --help); "
                                              f"a flag several stages define is spelled --{name}.FLAG")
            group.add_argument(f"--{name}.FLAG", help=f"{len(index.by_flag)} flags", metavar="VALUE")
    return parser


def _overview() -> str:
    rows = [f"  {name:<11} {(STAGE_CONFIGS[name].__doc__ or '').strip().splitlines()[0]}"
            + ("" if name in stages.available() else "  [not available yet]") for name in STAGE_CONFIGS]
    return "\n".join([(__doc__ or "").strip(), "", "stages:", *rows])


if __name__ == "__main__":
    sys.exit(main())
