"""The built-in rule-based rewards (--rm-type), each scoring as slime's rm_hub does (THUDM/slime 624b824a8).

tests/data/rm_hub/*.jsonl holds, per rm_type, cases with the reward slime gives; tests/unit/test_rm_hub_table.py asserts
every row. Where slime fails on an input (a non-integer dapo label, a missing label) we raise a ValueError that
says why, and the scorer marks that sample failed with it. Two deliberate differences: f1 reads a numeric label as
its text (slime fails on it), and math refuses a structured (dict, list) label by name where slime compares its
str() and scores 0. Our own addition is prefix_match.
"""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from collections.abc import Callable
from typing import Any

from slimeflow.config.train_validation import refuse_unbuilt
from slimeflow.rollout.answers import MathJudge
from slimeflow.rollout.math_grader import boxed_answer, last_boxed, minerva_normalize, unboxed

RewardValue = float | dict[str, Any]
BuiltinReward = Callable[[str, Any, dict[str, Any], MathJudge], RewardValue]
"""(response, label, metadata, judge) -> a reward, or (dapo) a dict of which --reward-key names the reward."""


def _label_text(label: Any, rm_type: str) -> str:
    """The label as text, as slime reads it (str() of a number); None and structured labels are refused."""
    if label is None:
        raise ValueError(f"rm_type {rm_type!r} compares against a label, and this sample has none (set --label-key)")
    if isinstance(label, str | int | float):
        return str(label)
    raise ValueError(f"rm_type {rm_type!r} compares against a text label, and this sample's label is a "
                     f"{type(label).__name__}; score structured labels with --custom-rm-path")


def _boxed_truth(truth: str) -> str | None:
    """A label that is itself boxed is compared by its boxed content (None: boxed, but nothing extractable)."""
    return boxed_answer(truth) if "\\boxed" in truth else truth


def math_reward(response: str, label: Any, metadata: dict[str, Any], judge: MathJudge) -> float:
    """1.0 when the response's last \\boxed{} answer grades equal to the label (judge: slime's grader), else 0.0.

    A falsy label (``""``, ``0``) scores 0.0, as in slime."""
    if not label:
        return 0.0
    truth = _boxed_truth(_label_text(label, "math"))
    given = boxed_answer(response)
    return float(given is not None and truth is not None and judge.equal(given, truth))


def deepscaler_reward(response: str, label: Any, metadata: dict[str, Any], judge: MathJudge) -> float:
    """DeepScaleR: the boxed answer after the last `</think>` (else after the first `###Response`) graded against the
    label; 0.0 without such a marker, without a boxed answer, or with an empty label."""
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0.0
    given = boxed_answer(solution)
    if given is None or label == "":
        return 0.0
    truth = _boxed_truth(_label_text(label, "deepscaler"))
    return float(truth is not None and judge.equal(given, truth))


DAPO_ANSWER = r"(?i)Answer\s*:\s*([^\n]+)"
"""Where DAPO reads a response's answer: the text after the last `Answer:` on its line."""


def dapo_label(label: Any) -> str:
    """A DAPO label as the integer text the prediction must equal (every DAPO answer is an integer)."""
    truth = minerva_normalize(label)
    try:
        return str(int(float(truth)))
    except (ValueError, OverflowError):
        raise ValueError(f"rm_type 'dapo' compares integer answers, and the label {label!r} is not an integer "
                         "(slime fails on it too); use rm_type math for other answers") from None


def minerva_check(solution: str, label: Any, answer_pattern: str = DAPO_ANSWER) -> tuple[bool, str]:
    """(correct, prediction): the last `answer_pattern` match of `solution`, Minerva-normalised ("[INVALID]" when
    none), against the integer `label`."""
    found = re.findall(answer_pattern, solution)
    pred = minerva_normalize(found[-1] if found else "[INVALID]")
    return pred == dapo_label(label), pred


def strict_box_check(solution: str, label: Any, pause_tokens_index: list[int] | None = None
                     ) -> tuple[bool, str | None]:
    """(correct, prediction): the last `\\boxed{...}` of the final 100 characters of `solution` (of the 100 before
    the last of 4 pause-token positions, when given), un-normalised, equal to `label` as it is."""
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index must hold 4 positions, got {pause_tokens_index!r}")
        tail = solution[pause_tokens_index[-1] - 100:]
    else:
        tail = solution[-100:]
    pred = unboxed(last_boxed(tail, ("\\boxed{",)))
    return pred == label, pred


def dapo_score(response: str, label: Any, strict_box: bool = False,
               pause_tokens_index: list[int] | None = None) -> dict[str, Any]:
    """DAPO on the final 300 characters of `response`: the Minerva check (or, with `strict_box`, the strict boxed
    check). {"score": 1.0 or -1.0, "acc": bool, "pred": the prediction}, as slime's compute_score."""
    tail = response[-300:]
    correct, pred = strict_box_check(tail, label, pause_tokens_index) if strict_box else minerva_check(tail, label)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


def dapo_reward(response: str, label: Any, metadata: dict[str, Any], judge: MathJudge) -> dict[str, Any]:
    """DAPO: the last `Answer: ...` line of the final 300 characters, Minerva-normalised, equal to the (integer)
    label. Returns {"score": 1.0 or -1.0, "acc": bool, "pred": the normalised answer}, as slime; the reward is
    `score` (--reward-key score, which slime's DAPO scripts pass, and our default for a dict without 'reward')."""
    return dapo_score(response, label)


_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_CLOSED_ANSWERS = ("yes", "no", "noanswer")


def squad_normalize(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def squad_f1(prediction: str, truth: str) -> tuple[float, float, float]:
    """(F1, precision, recall) of the normalised tokens; (0, 0, 0) without a common token, or when a yes/no/noanswer
    on either side is not matched exactly."""
    pred, gold = squad_normalize(prediction), squad_normalize(truth)
    if pred != gold and (pred in _CLOSED_ANSWERS or gold in _CLOSED_ANSWERS):
        return 0.0, 0.0, 0.0
    pred_tokens, gold_tokens = pred.split(), gold.split()
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0, 0.0, 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall), precision, recall


def f1_reward(response: str, label: Any, metadata: dict[str, Any], judge: MathJudge) -> float:
    """SQuAD token F1 between the whole response and the label (lower case, no punctuation or articles); a yes/no/
    noanswer on either side must match exactly."""
    return squad_f1(response, _label_text(label, "f1"))[0]


_GPQA_PATTERNS = tuple(re.compile(p, re.IGNORECASE) for p in (
    r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])",
    r"([A-Z])\s*(?:is\s*(?:the)?\s*correct)",
    r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])",
))
_LONE_CAPITAL = re.compile(r"\b([A-Z])\b")
GPQA_LETTERS = tuple(string.ascii_uppercase[:10])
"""The option letters of a GPQA question whose metadata names neither its letters nor its choices (A-J)."""


def _after_reasoning(text: str) -> str:
    return text.rsplit("</think>", 1)[-1]


def _loose(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def choice_letter(response: str, letters: list[str]) -> str | None:
    """The option letter a response picks: the first match of each phrase pattern in turn (`answer is B`,
    `B is correct`, `final answer: B`; case-insensitive) if it is a valid letter, else the last lone capital that
    is one. As slime's, `The answer is: B` reads as `I` (the `i` of `is`) when I is a valid letter."""
    if not response:
        return None
    text = _after_reasoning(response)
    valid = {letter.upper() for letter in letters}
    for pattern in _GPQA_PATTERNS:
        match = pattern.search(text)
        if match and match.group(1).upper() in valid:
            return match.group(1).upper()
    return next((c for c in reversed(_LONE_CAPITAL.findall(text)) if c in valid), None)


def gpqa_reward(response: str, label: Any, metadata: dict[str, Any], judge: MathJudge) -> float:
    """GPQA-style multiple choice, as slime: the right letter comes from metadata['correct_letter'], a one-letter
    label, a numeric label (an index) or the label's text among metadata['choices']; the letter the response picks
    decides, and without one, the right option's text (or the label's, or metadata['correct_answer'] /
    ['answer_text']) appearing in the response scores 1.0. Valid letters: metadata['valid_letters'], else one per
    choice, else A-J."""
    choices = metadata.get("choices")
    choices = list(choices.values()) if isinstance(choices, dict) else (list(choices) if choices is not None else None)
    if metadata.get("valid_letters"):
        letters = [str(letter).upper() for letter in metadata["valid_letters"]]
    else:
        letters = list(string.ascii_uppercase[:len(choices)]) if choices else list(GPQA_LETTERS)
    correct = metadata.get("correct_letter")
    correct = correct.strip().upper() if isinstance(correct, str) else None
    label_text = None
    if isinstance(label, str):
        label_text = label.strip()
        if len(label_text) == 1 and label_text.upper() in letters and not correct:
            correct = label_text.upper()
    elif isinstance(label, int | float) and 0 <= int(label) < len(letters):
        correct = letters[int(label)]
    if not correct and choices and label_text:
        wanted = _loose(label_text)
        correct = next((letters[i] for i, choice in enumerate(choices) if _loose(str(choice)) == wanted), None)

    picked = choice_letter(response, letters)
    if picked and correct:
        return float(picked == correct)
    targets = []
    if correct and choices and correct in letters and letters.index(correct) < len(choices):
        targets.append(str(choices[letters.index(correct)]))
    targets += [str(metadata[key]) for key in ("correct_answer", "answer_text") if metadata.get(key)]
    if label_text:
        targets.append(label_text)
    said = _loose(_after_reasoning(response))
    if any(target and target in said for target in map(_loose, targets)):
        return 1.0
    if picked and not correct and label_text:
        return float(picked == label_text.upper())
    return 0.0


def prefix_match_reward(response: str, label: Any, metadata: dict[str, Any], judge: MathJudge) -> float:
    """(slimeflow's own) 1.0 when the response, leading whitespace removed, starts with the label, else 0.0."""
    gold = _label_text(label, "prefix_match").strip()
    if not gold:
        raise ValueError("rm_type 'prefix_match' needs a non-empty label")
    return float(response.lstrip().startswith(gold))


BUILTIN_REWARDS: dict[str, BuiltinReward] = {
    "math": math_reward,
    "deepscaler": deepscaler_reward,
    "dapo": dapo_reward,
    "f1": f1_reward,
    "gpqa": gpqa_reward,
    "prefix_match": prefix_match_reward,
}
RANDOM = "random"
"""rm_type random: 0 or 1 with equal chance (slime's random.randint(0, 1)), from the generator the caller seeds."""


def builtin_reward(rm_type: str, response: str, label: Any, metadata: dict[str, Any], judge: MathJudge,
                   rng: random.Random | None = None) -> RewardValue:
    """The reward of built-in `rm_type`. A `boxed_` prefix scores, with the rm_type after it, the content of the
    response's last \\boxed{} (unwrapped, "" when none), as slime: so boxed_math and boxed_deepscaler, which look
    for a \\boxed{} themselves, score 0 unless the boxed content holds another \\boxed{}."""
    rm_type = rm_type.strip()
    if rm_type.startswith("boxed_"):
        response, rm_type = boxed_answer(response) or "", rm_type[len("boxed_"):]
    refuse_unbuilt(rm_type, "rm_type")
    if rm_type == RANDOM:
        if rng is None:
            raise ValueError("rm_type 'random' needs a seeded generator (RewardScorer passes one per sample)")
        return float(rng.randint(0, 1))
    if rm_type not in BUILTIN_REWARDS:
        raise ValueError(f"unknown rm_type {rm_type!r}; built-ins are {', '.join([*BUILTIN_REWARDS, RANDOM])} "
                         "(optionally with a boxed_ prefix), or remote_rm with --rm-url")
    return BUILTIN_REWARDS[rm_type](response, label, metadata, judge)
