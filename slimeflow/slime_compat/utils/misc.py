"""slime.utils.misc: the helpers slime's plug-ins use (load_function, SingletonMeta)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def load_function(path: str) -> Callable[..., Any]:
    """The attribute at 'package.module.function' (slime's spelling; 'package.module:function' too)."""
    module_path, _, attr = path.rpartition(":") if ":" in path else path.rpartition(".")
    return getattr(importlib.import_module(module_path), attr)


class SingletonMeta(type):
    """One instance per class for the process's lifetime, as slime's (clear_instances() forgets them)."""

    _instances: dict[type, Any] = {}

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls not in cls._instances:
            cls._instances[cls] = super().__call__(*args, **kwargs)
        return cls._instances[cls]

    def clear_instances(cls) -> None:
        cls._instances.clear()
