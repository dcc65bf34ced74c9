"""slime flags that slimeflow does not take (yet), as data: each with the reason, so none is silently ignored."""

from __future__ import annotations

NOT_YET_SUPPORTED: dict[str, str] = {
    "--async-buffer-size": "asynchronous training (slime's train_async.py) is not supported yet",
    "--update-weights-interval": "asynchronous training (slime's train_async.py) is not supported yet",
    "--use-fault-tolerance": "engine health checks and restarts are not supported yet",
    "--offload-train": "use --offload (colocated mode)",
    "--offload-rollout": "use --offload (colocated mode)",
    "--use-critic": "PPO with a trained critic is not supported yet",
    "--multi-latent-attention": "MLA models (DeepSeek) are not supported yet: dense Llama/Qwen2/Qwen3 only",
    "--num-experts": "mixture-of-experts models are not supported yet: dense Llama/Qwen2/Qwen3 only",
    "--use-distributed-optimizer": "the Megatron backend is not available yet",
    "--custom-config-path": "custom YAML args for plug-ins are not supported yet",
    "--eval-function-path": "a custom eval function is not supported yet",
    "--debug-rollout-only": "debug modes are not supported yet",
    "--debug-train-only": "debug modes are not supported yet",
    "--tensorboard-dir": "slimeflow tracks with MLflow: set --mlflow-tracking-uri",
    "--use-wandb": "slimeflow tracks with MLflow: set --mlflow-tracking-uri",
}

NOT_YET_SUPPORTED_PREFIXES: dict[str, str] = {
    "--moe-": "mixture-of-experts models are not supported yet: dense Llama/Qwen2/Qwen3 only",
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
