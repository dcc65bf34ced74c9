"""What keeps a --train-backend megatron run from starting, beyond the model flags that
slimeflow/config/model_args.py checks against the HF config."""

from __future__ import annotations

from slimeflow.config.train import TrainConfig
from slimeflow.train.backends.megatron.kernels import Kernels, kernel_problems


def megatron_backend_problems(config: TrainConfig) -> list[str]:
    """What keeps a --train-backend megatron run from starting (beyond check_model_args): its start checkpoint,
    the rank count against TP x PP, and what the backend does not build yet."""
    from slimeflow.io.checkpoints import find_latest
    from slimeflow.io.storage import Storage, is_local

    problems = []
    ckpt, placement, m = config.checkpoint, config.placement, config.megatron
    resumable = ckpt.load is not None and is_local(ckpt.load) and find_latest(Storage(), ckpt.load) is not None
    if ckpt.ref_load is None and not resumable:
        problems.append("--train-backend megatron starts from a torch_dist checkpoint, as slime's: pass --ref-load "
                        "(convert the HF checkpoint with `slimeflow convert --hf-checkpoint ... --save ...`)")
    if config.algorithm.needs_reference and ckpt.ref_load is None:
        problems.append("--use-kl-loss / --kl-coef with --train-backend megatron need --ref-load (the reference "
                        "model's torch_dist checkpoint)")
    ranks = placement.actor_num_nodes * placement.actor_num_gpus_per_node
    model_parallel = m.tensor_model_parallel_size * m.pipeline_model_parallel_size
    if ranks % model_parallel:
        problems.append(f"{ranks} training ranks (--actor-num-nodes x --actor-num-gpus-per-node) are not a multiple "
                        f"of --tensor-model-parallel-size x --pipeline-model-parallel-size = {model_parallel}")
    problems += _parallel_problems(config)
    # What this machine's kernels cannot run (the trainers check again where they run)
    problems += kernel_problems(config.megatron, Kernels.detect())
    return problems


def _parallel_problems(config: TrainConfig) -> list[str]:
    """The virtual pipeline and expert parallel settings the Megatron backend cannot run."""
    m, problems = config.megatron, []
    ranks = config.placement.actor_num_nodes * config.placement.actor_num_gpus_per_node
    if m.num_layers_per_virtual_pipeline_stage is not None and m.pipeline_model_parallel_size == 1:
        problems.append("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1 (it "
                        "interleaves pipeline stages); drop it or raise the pipeline size")
    if m.num_layers_per_virtual_pipeline_stage is not None and m.num_layers is not None and \
            m.num_layers % (m.pipeline_model_parallel_size * m.num_layers_per_virtual_pipeline_stage):
        problems.append(f"--num-layers-per-virtual-pipeline-stage {m.num_layers_per_virtual_pipeline_stage}: "
                        f"--num-layers {m.num_layers} does not split into --pipeline-model-parallel-size "
                        f"{m.pipeline_model_parallel_size} x stages of that many layers")
    tp, ep, etp = m.tensor_model_parallel_size, m.expert_model_parallel_size, m.expert_tensor_parallel_size
    if etp not in (None, 1, tp):
        problems.append(f"--expert-tensor-parallel-size {etp}: the Megatron backend splits experts over the "
                        f"tensor-parallel ranks as the rest of the model ({tp}, the default) or not at all (1); other "
                        f"sizes are not built (unverified against a one-process run): use 1 or {tp}")
    etp = tp if etp is None else etp
    if ep > 1 and ranks % (ep * etp * m.pipeline_model_parallel_size):
        problems.append(f"{ranks} training ranks are not a multiple of --expert-model-parallel-size {ep} x "
                        f"--expert-tensor-parallel-size {etp} x --pipeline-model-parallel-size "
                        f"{m.pipeline_model_parallel_size}")
    if tp > 1 and (ep > 1 or m.num_experts or m.multi_latent_attention) and not m.sequence_parallel:
        problems.append(f"an MoE model or multi-latent attention at --tensor-model-parallel-size {tp} trains with "
                        "--sequence-parallel only (megatron-core's MoE layer raises when it trains tensor-parallel "
                        "without it; MLA's RoPE key gets a partial gradient on each rank); add --sequence-parallel")
    if m.moe_token_dispatcher_type == "flex":
        problems.append("--moe-token-dispatcher-type flex: DeepEP / HybridEP dispatch (GPU kernels) is not built; "
                        "use allgather or alltoall")
    return problems
