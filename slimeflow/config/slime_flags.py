"""slime flags that slimeflow does not take (yet), as data: each with the reason, so none is silently ignored."""

from __future__ import annotations

_MOE = ("mixture-of-experts Megatron flags are read only by the Megatron backend, not in this version; the torch "
        "backend and the converter take a Qwen3-MoE model's experts from its HF config")

NOT_YET_SUPPORTED: dict[str, str] = {
    "--async-buffer-size": "--async (slime's train_async.py) generates one rollout ahead; a deeper buffer is not built",
    "--use-fault-tolerance": "engine health checks and restarts are not supported yet",
    "--offload": "offloading the trainer's state around rollouts (colocated mode) is not supported yet",
    "--offload-train": "offloading the trainer's state around rollouts (colocated mode) is not supported yet",
    "--offload-rollout": "releasing the engines' memory during training (colocated mode) is not supported yet",
    "--save-hf": "HF weights are not written at each save yet: export a checkpoint with `slimeflow export`",
    "--eval-config": "per-dataset eval settings from a YAML file are not supported yet: use the --eval-* flags",
    "--use-critic": "PPO with a trained critic is not supported yet",
    "--multi-latent-attention": "MLA models (DeepSeek) are not supported yet: Llama, Qwen2, Qwen3, GLM4 and Qwen3-MoE only",
    "--num-experts": _MOE,
    "--use-distributed-optimizer": "the Megatron backend is not available yet",
    "--custom-config-path": "custom YAML args for plug-ins are not supported yet",
    "--eval-function-path": "a custom eval function is not supported yet",
    "--load-debug-rollout-data-subsample": "subsampling replayed rollouts is not supported yet: "
                                           "--load-debug-rollout-data replays whole rollouts",
    "--save-debug-train-data": "saving the trainer's per-rank data is not supported yet: "
                               "--save-debug-rollout-data saves what the trainer receives",
    "--dump-details": "use --save-debug-rollout-data DIR/rollout_data/{rollout_id}.pt (the rollout half of it)",
    "--tensorboard-dir": "slimeflow tracks with MLflow: set --mlflow-tracking-uri",
    "--use-wandb": "slimeflow tracks with MLflow: set --mlflow-tracking-uri",
}

_MEGATRON = ("a Megatron-LM flag, read only by the Megatron training backend (--train-backend megatron), which is "
             "not in this version; the torch backend needs no such setting")
_MLA = "multi-latent attention (DeepSeek-V3, Kimi-K2, Moonlight) is not supported yet: Llama, Qwen2, Qwen3, GLM4 and Qwen3-MoE only"
_MTP = "multi-token prediction layers are not supported yet"
_SANDWICH = ("GLM4's sandwich norms come from its HF config (model_type glm4), which the torch backend and the "
             "converter read; this Megatron-LM flag is read only by the Megatron backend, not in this version")

# Megatron-LM flags that slime's scripts/run-*.sh and scripts/models/*.sh pass (THUDM/slime 624b824a8).
NOT_YET_SUPPORTED.update({flag: _MEGATRON for flag in (
    "--attention-backend", "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32",
    "--use-precision-aware-optimizer", "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
    "--no-rope-fusion", "--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion",
    "--decoder-last-pipeline-num-layers", "--spec", "--rotary-interleaved", "--no-position-embedding",
    "--allgather-cp", "--lr-warmup-fraction", "--deterministic-mode",
)})
NOT_YET_SUPPORTED.update({flag: _MLA for flag in (
    "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim", "--mscale",
    "--mscale-all-dim", "--rotary-scaling-factor",
)})
NOT_YET_SUPPORTED.update({flag: _MTP for flag in ("--mtp-num-layers", "--mtp-loss-scaling-factor", "--enable-mtp-training")})
NOT_YET_SUPPORTED.update({
    "--post-self-attn-layernorm": _SANDWICH,
    "--post-mlp-layernorm": _SANDWICH,
    "--update-weight-buffer-size": "bucketed weight sync is not supported yet: weights go to the engines whole",
    "--prefill-num-servers": "prefill/decode disaggregation is not supported yet",
    "--no-offload-train": "offload is not supported yet",
    "--no-offload-rollout": "offload is not supported yet",
    "--use-tensorboard": "slimeflow tracks with MLflow: set --mlflow-tracking-uri",
})

NOT_YET_SUPPORTED_PREFIXES: dict[str, str] = {
    "--moe-": _MOE,
    "--critic-": "PPO with a trained critic is not supported yet",
    "--wandb-": "slimeflow tracks with MLflow: set --mlflow-tracking-uri",
    "--fsdp-": "the FSDP backend is not supported: use --train-backend torch or megatron",
}

RENAMED: dict[str, str] = {
    # Spellings from older slime docs (the seeds) that slime itself no longer accepts.
    "--prompt-key": "--input-key",
    "--rollout-generate-func-path": "--custom-generate-function-path",
    "--reward-fn-path": "--custom-rm-path",
}


def explain_unknown(flag: str, known: list[str]) -> str:
    """One line saying why `flag` is not taken and what to do instead."""
    import difflib

    if flag in RENAMED:
        return f"{flag}: use {RENAMED[flag]} (the current slime spelling)"
    if flag in NOT_YET_SUPPORTED:
        return f"{flag}: not supported yet ({NOT_YET_SUPPORTED[flag]}); remove it"
    for prefix, reason in NOT_YET_SUPPORTED_PREFIXES.items():
        if flag.startswith(prefix):
            return f"{flag}: not supported yet ({reason}); remove it"
    close = difflib.get_close_matches(flag, known, n=3, cutoff=0.75)
    hint = f"; did you mean {' or '.join(close)}?" if close else "; see --help for the flags this command takes"
    return f"{flag}: unknown flag{hint}"
