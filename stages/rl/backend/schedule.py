"""Megatron's learning-rate schedule (OptimizerParamScheduler): linear warm-up, then constant, linear or cosine decay.

Step k is the k-th optimizer step, counted from 0; the learning rate of step k is `lr_at(config, k, ...)`. As in
Megatron, warm-up starts at 0, so with lr_warmup_iters > 0 the first step has learning rate 0.
"""

from __future__ import annotations

import math

import torch

from slimeflow.config.train import OptimizerConfig


def decay_steps(config: OptimizerConfig, total_steps: int | None) -> int | None:
    """Steps over which the learning rate decays: --lr-decay-iters, else the run's total optimizer steps.

    ValueError when the schedule decays but neither is known.
    """
    steps = config.lr_decay_iters or total_steps
    if steps is None and config.lr_decay_style != "constant":
        raise ValueError(f"--lr-decay-style {config.lr_decay_style} needs --lr-decay-iters or the run's total "
                         "optimizer steps (TorchBackend(total_steps=num_rollout x num_steps_per_rollout))")
    return steps


def lr_at(config: OptimizerConfig, step: int, total_steps: int | None = None) -> float:
    """The learning rate of optimizer step `step` (0-based), Megatron's formula.

    Warm-up: lr x step / lr_warmup_iters while step <= lr_warmup_iters; after the decay steps: min_lr;
    in between: min_lr + coeff x (lr - min_lr), coeff = 1 - r (linear) or (1 + cos(pi r)) / 2 (cosine),
    r = (step - warmup) / (decay - warmup); constant: lr.
    """
    warmup = config.lr_warmup_iters
    if warmup > 0 and step <= warmup:
        return config.lr * step / warmup
    if config.lr_decay_style == "constant":
        return config.lr
    decay = decay_steps(config, total_steps)
    assert decay is not None
    if step > decay:
        return config.min_lr
    ratio = (step - warmup) / max(decay - warmup, 1)
    if config.lr_decay_style == "linear":
        coeff = 1.0 - ratio
    else:
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return config.min_lr + coeff * (config.lr - config.min_lr)


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                    total_steps: int | None) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose step-k learning rate is lr_at(config, k); its state_dict holds the step count."""
    decay_steps(config, total_steps)  # fail at construction, not at the first decaying step
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(config, step, total_steps) / config.lr)
