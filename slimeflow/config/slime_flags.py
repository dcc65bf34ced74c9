"""slime flags that slimeflow does not take (yet), as data: each with the reason, so none is silently ignored."""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from slimeflow.config.infra import CREDENTIAL_KEYS, CREDENTIALS_ELSEWHERE

_MOE = ("a Megatron mixture-of-experts flag the Megatron backend does not read yet; it takes the experts' shape "
        "flags (--num-experts, --moe-router-topk, ...) and --moe-token-dispatcher-type, "
        "--moe-router-load-balancing-type, --moe-aux-loss-coeff, --moe-z-loss-coeff, --moe-router-dtype, "
        "--moe-router-bias-update-rate")

NOT_YET_SUPPORTED: dict[str, str] = {
    "--save-hf": "HF weights are not written at each save yet: export a checkpoint with `slimeflow export`",
    "--eval-config": "per-dataset eval settings from a YAML file are not supported yet: use the --eval-* flags",
    "--load-debug-rollout-data-subsample": "subsampling replayed rollouts is not supported yet: "
                                           "--load-debug-rollout-data replays whole rollouts",
    "--save-debug-train-data": "saving the trainer's per-rank data is not supported yet: "
                               "--save-debug-rollout-data saves what the trainer receives",
    "--dump-details": "use --save-debug-rollout-data DIR/rollout_data/{rollout_id}.pt (the rollout half of it)",
}

_MEGATRON = ("a Megatron-LM flag that the Megatron training backend (--train-backend megatron) does not read yet; "
             "the torch backend needs no such setting")
_MTP = "multi-token prediction layers are not supported yet"
_NEW_ATTENTION_FAMILIES = "those families' gated attention is not supported yet either"
_SANDWICH = ("GLM4's sandwich norms come from its HF config (model_type glm4), which the torch backend and the "
             "converter read; the Megatron backend takes them from the checkpoint's args, not from this flag")

# Megatron-LM flags that slime's scripts/run-*.sh and scripts/models/*.sh pass (THUDM/slime 624b824a8).
# (--bf16's precision flags, the fusion switches, --attention-backend, --lr-warmup-fraction, --deterministic-mode and
# the optimizer's --use-precision-aware-optimizer and --optimizer-cpu-offload options are taken: the Megatron backend
# sets them as megatron-core fields, slimeflow/train/backends/megatron/kernels.py.)
NOT_YET_SUPPORTED.update({flag: _MEGATRON for flag in (
    "--decoder-last-pipeline-num-layers", "--rotary-interleaved", "--no-position-embedding",
)})
_OPTIMIZER_DTYPES = ("the precision-aware optimizer's dtypes are not taken yet: it runs with megatron-core's "
                     "defaults (fp32 gradients and Adam state; Transformer Engine's FusedAdam keeps the main "
                     "parameters)")
NOT_YET_SUPPORTED.update({flag: _OPTIMIZER_DTYPES for flag in (
    "--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype")})
NOT_YET_SUPPORTED.update({
    "--use-torch-optimizer-for-cpu-offload": ("in megatron-core 0.16.1 it changes only SGD's GPU part; Adam's (the "
                                              "only optimizer here) is always Transformer Engine's FusedAdam, torch's "
                                              "AdamW without it: there is nothing for it to change"),
    "--spec": ("a custom layer-spec module is not read: the Megatron backend builds Transformer Engine's spec on GPUs "
               "with TE and megatron-core's local spec elsewhere, from the model family"),
    "--allgather-cp": "context parallelism is not built (and cannot run on a CPU: megatron's local attention asserts "
                      "context parallel size 1)",
})
_CRITIC = ("PPO with a critic is not built yet: slime trains a value model beside the actor for "
           "--advantage-estimator ppo (value loss clipped by --value-clip, --num-critic-only-steps warm-up); the "
           "trainer here has no value model, so use grpo, gspo, cispo or reinforce_plus_plus(_baseline)")
NOT_YET_SUPPORTED.update({flag: _CRITIC for flag in ("--use-critic", "--value-clip", "--num-critic-only-steps")})
NOT_YET_SUPPORTED["--opd-teacher-ckpt-step"] = ("picking the teacher checkpoint's step is not supported: name its "
                                                 "iter_XXXXXXX/ directory in --opd-teacher-load")
NOT_YET_SUPPORTED.update({flag: _MTP for flag in ("--mtp-num-layers", "--mtp-loss-scaling-factor", "--enable-mtp-training")})
NOT_YET_SUPPORTED.update({
    # slime's MoE scripts pass these; the Megatron backend runs megatron-core's local experts (SequentialMLP).
    "--moe-enable-deepep": "DeepEP's all-to-all kernels (GPUs) are not built: use --moe-token-dispatcher-type "
                           "alltoall or allgather",
    "--moe-token-drop-policy": "token dropping (expert capacity) is not built: every routed token reaches its experts",
    "--moe-shared-expert-gate": "a gated shared expert (Qwen3-Next, Qwen3.5) is not built: " + _NEW_ATTENTION_FAMILIES,
    "--post-self-attn-layernorm": _SANDWICH,
    "--post-mlp-layernorm": _SANDWICH,
    "--prefill-num-servers": "prefill/decode disaggregation is not supported yet",
})

NOT_YET_SUPPORTED_PREFIXES: dict[str, str] = {
    "--moe-": _MOE,
    "--critic-": _CRITIC,
    "--fsdp-": "the FSDP backend is not supported: use --train-backend torch or megatron",
}

RENAMED: dict[str, str] = {
    # Spellings from older slime docs (the seeds) that slime itself no longer accepts.
    "--prompt-key": "--input-key",
    "--rollout-generate-func-path": "--custom-generate-function-path",
    "--reward-fn-path": "--custom-rm-path",
}


def refusal_reason(flag: str) -> str | None:
    """Why slimeflow refuses a flag slime defines (None for a flag it does not know at all, or takes)."""
    if flag in NOT_YET_SUPPORTED:
        return NOT_YET_SUPPORTED[flag]
    return next((reason for prefix, reason in NOT_YET_SUPPORTED_PREFIXES.items() if flag.startswith(prefix)), None)


_DEFERRED: ContextVar[dict[str, str] | None] = ContextVar("deferred_refusals", default=None)


@contextmanager
def deferring_refusals() -> Iterator[dict[str, str]]:
    """Inside, a slime flag that slimeflow refuses by name is collected (flag -> reason) instead of failing the parse.

    `--print-config` uses it, so a slime script translates whole and shows what a run would refuse; a run parses
    without it and refuses them before any work. Unknown flags (typos) fail the parse either way.
    """
    collected: dict[str, str] = {}
    token = _DEFERRED.set(collected)
    try:
        yield collected
    finally:
        _DEFERRED.reset(token)


def deferred(flag: str) -> bool:
    """True when `flag` is refused by name and refusals are being collected (see deferring_refusals)."""
    collected, reason = _DEFERRED.get(), refusal_reason(flag)
    if collected is None or reason is None:
        return False
    collected[flag] = reason
    return True


def explain_unknown(flag: str, known: list[str]) -> str:
    """One line saying why `flag` is not taken and what to do instead."""
    if flag in RENAMED:
        return f"{flag}: use {RENAMED[flag]} (the current slime spelling)"
    if flag.rsplit(".", 1)[-1].lstrip("-").replace("-", "_") in CREDENTIAL_KEYS:
        return f"{flag}: {CREDENTIALS_ELSEWHERE}"
    reason = refusal_reason(flag)
    if reason is not None:
        return f"{flag}: not supported yet ({reason}); remove it"
    close = difflib.get_close_matches(flag, known, n=3, cutoff=0.75)
    hint = f"; did you mean {' or '.join(close)}?" if close else "; see --help for the flags this command takes"
    return f"{flag}: unknown flag{hint}"

# The rest of what slime defines (slime/utils/arguments.py) and its scripts pass (THUDM/slime 624b824a8), each with
# why it is not taken; tests/data/slime_flags/ holds the lists, and tests/unit/test_slime_flag_surface.py checks that
# none of them is unknown.
_NEW_ATTENTION = ("gated / linear attention (Qwen3-Next, Qwen3.5) is not supported yet: Llama, Qwen2, Qwen3, GLM4 "
                  "and Qwen3-MoE only")
_CI = "slime's CI assertions are not supported: slimeflow's test suite checks these properties itself"
_PROFILE = "memory and step profiling is not supported yet"
_WEIGHT_SYNC = ("delta weight updates, their disk files and checks are not supported yet: weights go whole, over HTTP, "
                "a /dev/shm file or SGLang's tensor handles (--colocate), a gloo group (--update-weight-transport "
                "nccl) or disk (external servers)")
_EVAL_KEYS = ("per-eval-set data keys and lengths are not supported yet: the eval sets use --input-key, --label-key "
              "and the --eval-* sampling flags")
NOT_YET_SUPPORTED.update({flag: _MEGATRON for flag in (
    "--enable-experimental", "--data-pad-size-multiplier", "--no-check-for-nan-in-loss-and-grad",
    "--decoder-first-pipeline-num-layers", "--distributed-timeout-minutes",
    "--megatron-deepgemm-forward-layers", "--megatron-deepgemm-forward-modules",
    "--megatron-deepgemm-moe-forward-layers", "--megatron-deepgemm-moe-forward-modules", "--padded-vocab-size",
    "--recompute-loss-function", "--balance-by-flops", "--use-stateless-adam",
)})
NOT_YET_SUPPORTED.update({flag: _NEW_ATTENTION for flag in (
    "--use-gated-attention", "--apply-layernorm-1p", "--attention-output-gate", "--qwen-gdn-backend")})
NOT_YET_SUPPORTED.update({flag: _CI for flag in (
    "--ci-test", "--ci-disable-kl-checker", "--ci-train-rollout-logprob-abs-diff-threshold", "--ci-save-grad-norm",
    "--ci-load-grad-norm")})
NOT_YET_SUPPORTED.update({flag: _PROFILE for flag in (
    "--memory-recorder", "--memory-snapshot-dir", "--memory-snapshot-num-steps", "--profile-target",
    "--record-memory-history")})
NOT_YET_SUPPORTED.update({flag: _WEIGHT_SYNC for flag in (
    "--update-weight-mode", "--update-weight-delta-checksum",
    "--update-weight-delta-encoding", "--update-weight-disk-dir", "--update-weight-disk-keep-files",
    "--update-weight-local-checkpoint-dir", "--check-weight-update-equal")})
NOT_YET_SUPPORTED.update({flag: _EVAL_KEYS for flag in (
    "--eval-input-key", "--eval-label-key", "--eval-tool-key", "--eval-max-prompt-len", "--eval-min-new-tokens",
    "--eval-max-context-len")})
NOT_YET_SUPPORTED.update({
    "--tensorboard-dir": "Megatron-LM's TensorBoard flag: use --use-tensorboard with --tb-project-name (slime's)",
    "--wandb-always-use-train-step": ("metrics are logged once per rollout, at rollout/step (evaluations at "
                                     "eval/step); per-train-step logging is not supported yet"),
})
NOT_YET_SUPPORTED.update({
    "--use-rope-scaling": ("Megatron-LM's Llama 3.1 rope scaling flag; the torch backend and the converter read "
                           "rope scaling from the HF config (rope_scaling / rope_parameters)"),
    "--freeze-indexer": "GLM-5's sparse-attention indexer is not supported yet",
    "--multimodal-keys": "multimodal (vision-language) data is not supported yet",
    "--use-routing-replay": "MoE routing replay (the rollout's expert choices replayed in training) is not built in either backend",
    "--use-rollout-routing-replay": "MoE routing replay (the rollout's expert choices replayed in training) is not built in either backend",
    "--model-name": ("slimeflow picks the HF name map from the HF config's model_type (slimeflow.families), so no "
                     "model name is needed"),
    "--log-probs-chunk-size": "chunked log-prob computation is not supported yet: bound memory with "
                              "--max-tokens-per-gpu",
    "--log-probs-max-tokens-per-gpu": "a separate token budget for log-probs is not supported yet: "
                                      "--max-tokens-per-gpu applies to both",
    "--disable-rewards-normalization": "turning off the estimator's reward normalization is not supported yet",
    "--use-unbiased-kl": "the unbiased (importance-weighted) KL estimate is not supported yet",
    "--ref-update-interval": "updating the reference model from the actor is not supported yet",
    "--ref-ckpt-step": "picking the reference checkpoint's step is not supported yet: --ref-load reads its latest",
    "--use-opsm": "off-policy sequence masking is not supported yet",
    "--opsm-delta": "off-policy sequence masking is not supported yet",
    "--use-rollout-entropy": "entropy from the rollout log-prob pass is not supported yet",
    "--only-train-params-name-list": "training a subset of the parameters is not supported yet",
    "--freeze-params-name-list": "freezing parameters is not supported yet",
    "--reset-optimizer-states": "resetting the optimizer after each rollout is not supported yet",
    "--no-save-optim": "checkpoints always carry the optimizer state (a resumed run needs it)",
    "--keep-old-actor": "keeping a copy of the pre-update actor is not supported yet",
    "--release-train": "releasing the trainers during rollout is not supported yet",
    "--train-env-vars": "set the trainers' environment in the Ray runtime env or the worker's environment",
    "--distributed-backend": "slimeflow picks the process-group backend itself (NCCL on GPUs, gloo on CPU)",
    "--rollout-max-context-len": "a context cap for the engines is not supported yet: set "
                                 "--rollout-max-prompt-len and --rollout-max-response-len",
    "--rollout-skip-special-tokens": "skipping special tokens in decoded responses is not supported yet",
    "--apply-chat-template-kwargs": "extra chat-template arguments are not supported yet",
    "--rollout-buffer-url": "an external rollout buffer service is not supported",
    "--fetch-trajectory-retry-times": "an external rollout buffer service is not supported",
    "--min-batch-collection-ratio": "an external rollout buffer service is not supported",
    "--rollout-task-type": "an external rollout buffer service is not supported",
    "--disable-rollout-global-dataset": "rollouts always read a data source (--prompt-data, or the class of "
                                        "--data-source-path, which then saves and loads its own state)",
    "--rollout-data-transport": "rollout data goes to the trainers through Ray's object store",
    "--http-proxy": "set the HTTP proxy in the environment (HTTP_PROXY / NO_PROXY)",
    "--use-distributed-post": "requests go to the engines through one client; distributed posting is not "
                              "supported yet",
    "--load-forge-rollout-data": "use --load-debug-rollout-data to replay saved rollouts",
    "--log-multi-turn": "multi-turn rollout logging is not supported yet",
    "--log-passrate": "pass@n logging is not supported yet",
    "--log-correct-samples": "pass@n logging is not supported yet",
    "--log-reward-category": "reward-category logging is not supported yet",
})
