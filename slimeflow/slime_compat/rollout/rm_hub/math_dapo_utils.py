"""slime.rollout.rm_hub.math_dapo_utils: DAPO's scorer (Minerva or strict boxed), over slimeflow's rule_rewards."""

from __future__ import annotations

from typing import Any

from slimeflow.rollout.math_grader import last_boxed, minerva_normalize, unboxed
from slimeflow.rollout.rule_rewards import DAPO_ANSWER, dapo_score, minerva_check, strict_box_check

__all__ = ["compute_score", "is_correct_minerva", "is_correct_strict_box", "last_boxed_only_string",
           "normalize_final_answer", "remove_boxed", "verify"]

normalize_final_answer = minerva_normalize


def last_boxed_only_string(string: str) -> str | None:
    """The last `\\boxed{...}` span of `string` (no `\\fbox` fallback here, as slime's DAPO scorer), or None."""
    return last_boxed(string, ("\\boxed{",))


def remove_boxed(s: str | None) -> str:
    """The content of `\\boxed{...}`; AssertionError ("box error") on anything else, as slime's DAPO scorer."""
    content = unboxed(s)
    if content is None:
        raise AssertionError(f"box error: {s}")
    return content


def is_correct_minerva(solution_str: str, gt: Any, gt_need_extract: bool = False,
                       answer_pattern: str = DAPO_ANSWER) -> tuple[bool, str]:
    """(correct, prediction) of the last `answer_pattern` answer against the integer `gt` (boxed in `gt` when
    `gt_need_extract`)."""
    if gt_need_extract:
        gt = remove_boxed(last_boxed_only_string(gt))
    return minerva_check(solution_str, gt, answer_pattern)


def is_correct_strict_box(pred: str, gt: Any, pause_tokens_index: list[int] | None = None) -> tuple[int, str | None]:
    """(1 or -1, prediction): the last boxed answer of the final 100 characters of `pred` equal to `gt`."""
    correct, extracted = strict_box_check(pred, gt, pause_tokens_index)
    return (1 if correct else -1), extracted


def verify(solution_str: str, answer: Any, strict_box_verify: bool = False,
           pause_tokens_index: list[int] | None = None) -> tuple[bool, str | None]:
    """(correct, prediction) by the strict boxed check or the Minerva one."""
    if strict_box_verify:
        return strict_box_check(solution_str, answer, pause_tokens_index)
    return minerva_check(solution_str, answer)


def compute_score(solution_str: str, ground_truth: Any, strict_box_verify: bool = False,
                  pause_tokens_index: list[int] | None = None) -> dict[str, Any]:
    """{"score": 1.0 or -1.0, "acc": bool, "pred": prediction} of the final 300 characters of `solution_str`."""
    return dapo_score(solution_str, ground_truth, strict_box_verify, pause_tokens_index)
