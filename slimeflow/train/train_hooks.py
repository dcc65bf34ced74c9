"""slime's hooks into its training actor, called where slime's Megatron actor calls them (--train-hooks group).

| hook (flag)                                  | called                                                | with |
|----------------------------------------------|-------------------------------------------------------|------|
| --custom-megatron-init-path                  | once per rank, parallel state set up, no model yet    | (args) |
| --custom-model-provider-path                 | for every model chunk (policy, reference, teacher)   | (pre_process=, post_process=[, vp_stage=][, args=]) |
| --custom-megatron-before-log-prob-hook-path  | before each log-prob pass                             | (args, model, store_prefix) |
| --rollout-data-postprocess-path              | after log-probs and advantages, before training       | (args, rollout_id, rollout_data) |
| --custom-megatron-before-train-step-hook-path| before each optimizer step's forward/backward         | (args, rollout_id, step_id, model, optimizer, opt_param_scheduler) |

`args` is slime's namespace (slime_plugins.slime_args), with the Megatron args of the checkpoint the model is built
from underneath (num_layers, hidden_size, ...), as slime's args hold both. The first four hooks hand over megatron
objects and run on the Megatron backend only (TrainConfig refuses them with --train-backend torch); rollout-data
post-processing runs on both backends.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from slimeflow.config.megatron import MegatronConfig
from slimeflow.config.train import TrainConfig
from slimeflow.rollout.plugins import load_plugin
from slimeflow.rollout.slime_plugins import slime_args

if TYPE_CHECKING:
    from slimeflow.train.backends.protocol import Backend

Hook = Callable[..., Any]
RUN_LAYOUT = frozenset({
    # MegatronConfig's flags that the Megatron backend takes from the run, not from the checkpoint's args.
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "num_layers_per_virtual_pipeline_stage", "sequence_parallel",
    "recompute_granularity", "recompute_method", "recompute_num_layers", "use_distributed_optimizer",
    "moe_token_dispatcher_type", "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
    "moe_router_dtype", "moe_router_bias_update_rate", "deterministic_mode", "use_precision_aware_optimizer",
    "optimizer_cpu_offload", "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d"})


@dataclass
class TrainHooks:
    """The loaded hooks of one training rank (None: not given) and the `args` they are called with."""

    args: Any
    init: Hook | None = None
    model_provider: Hook | None = None
    before_log_prob: Hook | None = None
    rollout_data_postprocess: Hook | None = None
    before_train_step: Hook | None = None

    @classmethod
    def load(cls, config: TrainConfig) -> TrainHooks:
        h = config.train_hooks

        def hook(path: str | None, flag: str) -> Hook | None:
            return None if path is None else load_plugin(path, flag)

        return cls(args=slime_args(config),
                   init=hook(h.custom_megatron_init_path, "custom-megatron-init-path"),
                   model_provider=hook(h.custom_model_provider_path, "custom-model-provider-path"),
                   before_log_prob=hook(h.custom_megatron_before_log_prob_hook_path,
                                        "custom-megatron-before-log-prob-hook-path"),
                   rollout_data_postprocess=hook(h.rollout_data_postprocess_path, "rollout-data-postprocess-path"),
                   before_train_step=hook(h.custom_megatron_before_train_step_hook_path,
                                          "custom-megatron-before-train-step-hook-path"))

    def with_model_args(self, model_args: Any) -> None:
        """Merge in the Megatron args of the checkpoint the model is built from: its model shape (the backend builds
        that shape whatever the run's shape flags say) and what the run leaves unset; the run's parallel layout and
        training flags stay the run's."""
        shape = set(MegatronConfig.model_fields) - RUN_LAYOUT
        given = vars(self.args)
        for name, value in vars(model_args).items():
            if name in shape or given.get(name) is None:
                setattr(self.args, name, value)

    def provide(self, pre_process: bool, post_process: bool, vp_stage: int | None) -> torch.nn.Module:
        """One model chunk from --custom-model-provider-path, called as slime calls it."""
        assert self.model_provider is not None
        kwargs: dict[str, Any] = {"pre_process": pre_process, "post_process": post_process}
        params = inspect.signature(self.model_provider).parameters
        if "vp_stage" in params:
            kwargs["vp_stage"] = vp_stage
        if "args" in params:
            kwargs["args"] = self.args
        return self.model_provider(**kwargs)

    def before_log_probs(self, model: list[torch.nn.Module], store_prefix: str) -> None:
        if self.before_log_prob is not None:
            self.before_log_prob(self.args, model, store_prefix)

    def before_step(self, rollout_id: int, step_id: int, backend: Backend) -> None:
        if self.before_train_step is not None:
            self.before_train_step(self.args, rollout_id, step_id, backend.model, backend.optimizer, backend.scheduler)


def check_provided(model: torch.nn.Module, tensor_parallel: int, pipeline_parallel: int, where: str,
                   per_token_loss: bool = False) -> None:
    """A provider's chunk runs in this backend's schedule: its parallel sizes must be the run's, and with tensor
    parallelism its logits gathered (parallel_output=False), as the loss reads the whole vocabulary. The two
    settings the schedule reads from the chunk's config are set here (megatron's loss scaling, the run's
    --calculate-per-token-loss, which the MoE routers copied when built; gloo cannot batch p2p)."""
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"{where} returned a {type(model).__name__} without a megatron TransformerConfig (.config); "
                        "return a megatron-core GPTModel")
    sizes = (config.tensor_model_parallel_size, config.pipeline_model_parallel_size)
    if sizes != (tensor_parallel, pipeline_parallel):
        raise ValueError(f"{where} built a model for tensor x pipeline parallel sizes {sizes}, the run uses "
                         f"{(tensor_parallel, pipeline_parallel)}: build its TransformerConfig with the run's sizes")
    if tensor_parallel > 1 and getattr(model, "parallel_output", False):
        raise ValueError(f"{where} built a GPTModel with parallel_output=True at tensor-parallel size "
                         f"{tensor_parallel}: the loss reads every token's full vocabulary; pass parallel_output=False")
    config.calculate_per_token_loss = per_token_loss
    for module in model.modules() if isinstance(model, torch.nn.Module) else ():  # megatron's routers keep their own copy (how they scale the aux and z losses)
        if hasattr(module, "calculate_per_token_loss"):
            router: Any = module  # a plain attribute of megatron's routers, which torch's Module typing does not know
            router.calculate_per_token_loss = per_token_loss
    config.batch_p2p_comm = False


SLIME_KEYS = ("advantages", "log_probs", "ref_log_probs", "loss_masks")
"""What a rollout-data post-process may change that training then reads."""


def postprocess_rollout_data(hooks: TrainHooks | None, rollout_id: int, batch: Any, own: list[int],
                             prepared: Any) -> None:
    """--rollout-data-postprocess-path on this rank's samples `own` (slime's rollout_data: each rank's partition,
    in slime's keys); what it leaves in SLIME_KEYS replaces `prepared`'s and the batch's loss masks for those
    samples."""
    if hooks is None or hooks.rollout_data_postprocess is None:
        return

    def mine(values: list[Any] | None) -> list[Any] | None:
        return None if values is None else [values[i] for i in own]

    data: dict[str, Any] = {
        "tokens": mine(batch.tokens), "response_lengths": mine(batch.response_lengths),
        "total_lengths": mine(batch.total_lengths), "loss_masks": mine(batch.loss_masks),
        "rewards": [float(r) for r in batch.rewards[own]], "advantages": mine(prepared.advantages),
        "returns": [a.clone() for a in mine(prepared.advantages) or []], "partition": list(own),
        "log_probs": mine(prepared.old_log_probs), "ref_log_probs": mine(prepared.ref_log_probs),
        "rollout_log_probs": mine(batch.rollout_log_probs), "teacher_log_probs": mine(batch.teacher_log_probs)}
    data = {key: value for key, value in data.items() if value is not None}  # slime's dict lacks what was not computed
    hooks.rollout_data_postprocess(hooks.args, rollout_id, data)
    targets = {"advantages": prepared.advantages, "log_probs": prepared.old_log_probs,
               "ref_log_probs": prepared.ref_log_probs, "loss_masks": batch.loss_masks}
    for key in SLIME_KEYS:
        values, target = data.get(key), targets[key]
        if values is None or target is None:
            continue
        if len(values) != len(own):
            raise ValueError(f"--rollout-data-postprocess-path left {len(values)} rollout_data[{key!r}] for this "
                             f"rank's {len(own)} samples; change the values in place, one per sample")
        for i, value in zip(own, values, strict=True):
            target[i] = torch.as_tensor(value, dtype=target[i].dtype)


def post_write_hook(config: TrainConfig, args: Any, targets: Any) -> Callable[[str], Any] | None:
    """--custom-update-weight-post-write-path as the disk sync calls it, hook(version_dir), with slime's other
    arguments bound: `args`, and the engines (their URLs, where slime has Ray handles of its engine actors)."""
    path = config.weight_sync.custom_update_weight_post_write_path
    if path is None:
        return None
    hook, engines = load_plugin(path, "custom-update-weight-post-write-path"), list(targets.worker_urls)
    return lambda version_dir: hook(args, version_dir, list(engines))
