"""Test-only: the names SGLang's weight_sync.tensor_bucket module gives a trainer (slime imports them from there),
so that a pickle made where this stand-in is installed names SGLang's metadata class, as one made beside a real
SGLang does. Only the fields and the flag a sender reads; the embedded engine rebuilds with its own class."""

from dataclasses import dataclass
from typing import Any


@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: Any
    dtype: Any
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    supports_multi_dtypes = True
