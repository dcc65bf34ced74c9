"""Loading `module.path:function` plug-ins (custom rewards, filters, losses, advantages) once, with a clear error."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


class PluginError(ValueError):
    """A plug-in path that cannot be loaded: names the flag, the path and the reason."""


def load_plugin(path: str, flag: str) -> Callable[..., Any]:
    """The callable at `path` ('pkg.module:function', or slime's 'pkg.module.function'), for flag `flag`.

    Raises PluginError naming the flag, the path and what is wrong (module missing, attribute missing, not callable),
    so a wrong path fails at start-up rather than in the middle of a run.
    """
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise PluginError(f"--{flag} {path!r}: write it as 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(
            f"--{flag} {path!r}: cannot import module {module_name!r} ({exc}); check the spelling and that the "
            "module is on PYTHONPATH"
        ) from exc
    if not hasattr(module, attr):
        public = sorted(name for name in dir(module) if not name.startswith("_"))
        raise PluginError(
            f"--{flag} {path!r}: module {module_name!r} has no attribute {attr!r} "
            f"(it defines: {', '.join(public[:20]) or 'nothing public'})"
        )
    function = getattr(module, attr)
    if not callable(function):
        raise PluginError(f"--{flag} {path!r}: {attr!r} is a {type(function).__name__}, not a function")
    return function
