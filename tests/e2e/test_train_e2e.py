"""The loop end to end on a tiny model: the whole pipeline under Prefect (its manifests, its MLflow runs, a rerun that
reuses every stage) and learning on the demo task. A training stage killed with SIGKILL mid-save that resumes with
the same data order: tests/e2e/test_megatron_train.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_helpers import DATA, MODEL, demo_train, train_config

from slimeflow.config.pipeline import load_pipeline_config
from slimeflow.io.storage import ArtifactRecord, Storage

pytestmark = pytest.mark.slow


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


def test_pipeline_trains_evaluates_exports_and_a_rerun_skips_every_stage(prefect_harness, tmp_path, mlflow_uri,
                                                                        local_ray):
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM

    from slimeflow.flows.runner import run_pipeline

    # Two data-parallel TrainActors (gloo), so the pipeline also runs the DP path: gradients all-reduced, every
    # rank in the collective save (the one after the last rollout: each save is a conversion process of its own).
    # A custom config that sets a flag (to the value it has) and a setting no plug-in reads: both recorded.
    custom = tmp_path / "custom.yaml"
    custom.write_text("eval_interval: 2\nunread_setting: 1\n")
    train = demo_train(**{"num-rollout": 4, "rollout-batch-size": 4, "n-samples-per-prompt": 4,
                          "eval-interval": 2, "save-interval": None, "actor-num-gpus-per-node": 2,
                          "custom-config-path": str(custom)})
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

    # The model stage's manifest (test_flows.py's pipeline test, merged here): the checkpoint, its facts and figures,
    # the same content hash on disk, and every fingerprint verifies against the files.
    built = manifests["model"]
    checkpoint = Path(built["outputs"]["hf_checkpoint"])
    assert (checkpoint / "config.json").is_file()
    assert built["facts"]["model_type"] == "llama" and built["counts"]["parameters"] > 0
    manifest_uri = str(tmp_path / "manifests" / "model.json")
    on_disk = json.loads(Path(manifest_uri).read_text())
    assert on_disk["hashes"]["content"] == built["hashes"]["content"]
    for record in built["artifacts"]:
        Storage().read_bytes(str(checkpoint / record["path"]), expect=ArtifactRecord.model_validate(record))

    client = MlflowClient(mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    train_run = next(r for r in runs if r.info.run_name == "train")
    history = client.get_metric_history(train_run.info.run_id, "rollout/reward_mean")
    assert sorted(m.step for m in history) == [0, 1, 2, 3]
    assert client.get_metric_history(train_run.info.run_id, "pg_loss")
    assert train_run.data.tags["manifest_uri"].endswith("manifests/train.json")
    assert trained["facts"]["custom_config"]["unused"] == ["unread_setting"]
    assert {k: v for k, v in train_run.data.params.items() if k.startswith("custom_config.")} == {
        "custom_config.path": str(custom), "custom_config.flags.eval.eval_interval": "2",
        "custom_config.settings.unread_setting": "1"}
    # A stage's MLflow run is a child of the pipeline's, with its config as params and its figures as metrics.
    parent = next(r for r in runs if r.info.run_name == "e2e")
    stage = next(r for r in runs if r.info.run_name == "model")
    assert parent.info.status == stage.info.status == "FINISHED"
    assert stage.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert stage.data.params["model.hf_checkpoint"] == MODEL
    assert stage.data.metrics["model.parameters"] == built["counts"]["parameters"]
    assert stage.data.tags["manifest_uri"] == manifest_uri

    again = run_pipeline(load_pipeline_config(pipeline_data(tmp_path, mlflow_uri, train)))
    assert {stage: m["created_at"] for stage, m in again.items()} == \
        {stage: m["created_at"] for stage, m in manifests.items()}  # every stage reused, nothing rerun
    # The reused model reports the same content hash and checkpoint (test_flows.py's rerun test, merged here).
    assert built["hashes"]["content"] == again["model"]["hashes"]["content"]
    assert built["outputs"]["hf_checkpoint"] == again["model"]["outputs"]["hf_checkpoint"]


def test_the_demo_task_is_learned(tmp_path, local_ray):
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
