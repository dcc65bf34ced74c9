"""The evaluate stage's engine: served from a thread of the stage's process (the default, as the train stage serves
one engine) or from a process of its own, the same scores either way; the thread leaves the stage's torch threads as
it found them (the engine's set-up sets its own thread's to one)."""

from __future__ import annotations

import torch
from train_helpers import DATA

from slimeflow.config.evaluate import EvaluateConfig
from slimeflow.families.tiny import TinyModelSpec
from slimeflow.io.storage import Storage
from slimeflow.stages.base import StageContext
from slimeflow.stages.evaluate.stage import run


def test_the_engine_in_process_scores_as_one_of_its_own(tiny_torch_dist, tmp_path):
    hf = tiny_torch_dist(TinyModelSpec(seed=7))["hf"]
    # Sampled (seeded per response) rather than greedy: a random model answers nothing right, so the score to
    # compare is each response's length (in characters) under a length-counting reward.
    config = EvaluateConfig(hf_checkpoint=str(hf), eval_prompt_data={"increment": str(DATA / "increment-eval.jsonl")},
                            input_key="prompt", label_key="label", eval_max_response_len=3, eval_temperature=1.0,
                            n_samples_per_eval_prompt=2, custom_rm_path=f"{__name__}:response_length")
    threads = torch.get_num_threads()
    scores = {}
    for in_process in (True, False):
        ctx = StageContext(Storage(), tmp_path / str(in_process), str(tmp_path / str(in_process)))
        scores[in_process] = run(config.model_copy(update={"engine_in_process": in_process}), ctx).metrics
        assert torch.get_num_threads() == threads
    assert scores[True] == scores[False]
    assert scores[True]["eval/increment/avg_at_2"] > 0


async def response_length(args, sample) -> float:
    return float(len(sample.response))
