"""What keeps a --train-backend megatron run from starting, beyond the model flags that
slimeflow/config/model_args.py checks against the HF config."""

from __future__ import annotations

from slimeflow.config.model_args import NOT_BUILT
from slimeflow.stages.rl.config import TrainConfig


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
    if config.optimizer.bf16:
        problems.append("--bf16 with --train-backend megatron: " + NOT_BUILT + " (it trains in fp32)")
    return problems
