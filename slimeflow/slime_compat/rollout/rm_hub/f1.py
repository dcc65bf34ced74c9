"""slime.rollout.rm_hub.f1: SQuAD token F1, over slimeflow.rollout.rule_rewards."""

from __future__ import annotations

from slimeflow.rollout.rule_rewards import squad_f1, squad_normalize

__all__ = ["f1_score", "normalize_answer"]

normalize_answer = squad_normalize


def f1_score(prediction: str | None, ground_truth: str) -> tuple[float, float, float]:
    """(F1, precision, recall) of `prediction` against `ground_truth`; (0, 0, 0) for a missing prediction."""
    if prediction is None:
        return 0.0, 0.0, 0.0
    return squad_f1(prediction, ground_truth)
