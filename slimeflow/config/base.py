"""The base of every config model, and the small value types configs share."""

from __future__ import annotations

import re
import types
import typing
from functools import cache
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationInfo, field_validator

_PLUGIN_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*[:.][A-Za-z_][\w]*$")


class ConfigModel(BaseModel):
    """A config node: unknown keys are errors (a typo never silently falls back to a default)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads true as 1 and false as 0: `processes: true` would run one process.
        if isinstance(value, bool) and info.field_name and _numbers_only(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"takes a number, not {str(value).lower()}")
        return value


@cache
def _numbers_only(annotation: Any) -> bool:
    """Whether a field's type takes int or float values but not bool (through Optional, unions, Annotated)."""
    found: set[type] = set()
    stack = [annotation]
    while stack:
        item = stack.pop()
        origin = typing.get_origin(item)
        if origin is Annotated:
            stack.append(typing.get_args(item)[0])
        elif origin in (typing.Union, types.UnionType):
            stack.extend(typing.get_args(item))
        elif isinstance(item, type):
            found.add(item)
    return bool(found & {int, float}) and bool not in found


def _check_plugin_path(value: str | None) -> str | None:
    if value is not None and not _PLUGIN_PATH.match(value):
        raise ValueError(
            f"{value!r} is not a plug-in path; write it as 'package.module:function' (or slime's "
            "'package.module.function'), e.g. 'my_project.rewards:reward'"
        )
    return value


PluginPath = Annotated[str | None, AfterValidator(_check_plugin_path)]
"""`module.path:function` (slime also accepts a final dot); loaded once at start-up by the stage that uses it."""


def _check_positive(value: int | None) -> int | None:
    if value is not None and value <= 0:
        raise ValueError(f"must be a positive integer, got {value}")
    return value


PositiveInt = Annotated[int, AfterValidator(_check_positive)]
OptionalPositiveInt = Annotated[int | None, AfterValidator(_check_positive)]
