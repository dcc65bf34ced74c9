"""slime-spelled flags over a tree of config models.

Every leaf field of a config tree is a flag: `TrainConfig.batch.rollout_batch_size` is `--rollout-batch-size`.
Leaf names are unique within a tree, so a slime flag list maps onto it flag for flag. `--sglang-X` flags are
passed through to SGLang, `--router-X` flags to sglang-router. A flag that the tree does not take is reported by name with the reason
(slime_flags.explain_unknown), never dropped.
"""

from __future__ import annotations

import argparse
import logging
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from slimeflow.config.slime_flags import deferred, explain_unknown
from slimeflow.errors import ConfigError

log = logging.getLogger("slimeflow.config")

Kind = Literal["bool", "list", "pairs", "scalar"]
SGLANG_PREFIX = "--sglang-"
ROUTER_PREFIX = "--router-"
@dataclass(frozen=True)
class Leaf:
    """One flag: where its value lives in the config tree, and how the command line spells and parses it."""

    path: tuple[str, ...]
    annotation: Any
    help: str
    default: Any

    @property
    def name(self) -> str:
        return self.path[-1]

    @property
    def flag(self) -> str:
        return "--" + self.name.rstrip("_").replace("_", "-")  # `async_` (a Python keyword's field) is --async

    @property
    def kind(self) -> Kind:
        base = _strip_optional(self.annotation)
        if base is bool:
            return "bool"
        origin = typing.get_origin(base)
        if origin is list:
            return "list"
        if origin is dict:
            return "pairs"
        return "scalar"


def _strip_optional(annotation: Any) -> Any:
    """`int | None` -> int; `Annotated[int | None, ...]` -> int."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _strip_optional(args[0])
    return annotation


def _group_model(annotation: Any) -> type[BaseModel] | None:
    base = _strip_optional(annotation)
    return base if isinstance(base, type) and issubclass(base, BaseModel) else None


def leaves(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[Leaf]:
    """All leaf fields of a config tree, depth first, in declaration order."""
    found: list[Leaf] = []
    for name, info in model.model_fields.items():
        group = _group_model(info.annotation)
        if group is not None:
            found.extend(leaves(group, (*prefix, name)))
        else:
            default = None if info.is_required() else info.get_default(call_default_factory=True)
            found.append(Leaf((*prefix, name), info.annotation, (info.description or "").strip(), default))
    return found


class FlagIndex:
    """The flags of one config tree, by flag spelling; leaf names must be unique within the tree."""

    def __init__(self, model: type[BaseModel]):
        self.model = model
        self.by_flag: dict[str, Leaf] = {}
        for leaf in leaves(model):
            if leaf.flag in self.by_flag:
                raise TypeError(f"{model.__name__}: {leaf.flag} is defined twice ({self.by_flag[leaf.flag].path}, {leaf.path})")
            self.by_flag[leaf.flag] = leaf
        self.by_path = {leaf.path: leaf for leaf in self.by_flag.values()}
        # A bool that defaults to None (decided by other flags, as slime's BooleanOptionalAction flags) is also
        # spelled --no-X, which sets it false.
        self.negations = {"--no-" + leaf.flag[2:]: leaf for leaf in self.by_flag.values()
                          if leaf.kind == "bool" and leaf.default is None}
        self.passthrough = _passthrough_path(model)
        self.router_passthrough = ("sglang", "router") if self.passthrough else None

    def takes(self, flag: str) -> bool:
        """Whether `flag` is one of this tree's flags (a --no-X negation included)."""
        return flag in self.by_flag or flag in self.negations

    def flag_for(self, loc: Sequence[Any]) -> str | None:
        """The flag of a pydantic error location, or None for a model-level error."""
        leaf = self.by_path.get(tuple(str(p) for p in loc if isinstance(p, str)))
        return leaf.flag if leaf else None


def _passthrough_path(model: type[BaseModel]) -> tuple[str, ...] | None:
    """Where `--sglang-*` flags go: the `args` dict of a field named `sglang`, if the tree has one."""
    info = model.model_fields.get("sglang")
    return ("sglang", "args") if info is not None and _group_model(info.annotation) else None


def build_parser(index: FlagIndex, prog: str, description: str) -> argparse.ArgumentParser:
    """An argparse parser whose --help lists every flag under slime's name, grouped as the config tree is."""
    parser = argparse.ArgumentParser(prog=prog, description=description, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(parser, index)
    return parser


def add_flags(parser: argparse.ArgumentParser, index: FlagIndex, dest_prefix: str = "",
              skip: frozenset[str] = frozenset()) -> None:
    """Add every flag of `index` (but those in `skip`) to `parser`, one argument group per config group."""
    groups: dict[tuple[str, ...], argparse._ArgumentGroup] = {}
    for leaf in index.by_flag.values():
        if leaf.flag in skip or leaf.path in (index.passthrough, index.router_passthrough):
            continue  # the pass-through dicts are filled by --sglang-X / --router-X, not flags of their own
        key = leaf.path[:-1]
        if key not in groups:
            groups[key] = parser.add_argument_group(".".join(key) or index.model.__name__)
        kwargs: dict[str, Any] = {"dest": dest_prefix + ".".join(leaf.path), "default": argparse.SUPPRESS}
        shown = "" if leaf.default in (None, [], {}) else f" (default: {leaf.default})"
        kwargs["help"] = (leaf.help + shown).replace("%", "%%")
        if leaf.kind == "bool":
            kwargs.update(nargs="?", const="true", metavar="BOOL")
        elif leaf.kind == "list":
            kwargs.update(nargs="+", action="extend", metavar="VALUE")
        elif leaf.kind == "pairs":
            kwargs.update(nargs="+", action="append", metavar="NAME PATH")
        else:
            kwargs["metavar"] = _metavar(leaf)
        groups[key].add_argument(leaf.flag, **kwargs)
    for flag, leaf in index.negations.items():
        if leaf.flag not in skip:
            groups[leaf.path[:-1]].add_argument(flag, dest=dest_prefix + ".".join(leaf.path), default=argparse.SUPPRESS,
                                                action="store_const", const="false", help=f"{leaf.flag} false")
    if index.passthrough:
        parser.add_argument_group("sglang pass-through", "--sglang-X VALUE is passed to the SGLang servers slimeflow "
                                  "launches as --X VALUE, --router-X VALUE to its sglang-router as --X VALUE")


def _metavar(leaf: Leaf) -> str:
    base = _strip_optional(leaf.annotation)
    if typing.get_origin(base) is Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(base)) + "}"
    return getattr(base, "__name__", "VALUE").upper()


def parse_flags(argv: Sequence[str], index: FlagIndex, *, prog: str = "slimeflow", description: str = "") -> dict[str, Any]:
    """Parse slime-spelled flags into a nested dict of overrides (raw strings; pydantic converts them).

    Raises ConfigError naming every flag it does not take (with the reason), and every malformed value.
    """
    parser = build_parser(index, prog, description)
    namespace, extras = parser.parse_known_args(list(argv))
    overrides: dict[str, Any] = {}
    problems: list[str] = []
    for dest, value in vars(namespace).items():
        leaf = index.by_path[tuple(dest.split("."))]
        if leaf.kind == "pairs":
            value, problem = _pairs(leaf.flag, [v for chunk in value for v in chunk])
            if problem:
                problems.append(problem)
                continue
        set_path(overrides, leaf.path, value)
    problems += _extras(extras, index, overrides)
    _note_given_twice(argv, index, prog)
    if problems:
        raise ConfigError(problems, "command line")
    return overrides


def _note_given_twice(argv: Sequence[str], index: FlagIndex, prog: str) -> None:
    """A one-value flag given several times with different values: the last one stands, as argparse (and so slime)
    keeps it, and slime's scripts rely on that (a model script's --moe-token-dispatcher-type, overridden by the run
    script's); logged once, with every value, so that it is not silent. List flags (--input a --input b) add up."""
    seen: dict[str, list[str]] = {}
    flag: str | None = None
    for token in argv:
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            leaf = index.by_flag.get(name)
            flag = name if leaf is not None and leaf.kind in ("scalar", "bool") else None
            if flag is not None:
                seen.setdefault(flag, []).append(value if eq else "")
        elif flag is not None:
            values = seen[flag]
            values[-1] = f"{values[-1]} {token}".strip()
    for name, values in seen.items():
        if len(set(values)) > 1:
            shown = ", ".join(v or "(no value)" for v in values)
            log.warning("%s: %s is given %d times (%s); the last, %s, stands", prog, name, len(values), shown,
                        values[-1] or "(no value)")


def _pairs(flag: str, values: list[str]) -> tuple[dict[str, str], str | None]:
    if len(values) % 2:
        return {}, f"{flag} takes NAME PATH pairs, got {len(values)} values: {' '.join(values)}"
    return dict(zip(values[::2], values[1::2], strict=True)), None


def _extras(extras: list[str], index: FlagIndex, overrides: dict[str, Any]) -> list[str]:
    """Handle what argparse did not take: --sglang-* pass-through, unknown flags, stray values."""
    problems: list[str] = []
    known = list(index.by_flag)
    i = 0
    while i < len(extras):
        token = extras[i]
        values = []
        while i + 1 < len(extras) and not extras[i + 1].startswith("--"):
            i += 1
            values.append(extras[i])
        i += 1
        if not token.startswith("--"):
            problems.append(f"{token!r}: a value with no flag before it; flags are spelled --name value")
        elif token.startswith((SGLANG_PREFIX, ROUTER_PREFIX)) and index.passthrough:
            sglang = token.startswith(SGLANG_PREFIX)
            key = token.removeprefix(SGLANG_PREFIX if sglang else ROUTER_PREFIX).replace("-", "_")
            value = (values[0] if len(values) == 1 else values) if values else True  # several values: a list
            set_path(overrides, (*(index.passthrough if sglang else index.router_passthrough), key), value)
        elif not deferred(token.split("=", 1)[0]):
            problems.append(explain_unknown(token.split("=", 1)[0], known))
    return problems


def set_path(tree: dict[str, Any], path: Sequence[str], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge of nested dicts: values in `override` win; dicts are merged key by key (so a flag's named
    eval set or `--sglang-*` argument adds to, or replaces by name, those of the YAML file)."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def nest_keys(data: Mapping[str, Any], index: FlagIndex, where: str) -> dict[str, Any]:
    """A YAML section in either shape: nested groups (as the models are) or flat slime names (kebab or snake).

    Flat keys are routed to their group; a key the tree does not take raises ConfigError naming it and `where`.
    """
    if not isinstance(data, Mapping):
        raise ConfigError([f"{where}: expected a mapping of flags (key: value), got {type(data).__name__} {data!r}"])
    out: dict[str, Any] = {}
    problems: list[str] = []
    _nest(data, index.model, (), index, out, problems, where)
    if problems:
        raise ConfigError(problems, where)
    return out


def _nest(data, model, prefix, index, out, problems, where) -> None:
    spellings: dict[str, str] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        if key in spellings:  # `rollout-batch-size` and `rollout_batch_size` in one section
            location = ".".join((*prefix, str(raw_key)))
            problems.append(f"{where}: {location}: given twice (also as {spellings[key]!r}); keep one of them")
            continue
        spellings[key] = str(raw_key)
        info = model.model_fields.get(key)
        group = _group_model(info.annotation) if info else None
        if index.passthrough and (*prefix, key) == index.passthrough[:-1] and isinstance(value, Mapping):
            # `sglang: {mem_fraction_static: 0.8}` and `sglang: {args: {...}, router: {...}}` both mean pass-through.
            nested = set(value) <= {"args", "router"}
            args = value.get("args", {}) if nested else value
            set_path(out, index.passthrough, {str(k).replace("-", "_"): v for k, v in args.items()})
            for name, setting in (value.get("router") or {}).items() if nested else ():
                set_path(out, (*index.router_passthrough, str(name).replace("-", "_")), setting)
        elif index.router_passthrough and not prefix and key.startswith("router_") and info is None:
            set_path(out, (*index.router_passthrough, key.removeprefix("router_")), value)  # flat `router-policy: x`
        elif group is not None and isinstance(value, Mapping):
            _nest(value, group, (*prefix, key), index, out, problems, where)
        elif info is not None:
            set_path(out, (*prefix, key), value)
        elif ("--" + key.replace("_", "-")) in index.by_flag:
            set_path(out, index.by_flag["--" + key.replace("_", "-")].path, value)
        elif not deferred("--" + key.replace("_", "-")):
            location = ".".join((*prefix, str(raw_key)))
            problems.append(f"{where}: {location}: " + explain_unknown("--" + key.replace("_", "-"), list(index.by_flag))
                            .split(": ", 1)[1])


def validate(model: type[BaseModel], data: Mapping[str, Any], index: FlagIndex, where: str):
    """model.model_validate(data), with pydantic's errors rewritten to name slime flags, values and what is allowed."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise ConfigError([_describe(e, index) for e in err.errors()], where) from None


def _is_required(model: type[BaseModel], path: tuple[str, ...]) -> bool:
    for key in path[:-1]:
        model = _group_model(model.model_fields[key].annotation)
    return model.model_fields[path[-1]].is_required()


def _describe(error: Mapping[str, Any], index: FlagIndex) -> str:
    loc = tuple(error["loc"])
    message = str(error["msg"]).removeprefix("Value error, ")
    flag = index.flag_for(loc)
    if error["type"] == "missing":
        prefix = tuple(str(p) for p in loc)
        inside = [leaf.flag for leaf in index.by_flag.values() if leaf.path[: len(prefix)] == prefix and leaf.default is None
                  and leaf.annotation is not None and _is_required(index.model, leaf.path)]
        return f"{' and '.join(inside) or flag or '.'.join(prefix)} is required"
    if flag is None:
        return message
    value = error.get("input")
    shown = value if isinstance(value, str) and value and not any(c.isspace() for c in value) else repr(value)
    if isinstance(value, bool):
        shown = str(value).lower()
    return f"{flag} {shown}: {message}"
