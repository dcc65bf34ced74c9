"""Dynamic sampling: keep a group only if a filter passes, over-sampling until enough groups are kept.

Pure bookkeeping that the rollout drives: it asks `groups_to_request()` how many new prompts to submit, offers each
finished group with `offer()`, and stops when `done`. Every dropped group is counted with its reason.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from slimeflow.rollout.types import Sample, Status


@dataclass(frozen=True)
class FilterOutcome:
    """A filter's verdict on one group; `reason` says why a dropped group was dropped."""

    keep: bool
    reason: str | None = None
    keep_when_insufficient: bool = False
    """Keep the group anyway when dropping it would leave too few kept and in flight to fill the batch (slime's)."""


GroupFilter = Callable[[Sequence[Sample]], "FilterOutcome | bool"]
"""(group) -> FilterOutcome, or a bool (False is counted under the filter's name)."""


def check_reward_nonzero_std(group: Sequence[Sample]) -> FilterOutcome:
    """Keep a group whose rewards are not all equal (a zero-std group gives GRPO no gradient)."""
    rewards = torch.tensor([float(s.reward) for s in group])
    if len(group) > 1 and rewards.std().item() > 0.0:
        return FilterOutcome(True)
    return FilterOutcome(False, "zero_std")


def drops_group(keep: bool, keep_when_insufficient: bool, remaining: int, target: int) -> bool:
    """Whether a group the filter judged is dropped: one it rejected is, unless it is kept when insufficient and
    `remaining` (the groups kept and in flight, this one included) would no longer reach `target` without it."""
    return not keep and not (keep_when_insufficient and remaining <= target)


class DynamicSampler:
    """Collects `target_groups` groups that pass `group_filter`, requesting `over_sampling_batch_size` at a time.

    A group with a failed sample (its reward raised) is dropped as "failed_sample" before the filter runs.
    Groups kept beyond the target (they finished after it was reached) are returned as `surplus`.
    """

    def __init__(self, target_groups: int, over_sampling_batch_size: int | None = None,
                 group_filter: GroupFilter | None = None):
        over = over_sampling_batch_size or target_groups
        if over < target_groups:
            raise ValueError(f"over_sampling_batch_size {over} is smaller than rollout_batch_size {target_groups}")
        self.target_groups = target_groups
        self.over_sampling_batch_size = over
        self.group_filter = group_filter
        self.kept: list[list[Sample]] = []
        self.dropped: Counter[str] = Counter()
        self.requested = 0
        self.finished = 0

    @property
    def in_flight(self) -> int:
        """Groups requested but not yet offered."""
        return self.requested - self.finished

    @property
    def done(self) -> bool:
        """Whether enough groups have been kept."""
        return len(self.kept) >= self.target_groups

    def groups_to_request(self) -> int:
        """How many new groups to submit now (counted as requested): a full over-sampling batch when the groups kept
        and in flight cannot reach the target, else 0."""
        if self.done or len(self.kept) + self.in_flight >= self.target_groups:
            return 0
        self.requested += self.over_sampling_batch_size
        return self.over_sampling_batch_size

    def withdraw(self) -> None:
        """Forget one requested group that will not be offered (its generation was aborted; it is asked again)."""
        if self.in_flight <= 0:
            raise ValueError("withdraw() with no group in flight")
        self.requested -= 1

    def offer(self, group: Sequence[Sample]) -> bool:
        """Account for one finished group; returns whether it was kept."""
        if self.finished >= self.requested:
            raise ValueError("a group was offered that was never requested; call groups_to_request() first")
        self.finished += 1
        failed = [s for s in group if s.status is Status.FAILED]
        if failed:
            self.dropped["failed_sample"] += 1
            return False
        if self.group_filter is not None:
            outcome = self.group_filter(group)
            if not isinstance(outcome, FilterOutcome):
                outcome = FilterOutcome(bool(outcome), None if outcome else getattr(self.group_filter, "__name__", "filter"))
            remaining = len(self.kept) + self.in_flight + 1  # this group included
            if drops_group(outcome.keep, outcome.keep_when_insufficient, remaining, self.target_groups):
                self.dropped[outcome.reason or "filtered"] += 1
                return False
        self.kept.append(list(group))
        return True

    def result(self) -> tuple[list[list[Sample]], list[list[Sample]]]:
        """(the first target_groups kept groups, the surplus kept groups)."""
        if not self.done:
            raise ValueError(f"only {len(self.kept)} of {self.target_groups} groups have been kept so far")
        return self.kept[:self.target_groups], self.kept[self.target_groups:]

    def stats(self) -> dict[str, int]:
        """Counts for the rollout's metrics: requested, finished, kept, and dropped/<reason> for each reason."""
        counts = {"requested": self.requested, "finished": self.finished, "kept": len(self.kept),
                  "dropped": sum(self.dropped.values())}
        counts.update({f"dropped/{reason}": n for reason, n in sorted(self.dropped.items())})
        return counts
