"""--custom-config-path: a YAML file of extra `args` attributes for plug-ins, as slime reads it.

slime loads the file after parsing its flags and sets every key as an attribute of `args`, over a flag of the same
name (it logs that it overrides it). Here a key that is one of the train stage's flags sets that flag, over the
command line and the run's YAML (slime's precedence); `sglang_X` / `router_X` keys go to the SGLang and router
pass-through as their flags do; a key that names a slime flag slimeflow refuses is refused with the reason; every
other key is a plug-in's own setting, an attribute of the `args` the plug-ins get (slime_plugins.slime_args).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import BaseModel

_PASSTHROUGH = {"sglang_": ("sglang", "args"), "router_": ("sglang", "router")}


def read_custom_config(path: str, config_class: type[BaseModel]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the flags it sets, as a nested config tree; the plug-in settings, by key) of the YAML file at `path`, for
    the train config `config_class` (whose flags a key may set). Raises ValueError naming the file and every key it
    cannot take."""
    from slimeflow.config.flags import FlagIndex, set_path
    from slimeflow.config.slime_flags import refusal_reason
    from slimeflow.config.yaml_file import read_yaml

    where = f"--custom-config-path {path}"
    if not Path(path).is_file():
        raise ValueError(f"{where}: no such file; give the YAML file of the plug-ins' settings (key: value)")
    data = read_yaml(path)
    index = FlagIndex(config_class)
    flags: dict[str, Any] = {}
    custom: dict[str, Any] = {}
    problems = []
    for key, value in data.items():
        name = str(key)
        flag = "--" + name.replace("_", "-")
        prefix = next((p for p in _PASSTHROUGH if name.startswith(p)), None)
        if name == "custom_config_path":
            problems.append(f"{name}: a custom config cannot name another one")
        elif flag in index.by_flag:
            set_path(flags, index.by_flag[flag].path, value)
        elif prefix is not None:
            set_path(flags, (*_PASSTHROUGH[prefix], name.removeprefix(prefix)), value)
        elif refusal_reason(flag) is not None:
            problems.append(f"{name}: slime's flag {flag}, which slimeflow does not take ({refusal_reason(flag)})")
        else:
            custom[name] = value
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))
    return flags, custom


def custom_config_record(path: str, config_class: type[BaseModel]) -> dict[str, Any]:
    """What the file at `path` set, for the manifest and the MLflow params: its path, the flags it set by dotted
    config path (`algorithm.lr`), and the plug-in settings."""
    flags, custom = read_custom_config(path, config_class)
    return {"path": path, "flags": _dotted(flags), "settings": custom}


def _dotted(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            flat.update(_dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def overridden(given: Mapping[str, Any], flags: Mapping[str, Any], config_class: type[BaseModel],
               ) -> dict[str, tuple[Any, Any]]:
    """What the file's flag keys (read_custom_config's `flags` tree) change, by key: (the value the flag had in
    `given`, the command line's and YAML's tree, else its default; the file's value). slime prints each such
    override; a key that sets a flag to the value it already had is left out."""
    from slimeflow.config.flags import FlagIndex

    by_path = FlagIndex(config_class).by_path
    changes = {}
    for path, new in _leaves(flags):
        old = _get(given, path)
        if old is _ABSENT:
            old = by_path[path].default if path in by_path else None
        elif path in by_path:  # a command line's value is still a string
            old = _as(by_path[path].annotation, old)
        new = _as(by_path[path].annotation, new) if path in by_path else new
        if old != new:
            changes[path[-1] if path in by_path else "_".join(path[1:])] = (old, new)
    return changes


_ABSENT = object()


def _as(annotation: Any, value: Any) -> Any:
    """`value` as its flag's type (unchanged where it does not validate: the config's validation reports it)."""
    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(annotation).validate_python(value)
    except ValidationError:
        return value


def _leaves(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    found = []
    for key, value in tree.items():
        path = (*prefix, key)
        found += _leaves(value, path) if isinstance(value, Mapping) else [(path, value)]
    return found


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree.get(key, _ABSENT) if isinstance(tree, Mapping) else getattr(tree, key, _ABSENT)
        if tree is _ABSENT:
            return _ABSENT
    return tree
