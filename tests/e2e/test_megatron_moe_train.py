"""Qwen3-MoE RL-trained with the Megatron backend at expert-model-parallel size 2 on Ray: the weights the two ranks
gather (experts under the per-expert names of HF checkpoints) reach the embedded engine, whose transformers model
holds them fused, after every step (issue 32: the first push used to be refused)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import train_config

pytestmark = pytest.mark.slow

MOE = "tiny:qwen3_moe?seed=3"


def test_qwen3_moe_trains_with_the_megatron_backend_at_ep2(tmp_path, slime_plugins_importable):
    from slimeflow.config.convert import ConvertConfig
    from slimeflow.stages.convert.stage import run as convert_run
    from slimeflow.stages.train.stage import run
    from slimeflow.train.backends.torch.checkpoint import read_weights

    config, ctx = train_config(tmp_path, MOE, **{
        "num-rollout": 2, "save-interval": 2, "eval-interval": 2, "skip-eval-before-train": True,
        "rollout-batch-size": 4, "n-samples-per-prompt": 4, "train-backend": "megatron",
        "expert-model-parallel-size": 2, "actor-num-gpus-per-node": 2,
        "eval-function-path": "slime_megatron_hooks:snapshot_engine_weights", "save": str(tmp_path / "ckpt")})
    ref = convert_run(ConvertConfig(hf_checkpoint=config.checkpoint.hf_checkpoint, save=str(tmp_path / "ref"),
                                    processes=1), ctx).outputs["torch_dist"]
    config = config.model_copy(update={"checkpoint": config.checkpoint.model_copy(update={"ref_load": ref})})
    manifest = run(config, ctx)
    assert manifest.counts["rollouts_run"] == 2 and manifest.outputs["checkpoint"].endswith("iter_0000001")
    lines = (ctx.workdir / "train" / "rollouts.jsonl").read_text().splitlines()
    rows = [row for row in map(json.loads, lines) if "ppo_kl" in row]  # the rollouts' (not the evaluation's)
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["ppo_kl"] == 0.0  # the trainer's first log-probs are the ones it sampled from
    # Rollout 1 was sampled with the weights pushed after step 0: the engine's log-probs are the trainer's.
    assert max(r["train_rollout_logprob_abs_diff"] for r in rows) < 1e-5
    # After the last push (step 1's weights, the ones the final checkpoint holds) the engine serves them exactly.
    served = load_file(tmp_path / "ckpt" / "engine_weights_2.safetensors")
    trained = read_weights(manifest.outputs["checkpoint"], config.checkpoint.hf_checkpoint)
    assert any(".mlp.experts.3.gate_proj.weight" in name for name in trained)
    assert set(trained) <= set(served)
    unequal = [name for name in trained if not torch.equal(served[name], trained[name].to(served[name].dtype))]
    assert not unequal, unequal
