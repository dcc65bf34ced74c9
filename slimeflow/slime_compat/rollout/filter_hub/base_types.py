"""slime.rollout.filter_hub.base_types: what a dynamic-sampling filter returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slimeflow.rollout.filters import drops_group


@dataclass
class DynamicFilterOutput:
    """A filter's verdict on a group. `keep` may be a bool or a one-element tensor (slime's filters return
    `tensor(False)`); `keep_when_insufficient` keeps a rejected group when dropping it would leave too few to fill
    the rollout batch."""

    keep: Any
    reason: str | None = None
    keep_when_insufficient: bool = False


def call_dynamic_filter(fn: Any, *args: Any, **kwargs: Any) -> DynamicFilterOutput:
    """`fn(*args, **kwargs)` as a DynamicFilterOutput (a bare bool is wrapped, as slime does for old filters)."""
    if fn is None:
        return DynamicFilterOutput(keep=True)
    output = fn(*args, **kwargs)
    return output if isinstance(output, DynamicFilterOutput) else DynamicFilterOutput(keep=output)


def should_drop_dynamic_filter_output(output: DynamicFilterOutput, *, remaining_batch_size: int,
                                      target_data_size: int) -> bool:
    """Whether the group judged `output` is dropped, `remaining_batch_size` groups (kept and in flight, this one
    included) standing against `target_data_size` (slimeflow's dynamic sampler's rule)."""
    return drops_group(bool(output.keep), output.keep_when_insufficient, remaining_batch_size, target_data_size)
