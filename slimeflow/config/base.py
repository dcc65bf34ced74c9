"""The base of every config model, and the small value types configs share."""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Callable, Mapping
from functools import cache
from typing import Annotated, Any, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
)

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


ModelT = TypeVar("ModelT", bound=BaseModel)


def replace(model: ModelT, **updates: Any) -> ModelT:
    """A copy of `model` with `updates`, validated as a new one would be (pydantic's model_copy(update=...) does not
    validate). Only what was set is carried over (model_fields_set, nested models included), so that values derived
    from other fields are derived again from the updated ones, and `model_fields_set` keeps meaning "given"."""
    return type(model).model_validate({**model.model_dump(exclude_unset=True, round_trip=True), **updates})


def peek(model: type[BaseModel], data: Any, *names: str) -> tuple[Any, ...] | None:
    """The values `data` (a model's raw input: a mapping, an instance or None) gives `names`, validated as those
    fields validate them, defaults for the absent ones; None when one does not validate or a required one is absent (the model's own validation
    reports it). For validators that derive one field's default from others before the model is built."""
    if isinstance(data, model):
        return tuple(getattr(data, name) for name in names)
    data = data if isinstance(data, Mapping) else {}
    if any(name not in data and model.model_fields[name].is_required() for name in names):
        return None
    try:
        return tuple(_field_adapter(model, name).validate_python(data[name]) if name in data
                     else model.model_fields[name].get_default(call_default_factory=True) for name in names)
    except ValidationError:
        return None


@cache
def _field_adapter(model: type[BaseModel], name: str) -> TypeAdapter[Any]:
    field = model.model_fields[name]
    return TypeAdapter(Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation)


def given(data: Any, name: str) -> bool:
    """Whether a model's raw input (a mapping or an instance) gives field `name` a value, not None."""
    if isinstance(data, BaseModel):
        return name in data.model_fields_set and getattr(data, name) is not None
    return isinstance(data, Mapping) and data.get(name) is not None


def validate_derived(handler: Callable[[Any], ModelT], data: Any, derived: Mapping[str, Any],
                     groups: Mapping[str, Mapping[str, Any]] | None = None) -> ModelT:
    """handler(data) (a wrap validator's) with `derived` field values filled in, and `groups`' values filled into
    those nested groups' input. The filled values are not marked as given (model_fields_set), so that what is
    stored as given (Prefect's parameters, `replace`) never freezes a default that follows other flags: it is
    derived again, from the current flags, each time the config is validated."""
    data = dict(data)
    raw_groups = {name: data.get(name) for name in groups or {}}
    for name, values in (groups or {}).items():
        raw = raw_groups[name]
        base = raw.model_dump(exclude_unset=True, round_trip=True) if isinstance(raw, BaseModel) else dict(raw or {})
        data[name] = {**base, **values}
    model = handler({**data, **derived})
    model.__pydantic_fields_set__.difference_update(name for name in derived if not given(data, name))
    for name, values in (groups or {}).items():
        group = getattr(model, name)
        group.__pydantic_fields_set__.difference_update(f for f in values if not given(raw_groups[name], f))
        if raw_groups[name] is None:
            model.__pydantic_fields_set__.discard(name)
    return model
