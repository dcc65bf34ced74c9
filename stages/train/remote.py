"""Ray actor classes whose failures reach the driver whole: the exception's type, message and traceback, and
`call`, the driver's ray.get that re-raises them as a LoopError.

Ray loses them in two ways: an exception raised in an actor's __init__ kills the actor, and every later call
gets only `ActorDiedError` (the cause is text in the actor's log); an exception that does not pickle arrives as
`UnserializableException`. `hosted(cls)` is `cls` with both closed: a failed __init__ is kept and raised by every
call, and every failure crosses as an `ActorFailure`, which always pickles.
"""

from __future__ import annotations

import functools
import inspect
import traceback
from collections.abc import Callable
from typing import Any

import ray


class ActorFailure(RuntimeError):
    """An exception raised inside an actor, as text: `kind` (its type's name), `message`, `traceback_text`, and
    `context` (what the actor was doing, e.g. "RolloutManager could not start")."""

    def __init__(self, kind: str, message: str, traceback_text: str = "", context: str = ""):
        super().__init__(kind, message, traceback_text, context)  # pickled as these strings
        self.kind, self.message, self.traceback_text, self.context = kind, message, traceback_text, context

    @classmethod
    def of(cls, exc: BaseException, context: str = "") -> ActorFailure:
        return cls(type(exc).__name__, str(exc), "".join(traceback.format_exception(exc)), context)

    def __str__(self) -> str:
        return f"{self.context}: {self.kind}: {self.message}" if self.context else f"{self.kind}: {self.message}"


def hosted(cls: type[Any]) -> type:
    """`cls` for `ray.remote`: its __init__ and public methods raise only ActorFailure; after a failed __init__
    the actor stays up and every call raises that failure (so the caller learns why it could not start)."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        self._start_failure, self._in_call = None, False
        try:
            cls.__init__(self, *args, **kwargs)
        except Exception as exc:
            self._start_failure = ActorFailure.of(exc, f"{cls.__name__} could not start")

    methods = {name: _reporting(method) for name, method in vars(cls).items()
               if inspect.isfunction(method) and not name.startswith("_")}
    return type(cls.__name__, (cls,), {**methods, "__init__": __init__, "__doc__": cls.__doc__,
                                        "__module__": cls.__module__})


def _reporting(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method`, raising ActorFailure when called from outside; a call from another of the actor's methods (a
    callback) raises what it raises, as in `cls` itself. Ray runs one call of a (sync) actor at a time."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._start_failure is not None:
            raise self._start_failure
        if self._in_call:
            return method(self, *args, **kwargs)
        self._in_call = True
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            raise ActorFailure.of(exc) from None
        finally:
            self._in_call = False

    return call


class LoopError(RuntimeError):
    """A failure inside an actor, re-raised on the driver with the actor, the call and the cause's message."""


def call(ref: Any, what: str) -> Any:
    """ray.get with the cause's own type and message instead of a stack of Ray wrappers; the actor's traceback
    (from an actor class made with remote.hosted) is a note on the LoopError."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as err:
        cause = err.cause if getattr(err, "cause", None) is not None else err
        error = LoopError(f"{what} failed: {cause}" if isinstance(cause, ActorFailure)
                          else f"{what} failed: {type(cause).__name__}: {cause}")
        if isinstance(cause, ActorFailure):
            error.add_note(f"raised in the actor:\n{cause.traceback_text}")
        raise error from None
    except ray.exceptions.RayActorError as err:
        last = next((line for line in reversed(str(err).splitlines()) if line.strip()), "")
        raise LoopError(f"{what} failed: the actor died ({type(err).__name__}: {last}); see its log above") from None
