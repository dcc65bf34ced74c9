"""A copy that checks finiteness in the same pass (finite_copy.c), for the trainer's writes into a shared segment.

The engines refuse weights that hold NaN or Inf. For the /dev/shm segment (shared_segment.py) the trainer checks
while it writes, so that the engines need not read every byte again: one pass over the bytes instead of two. The C
file is built once per machine with decode_kernel's mechanism (cached by source, flags, compiler and CPU); where it
cannot be built, or for a tensor it does not take (not a contiguous CPU tensor of float32, bfloat16, float16 or
float64), torch copies and then checks: two passes, the same verdict.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import torch

from slimeflow.engine.decode_kernel import build_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("finite_copy.c")
FLAGS = ("-O3", "-fPIC", "-shared")
OPTIONAL_FLAGS = (("-march=native",), ())
"""-march=native gives the AVX2 loop on x86 (SSE2 without it); the first that builds is kept."""
EXPONENT_MASKS = {torch.float32: 0x7F800000, torch.bfloat16: 0x7F80, torch.float16: 0x7C00,
                  torch.float64: 0x7FF0000000000000}
"""The exponent bits of each IEEE dtype the kernel takes: all of them set means NaN or Inf."""


class FiniteCopy:
    """The loaded kernel: `copy(dst, src)` for tensors `supports` accepts."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._fn = library.slimeflow_copy_finite
        self._fn.restype = ctypes.c_int64
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint64]

    @staticmethod
    def supports(dst: torch.Tensor, src: torch.Tensor) -> bool:
        return (src.dtype in EXPONENT_MASKS and dst.dtype == src.dtype and dst.shape == src.shape
                and src.device.type == dst.device.type == "cpu" and src.is_contiguous() and dst.is_contiguous())

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> int | None:
        """Copy `src` into `dst` (ctypes releases the GIL meanwhile); the flat index of its first NaN or Inf, or
        None."""
        at = self._fn(dst.data_ptr(), src.data_ptr(), src.numel(), src.element_size(), EXPONENT_MASKS[src.dtype])
        if at == -2:
            raise RuntimeError(f"finite copy kernel ({self.path}) refused element size {src.element_size()}")
        return None if at == -1 else int(at)


@functools.cache
def load_finite_copy() -> FiniteCopy | None:
    """Build (once per machine) and load the kernel; None, with the reason logged, when it cannot be had."""
    try:
        path = build_library(SOURCE, FLAGS, OPTIONAL_FLAGS)
        return FiniteCopy(ctypes.CDLL(str(path)), path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        log.warning("weight pushes through shared memory check finiteness in a second pass (torch): the finite copy "
                    "kernel is not available: %s", err)
        return None


def copy_checked(dst: torch.Tensor, src: torch.Tensor, kernel: FiniteCopy | None | bool = True) -> int | None:
    """Copy `src` into `dst` (same shape; `dst` of src's dtype) and return the flat index of the first NaN or Inf
    element of `src`, or None when there is none (or it is not a floating-point tensor). When there is one, `dst`
    may be written only in part. `kernel`: True loads the C kernel (falling back to torch where it cannot be had),
    False or None copies and checks with torch."""
    if kernel is True:
        kernel = load_finite_copy()
    if kernel and kernel.supports(dst, src):
        return kernel.copy(dst, src)
    dst.copy_(src)
    if not src.is_floating_point():
        return None
    checked = src if src.device.type != "cpu" else dst  # on an accelerator the check reads its own memory
    if all_finite(checked):
        return None
    return int(torch.isfinite(checked).logical_not().flatten().nonzero()[0])


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of a floating-point tensor is finite, in one read when it is."""
    # A sum is one read of the tensor and allocates nothing; it is finite whenever every element is (NaN and Inf
    # propagate), so only a non-finite sum (or an overflow of large finite values) needs the exact elementwise test.
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())
