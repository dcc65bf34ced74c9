"""What keeps a --train-backend megatron run from starting, beyond the model flags that
slimeflow/config/model_args.py checks against the HF config."""

from __future__ import annotations

from slimeflow.config.train import TrainConfig
from slimeflow.config.train_validation import megatron_layout_problems
from slimeflow.io.checkpoints import find_latest
from slimeflow.io.storage import Storage, is_local
from slimeflow.train.backends.megatron.kernels import Kernels, kernel_problems


def megatron_backend_problems(config: TrainConfig) -> list[str]:
    """What keeps a --train-backend megatron run from starting (beyond check_model_args): its start checkpoint,
    the layout's flags (train_validation.megatron_layout_problems) and this machine's kernels."""
    problems = []
    ckpt = config.checkpoint
    resumable = ckpt.load is not None and is_local(ckpt.load) and find_latest(Storage(), ckpt.load) is not None
    if ckpt.ref_load is None and not resumable:
        problems.append("--train-backend megatron starts from a torch_dist checkpoint, as slime's: pass --ref-load "
                        "(convert the HF checkpoint with `slimeflow convert --hf-checkpoint ... --save ...`)")
    problems += megatron_layout_problems(config)
    # What this machine's kernels cannot run (the trainers check again where they run)
    problems += kernel_problems(config.megatron, Kernels.detect())
    return problems
