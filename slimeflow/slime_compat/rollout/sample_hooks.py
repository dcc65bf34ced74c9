"""slime.rollout.sample_hooks: --rollout-sample-hook-path applied by hand, as slime's custom rollout functions do,
over slimeflow's own hook runner (slimeflow.rollout.slime_rollout_hooks).

`apply_rollout_sample_hooks(args, value, **kwargs)` runs the hooks at args.rollout_sample_hook_path on every Sample
of `value` (a Sample or nested lists of them) and returns the same shape; each hook gets the keywords it takes.
`rollout_id` defaults to the one last given to `set_current_rollout_id`: slime keeps it in a module global, and a
custom rollout function that calls these hooks itself sets it the same way.
"""

from __future__ import annotations

from typing import Any

from slimeflow.rollout.plugins import load_plugin
from slimeflow.rollout.slime_rollout_hooks import apply_hooks_to_sample
from slimeflow.rollout.types import Sample

__all__ = ["apply_rollout_sample_hooks", "set_current_rollout_id"]

_current_rollout_id: int | None = None


def set_current_rollout_id(rollout_id: int | None) -> None:
    """The rollout_id that apply_rollout_sample_hooks passes when its caller gives none."""
    global _current_rollout_id
    _current_rollout_id = rollout_id


async def apply_rollout_sample_hooks(args: Any, value: Any, **kwargs: Any) -> Any:
    """The hooks on every Sample leaf of `value`, nested list shape kept; `value` itself when no hook is set."""
    paths = getattr(args, "rollout_sample_hook_path", None) or []
    if not paths:
        return value
    hooks = [load_plugin(path, "rollout-sample-hook-path") for path in paths]
    kwargs.setdefault("rollout_id", _current_rollout_id)
    return await _apply(hooks, args, value, kwargs)


async def _apply(hooks: list[Any], args: Any, value: Any, kwargs: dict[str, Any]) -> Any:
    if isinstance(value, Sample):
        return await apply_hooks_to_sample(hooks, args, value, **kwargs)
    if isinstance(value, list):
        return [await _apply(hooks, args, item, kwargs) for item in value]
    raise TypeError(f"apply_rollout_sample_hooks takes a Sample or a (nested) list of Samples, got "
                    f"{type(value).__name__}")
