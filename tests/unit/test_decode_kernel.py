"""The engine's decode attention kernel: SDPA's results on the cache's own strided views, its build and fallback."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from slimeflow.engine import decode_kernel, native
from slimeflow.engine.native import (
    CALIBRATION_ROWS,
    CPU_KERNELS,
    CalibratedLinear,
    NativeForward,
    _onednn_linear,
)
from slimeflow.engine.weights import load_model
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model


@pytest.fixture(scope="module")
def kernel():
    loaded = decode_kernel.load_decode_attention()
    if loaded is None:
        pytest.skip("no C compiler here: the engine runs SDPA (test_the_engine_runs_sdpa_without_a_compiler)")
    return loaded


def reference(q, keys, values, mask, scale):
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.bool()[:, None, None, :], scale=scale)


@pytest.mark.parametrize(("kv_heads", "group", "dim"), [(4, 2, 32), (2, 4, 64), (1, 1, 128), (3, 2, 24), (2, 3, 80)])
def test_kernel_equals_sdpa_on_left_padded_strided_caches(kernel, kv_heads, group, dim):
    # The cache's keys/values are views of [B, kv_heads, capacity, D] buffers cut to the columns in use (and, after
    # rows leave, to the columns after the common padding): strides the kernel reads as they are.
    gen = torch.Generator().manual_seed(dim)
    batch, capacity, start, length = 5, 40, 3, 29
    buffers = [torch.randn(batch, kv_heads, capacity, dim, generator=gen) * 2 for _ in range(2)]
    keys, values = (b[:, :, start:start + length] for b in buffers)
    mask_buffer = torch.ones(batch, capacity, dtype=torch.long)
    for row, padding in enumerate([0, 4, 17, 28, 1]):  # row 3 has one real key: its own
        mask_buffer[row, start:start + padding] = 0
    mask = mask_buffer[:, start:start + length]
    q = torch.randn(batch, kv_heads, group, dim, generator=gen)
    assert decode_kernel.DecodeAttention.supports(q, keys, values, mask)
    got = kernel.attend(q, keys, values, mask, dim ** -0.5, threads=1)
    torch.testing.assert_close(got, reference(q, keys, values, mask, dim ** -0.5), atol=2e-6, rtol=1e-5)
    # Rows split over threads (more threads than rows: one row each) are computed exactly as on one.
    for threads in (2, 3, 8):
        assert torch.equal(kernel.attend(q, keys, values, mask, dim ** -0.5, threads=threads), got)
    # Row 3 attends to its last key only: its output is that value row exactly (up to the softmax's 1.0).
    torch.testing.assert_close(got[3], values[3, :, -1:].expand(kv_heads, group, dim), atol=1e-6, rtol=0)


def test_kernel_handles_extreme_scores_like_softmax(kernel):
    # Scores far apart (exp underflows for all but the largest) and all equal: the same weights as softmax's.
    q = torch.tensor([[[[30.0] * 32]], [[[0.0] * 32]]])
    keys = torch.zeros(2, 1, 6, 32)
    keys[0, 0, 2] = 1.0
    keys[0, 0, 4] = -1.0
    values = torch.randn(2, 1, 6, 32, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 6, dtype=torch.long)
    got = kernel.attend(q, keys, values, mask, 1.0)
    torch.testing.assert_close(got, reference(q, keys, values, mask, 1.0), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[1, 0, 0], values[1, 0].mean(0), atol=1e-6, rtol=1e-5)


def test_kernel_refuses_what_it_does_not_compute():
    q, kv, mask = torch.zeros(1, 1, 1, 32), torch.zeros(1, 1, 4, 32), torch.ones(1, 4, dtype=torch.long)
    supports = decode_kernel.DecodeAttention.supports
    assert supports(q, kv, kv, mask)
    assert not supports(q.bfloat16(), kv.bfloat16(), kv.bfloat16(), mask)
    assert not supports(q, kv, kv, mask.bool())
    assert not supports(q, kv.transpose(-1, -2).contiguous().transpose(-1, -2), kv, mask)  # last axis strided
    assert not supports(q, kv, kv, torch.ones(1, 5, dtype=torch.long))


def test_kernel_builds_once_into_the_cache_named_by_source_and_machine(tmp_path, monkeypatch):
    if decode_kernel.find_compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = decode_kernel._build()
    assert built.parent == tmp_path / "slimeflow" / "kernels" and built.name.startswith("decode_attention-")
    assert [p.name for p in built.parent.iterdir()] == [built.name]  # no staging file left behind
    mtime = built.stat().st_mtime_ns
    assert decode_kernel._build() == built and built.stat().st_mtime_ns == mtime  # reused, not rebuilt


def test_the_engine_runs_sdpa_without_a_compiler(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there yet
    monkeypatch.setattr(decode_kernel, "find_compiler", lambda: None)
    decode_kernel.load_decode_attention.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert decode_kernel.load_decode_attention() is None
        assert "no C compiler on PATH" in caplog.text and "runs torch's attention" in caplog.text
        model_dir = build_tiny_model(tmp_path / "tiny", TinyModelSpec(family="llama", seed=1))
        forward = NativeForward(load_model(model_dir, device="cpu").model)
        assert forward.decode_attention is None
    finally:
        decode_kernel.load_decode_attention.cache_clear()


def test_a_failing_build_says_what_the_compiler_said(tmp_path, monkeypatch):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C;\n")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(decode_kernel, "SOURCE", broken)
    if decode_kernel.find_compiler() is None:
        pytest.skip("no C compiler here")
    with pytest.raises(RuntimeError, match="could not build broken.c: .*error"):
        decode_kernel._build()
    assert list((tmp_path / "cache" / "slimeflow" / "kernels").iterdir()) == []


def test_the_native_forward_runs_each_linear_on_a_measured_cpu_kernel_that_matches_f_linear(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny", TinyModelSpec(family="qwen2", seed=1))
    forward = NativeForward(load_model(model_dir, device="cpu").model, decode_attention=False)
    if not torch.backends.mkldnn.is_available():
        assert forward.linear is F.linear
        return
    assert isinstance(forward.linear, CalibratedLinear)
    config = forward.model.config
    assert (config.vocab_size, config.hidden_size) in forward.linear.names  # the output layer is timed too
    assert all(len(names) == len(CALIBRATION_ROWS) and set(names) <= set(CPU_KERNELS)
               for names in forward.linear.names.values())
    gen = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(6, 3, 64, generator=gen), torch.randn(96, 64, generator=gen), torch.randn(96)
    with torch.inference_mode():
        torch.testing.assert_close(_onednn_linear(x, weight, bias), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(_onednn_linear(x[:, 1], weight), F.linear(x[:, 1], weight), atol=1e-5, rtol=1e-5)


def _slow_linear(x, weight, bias=None):
    for _ in range(7):  # the same product, seven times: CPU time a timer cannot miss
        out = F.linear(x, weight, bias)
    return out


@pytest.mark.parametrize("slow_first", [True, False])
def test_calibration_keeps_the_faster_kernel_for_every_shape_and_row_count(slow_first, monkeypatch):
    # Names unique to this test: the process-wide cache is keyed by them.
    kernels = {f"slow-{slow_first}": _slow_linear, f"fast-{slow_first}": F.linear}
    if not slow_first:
        kernels = dict(reversed(kernels.items()))
    monkeypatch.setattr(native, "CALIBRATION_FLOP", 2 * 64 * 96 * 48)  # the larger weight's 512 rows: not timed
    small, large = (torch.randn(32, 48), None), (torch.randn(96, 48), torch.randn(96))
    linear = native.calibrate_linear([small, large, (torch.randn(32, 48), None)], kernels, threads=1)
    assert linear.names == {(32, 48): (f"fast-{slow_first}",) * 4, (96, 48): (f"fast-{slow_first}",) * 4}
    x = torch.randn(5, 48)
    torch.testing.assert_close(linear(x, *large), F.linear(x, *large))


def test_a_call_runs_the_kernel_chosen_at_the_nearest_row_count():
    called = []

    def kernel(bucket):
        return lambda x, weight, bias=None: called.append(bucket) or F.linear(x, weight, bias)

    linear = CalibratedLinear({(4, 3): tuple(kernel(rows) for rows in CALIBRATION_ROWS)}, {})
    weight = torch.randn(4, 3)
    for rows in (1, 2, 3, 7, 20, 30, 64, 180, 200, 4096):
        linear(torch.randn(rows, 3), weight)
    linear(torch.randn(16, 4, 3), weight)  # 64 rows in a [B, T, hidden] input
    assert called == [1, 1, 8, 8, 8, 64, 64, 64, 512, 512, 64]
