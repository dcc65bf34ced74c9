"""The engine's decode attention kernel (decode_attention.c), built with the machine's C compiler on first use.

A decode step's attention on a CPU is a tiny matrix product per (row, key/value head); torch's SDPA kernel spends
most of its time packing blocks for them (1.0-1.1 ms a layer on engine_bench's batch of 64, where reading the
cache takes 0.3 ms). The C kernel reads each key and value row once, streaming (0.3-0.5 ms on one thread), its
rows split over torch's thread count on torch's own OpenMP threads (see the .c file). It is compiled once per
machine into a cache directory (a file named by the hash of its source, flags, compiler and CPU, so a home
directory shared by different nodes holds one build for each) in about 0.3 s, and loaded with ctypes, which
releases the GIL while it runs.

Where there is no C compiler, or the build fails, `load_decode_attention` returns None with the reason logged,
and the engine runs SDPA: slower, the same results to float rounding.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.c")
FLAGS = ("-O3", "-fopenmp-simd", "-fno-math-errno", "-fPIC", "-shared")
"""No -ffast-math: the kernel's exp rounds with float arithmetic that reassociation would undo (measured: errors of
0.2 in the output). -fopenmp-simd lets the reductions the source marks vectorize."""
OPTIONAL_FLAGS = (("-march=native", "-fopenmp"), ("-fopenmp",), ())
"""Tried in turn: for this CPU (AVX-512 on the machines measured) with OpenMP threads (torch's own libgomp), then
without -march=native, then single-threaded; the first that builds is kept."""
MAX_DIM = 512
"""The largest head_dim the kernel takes: decode_attention.c's MAX_DIM (its accumulators live on the stack)."""
KERNEL_ERRORS = {1: "no memory for its scratch scores", 2: f"head_dim above {MAX_DIM}"}
COMPILE_TIMEOUT_S = 120


def cache_dir() -> Path:
    """Where built kernels are kept: $XDG_CACHE_HOME/slimeflow/kernels (~/.cache when unset), as pip and torch do."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "slimeflow" / "kernels"


def find_compiler() -> str | None:
    """The C compiler: $CC when set (as make and setuptools take it), else cc, gcc or clang on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        path = shutil.which(name) if name else None
        if path:
            return path
    return None


class DecodeAttention:
    """The loaded kernel: `attend(q, keys, values, mask, scale)` for float32 CPU tensors (see `supports`)."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._fn = library.slimeflow_decode_attention
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 12 + [ctypes.c_float, ctypes.c_int64]

    @staticmethod
    def supports(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> bool:
        """q [B, kv_heads, group, D]; keys, values [B, kv_heads, L, D] (any strides, the last axis contiguous);
        mask [B, L] of int64 (1 = a real key; its last axis contiguous); all float32 on a CPU."""
        return (q.device.type == keys.device.type == values.device.type == mask.device.type == "cpu"
                and q.dtype == keys.dtype == values.dtype == torch.float32 and mask.dtype == torch.int64
                and q.dim() == 4 and keys.dim() == 4 and q.shape[-1] <= MAX_DIM
                and keys.stride(-1) == 1 and values.stride(-1) == 1 and mask.stride(-1) == 1
                and keys.shape == values.shape and keys.shape[:2] == q.shape[:2]
                and tuple(mask.shape) == (keys.shape[0], keys.shape[2]))

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
               scale: float, threads: int | None = None) -> torch.Tensor:
        """softmax(scale * q @ keys^T, over the keys where mask is 1) @ values: [B, kv_heads, group, D].

        The rows are split over `threads` threads (None: torch's thread count for the calling thread)."""
        q = q.contiguous()
        batch, kv_heads, group, dim = q.shape
        out = torch.empty_like(q)
        status = self._fn(q.data_ptr(), keys.data_ptr(), values.data_ptr(), mask.data_ptr(), out.data_ptr(),
                          batch, kv_heads, group, dim, keys.shape[2], *keys.stride()[:3], *values.stride()[:3],
                          mask.stride(0), scale, threads or torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"decode attention kernel ({self.path}) failed: "
                               f"{KERNEL_ERRORS.get(status, f'status {status}')}")
        return out


@functools.cache
def load_decode_attention() -> DecodeAttention | None:
    """Build (once per machine) and load the kernel; None, with the reason logged, when it cannot be had."""
    try:
        path = _build()
        return DecodeAttention(ctypes.CDLL(str(path)), path)
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        log.warning("the engine runs torch's attention for decode steps (slower on a CPU): the decode attention "
                    "kernel is not available: %s", err)
        return None


def _build() -> Path:
    return build_library(SOURCE, FLAGS, OPTIONAL_FLAGS)


def build_library(path: Path, flags: tuple[str, ...], optional_flags: tuple[tuple[str, ...], ...]) -> Path:
    """The shared library of the C file `path`, built once per machine into `cache_dir()` (STEM-HASH.so) with
    `flags` and the first of `optional_flags` that builds; RuntimeError naming what the compiler said when none
    does, or when there is no compiler."""
    compiler = find_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler on PATH (cc, gcc or clang; or set CC)")
    source = path.read_bytes()
    identity = hashlib.sha256(b"\0".join([source, repr((flags, optional_flags)).encode(),
                                          _compiler_version(compiler), _cpu_identity()])).hexdigest()[:20]
    target = cache_dir() / f"{path.stem}-{identity}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for extra in optional_flags:
        # Built beside the target under a temporary name, then renamed: engines starting together each build and
        # the last rename wins; none ever loads a half-written library.
        with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
            staging = Path(tmp.name)
        result = subprocess.run([compiler, *flags, *extra, "-o", str(staging), str(path), "-lm"],
                                capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if result.returncode == 0:
            os.replace(staging, target)
            return target
        staging.unlink(missing_ok=True)
        errors.append(f"{' '.join(extra) or 'no optional flags'}: {result.stderr.strip()[-500:]}")
    raise RuntimeError(f"{compiler} could not build {path.name}: " + " | ".join(errors))


def _compiler_version(compiler: str) -> bytes:
    result = subprocess.run([compiler, "--version"], capture_output=True, timeout=30)
    return result.stdout


def _cpu_identity() -> bytes:
    """The CPU's model and instruction-set flags (Linux), else the architecture: -march=native builds for them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}".encode()
    wanted = [line for line in lines if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(dict.fromkeys(wanted)).encode()
