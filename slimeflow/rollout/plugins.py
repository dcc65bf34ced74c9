"""Loading `module.path:function` plug-ins (custom rewards, filters, losses, advantages) once, with a clear error."""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable
from typing import Any

from slimeflow import slime_compat
from slimeflow.errors import PluginError


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
    slime_compat.install()  # a plug-in written against slime imports slime.*: answered where slime is absent
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(
            f"--{flag} {path!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); check the "
            "spelling and that the module and what it imports are on PYTHONPATH"
        ) from exc
    except Exception as exc:  # the module's own code failed (SyntaxError, an error at import time, ...)
        raise PluginError(f"--{flag} {path!r}: importing module {module_name!r} failed: {type(exc).__name__}: {exc}"
                          f"{_raised_at(exc)}; fix the module") from exc
    try:
        present = hasattr(module, attr)
    except ImportError as exc:  # a module that answers why it does not provide the name (slime_compat's)
        raise PluginError(f"--{flag} {path!r}: {exc}") from exc
    if not present:
        public = sorted(name for name in dir(module) if not name.startswith("_"))
        raise PluginError(
            f"--{flag} {path!r}: module {module_name!r} has no attribute {attr!r} "
            f"(it defines: {', '.join(public[:20]) or 'nothing public'})"
        )
    function = getattr(module, attr)
    if not callable(function):
        raise PluginError(f"--{flag} {path!r}: {attr!r} is a {type(function).__name__}, not a function")
    return function


def _raised_at(exc: BaseException) -> str:
    """' (at FILE:LINE)' of the innermost frame of `exc` (of the code for a SyntaxError), else ''."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" (at {exc.filename}:{exc.lineno})"
    frames = traceback.extract_tb(exc.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
