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


def warmup_steps(config: OptimizerConfig, total_steps: int | None) -> float:
    """Warm-up steps: --lr-warmup-iters, or --lr-warmup-fraction x the decay steps (Megatron-LM's rule; a
    fraction need not give a whole number of steps). ValueError when a fraction is given and the decay steps are
    not known."""
    if config.lr_warmup_fraction is None:
        return config.lr_warmup_iters
    steps = config.lr_decay_iters or total_steps
    if steps is None:
        raise ValueError(f"--lr-warmup-fraction {config.lr_warmup_fraction} is a fraction of the decay steps: give "
                         "--lr-decay-iters (or the run's total optimizer steps), or use --lr-warmup-iters")
    return config.lr_warmup_fraction * steps


def schedule_steps(config: OptimizerConfig, total_steps: int | None) -> tuple[float, int]:
    """(warm-up steps, decay steps) as megatron-core's OptimizerParamScheduler takes them, which needs warm-up to end
    before decay does. A constant schedule never decays, so its decay steps only have to come after the warm-up.
    ValueError when a decaying schedule's warm-up is not shorter than its decay (Megatron-LM asserts)."""
    warmup, decay = warmup_steps(config, total_steps), decay_steps(config, total_steps)
    if config.lr_decay_style == "constant":
        return warmup, max(decay or 1, math.floor(warmup) + 1)
    assert decay is not None  # decay_steps raised otherwise
    if warmup >= decay:
        raise ValueError(f"--lr-decay-style {config.lr_decay_style}: {warmup:g} warm-up steps (--lr-warmup-iters / "
                         f"--lr-warmup-fraction) are not fewer than the {decay} decay steps (--lr-decay-iters, else "
                         "the run's optimizer steps): warm-up must end before the decay does; lower the warm-up or "
                         "raise --lr-decay-iters")
    return warmup, decay


def lr_at(config: OptimizerConfig, step: int, total_steps: int | None = None) -> float:
    """The learning rate of optimizer step `step` (0-based), Megatron's formula.

    Warm-up: lr x step / warmup while step <= warmup (warmup_steps); after the decay steps: min_lr;
    in between: min_lr + coeff x (lr - min_lr), coeff = 1 - r (linear) or (1 + cos(pi r)) / 2 (cosine),
    r = (step - warmup) / (decay - warmup); constant: lr.
    """
    warmup = warmup_steps(config, total_steps)
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
    schedule_steps(config, total_steps)  # fail at construction, not at the first decaying step
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(config, step, total_steps) / config.lr)
