"""Search-R1 on slime's plug-in contracts: a multi-turn generate function and an exact-match reward.

Written as a slime plug-in is (`from slime...` imports, slime's `Sample` and `post`), so the same file runs under
slime and, where slime is not installed, under slimeflow's compatibility namespace. Pass it as

    --custom-generate-function-path generate_with_search.generate
    --custom-rm-path generate_with_search.reward_func

with this directory on PYTHONPATH (run.sh does). The search is `retriever.search` over the shipped corpus, in
process, where slime's example calls a retrieval server or a web search API.

One trajectory: the model writes until `</search>` or `</answer>` (at most TURN_TOKENS tokens a turn); a search's
results are appended as `<information>...</information>`, a turn without an action gets a note saying so, and the
model goes on, up to MAX_TURNS turns and the --rollout-max-response-len budget. Model tokens train (loss mask 1,
the engine's log-probs); the appended results and the note after an invalid action do not (loss mask 0).
"""

from __future__ import annotations

import re

from retriever import search
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.http_utils import post
from slime.utils.types import Sample

MAX_TURNS = 2
TURN_TOKENS = 48
"""At most this many new tokens per model turn (a turn that ends without an action is an invalid action)."""
TOPK = 2
STOP = ["</search>", "</answer>"]
INVALID = "\nInvalid action: write <search> query </search> or <answer> answer </answer>.\n"
_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def passages(results: list[dict]) -> str:
    """Retrieved documents as the model reads them: 'Doc i(Title: ...) text' lines."""
    lines = []
    for i, result in enumerate(results, 1):
        title, _, text = result["document"]["contents"].partition("\n")
        lines.append(f"Doc {i}(Title: {title}) {text}")
    return "\n".join(lines)


def observe(turn_text: str) -> tuple[str | None, bool]:
    """What the environment answers to one model turn: (text to append or None, whether the trajectory is done)."""
    action = _ACTION.search(turn_text)
    if action is None:
        return INVALID, False
    if action.group(1) == "answer":
        return None, True
    return f"\n\n<information>{passages(search(action.group(2).strip(), TOPK))}</information>\n\n", False


async def generate(args, sample: Sample, sampling_params) -> Sample:
    """slime's custom generate contract: one multi-turn trajectory for `sample`'s prompt, in place."""
    assert not args.partial_rollout, "this generate function starts every trajectory afresh (no --partial-rollout)"
    state = GenerateState(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt = sample.prompt
    if isinstance(prompt, list):  # messages: the data was not rendered with --apply-chat-template
        prompt = state.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    sample.tokens = state.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    sample.response, sample.response_length, sample.loss_mask, sample.rollout_log_probs = "", 0, [], []
    stop = sampling_params.get("stop") or []
    params = {**sampling_params, "stop": list(dict.fromkeys([*([stop] if isinstance(stop, str) else stop), *STOP]))}
    budget = sampling_params["max_new_tokens"]

    for turn in range(MAX_TURNS):
        params["max_new_tokens"] = min(TURN_TOKENS, budget - sample.response_length)
        # Tokens in, tokens out: the engine continues exactly the token ids the trainer will see.
        output = await post(url, {"input_ids": sample.tokens, "sampling_params": params, "return_logprob": True})
        meta = output["meta_info"]
        if meta["finish_reason"]["type"] == "abort":
            sample.status = Sample.Status.ABORTED
            return sample
        pairs = meta["output_token_logprobs"]
        sample.append_response_tokens(args, tokens=[p[1] for p in pairs], log_probs=[p[0] for p in pairs],
                                      trainable=True, meta_info=meta, text=output["text"])
        if sample.response_length >= budget or turn == MAX_TURNS - 1:
            break
        observation, done = observe(output["text"])
        if done:
            break
        ids = state.tokenizer(observation, add_special_tokens=False)["input_ids"]
        if sample.response_length + len(ids) >= budget:  # no room left for the model to read it and go on
            sample.status = Sample.Status.TRUNCATED
            break
        sample.append_response_tokens(args, tokens=ids, trainable=False, text=observation)
    return sample


def normalize(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (the usual QA exact-match normalisation)."""
    text = re.sub(r"[^\w\s]", " ", text.lower())
    return " ".join(word for word in text.split() if word not in ("a", "an", "the"))


def exact_match(response: str, targets: list[str]) -> float:
    """1.0 when the last <answer> of `response` equals one of `targets` after normalisation, else 0.0."""
    answers = _ANSWER.findall(response)
    return float(bool(answers) and normalize(answers[-1]) in {normalize(t) for t in targets})


async def reward_func(args, sample: Sample, **kwargs) -> float:
    """slime's custom reward contract: exact match of the response's answer with the golden answers, which the
    Search-R1 data carries as its label (`reward_model`): {"ground_truth": {"target": [...]}}."""
    if not isinstance(sample, Sample):
        raise TypeError(f"reward_func expects slime's Sample, got {type(sample).__name__}")
    return exact_match(sample.response, sample.label["ground_truth"]["target"])
