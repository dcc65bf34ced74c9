"""Reading the pickles inside a checkpoint we may not have written (common.pt, .metadata, an older rng_state.pt)
without running code from it.

A pickle names the callables that rebuild its objects, and plain `pickle`/`torch.load(weights_only=False)` calls
them: a `--ref-load`, evaluate or export checkpoint could run anything. Here only an allow-list is rebuilt for
real: argparse.Namespace, OrderedDict, torch sizes, dtypes, layouts and tensors, torch.distributed.checkpoint's
metadata records, numpy arrays (older RNG states) and the enums of megatron packages (what Megatron-LM and
megatron-core put in `args`). Any other global becomes an inert `Unloaded` placeholder that keeps its name and
arguments and calls nothing, so a Megatron-LM checkpoint whose `args` hold a class we do not know still loads
(we read only plain fields of `args`) and a crafted `__reduce__` runs nothing; a warning names such globals.
"""

from __future__ import annotations

import enum
import importlib
import io
import logging
import pickle
import types
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_ALLOWED = {
    ("argparse", "Namespace"), ("collections", "OrderedDict"), ("_codecs", "encode"),
    ("torch", "Size"), ("torch", "device"), ("torch.serialization", "_get_layout"),
    ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    *(("torch.distributed.checkpoint.planner", name) for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")),
    *((module, name) for module in ("numpy.core.multiarray", "numpy._core.multiarray")
      for name in ("_reconstruct", "scalar")),
    ("numpy", "ndarray"), ("numpy", "dtype"),
}
_ENUM_PACKAGES = ("megatron.",)
"""Packages whose Enum classes are rebuilt for real (calling an Enum class only looks a member up)."""


class Unloaded:
    """An object of a class that was not rebuilt: `qualname` names it; `args` and `state` are what it was given."""

    qualname = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Unloaded:
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<unloaded {self.qualname}{self.args!r}>"


class RestrictedUnpickler(pickle.Unpickler):
    """pickle.Unpickler that rebuilds only the allow-list; every other global is an `Unloaded` subclass."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.unloaded: set[str] = set()

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed(module, name)
        if found is not None:
            return found
        self.unloaded.add(f"{module}.{name}")
        return type(name, (Unloaded,), {"qualname": f"{module}.{name}", "__module__": __name__})


def _allowed(module: str, name: str) -> Any:
    """The real object for an allowed global, else None."""
    if module == "torch" and (module, name) not in _ALLOWED:
        import torch

        value = getattr(torch, name, None)  # dtypes, layouts and memory formats are module attributes
        return value if isinstance(value, torch.dtype | torch.layout | torch.memory_format) else None
    if (module, name) not in _ALLOWED and not module.startswith(_ENUM_PACKAGES):
        return None
    try:
        value = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    if (module, name) in _ALLOWED or (isinstance(value, type) and issubclass(value, enum.Enum)):
        return value
    return None


def loads(data: bytes, what: str | Path) -> Any:
    """pickle.loads through RestrictedUnpickler; `what` names the file in the warning about unloaded globals."""
    unpickler = RestrictedUnpickler(io.BytesIO(data))
    value = unpickler.load()
    _warn(unpickler.unloaded, what)
    return value


def torch_load(path: str | Path) -> Any:
    """torch.load of a torch.save file (tensors on the CPU) through RestrictedUnpickler."""
    import torch

    unloaded: set[str] = set()

    class Recording(RestrictedUnpickler):
        def load(self) -> Any:
            try:
                return super().load()
            finally:
                unloaded.update(self.unloaded)

    module = types.SimpleNamespace(__name__=__name__, Unpickler=Recording, load=pickle.load)
    value = torch.load(path, map_location="cpu", weights_only=False, pickle_module=module)
    _warn(unloaded, path)
    return value


def _warn(unloaded: set[str], what: str | Path) -> None:
    if unloaded:
        logger.warning("%s refers to %s, not rebuilt (kept as inert placeholders; nothing in it was run)",
                       what, ", ".join(sorted(unloaded)))

