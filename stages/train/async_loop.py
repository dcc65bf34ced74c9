"""The asynchronous loop, as slime's train_async.py: rollout k+1 is generated while the trainer trains on rollout k.

The rollout manager is asked for the next rollouts before training starts, with the weights the engines hold:
--async-buffer-size N of them (1, slime's train_async.py: rollout k+1 while training on k; N: k+1..k+N). It
generates them one after another, in the synchronous loop's data order. Weights are pushed every
--update-weights-interval rollouts, once the rollouts asked for are generated (never under one). So a sample may lag
the trained policy: its staleness, the trained version minus the version that generated it, is at most N + I - 1
for I = --update-weights-interval (0 for the first rollout of a run), recorded per rollout and checked against
--max-staleness. With --partial-rollout a continued sample's earlier tokens count with the version that generated
them (unless --mask-offpolicy-in-partial-rollout keeps them out of the loss): the rollout function starts again
from its prompt a buffered sample that would exceed the bound. The trainer's old log-probs are its own (the current
weights), so --use-tis weighs each token by them over the engine's log-probs of the older policy that sampled it, as
slime's TIS does. A save carries the rollouts generated and not yet trained, and the buffered partial samples
(RolloutManager.state_dict), so a killed run resumes with them. An evaluation pushes the trained weights first, so
it scores the same policy as the synchronous loop's. Reporting, intervals and evaluation are loop.py's.
"""

from __future__ import annotations

from collections import deque

from slimeflow.config.train import staleness_bound
from slimeflow.stages.train.loop import (
    LoopResult,
    Metrics,
    Reporter,
    Timer,
    evaluate,
    should_run,
    should_save,
)
from slimeflow.stages.train.placement import Placement


class StalenessError(RuntimeError):
    """A rollout's samples lag the trainer by more versions than the bound allows."""


def train(placement: Placement, num_rollout: int, report: Reporter) -> LoopResult:
    """Run rollouts [start, num_rollout) where start follows the loaded checkpoint (0 on a fresh run)."""
    config = placement.config
    rollout_manager, actor_group = placement.rollout_manager, placement.actor_group
    interval, eval_interval = config.weight_sync.update_weights_interval, config.eval.eval_interval
    ahead, bound = config.placement.async_buffer_size, staleness_bound(config)
    assert bound is not None  # bounded under --async, the only loop this one runs
    start_rollout_id, saved_state = actor_group.load()
    result = LoopResult(start_rollout_id, num_rollout)
    evaluate_first = start_rollout_id < num_rollout and bool(eval_interval) and not config.eval.skip_eval_before_train
    report.started(start_rollout_id, evaluate_first, saved_state.get("report"))
    if start_rollout_id >= num_rollout:
        return result  # a finished run, started again: nothing left to do
    if saved_state.get("data_source"):
        rollout_manager.load_state_dict(saved_state["data_source"])  # with the rollouts that were in flight
    actor_group.update_weights(version=start_rollout_id)
    engine_version = start_rollout_id

    if evaluate_first:
        result.eval_history[start_rollout_id] = evaluate(rollout_manager, start_rollout_id, report)

    pending = deque(rollout_manager.start_generate(k, engine_version)
                    for k in range(start_rollout_id, min(start_rollout_id + ahead, num_rollout)))
    for rollout_id in range(start_rollout_id, num_rollout):
        timer = Timer()
        with timer("wait_generate"):
            batch, rollout_metrics, result.row_ids[rollout_id] = pending.popleft().result()
        report.generated(rollout_id, result.row_ids[rollout_id])  # before any save that covers this rollout
        staleness = check_staleness(rollout_id, rollout_metrics, bound)
        if rollout_id + ahead < num_rollout:  # keep `ahead` rollouts asked for while this one trains
            pending.append(rollout_manager.start_generate(rollout_id + ahead, engine_version))
        with timer("train"):
            train_metrics = actor_group.train(rollout_id, batch)

        if should_save(config.checkpoint.save_interval, rollout_id, num_rollout):
            with timer("save"):  # waits for the rollouts in flight: the checkpoint carries them
                result.checkpoint = actor_group.save(rollout_id, {"data_source": rollout_manager.state_dict(rollout_id),
                                                                  "report": {**rollout_metrics, **staleness,
                                                                             **train_metrics, **timer.seconds}})

        evaluates = should_run(eval_interval, rollout_id, num_rollout)
        if (rollout_id + 1) % interval == 0 or evaluates or rollout_id + 1 == num_rollout:
            with timer("update_weights"):
                for rollout in pending:  # never swap the weights under a rollout being generated
                    rollout.wait()
                actor_group.update_weights(version=rollout_id + 1)
                engine_version = rollout_id + 1

        if evaluates:
            with timer("eval"):
                result.eval_history[rollout_id + 1] = evaluate(rollout_manager, rollout_id + 1, report)
        result.last_metrics = {**rollout_metrics, **staleness, **train_metrics, **timer.seconds}
        report.rollout(rollout_id, result.last_metrics)
    actor_group.wait_for_save()  # --async-save: the last checkpoint is committed before the run ends
    return result


def check_staleness(rollout_id: int, rollout_metrics: Metrics, bound: int) -> Metrics:
    """The staleness of rollout `rollout_id`'s samples (trained with version `rollout_id`) from the versions the
    engines reported (`rollout/weight_version_min/max`); raises StalenessError over `bound`."""
    if "rollout/weight_version_min" not in rollout_metrics:
        raise StalenessError(f"rollout {rollout_id}: the engines reported no weight version with its samples, so their "
                             "staleness cannot be bounded; the async loop needs engines that report weight_version "
                             "(SGLang's meta_info, the embedded engine's)")
    oldest = rollout_id - int(rollout_metrics["rollout/weight_version_min"])
    newest = rollout_id - int(rollout_metrics["rollout/weight_version_max"])
    if oldest > bound or newest < 0:
        raise StalenessError(f"rollout {rollout_id} is trained with policy version {rollout_id} on samples of versions "
                             f"{rollout_id - oldest}..{rollout_id - newest}: staleness {newest}..{oldest}, outside "
                             f"0..{bound} (--max-staleness, default --update-weights-interval + --async-buffer-size "
                             "- 1); this is a bug in the weight pushes or in the restart of stale partial samples")
    return {"async/staleness_max": float(oldest), "async/staleness_min": float(newest)}
