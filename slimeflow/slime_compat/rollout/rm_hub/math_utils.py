"""slime.rollout.rm_hub.math_utils: slime's math answer checks, over slimeflow.rollout.math_grader.

Names and return values are slime's (None where slime's give None). The one difference: grade_answer_verl bounds
each check with MathJudge's timeout (a runaway sympy.simplify counts as not equal; slime's waits).
"""

from __future__ import annotations

from typing import Any

from slimeflow.rollout import math_grader
from slimeflow.rollout.answers import MathJudge
from slimeflow.rollout.rule_rewards import math_reward

__all__ = ["extract_answer", "extract_boxed_answer", "grade_answer_mathd", "grade_answer_sympy", "grade_answer_verl",
           "last_boxed_only_string", "mathd_normalize_answer", "remove_boxed"]

JUDGE = MathJudge()
"""The judge slime's module-level functions grade with: slime's API has no judge argument, so the module holds one
(its worker process starts only when a check runs off the main thread)."""

last_boxed_only_string = math_grader.last_boxed
remove_boxed = math_grader.unboxed
extract_boxed_answer = math_grader.boxed_answer
mathd_normalize_answer = math_grader.hendrycks_normalize
_strip_string = math_grader.hendrycks_strip
_normalize = math_grader.prm800k_normalize
grade_answer_mathd = math_grader.hendrycks_equal
grade_answer_sympy = math_grader.prm800k_equal


def extract_answer(passage: str) -> str | None:
    """The last \\boxed{} answer of `passage`; None when it has no `\\boxed`."""
    return math_grader.boxed_answer(passage) if "\\boxed" in passage else None


def grade_answer_verl(solution_str: str, ground_truth: Any) -> bool:
    """Whether the last \\boxed{} answer of `solution_str` is `ground_truth` (itself boxed or not); False for a falsy
    ground truth or a solution without a boxed answer."""
    return math_reward(solution_str, ground_truth, {}, JUDGE) == 1.0
