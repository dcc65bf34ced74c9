"""The engine's native forward pass: transformers' logits for every family, through joins, leaves and updates."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from slimeflow.engine import kv_batch, native
from slimeflow.engine.batcher import Batcher, GenerateRequest
from slimeflow.engine.decode_kernel import load_decode_attention
from slimeflow.engine.native import HFForward, NativeForward, select_forward
from slimeflow.engine.sampling import SamplingParams
from slimeflow.engine.weights import apply_update, load_model
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model

CPU = torch.device("cpu")
PROMPTS = [[72, 101, 108, 108, 111], [50, 43], [84, 104, 101, 32, 99, 97, 116, 32, 115, 97, 116]]
SPECS = {
    "llama": TinyModelSpec(family="llama", seed=2),
    "qwen2": TinyModelSpec(family="qwen2", seed=3, tie_word_embeddings=True),
    "qwen3": TinyModelSpec(family="qwen3", seed=4, head_dim=24),
}


@pytest.fixture(scope="module", params=sorted(SPECS))
def model_dir(request, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp(request.param) / "tiny", SPECS[request.param])


@pytest.fixture()
def model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def plain_logits(model, seq: list[int]) -> torch.Tensor:
    """The last position's logits from one forward pass over the sequence alone (no padding, no cache)."""
    return model(torch.tensor([seq])).logits[0, -1]


@pytest.mark.parametrize("kernel", [True, False], ids=["decode-kernel", "sdpa"])
def test_native_logits_equal_transformers_through_joins_leaves_and_growth(model, monkeypatch, kernel):
    # Prompts of different lengths share one left-padded batch; 2 columns of headroom make the buffers grow; a
    # longer prompt joins (re-padding the running rows); rows leave from the front and the back. The rotary
    # table starts at 8 positions, so it grows twice on the way. Decode steps run the C kernel (where this
    # machine can build it) or SDPA; qwen3's head_dim 24 takes the kernel's generic path.
    monkeypatch.setattr(native, "ROTARY_ROWS", 8)
    forward = NativeForward(model, decode_attention=kernel)
    assert (forward.decode_attention is not None) == (kernel and load_decode_attention() is not None)
    assert forward.rotary.shape[0] == 8
    seqs = [list(p) for p in PROMPTS]
    with torch.inference_mode():
        batch, logits = kv_batch.prefill(forward, seqs, CPU, headroom=2)
        for step in range(10):
            if step == 2:
                joiners = [[256, *range(70, 95)], [66]]
                new, new_logits = kv_batch.prefill(forward, joiners, CPU, headroom=3)
                batch, seqs, logits = kv_batch.merge(batch, new), seqs + joiners, torch.cat([logits, new_logits])
            if step in (4, 7):
                order = kv_batch.compaction_order([row != {4: 0, 7: 3}[step] for row in range(len(seqs))])
                batch, seqs, logits = kv_batch.select(batch, order), [seqs[i] for i in order], logits[order]
            expected = torch.stack([plain_logits(model, seq) for seq in seqs])
            assert (logits - expected).abs().max() <= 1e-4, f"step {step}"
            for seq, row in zip(seqs, logits, strict=True):
                seq.append(int(row.argmax()))
            logits = kv_batch.decode(forward, batch, [seq[-1] for seq in seqs])
    assert 8 < forward.rotary.shape[0] <= model.config.max_position_embeddings


def test_prompts_with_a_common_prefix_prefill_it_once_and_decode_as_if_alone(model):
    # A chat template's system prompt: 10 shared tokens, then tails of 1, 4 and 2 tokens (padding between prefix
    # and tail in two rows); a prompt without the prefix joins later, so the merge re-aligns the padded rows.
    prefix = list(range(60, 70))
    seqs = [[*prefix, 5], [*prefix, 7, 8, 9, 10], [*prefix, 11, 12]]
    forward = NativeForward(model)
    calls: list[int] = []
    counted = _CountingForward(forward, calls)
    with torch.inference_mode():
        batch, logits = kv_batch.prefill(counted, seqs, CPU, headroom=1)
        assert [*calls] == [1 * 10, 3 * 4]  # the prefix once, then each row's tail (left-padded to 4)
        unshared, unshared_logits = kv_batch.prefill(forward, seqs, CPU, share_prefix=False)
        torch.testing.assert_close(logits, unshared_logits, atol=1e-4, rtol=0)
        for step in range(4):
            if step == 1:
                joiner = [[3, 1, 4, 1, 5, 9]]
                new, new_logits = kv_batch.prefill(forward, joiner, CPU)
                batch, seqs, logits = kv_batch.merge(batch, new), seqs + joiner, torch.cat([logits, new_logits])
            expected = torch.stack([plain_logits(model, seq) for seq in seqs])
            assert (logits - expected).abs().max() <= 1e-4, f"step {step}"
            for seq, row in zip(seqs, logits, strict=True):
                seq.append(int(row.argmax()))
            logits = kv_batch.decode(forward, batch, [seq[-1] for seq in seqs])
    assert kv_batch.shared_prefix([[1, 2, 3], [1, 2, 3]]) == 2  # every prompt keeps a token of its own
    assert kv_batch.shared_prefix([[1, 2, 3], [1, 4]]) == 1


def test_a_padded_prefill_runs_the_linear_layers_on_real_tokens_and_the_last_layer_on_last_tokens(model):
    forward = NativeForward(model)
    rows: dict[int, list[int]] = {}  # weight's output size -> rows of each call

    def counting(x, weight, bias=None):
        rows.setdefault(weight.shape[0], []).append(x.numel() // x.shape[-1])
        return F.linear(x, weight, bias)

    forward.linear = counting
    with torch.inference_mode():
        _, logits = kv_batch.prefill(forward, [list(p) for p in PROMPTS], CPU, share_prefix=False)
    real, layers, config = sum(len(p) for p in PROMPTS), model.config.num_hidden_layers, model.config
    mlp = rows[config.intermediate_size]  # gate and up: every layer, twice
    assert mlp == [real] * (2 * (layers - 1)) + [len(PROMPTS)] * 2  # 18 real tokens of 3 x 11 columns
    assert rows[config.vocab_size] == [len(PROMPTS)]
    expected = torch.stack([plain_logits(model, p) for p in PROMPTS])
    assert (logits - expected).abs().max() <= 1e-4


class _CountingForward:
    """A forward that records the tokens of each call (rows x columns) before running it."""

    def __init__(self, forward: NativeForward, calls: list[int]) -> None:
        self.forward, self.calls, self.model = forward, calls, forward.model

    def __call__(self, ids, *rest):
        self.calls.append(ids.numel())
        return self.forward(ids, *rest)


def test_weight_updates_reach_the_native_forward(model):
    forward = NativeForward(model)  # built before the update: it reads the model's own tensors
    prompt = PROMPTS[2]
    with torch.inference_mode():
        before = plain_logits(model, prompt)
        noise = torch.Generator().manual_seed(0)
        update = {name: tensor + 0.05 * torch.randn(tensor.shape, generator=noise)
                  for name, tensor in model.state_dict().items() if ".self_attn." in name or ".mlp." in name}
        apply_update(model, update)
        _, after = kv_batch.prefill(forward, [prompt], CPU)
        expected = plain_logits(model, prompt)
    assert (expected - before).abs().max() > 1e-2, "the update must change the model's outputs"
    assert (after[0] - expected).abs().max() <= 1e-4


def test_unsupported_models_fall_back_to_transformers_and_say_why(model, caplog):
    model.config.hidden_act = "gelu"
    with caplog.at_level(logging.WARNING):
        forward = select_forward(model)
    assert isinstance(forward, HFForward)
    assert "hidden_act 'gelu' is not silu" in caplog.text
    with pytest.raises(ValueError, match="hidden_act"):
        NativeForward(model)


def test_batcher_logprobs_match_and_seeds_reproduce_whatever_shares_the_batch(model_dir):
    loaded = load_model(model_dir, device="cpu")
    assert isinstance(select_forward(loaded.model), NativeForward)
    params = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, sampling_seed=5)

    def serve(prompts: list[list[int]]) -> list:
        batcher = Batcher(loaded, max_batch_size=8)
        batcher.start()
        try:
            futures = [batcher.submit(GenerateRequest(rid=str(i), input_ids=p, params=params))
                       for i, p in enumerate(prompts)]
            return [f.result(timeout=60) for f in futures]
        finally:
            batcher.stop()

    alone = serve([PROMPTS[0]])[0]
    shared = serve([PROMPTS[1], PROMPTS[0], PROMPTS[2]])[1]
    assert shared.output_ids == alone.output_ids
    with torch.inference_mode():
        ids = torch.tensor([PROMPTS[0] + alone.output_ids])
        logp = loaded.model(ids).logits[0].log_softmax(-1)
    start = len(PROMPTS[0]) - 1
    expected = logp[torch.arange(start, start + len(alone.output_ids)), torch.tensor(alone.output_ids)]
    torch.testing.assert_close(torch.tensor(alone.output_logprobs), expected, atol=1e-4, rtol=0)


def test_samples_of_one_prompt_share_its_prefill_and_decode_as_if_alone(llama, monkeypatch):
    """A GRPO group (one prompt, n seeds) is prefilled once; each sample still continues exactly as it would
    alone, including those that finish at their first token (which never join the decode batch)."""
    prefilled: list[int] = []
    prefill = kv_batch.prefill
    monkeypatch.setattr(kv_batch, "prefill", lambda forward, prompts, *rest, **options:
                        prefilled.append(len(prompts)) or prefill(forward, prompts, *rest, **options))

    def serve(requests: list[GenerateRequest]) -> list:
        batcher = Batcher(llama, max_batch_size=16, admission_window_s=0.0)
        batcher.start()
        try:
            return batcher.submit_batch(requests).result(timeout=60)
        finally:
            batcher.stop()

    def request(i: int, prompt: list[int], seed: int, new_tokens: int) -> GenerateRequest:
        return GenerateRequest(rid=str(i), input_ids=prompt, params=SamplingParams(
            temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, sampling_seed=seed))

    group = [request(i, PROMPTS[0], seed=i, new_tokens=1 if i == 2 else 6) for i in range(5)]
    together = serve([*group, request(5, PROMPTS[2], seed=9, new_tokens=6)])
    assert sum(prefilled) == 2  # two distinct prompts prefilled, not six rows
    for req, result in zip(group, together, strict=False):
        alone = serve([req])[0]
        assert result.output_ids == alone.output_ids and len(result.output_ids) == req.params.max_new_tokens
        torch.testing.assert_close(torch.tensor(result.output_logprobs), torch.tensor(alone.output_logprobs),
                                   atol=1e-5, rtol=0)
    assert len({tuple(r.output_ids) for r in together[:5]}) > 1  # the seeds differ, so do the samples


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return load_model(build_tiny_model(tmp_path_factory.mktemp("llama") / "tiny", SPECS["llama"]), device="cpu")


def _timed_results(batcher: Batcher, prompts: list[list[int]], gap_s: float = 0.0) -> tuple[float, list]:
    """Submit one 1-token request per prompt, `gap_s` apart; seconds until the last result, and the results."""
    params = SamplingParams(temperature=0.0, max_new_tokens=1)
    start, futures = time.monotonic(), []
    for i, prompt in enumerate(prompts):
        if i and gap_s:
            time.sleep(gap_s)
        futures.append(batcher.submit(GenerateRequest(rid=str(i), input_ids=prompt, params=params)))
    results = [f.result(timeout=60) for f in futures]
    return time.monotonic() - start, results


@pytest.mark.parametrize("window_s", [0.0, 0.3])
def test_a_lone_request_waits_at_most_the_admission_window(llama, window_s):
    batcher = Batcher(llama, max_batch_size=8, admission_window_s=window_s)
    batcher.start()
    try:
        _timed_results(batcher, [PROMPTS[0]])  # warm-up: the first forward pass pays one-off costs
        seconds, results = _timed_results(batcher, [PROMPTS[0]])
    finally:
        batcher.stop()
    assert results[0].output_ids
    assert window_s <= seconds < window_s + 0.5  # the window, plus one small forward pass on a busy CPU


def test_requests_arriving_within_the_window_share_one_prefill_round(llama):
    batcher = Batcher(llama, max_batch_size=8, admission_window_s=0.5)
    batcher.start()
    try:
        _, results = _timed_results(batcher, PROMPTS, gap_s=0.02)
        assert batcher.admission_rounds == 1
        assert [r.rid for r in results] == ["0", "1", "2"]
    finally:
        batcher.stop()


def test_requests_that_fill_the_batch_are_admitted_without_waiting(llama):
    batcher = Batcher(llama, max_batch_size=3, admission_window_s=5.0)
    batcher.start()
    try:
        seconds, _ = _timed_results(batcher, PROMPTS)
    finally:
        batcher.stop()
    assert seconds < 2.0 and batcher.admission_rounds == 1


def test_a_batched_generate_is_admitted_without_waiting_for_the_window(llama):
    """The prompts of one batched /generate arrive whole: holding them for others would only add delay."""
    batcher = Batcher(llama, max_batch_size=8, admission_window_s=5.0)
    batcher.start()
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=2)
        start = time.monotonic()
        results = batcher.submit_batch([GenerateRequest(rid=str(i), input_ids=p, params=params)
                                        for i, p in enumerate(PROMPTS)]).result(timeout=60)
        seconds = time.monotonic() - start
    finally:
        batcher.stop()
    assert [r.rid for r in results] == [str(i) for i in range(len(PROMPTS))]
    assert seconds < 2.0 and batcher.admission_rounds == 1


def test_merging_several_batches_at_once_equals_merging_them_one_by_one(llama):
    forward = select_forward(llama.model)
    with torch.inference_mode():
        parts = [kv_batch.prefill(forward, [p], CPU, headroom=headroom)[0]
                 for p, headroom in zip(PROMPTS, [4, 9, 2], strict=True)]
        at_once = kv_batch.merge(None, *parts)
        parts = [kv_batch.prefill(forward, [p], CPU, headroom=headroom)[0]
                 for p, headroom in zip(PROMPTS, [4, 9, 2], strict=True)]
        chained = kv_batch.merge(kv_batch.merge(parts[0], parts[1]), parts[2])
    assert (at_once.length, at_once.free) == (chained.length, chained.free)
    torch.testing.assert_close(at_once.mask_buffer, chained.mask_buffer, rtol=0, atol=0)
    torch.testing.assert_close(at_once.next_positions, chained.next_positions, rtol=0, atol=0)
    for mine, theirs in zip(at_once.cache.layers, chained.cache.layers, strict=True):
        torch.testing.assert_close(mine.keys[:, :, :mine.length], theirs.keys[:, :, :theirs.length], rtol=0, atol=0)
        torch.testing.assert_close(mine.values[:, :, :mine.length], theirs.values[:, :, :theirs.length],
                                   rtol=0, atol=0)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: every thread computes on one core anyway")
def test_the_scheduler_thread_computes_with_the_thread_count_it_was_given(llama):
    """torch.set_num_threads applies to the calling thread only; the forward passes run on the scheduler thread,
    which would otherwise use one thread per core whatever --num-threads said (it did, until this test)."""

    def cpu_per_wall_second() -> float:  # of this process, over matmuls big enough to run in parallel
        a = torch.randn(768, 768)
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(30):
            a @ a
        return (time.process_time() - cpu) / (time.perf_counter() - wall)

    batcher = Batcher(llama, num_threads=1)
    batcher.start()
    try:
        ratio = batcher._call(cpu_per_wall_second).result(timeout=60)
    finally:
        batcher.stop()
    assert ratio < 1.4, f"the scheduler thread used {ratio:.2f} CPU seconds per second with num_threads=1"
