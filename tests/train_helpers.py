"""The train stage on the demo task for the tests of every tier: a train config over the demo data (the model and
preprocess stages run first), the stage in this process (run_stage) or in a process of its own (launch), and the
SIGKILL-mid-save-then-resume harness (kill_and_resume) with its readers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from paths import ROOT
from process_sessions import wait_until_gone

from slimeflow.io.guard import ABANDONED

DATA = ROOT / "examples" / "data"
MODEL = "tiny:llama?seed=0&hidden_size=128&intermediate_size=256"


def demo_train(**overrides) -> dict:
    """The demo's train section (examples/demo.yaml), shortened by `overrides`."""
    section = {"rollout-batch-size": 16, "n-samples-per-prompt": 16, "num-rollout": 150,
               "rollout-max-response-len": 1, "rollout-temperature": 1.5, "rollout-shuffle": True,
               "rm-type": "prefix_match", "lr": 1.0e-3, "use-dynamic-batch-size": True, "max-tokens-per-gpu": 8192,
               "eval-interval": 25, "eval-temperature": 0.0, "save-interval": 50}
    section.update(overrides)
    return section



def train_section(tmp_path: Path, model: str = MODEL, **overrides) -> dict:
    """The demo's train section (flag spelling) over the demo data, prepared by the model and preprocess stages in
    `tmp_path` (the model stage builds `model`): --hf-checkpoint, --prompt-data and --eval-prompt-data filled in."""
    from slimeflow.config.model import ModelConfig
    from slimeflow.config.preprocess import PreprocessConfig
    from slimeflow.io.storage import Storage
    from slimeflow.stages.base import StageContext
    from slimeflow.stages.model.stage import run as model_run
    from slimeflow.stages.preprocess.stage import run as preprocess_run

    ctx = StageContext(Storage(), tmp_path, str(tmp_path))
    hf = model_run(ModelConfig(hf_checkpoint=model), ctx).outputs["hf_checkpoint"]
    pre = preprocess_run(PreprocessConfig(input=[str(DATA / "increment-train.jsonl")], input_key="prompt",
                                          eval_input={"increment": str(DATA / "increment-eval.jsonl")},
                                          label_key="label"), ctx)
    section = demo_train(**overrides)
    section.update({"hf-checkpoint": hf, "prompt-data": pre.outputs["train"],
                    "eval-prompt-data": {"increment": pre.outputs["eval.increment"]}})
    return section


def train_config(tmp_path: Path, model: str = MODEL, **overrides):
    """A train-stage config over the demo data (train_section) and the stage context of `tmp_path`."""
    from slimeflow.config.pipeline import load_stage_config
    from slimeflow.config.train import TrainConfig
    from slimeflow.io.storage import Storage
    from slimeflow.stages.base import StageContext

    config = load_stage_config("train", train_section(tmp_path, model, **overrides))
    assert isinstance(config, TrainConfig)
    return config, StageContext(Storage(), tmp_path, str(tmp_path))



RESUME = """
import json, sys
from pathlib import Path
from slimeflow.io.storage import Storage
from slimeflow.stages.base import StageContext
from slimeflow.config.train import TrainConfig
from slimeflow.stages.train.stage import run
config = TrainConfig.model_validate_json(Path(sys.argv[1]).read_text())
run(config, StageContext(Storage(), Path(sys.argv[2]), sys.argv[2]))
"""


def launch(config, workdir: Path, log: Path | None = None) -> subprocess.Popen:
    """The train stage on `config` in a process (and session) of its own; its output goes to `log` (default
    <workdir>/run.log, what log_tail shows)."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(config.model_dump_json())
    with (log or workdir / "run.log").open("ab") as out:  # what a failed check shows (log_tail)
        return subprocess.Popen([sys.executable, "-c", RESUME, str(workdir / "config.json"), str(workdir)],
                                start_new_session=True, stdout=out, stderr=subprocess.STDOUT)


def log_tail(workdir: Path, lines: int = 30) -> str:
    path = workdir / "run.log"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no run.log)"


def row_ids(workdir: Path) -> dict[int, list[str]]:
    """The prompt row ids of each rollout (a line per rollout: a resumed run drops the killed run's lines for the
    rollouts it redoes)."""
    lines = (workdir / "train" / "row_ids.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len({r["rollout_id"] for r in records}) == len(records), "a rollout is on record twice"
    return {r["rollout_id"]: r["row_ids"] for r in records}


def kill_mid_save(victim: subprocess.Popen, workdir: Path, staged: int, committed: int) -> Path:
    """SIGKILL the train stage `victim` in the middle of its save of rollout `staged` (its staged directory is there,
    seconds before the commit), once checkpoint `committed` is committed; wait until every process of its session is
    gone and check the save it was making was not committed. Returns the checkpoint root."""
    root = workdir / "checkpoints"
    tracker = root / "latest_checkpointed_iteration.txt"
    deadline = time.time() + 300
    while victim.poll() is None and time.time() < deadline and not list(root.glob(f".iter_{staged:07d}.tmp-*")):
        time.sleep(0.005)
    assert tracker.exists() and tracker.read_text() == str(committed), (
        f"checkpoint {committed} should be committed before the kill; the run (exit {victim.poll()}) logged:\n"
        f"{log_tail(workdir)}")
    os.killpg(victim.pid, signal.SIGKILL)  # the driver, Ray's raylet and GCS, the engines
    victim.wait()
    # Ray's actors run in process groups of their own and die only once they notice their raylet's death, a second
    # or more later; the TrainActor, finding its raylet gone, must not commit the save it was making
    # (TrainActor.check_may_commit).
    wait_until_gone(session=victim.pid, timeout=60)
    assert tracker.read_text() == str(committed)
    return root


def kill_and_resume(straight_config, config, tmp_path: Path, staged: int, committed: int,
                    check_killed=lambda root: None) -> Path:
    """Run `straight_config` uninterrupted in tmp_path/straight beside `config` in tmp_path/resumed (separate Ray
    clusters and workdirs); SIGKILL the latter mid-save (kill_mid_save), call `check_killed(root)`, resume it to its
    end; every run must exit 0 and the resume must clear the killed save's staging. Returns the checkpoint root. A
    failed check leaves none of the runs behind."""
    launched: list[subprocess.Popen] = []
    try:
        launched.append(straight := launch(straight_config, tmp_path / "straight"))
        launched.append(victim := launch(config, tmp_path / "resumed"))
        root = kill_mid_save(victim, tmp_path / "resumed", staged=staged, committed=committed)
        check_killed(root)
        assert straight.wait(timeout=400) == 0, log_tail(tmp_path / "straight")
        launched.append(resumed := launch(config, tmp_path / "resumed"))
        assert resumed.wait(timeout=400) == 0, log_tail(tmp_path / "resumed")
        assert not [p.name for p in root.iterdir() if ABANDONED.match(p.name)]
        return root
    finally:
        for process in launched:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def flag_config(*flags: str):
    """A train config from slime-style flags (the batch flags filled in), for the checks that only parse."""
    from slimeflow.config.pipeline import load_stage_config

    return load_stage_config("train", None, ["--rollout-batch-size", "8", "--num-rollout", "10", *flags])


def run_stage(config, workdir: Path, monkeypatch) -> tuple[list[dict], list[str], object]:
    """Run the train stage in `workdir`; returns (rollouts.jsonl records, the actor classes created, manifest)."""
    from slimeflow.io.storage import Storage
    from slimeflow.stages.base import StageContext
    from slimeflow.stages.train import placement
    from slimeflow.stages.train.stage import run

    created: list[str] = []
    real = placement.hosted

    def spy(cls):
        created.append(cls.__name__)
        return real(cls)

    monkeypatch.setattr(placement, "hosted", spy)
    manifest = run(config, StageContext(Storage(), workdir, str(workdir)))
    lines = (workdir / "train" / "rollouts.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], created, manifest


def with_debug(config, **debug):
    return config.model_copy(update={"debug": config.debug.model_validate({**config.debug.model_dump(), **debug})})


