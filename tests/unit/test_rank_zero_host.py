"""The RolloutManager hosted in trainer rank 0's process (placement.rank_zero_class): each role keeps its methods,
its start failure and its errors, as it has in an actor of its own; and when the two share a process."""

from __future__ import annotations

import pytest

from slimeflow.config.pipeline import load_stage_config
from slimeflow.stages.train.placement import Facet, rank_zero_class, shares_rank_zero
from slimeflow.stages.train.remote import ActorFailure, hosted


class Manager:
    def __init__(self, fail: bool = False):
        if fail:
            raise ValueError("no engine could load the model")
        self.generated: list[int] = []

    def generate(self, rollout_id: int) -> str:
        self.generated.append(rollout_id)
        return f"batch {rollout_id}"

    def plugin_settings_read(self) -> list[str]:
        return ["from-the-manager"]


class Trainer:
    def __init__(self, rank: int):
        self.rank = rank

    def train(self, rollout_id: int, batch: str) -> str:
        if batch == "poison":
            raise RuntimeError("loss is nan")
        return f"rank {self.rank} trained {rollout_id} on {batch}"

    def plugin_settings_read(self) -> list[str]:
        return ["from-the-trainer"]


class Handle:
    """What a Ray actor handle gives for `name`: the bound method (here, called directly)."""

    def __init__(self, actor):
        self.actor = actor

    def __getattr__(self, name):
        return getattr(self.actor, name)


def test_each_role_keeps_its_methods_and_errors():
    host = rank_zero_class(hosted(Manager), hosted(Trainer))((), (0,))
    manager, trainer = Facet(Handle(host), "manager_"), Facet(Handle(host), "trainer_")
    assert trainer.train(3, manager.generate(3)) == "rank 0 trained 3 on batch 3"
    # Same-named methods stay apart.
    assert (manager.plugin_settings_read(), trainer.plugin_settings_read()) == (["from-the-manager"],
                                                                                 ["from-the-trainer"])
    with pytest.raises(ActorFailure, match="RuntimeError: loss is nan"):
        trainer.train(4, "poison")
    assert host.manager.generated == [3]


def test_a_role_that_cannot_start_says_so_on_its_own_calls_only():
    host = rank_zero_class(hosted(Manager), hosted(Trainer))((True,), (0,))
    with pytest.raises(ActorFailure, match="Manager could not start: ValueError: no engine could load the model"):
        host.manager_generate(0)
    assert host.trainer_train(0, "b") == "rank 0 trained 0 on b"


def test_the_manager_shares_rank_zero_only_on_a_cpu_in_a_synchronous_run_without_fault_tolerance():
    def config(*flags: str):
        return load_stage_config("train", None, ["--rollout-batch-size", "8", "--num-rollout", "2", *flags])

    plain = config()
    assert shares_rank_zero(plain, on_gpus=False, ranks=1)
    assert shares_rank_zero(plain, on_gpus=False, ranks=2)  # rank 0 hosts it; rank 1 is an actor of its own
    assert not shares_rank_zero(plain, on_gpus=True, ranks=1)  # slime's placement group: each on its bundle
    assert not shares_rank_zero(plain, on_gpus=False, ranks=0)  # --debug-rollout-only: no trainer
    assert not shares_rank_zero(config("--async"), on_gpus=False, ranks=1)  # the two compute at once
    assert not shares_rank_zero(config("--use-fault-tolerance"), on_gpus=False, ranks=1)  # the manager calls rank 0
