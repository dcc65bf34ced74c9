"""The base of every config model, and the small value types configs share."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

_PLUGIN_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*[:.][A-Za-z_][\w]*$")


class ConfigModel(BaseModel):
    """A config node: unknown keys are errors (a typo never silently falls back to a default)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


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
