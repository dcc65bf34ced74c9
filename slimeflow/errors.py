"""The error types every layer raises. Each message says what is wrong, where, and how to fix it.

Errors that only one module raises and catches (an engine's HTTP errors, a row's parse error) stay beside it; the
ones here cross layers: a library raises them and a stage, a flow or the CLI reports them.
"""

from __future__ import annotations

from collections.abc import Sequence


class StageInputError(ValueError):
    """An input a stage cannot use: the message names it, lists each problem and says how to fix it."""

    def __init__(self, what: str, problems: list[str], fix: str = ""):
        self.problems = problems
        lines = [f"{what}:", *(f"  - {p}" for p in problems)]
        if fix:
            lines.append(fix)
        super().__init__("\n".join(lines))


class ConfigError(ValueError):
    """A config that cannot be used: every line names the flag (or key), the value and what is allowed."""

    def __init__(self, problems: Sequence[str], where: str = ""):
        self.problems = list(problems)
        head = f"invalid configuration{f' ({where})' if where else ''}:"
        super().__init__("\n".join([head, *(f"  {p}" for p in self.problems)]))


class PluginError(ValueError):
    """A plug-in path that cannot be loaded: names the flag, the path and the reason."""


class StorageError(RuntimeError):
    """A storage operation failed; the message names the URI."""


class ChecksumError(StorageError):
    """Stored bytes differ from their `ArtifactRecord` (size or sha256)."""


class NotFoundError(StorageError):
    """No file or object exists under the URI."""


class UnsafePathError(StorageError):
    """A path taken from data (an object key, an index entry, a manifest, a set name) would leave its root."""


class CheckpointError(RuntimeError):
    """A checkpoint or its tracker is not what the layout requires; the message names the URI."""
