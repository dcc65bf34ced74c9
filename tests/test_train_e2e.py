"""The loop end to end on a tiny model: the whole pipeline under Prefect, learning on the demo task, and a
training stage killed with SIGKILL after its first checkpoint that resumes with the same data order."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_sessions import wait_until_gone

from slimeflow.config.pipeline import load_pipeline_config
from slimeflow.io.guard import ABANDONED

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "data"
MODEL = "tiny:llama?seed=0&hidden_size=128&intermediate_size=256"

pytestmark = pytest.mark.slow


def demo_train(**overrides) -> dict:
    """The demo's train section (examples/demo.yaml), shortened by `overrides`."""
    section = {"rollout-batch-size": 16, "n-samples-per-prompt": 16, "num-rollout": 150,
               "rollout-max-response-len": 1, "rollout-temperature": 1.5, "rollout-shuffle": True,
               "rm-type": "prefix_match", "lr": 1.0e-3, "use-dynamic-batch-size": True, "max-tokens-per-gpu": 8192,
               "eval-interval": 25, "eval-temperature": 0.0, "save-interval": 50}
    section.update(overrides)
    return section


def pipeline_data(tmp_path: Path, mlflow_uri: str, train: dict) -> dict:
    return {
        "name": "e2e", "hf_checkpoint": MODEL, "workdir": str(tmp_path), "infra": {"mlflow_tracking_uri": mlflow_uri},
        "convert": {"processes": 1},
        "preprocess": {"input": [str(DATA / "increment-train.jsonl")],
                       "eval_input": {"increment": str(DATA / "increment-eval.jsonl")},
                       "input_key": "prompt", "label_key": "label"},
        "train": train,
        "evaluate": {"eval-temperature": 0.0, "eval-max-response-len": 1, "rm-type": "prefix_match"},
        "export": {},
    }


def test_pipeline_trains_evaluates_exports_and_a_rerun_skips_every_stage(prefect_harness, tmp_path, mlflow_uri):
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM

    from slimeflow.flows.runner import run_pipeline

    # Two data-parallel TrainActors (gloo), so the pipeline also runs the DP path: gradients all-reduced, every
    # rank in the collective save (the one after the last rollout: each save is a conversion process of its own).
    train = demo_train(**{"num-rollout": 4, "rollout-batch-size": 4, "n-samples-per-prompt": 4,
                          "eval-interval": 2, "save-interval": None, "actor-num-gpus-per-node": 2})
    config = load_pipeline_config(pipeline_data(tmp_path, mlflow_uri, train))
    manifests = run_pipeline(config)
    assert list(manifests) == ["model", "convert", "preprocess", "train", "evaluate", "export"]

    trained = manifests["train"]
    assert trained["counts"]["rollouts_run"] == 4 and trained["outputs"]["checkpoint"].endswith("iter_0000003")
    assert trained["config"]["placement"]["actor_num_gpus_per_node"] == 2
    assert trained["config"]["checkpoint"]["ref_load"] == manifests["convert"]["outputs"]["torch_dist"]
    assert trained["config"]["data"]["prompt_data"] == manifests["preprocess"]["outputs"]["train"]
    assert manifests["evaluate"]["outputs"]["checkpoint"] == trained["outputs"]["checkpoint"]
    assert "eval/increment/avg_at_1" in manifests["evaluate"]["metrics"]
    assert manifests["export"]["outputs"]["checkpoint"] == trained["outputs"]["checkpoint"]
    assert Path(trained["outputs"]["reward_curve"]).stat().st_size > 1000
    model = AutoModelForCausalLM.from_pretrained(manifests["export"]["outputs"]["hf_model"])
    assert model.config.hidden_size == 128

    client = MlflowClient(mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    train_run = next(r for r in runs if r.info.run_name == "train")
    history = client.get_metric_history(train_run.info.run_id, "rollout/reward_mean")
    assert sorted(m.step for m in history) == [0, 1, 2, 3]
    assert client.get_metric_history(train_run.info.run_id, "pg_loss")
    assert train_run.data.tags["manifest_uri"].endswith("manifests/train.json")

    again = run_pipeline(load_pipeline_config(pipeline_data(tmp_path, mlflow_uri, train)))
    assert {stage: m["created_at"] for stage, m in again.items()} == \
        {stage: m["created_at"] for stage, m in manifests.items()}  # every stage reused, nothing rerun


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


def test_the_demo_task_is_learned(tmp_path):
    from slimeflow.stages.train.stage import run

    # With TensorBoard as a second sink (slime's --use-tensorboard): the stage opens it, feeds it and closes it.
    # No interval saves (the run still saves after its last rollout): each save converts the weights in a process
    # of its own, and what this test checks (learning, the sinks, log-prob drift) does not read a checkpoint.
    config, ctx = train_config(tmp_path, **{"use-tensorboard": True, "tb-project-name": "demo",
                                            "tb-experiment-name": "e2e", "save-interval": None})
    manifest = run(config, ctx)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "train" / "tensorboard_log" / "demo" / "e2e"))
    events.Reload()
    assert [e.step for e in events.Scalars("rollout/reward_mean")] == list(range(config.batch.num_rollout))
    before = manifest.facts["eval_first"]["eval/increment/avg_at_1"]
    after = manifest.facts["eval_last"]["eval/increment/avg_at_1"]
    # Greedy accuracy on the 20 held-out sums: a random model answers ~0-10% right.
    assert after >= before + 0.3, (before, after)
    # Every rollout was sampled with the weights the trainer had: the engine's log-probs of the sampled tokens equal
    # the trainer's (measured: at most 3.4e-7 over 60 rollouts; one optimizer step moves them by ~1e-3 or more).
    rows = [json.loads(line) for line in (ctx.workdir / "train" / "rollouts.jsonl").read_text().splitlines()]
    drift = [r["train_rollout_logprob_abs_diff"] for r in rows if "train_rollout_logprob_abs_diff" in r]
    assert len(drift) == config.batch.num_rollout and max(drift) < 1e-5, drift


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


def test_sigkill_after_the_first_checkpoint_resumes_with_the_same_data_order(tmp_path):
    # Four rollouts, a checkpoint every second: the kill lands in the save of the last one (3) once 1 is committed,
    # and the resumed run redoes rollouts 2 and 3 (each more rollout or save is seconds, and checks nothing new).
    config, _ = train_config(tmp_path / "prep", **{"num-rollout": 4, "save-interval": 2, "eval-interval": None,
                                                   "rollout-batch-size": 4, "n-samples-per-prompt": 2})
    # The uninterrupted run serves its engine from a process of its own (--engine-in-process false), the killed and
    # resumed one from a thread of the RolloutManager (the default): the data order depends on neither. Nor on the
    # saves: the uninterrupted run saves only after its last rollout (each save is a conversion process).
    own_process = config.model_copy(update={
        "placement": config.placement.model_copy(update={"engine_in_process": False}),
        "checkpoint": config.checkpoint.model_copy(update={"save_interval": None})})

    def only_the_committed_checkpoint_is_left(root: Path) -> None:
        # What the kill interrupted may leave a conversion's staging (ours by name); the resumed run removes it.
        left = sorted(p.name for p in root.iterdir() if not ABANDONED.match(p.name))
        assert left == [".slimeflow-run", "iter_0000001", "latest_checkpointed_iteration.txt"]

    root = kill_and_resume(own_process, config, tmp_path, staged=3, committed=1,
                           check_killed=only_the_committed_checkpoint_is_left)
    expected = row_ids(tmp_path / "straight")
    assert sorted(expected) == list(range(4))
    assert row_ids(tmp_path / "resumed") == expected
    log = (tmp_path / "resumed" / "train" / "rollouts.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in log]
    assert steps == [0, 1, 2, 3]  # each once: the killed run's rollout 2, redone after checkpoint 1, replaced
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "3"
