"""The trainer's copy into the shared segment checks every value in the same pass (finite_copy.c): a NaN or Inf
anywhere in a tensor is found (its first index, as torch's two passes find it), the bytes arrive exactly, and the
segment's writer refuses the version naming the tensors."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from slimeflow.engine import decode_kernel, finite_copy
from slimeflow.engine.shared_segment import NonFiniteWeightsError, SegmentWriter, read_segment

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Lengths around the kernel's 4096-byte blocks and vector widths: a tail only, whole blocks, blocks and a tail.
LENGTHS = (1, 7, 2048, 4096 + 13, 3 * 4096 + 5)


@pytest.fixture(scope="module")
def kernel():
    loaded = finite_copy.load_finite_copy()
    if loaded is None:
        pytest.skip("the finite copy kernel cannot be built here (no C compiler); the fallback is tested alone")
    return loaded


def both(dst_like: torch.Tensor, src: torch.Tensor, kernel) -> tuple[int | None, int | None]:
    """(the kernel's verdict, torch's), each into a fresh destination that must then equal `src` when finite."""
    verdicts = []
    for use in (kernel, False):
        dst = torch.full_like(dst_like, 7)
        verdicts.append(finite_copy.copy_checked(dst, src, kernel=use))
        if verdicts[-1] is None:
            assert torch.equal(bits(dst), bits(src))
    return verdicts[0], verdicts[1]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns (so -0.0 differs from 0.0)."""
    return tensor.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_nan_or_inf_anywhere_is_found_at_its_first_index_as_torch_finds_it(kernel, dtype):
    for length in LENGTHS:
        clean = torch.randn(length, generator=torch.Generator().manual_seed(length)).to(dtype) * 100
        assert both(clean, clean, kernel) == (None, None)
        for value in (float("nan"), float("inf"), float("-inf")):
            for at in sorted({0, length // 2, length - 1}):
                bad = clean.clone()
                bad[at] = value
                assert both(bad, bad, kernel) == (at, at), (dtype, length, value, at)
        if length > 10:  # two bad values: the first one is reported
            bad = clean.clone()
            bad[length - 2], bad[5] = float("nan"), float("inf")
            assert both(bad, bad, kernel) == (5, 5)


def test_every_bit_pattern_of_the_16_bit_dtypes_gets_torchs_verdict(kernel):
    """bfloat16/float16: the finite patterns all together pass; each non-finite one, put at a different place in a
    finite tensor of several blocks (the vector loop), is found there."""
    for dtype in (torch.bfloat16, torch.float16):
        patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
        finite = torch.isfinite(patterns)
        assert both(patterns[finite], patterns[finite], kernel) == (None, None)
        base = patterns[finite][:3 * 2048 + 3].clone()
        for i, pattern in enumerate(patterns[~finite]):
            bad = base.clone()
            at = (i * 37) % base.numel()
            bad[at] = pattern
            assert kernel.copy(torch.empty_like(bad), bad) == at, (dtype, pattern.view(torch.int16))
    extremes = torch.tensor([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max,
                             torch.finfo(torch.float32).tiny, 0.0, -0.0, 1e-45] * 2000)
    assert both(extremes, extremes, kernel) == (None, None)


def test_unaligned_tensors_are_copied_exactly(kernel):
    for dtype in (torch.float32, torch.bfloat16):
        src = torch.randn(5000).to(dtype)[3:]
        for shift in range(1, 9):
            dst = torch.empty(5010, dtype=dtype)[shift:shift + src.numel()]
            assert kernel.supports(dst, src) and kernel.copy(dst, src) is None and torch.equal(bits(dst), bits(src))
            src[4000 - shift] = float("nan")
            assert kernel.copy(dst, src) == 4000 - shift
            src[4000 - shift] = 1.0


def test_tensors_the_kernel_does_not_take_go_through_torch_with_the_same_verdict(kernel):
    strided = torch.randn(64, 64).t()  # not contiguous
    strided[3, 5] = float("inf")
    dst = torch.empty(64, 64)
    assert not kernel.supports(dst, strided)
    assert finite_copy.copy_checked(dst, strided, kernel=kernel) == 3 * 64 + 5
    integers = torch.arange(10)
    into = torch.empty(10, dtype=torch.long)
    assert finite_copy.copy_checked(into, integers, kernel=kernel) is None and torch.equal(into, integers)


def test_without_a_compiler_the_copy_is_torchs_with_the_reason_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there
    monkeypatch.setattr(decode_kernel, "find_compiler", lambda: None)
    finite_copy.load_finite_copy.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert finite_copy.load_finite_copy() is None
        assert "no C compiler on PATH" in caplog.text and "second pass (torch)" in caplog.text
        bad = torch.ones(100)
        bad[42] = float("nan")
        dst = torch.empty(100)
        assert finite_copy.copy_checked(dst, bad) == 42
        assert finite_copy.copy_checked(dst, torch.ones(100)) is None and torch.equal(dst, torch.ones(100))
    finally:
        finite_copy.load_finite_copy.cache_clear()


def test_the_kernel_builds_once_into_the_cache(tmp_path, monkeypatch):
    if decode_kernel.find_compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = decode_kernel.build_library(finite_copy.SOURCE, finite_copy.FLAGS, finite_copy.OPTIONAL_FLAGS)
    assert built.parent == tmp_path / "slimeflow" / "kernels" and built.name.startswith("finite_copy-")
    assert decode_kernel.build_library(finite_copy.SOURCE, finite_copy.FLAGS, finite_copy.OPTIONAL_FLAGS) == built


def test_the_segment_writer_refuses_a_version_with_nan_or_inf_naming_each_tensor_and_marks_a_clean_one():
    weights = {"a.weight": torch.randn(300, 40), "b.bias": torch.randn(40).to(torch.bfloat16),
               "c.weight": torch.randn(5000)}
    writer = SegmentWriter()
    try:
        writer.begin(weights)
        description = writer.write(weights, "v1")
        update = read_segment(description, {})
        assert update.finite and json.loads(description)["finite"] is True
        assert all(torch.equal(update.tensors[name], t) for name, t in weights.items())
        writer.commit()
        bad = {**weights, "b.bias": weights["b.bias"].clone(), "c.weight": weights["c.weight"].clone()}
        bad["b.bias"][39], bad["c.weight"][4097] = float("inf"), float("nan")
        writer.begin(bad)
        with pytest.raises(NonFiniteWeightsError) as refused:
            writer.write(bad, "v2")
        message = str(refused.value)
        assert ("weight version 'v2' refused before any engine read it: 2 of 3 tensors hold NaN or Inf values, "
                "first at b.bias (element 39 of 40), c.weight (element 4097 of 5000)") in message
        assert "a.weight" not in message and "--lr" in message
    finally:
        writer.close()


def test_an_unmarked_description_is_not_taken_as_checked():
    weights = {"w": torch.ones(16)}
    writer = SegmentWriter()
    try:
        writer.begin(weights)
        spec = json.loads(writer.write(weights))
        for marker in ({}, {"finite": False}, {"finite": "yes"}):
            spec.pop("finite", None)
            assert not read_segment(json.dumps({**spec, **marker}), {}).finite
    finally:
        writer.close()
