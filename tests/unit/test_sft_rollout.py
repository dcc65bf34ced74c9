"""slime's SFT rollout (slime.rollout.sft_rollout over slimeflow's loss masks) and the loss without advantages
(--disable-compute-advantages-and-returns) that slime's SFT scripts train with; the run itself is in
tests/integration/test_sft_train_only.py."""

from __future__ import annotations

import types

import pytest
import torch
from test_loss_masks import CONVERSATION, ToyTokenizer

from slimeflow.config.pipeline import load_stage_config
from slimeflow.errors import ConfigError
from slimeflow.rollout.types import Sample, Status, TrainBatch
from slimeflow.slime_compat import install
from slimeflow.slime_compat.rollout import sft_rollout
from slimeflow.slime_compat.utils.mask_utils import MultiTurnLossMaskGenerator
from slimeflow.train.train_step import prepare

install()

from slime.rollout.sft_rollout import generate_rollout  # noqa: E402


class Buffer:
    """slime's data-source API: get_samples(n) -> n groups."""

    def __init__(self, prompts):
        self.groups = [[Sample(index=i, group_index=i, prompt=p)] for i, p in enumerate(prompts)]

    def get_samples(self, n):
        taken, self.groups = self.groups[:n], self.groups[n:]
        return taken


@pytest.fixture
def toy_masks(monkeypatch):
    generator = MultiTurnLossMaskGenerator(ToyTokenizer(), tokenizer_type="qwen")
    monkeypatch.setattr(sft_rollout, "_mask_generator", lambda hf, style: generator)
    return generator


def test_a_conversation_becomes_tokens_with_the_assistant_turns_trained(toy_masks):
    args = types.SimpleNamespace(hf_checkpoint="/m", rollout_batch_size=1, loss_mask_type="qwen")
    (group,) = generate_rollout(args, 0, Buffer([CONVERSATION, CONVERSATION]))
    (sample,) = group
    tokens, mask = toy_masks.get_loss_mask(CONVERSATION)
    assert sample.tokens == tokens and sample.reward == 0 and sample.status is Status.COMPLETED
    # The response runs from the first trained token to the end; its mask is the conversation's over that part.
    assert sample.response_length == len(tokens) - mask.index(1) and sample.loss_mask == mask[mask.index(1):]
    trained = "".join(chr(t) for t, m in zip(sample.tokens[-sample.response_length:], sample.loss_mask, strict=True) if m)
    assert "A1" in trained and "A3" in trained and "A2" not in trained and "Q" not in trained and "T1" not in trained


def test_a_prompt_that_is_not_a_conversation_or_an_eval_rollout_is_refused(toy_masks):
    args = types.SimpleNamespace(hf_checkpoint="/m", rollout_batch_size=1)
    with pytest.raises(ValueError, match="needs a messages list: give --input-key the conversation column"):
        generate_rollout(args, 0, Buffer(["a rendered prompt"]))
    with pytest.raises(ValueError, match="makes training data only"):
        generate_rollout(args, 0, Buffer([CONVERSATION]), evaluation=True)


TRAIN = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "1", "--num-rollout", "1"]


def test_no_advantages_is_for_losses_that_read_none():
    config = load_stage_config("train", None, [*TRAIN, "--loss-type", "sft_loss",
                                               "--disable-compute-advantages-and-returns"])
    assert config.algorithm.disable_compute_advantages_and_returns
    with pytest.raises(ConfigError, match="--disable-compute-advantages-and-returns with --loss-type policy_loss, "
                                          "--use-kl-loss: these read the advantages"):
        load_stage_config("train", None, [*TRAIN, "--disable-compute-advantages-and-returns", "--use-kl-loss"])


def test_without_advantages_no_log_prob_pass_runs():
    config = load_stage_config("train", None, [*TRAIN, "--loss-type", "sft_loss",
                                               "--disable-compute-advantages-and-returns"])

    class NoForward:
        def compute_log_probs(self, *args, **kwargs):
            raise AssertionError("no old, reference or teacher log-probs are computed without advantages")

    samples = [Sample(index=i, group_index=i, tokens=[1, 2, 3, 4], response_length=2, loss_mask=[1, 1], reward=0.0,
                      status=Status.COMPLETED) for i in range(2)]
    prepared = prepare(NoForward(), TrainBatch.from_samples(samples), config, [[0, 1]], world_size=1)
    assert prepared.old_log_probs is None and prepared.ref_log_probs is None
    assert [a.tolist() for a in prepared.advantages] == [[0.0, 0.0], [0.0, 0.0]]
    assert all(isinstance(a, torch.Tensor) for a in prepared.advantages)
