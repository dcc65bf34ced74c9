"""slime's reward modules (`slime.rollout.rm_hub` and its scorers) served by slimeflow's compat layer, with slime
absent: each answers as slime's does at 624b824, over slimeflow's own rule rewards (one implementation)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from paths import DATA
from test_rl_rewards import reward_server  # noqa: F401  (the fixture: a reward server answering {"reward": ...})

from slimeflow import slime_compat
from slimeflow.rollout import answers, rule_rewards
from slimeflow.rollout.types import Sample

slime_compat.install()

from slime.rollout import rm_hub  # noqa: E402  (answered by the hook installed above)
from slime.rollout.rm_hub import deepscaler, f1, gpqa, math_dapo_utils, math_utils  # noqa: E402


def args(**overrides):
    values = dict(custom_rm_path=None, rm_type=None, rm_url=None, rollout_seed=3, reward_key=None)
    return SimpleNamespace(**{**values, **overrides})


def sample(response: str, label="7", index: int = 0, **fields) -> Sample:
    return Sample(index=index, group_index=0, prompt="q", response=response, label=label, **fields)


def test_the_slime_names_are_slimeflows_modules():
    assert math_utils is __import__("slimeflow.slime_compat.rollout.rm_hub.math_utils", fromlist=["x"])
    assert rm_hub.extract_boxed_answer is math_utils.extract_answer  # slime's __init__ exports it under this name
    assert gpqa.DEFAULT_VALID_LETTERS == list("ABCDEFGHIJ")


# --- math_utils ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,span", [
    (r"try \boxed{1} then \boxed{x^{2}}", r"\boxed{x^{2}}"),
    (r"only \fbox{9}", r"\fbox{9}"),  # \fbox only when there is no \boxed
    (r"\boxed{3} and \fbox{9}", r"\boxed{3}"),
    (r"\boxed{open", None),
    ("nothing", None),
])
def test_last_boxed_span(text, span):
    assert math_utils.last_boxed_only_string(text) == span


def test_boxed_content_is_none_when_not_boxed_braces():
    assert math_utils.remove_boxed(r"\boxed{a{b}}") == "a{b}"
    assert math_utils.remove_boxed(r"\fbox{9}") is None and math_utils.remove_boxed(None) is None
    assert math_utils.extract_boxed_answer(r"\fbox{9}") is None
    assert math_utils.extract_answer("9") is None and math_utils.extract_answer(r"so \boxed{9}.") == "9"


@pytest.mark.parametrize("raw,normal", [
    (r"\dfrac34", r"\frac{3}{4}"), (r"\sqrt2", r"\sqrt{2}"), ("k = 12", "12"), (r"90^\circ", "90"),
    (r"\left[1,2\right]", "[1,2]"), ("5/8", r"\frac{5}{8}"), ("{.25}", "{0.25}"),
])
def test_hendrycks_rewrites(raw, normal):
    assert math_utils._strip_string(raw) == normal


def test_mathd_normalize_unwraps_text_and_keeps_none():
    assert math_utils.mathd_normalize_answer(r" \text{blue} ") == "blue"
    assert math_utils.mathd_normalize_answer(None) is None


def test_mathd_and_sympy_grading():
    assert math_utils.grade_answer_mathd(r"\tfrac{5}{8}", "5/8")
    assert not math_utils.grade_answer_mathd("8", "9")
    assert math_utils.grade_answer_sympy("2*y+y", "3y")
    assert not math_utils.grade_answer_sympy(r"\frac{3}{6}", r"\frac{1}{2}")  # an unreduced fraction is wrong
    assert math_utils.grade_answer_sympy("1,000", "1000")


def test_grade_answer_verl():
    assert math_utils.grade_answer_verl(r"hence \boxed{\frac{1}{2}}", "0.5")
    assert math_utils.grade_answer_verl(r"\boxed{7}", r"the answer \boxed{7}")
    assert not math_utils.grade_answer_verl("7", "7")  # no boxed answer
    assert not math_utils.grade_answer_verl(r"\boxed{7}", "")
    assert rm_hub.grade_answer_verl is math_utils.grade_answer_verl


def test_slimes_graders_run_under_the_judges_timeout(monkeypatch):
    """A deliberate difference (docs/rl-api.md): a runaway check counts as not equal, where slime's waits."""
    monkeypatch.setattr(answers, "grade", lambda given, truth: time.sleep(5) or True)
    monkeypatch.setattr(math_utils.JUDGE, "timeout_s", 1)
    started = time.monotonic()
    assert not math_utils.grade_answer_verl(r"\boxed{7}", "7")
    assert deepscaler.get_deepscaler_rule_based_reward(r"</think>\boxed{7}", "7") == 0
    assert time.monotonic() - started < 4


# --- math_dapo_utils ----------------------------------------------------------------------------------------------

def test_dapo_boxes():
    assert math_dapo_utils.last_boxed_only_string(r"\fbox{2}") is None  # no \fbox fallback here
    assert math_dapo_utils.last_boxed_only_string(r"\boxed{1} \boxed 5") == r"\boxed{1}"
    assert math_dapo_utils.remove_boxed(r"\boxed{2}") == "2"
    with pytest.raises(AssertionError, match="box error"):
        math_dapo_utils.remove_boxed("2")


@pytest.mark.parametrize("raw,normal", [
    ("n = 17", "17"), ("12 students", "12"), (r"\text{yes}", "yes"), ("$40$", "40"), ("10,000", "10000"),
    ("3<|im_end|>", "3"),
])
def test_minerva_normalisation(raw, normal):
    assert math_dapo_utils.normalize_final_answer(raw) == normal


def test_minerva_check_reads_the_last_answer_line():
    assert math_dapo_utils.is_correct_minerva("Answer: 5\nno, wait.\nanswer: 6", "6.0") == (True, "6")
    assert math_dapo_utils.is_correct_minerva("6", "6") == (False, "[INVALID]")
    assert math_dapo_utils.is_correct_minerva("Answer: 6", r"\boxed{6}", gt_need_extract=True)[0]
    with pytest.raises(ValueError, match="not an integer"):
        math_dapo_utils.is_correct_minerva("Answer: x", "x+1")


def test_strict_box_reads_the_tail_as_written():
    assert math_dapo_utils.is_correct_strict_box(r"so \boxed{6}", "6") == (1, "6")
    assert math_dapo_utils.is_correct_strict_box(r"\boxed{6.0}", "6") == (-1, "6.0")  # no normalisation
    assert math_dapo_utils.is_correct_strict_box(r"\boxed{6}" + "." * 100, "6") == (-1, None)
    text = "." * 200 + r"\boxed{6}" + "." * 200  # 100 characters before the last pause token hold the box
    assert math_dapo_utils.is_correct_strict_box(text, "6", pause_tokens_index=[0, 0, 0, 250]) == (1, "6")
    assert math_dapo_utils.verify(r"\boxed{6}", "6", strict_box_verify=True) == (True, "6")
    assert math_dapo_utils.verify("Answer: 6", "6") == (True, "6")


def test_dapo_compute_score_is_the_rm_types_score():
    assert math_dapo_utils.compute_score("Answer: 8", "8") == {"score": 1.0, "acc": True, "pred": "8"}
    far = "Answer: 8\n" + "x" * 300
    assert math_dapo_utils.compute_score(far, "8")["score"] == -1.0  # only the last 300 characters count
    assert rm_hub.compute_score_dapo is math_dapo_utils.compute_score
    assert rule_rewards.dapo_reward("Answer: 8", "8", {}, None) == math_dapo_utils.compute_score("Answer: 8", "8")


# --- deepscaler, f1, gpqa -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("response,label,reward", [
    (r"\boxed{1}</think>so \boxed{2}", "2", 1),
    (r"\boxed{2}</think>so \boxed{1}", "2", 0),
    (r"draft###Response \boxed{0.25}", r"\frac14", 1),
    (r"\boxed{2}", "2", 0),  # neither marker
    ("</think>2", "2", 0),
    (r"</think>\boxed{2}", "", 0),
    (r"</think>\boxed{2}", 2.0, 1),
])
def test_deepscaler(response, label, reward):
    assert deepscaler.get_deepscaler_rule_based_reward(response, label) == reward


def test_f1_components():
    assert f1.normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    f1_value, precision, recall = f1.f1_score("red green blue", "green blue")
    assert (precision, recall) == (pytest.approx(2 / 3), 1.0) and f1_value == pytest.approx(0.8)
    assert f1.f1_score(None, "x") == (0, 0, 0)
    assert f1.f1_score("no", "no way") == (0, 0, 0) and f1.f1_score("No.", "no") == (1.0, 1.0, 1.0)
    assert f1.f1_score("cat", "dog") == (0, 0, 0)


@pytest.mark.parametrize("response,letters,letter", [
    ("I pick option: d", "ABCD", "D"), ("C is correct.", "ABCD", "C"), ("hmm A or maybe B", "ABCD", "B"),
    ("Answer: E, so B", "ABCD", "B"), ("answer is A</think>final answer: C", "ABCD", "C"), ("none", "ABCD", None),
])
def test_gpqa_letter(response, letters, letter):
    assert gpqa._extract_letter_from_response(response, list(letters)) == letter


def test_gpqa_reward_sources_of_the_right_letter():
    choices = ["helium", "neon", "argon"]
    assert gpqa.compute_gpqa_reward("Answer: B", "b") == 1.0 and gpqa.compute_gpqa_reward("Answer: B", "C") == 0.0
    assert gpqa.compute_gpqa_reward("Answer: B", "D", {"choices": choices}) == 0.0  # D is no option of three
    assert gpqa.compute_gpqa_reward("Answer: C", 2, {"choices": choices}) == 1.0
    assert gpqa.compute_gpqa_reward("Answer: B", "Neon", {"choices": choices}) == 1.0
    assert gpqa.compute_gpqa_reward("it is argon", "argon", {"choices": choices}) == 1.0
    assert gpqa.compute_gpqa_reward("Answer: A", "neon", {"correct_letter": " a "}) == 1.0
    assert gpqa.compute_gpqa_reward(None, "A") == 0.0


# --- async_rm / batched_async_rm ------------------------------------------------------------------------------------

def test_async_rm_builtins_as_slime_routes_them():
    assert asyncio.run(rm_hub.async_rm(args(rm_type="math"), sample(r"\boxed{7}"))) == 1.0
    # the sample's rm_type wins over args'; the boxed_ prefix scores the boxed content
    tagged = sample(r"\boxed{red green}", label="green", metadata={"rm_type": "boxed_f1"})
    assert asyncio.run(rm_hub.async_rm(args(rm_type="math"), tagged)) == pytest.approx(2 / 3)
    dapo = asyncio.run(rm_hub.async_rm(args(rm_type="dapo"), sample("Answer: 7")))
    assert dapo == {"score": 1.0, "acc": True, "pred": "7"}  # the dict, as slime's async_rm returns it
    with pytest.raises(ValueError, match="no reward is configured"):
        asyncio.run(rm_hub.async_rm(args(), sample("7")))
    with pytest.raises(ValueError, match="unknown rm_type 'nope'"):
        asyncio.run(rm_hub.async_rm(args(rm_type="nope"), sample("7")))
    with pytest.raises(ValueError, match="ifbench"):
        asyncio.run(rm_hub.async_rm(args(rm_type="ifbench"), sample("7")))


def test_async_rm_random_is_reproducible_per_sample():
    """A deliberate difference (docs/rl-api.md): slime draws from a global generator; ours is seeded per sample."""
    draws = [asyncio.run(rm_hub.async_rm(args(rm_type="random"), sample("x", index=i))) for i in range(16)]
    again = [asyncio.run(rm_hub.async_rm(args(rm_type="random"), sample("x", index=i))) for i in range(16)]
    assert draws == again and set(draws) == {0.0, 1.0}


def test_custom_paths_take_precedence(monkeypatch):
    monkeypatch.syspath_prepend(str(DATA / "slime_plugins"))
    plugin_args = args(rm_type="math", custom_rm_path="slime_style_hooks.dict_reward")
    assert asyncio.run(rm_hub.async_rm(plugin_args, sample("7"))) == {"acc": 1.0, "format": 0.5}
    own = sample("x", custom_rm_path="slime_style_hooks.parity_reward", tokens=[1, 4, 5])
    assert asyncio.run(rm_hub.async_rm(plugin_args, own)) == 1.0  # the sample's path wins over args'
    group = [sample("abc", index=0, response_length=3), sample("a", index=1, response_length=1)]
    batched = args(custom_rm_path="slime_style_hooks.group_length_reward")
    assert asyncio.run(rm_hub.batched_async_rm(batched, group)) == [1.0, 0.0]  # called once, on the list
    builtins = asyncio.run(rm_hub.batched_async_rm(args(rm_type="math"), [sample(r"\boxed{7}"), sample("7")]))
    assert builtins == [1.0, 0.0]


def test_remote_rm_returns_the_servers_answer(reward_server):  # noqa: F811  (the imported fixture)
    remote = args(rm_type="remote_rm", rm_url=reward_server)
    assert asyncio.run(rm_hub.async_rm(remote, sample("7"))) == {"reward": 1.0}  # the JSON as it came, as slime's
    with pytest.raises(ValueError, match="needs args.rm_url"):
        asyncio.run(rm_hub.async_rm(args(rm_type="remote_rm"), sample("7")))
