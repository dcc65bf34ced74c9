"""examples/search-r1: slime's search-r1 plug-in pattern (a multi-turn generate function with a local retriever, an
exact-match reward) on the Search-R1 data format; the turn logic against a scripted engine, and the example's
config through preprocess and 3 rollouts of training with the tiny model, its loss masks checked in the rollouts."""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

import pytest
from paths import ROOT

EXAMPLE = ROOT / "examples" / "search-r1"


@pytest.fixture()
def search_r1(monkeypatch):
    """The example's generate_with_search module, imported as slime's loader does (slime answered by slimeflow)."""
    from slimeflow import slime_compat

    slime_compat.install()
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import generate_with_search

    return generate_with_search


def test_retriever_ranks_the_passage_that_answers_first():
    sys.path.insert(0, str(EXAMPLE))
    try:
        from retriever import search
    finally:
        sys.path.remove(str(EXAMPLE))
    for query, title in [("capital of Australia", '"Canberra"'), ("deepest lake", '"Lake Baikal"'),
                         ("who wrote Hamlet", '"Hamlet"'), ("symbol of gold", '"Gold"')]:
        results = search(query, 3)
        assert len(results) == 3 and results[0]["document"]["contents"].split("\n")[0] == title, query
        assert results[0]["score"] > results[1]["score"]


def scripted_engine(tokenizer, turns: list[tuple[str, str]], seen: list[list[int]]):
    """A `post` that answers /generate with the next (text, finish reason) of `turns`, as SGLang would (token ids
    and log-probs of the text), recording each request's input_ids in `seen`."""
    async def post(url, payload, **kwargs):
        assert url == "http://127.0.0.1:30000/generate" and payload["return_logprob"] is True
        assert {"</search>", "</answer>"} <= set(payload["sampling_params"]["stop"])
        seen.append(list(payload["input_ids"]))
        text, finish = turns[len(seen) - 1]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) <= payload["sampling_params"]["max_new_tokens"]
        return {"text": text, "meta_info": {"finish_reason": {"type": finish},
                                             "output_token_logprobs": [[-0.5, i, None] for i in ids]}}
    return post


def run_generate(module, monkeypatch, turns, label, budget=512):
    from slimeflow.families.tiny import build_tiny_tokenizer
    from slimeflow.slime_compat.utils.types import Sample

    tokenizer = build_tiny_tokenizer("qwen2")
    seen: list[list[int]] = []
    monkeypatch.setattr(module, "post", scripted_engine(tokenizer, turns, seen))
    monkeypatch.setattr(module, "GenerateState", lambda args: SimpleNamespace(tokenizer=tokenizer))
    args = SimpleNamespace(partial_rollout=False, sglang_router_ip="127.0.0.1", sglang_router_port=30000)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Question: capital of Australia?"}],
                                           tokenize=False, add_generation_prompt=True)
    sample = Sample(prompt=prompt, label={"ground_truth": {"target": label}})
    out = asyncio.run(module.generate(args, sample, {"max_new_tokens": budget, "stop": None, "temperature": 1.0}))
    return out, tokenizer, seen


def test_a_search_turn_gets_the_retrieved_passages_masked_out_and_the_answer_is_rewarded(search_r1, monkeypatch):
    turns = [("<search> capital of Australia </search>", "stop"), ("<answer> Canberra </answer>", "stop")]
    sample, tokenizer, seen = run_generate(search_r1, monkeypatch, turns, ["Canberra"])

    first, second = (tokenizer(t, add_special_tokens=False)["input_ids"] for t, _ in turns)
    prompt = tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    information = sample.tokens[len(prompt) + len(first):len(sample.tokens) - len(second)]
    text = tokenizer.decode(information)
    assert text.startswith("\n\n<information>Doc 1(Title: \"Canberra\") Canberra is the capital city of Australia.")
    # The engine continued exactly the tokens the trainer sees; the passages are the environment's, not trained.
    assert seen == [prompt, prompt + first + information]
    assert sample.loss_mask == [1] * len(first) + [0] * len(information) + [1] * len(second)
    assert sample.rollout_log_probs == [-0.5] * len(first) + [0.0] * len(information) + [-0.5] * len(second)
    assert sample.response_length == len(sample.tokens) - len(prompt) and sample.status is sample.Status.COMPLETED
    assert sample.response == turns[0][0] + text + turns[1][0]
    assert asyncio.run(search_r1.reward_func(None, sample)) == 1.0
    sample.label = {"ground_truth": {"target": ["Sydney"]}}
    assert asyncio.run(search_r1.reward_func(None, sample)) == 0.0


def test_a_turn_without_an_action_gets_the_invalid_action_note_masked_out(search_r1, monkeypatch):
    turns = [("I think", "length"), ("<answer> the Canberra. </answer>", "stop")]
    sample, tokenizer, seen = run_generate(search_r1, monkeypatch, turns, ["canberra"])

    note = tokenizer(search_r1.INVALID, add_special_tokens=False)["input_ids"]
    first, second = (len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t, _ in turns)
    assert sample.loss_mask == [1] * first + [0] * len(note) + [1] * second
    assert asyncio.run(search_r1.reward_func(None, sample)) == 1.0  # normalised: case, article, punctuation


def test_results_that_do_not_fit_the_response_budget_end_the_trajectory_truncated(search_r1, monkeypatch):
    turns = [("<search> capital of Australia </search>", "stop")]
    sample, tokenizer, seen = run_generate(search_r1, monkeypatch, turns, ["Canberra"], budget=64)

    first = tokenizer(turns[0][0], add_special_tokens=False)["input_ids"]
    assert len(seen) == 1 and sample.status is sample.Status.TRUNCATED
    assert sample.response == turns[0][0] and sample.loss_mask == [1] * len(first)
