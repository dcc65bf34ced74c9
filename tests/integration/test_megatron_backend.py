"""The Megatron backend against the torch backend and against itself at TP2 and PP2 (CPU, fp32, gloo).

One tiny Llama, converted to torch_dist by the convert stage; every run loads that checkpoint. The one-process
runs happen in this process (their own one-rank world, torn down after); TP2 and PP2 run in two spawned
processes each (tests/megatron_steps.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from megatron_steps import (
    LR,
    make_backend,
    make_batch,
    make_config,
    make_job,
    rollout_batch,
    run_world,
    train_job,
    train_steps,
    two_step_config,
)
from paths import DATA

from slimeflow.families.tiny import TinyModelSpec


@pytest.fixture(scope="module")
def converted(tiny_torch_dist, tmp_path_factory) -> dict[str, Path]:
    """The tiny Llama and its torch_dist checkpoint (converted once for the session, read-only); the module's jobs
    write under its own `tmp`."""
    return {**tiny_torch_dist(TinyModelSpec(seed=7)), "tmp": tmp_path_factory.mktemp("megatron")}


@pytest.fixture
def one_process(megatron_one_process) -> dict:
    """The Megatron backend at TP1 PP1 in this process: the reference run of the parallel tests (run once for the
    session: conftest.py)."""
    return megatron_one_process


@pytest.mark.slow
def test_one_step_equals_the_torch_backend(converted):
    """Same checkpoint, batch and AdamW settings, one optimizer step. Tolerances: the two models compute the
    same fp32 function with different kernels (megatron's fused QKV and gate/up GEMMs against HF's separate
    projections), so log-probs differ by float rounding (~1e-7) and the loss metrics agree to a relative 1e-5;
    Adam's first step moves each weight by about lr x sign(gradient), so rounding in a near-zero gradient can
    move a weight by up to ~lr: weights agree to 0.1 x lr (measured: ~2e-6 at lr 1e-3). Weight decay 0.1 shows
    Megatron's rule: the torch backend decays every weight, megatron-core's optimizer not norms (1-D weights),
    which therefore end exactly lr x wd x w0 above the torch backend's."""
    from slimeflow.train.backends.torch.backend import TorchBackend

    config = make_config(batch={"micro_batch_size": 3}, optimizer={"lr": LR, "weight_decay": 0.1})
    batch = rollout_batch(converted["hf"])
    torch_backend = TorchBackend(converted["hf"], config.optimizer, config.algorithm, config.batch, seed=3,
                                 device="cpu")
    before = {k: v.clone() for k, v in torch_backend.named_weights().items()}
    expected = train_steps(torch_backend, batch, config, 0, 1)[0]
    job = make_job(converted["tmp"], "vs-torch", converted["hf"], converted["release"], batch, config)
    got = train_job(0, 1, job)
    step = got["steps"][0]
    assert set(step) == set(expected)
    for key, value in expected.items():  # the log-prob difference is rounding itself: its bound is checked
        assert step[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert step["train_rollout_logprob_abs_diff"] <= 1e-6
    assert step["grad_norm"] > 0.1  # a real step, not a zero gradient
    assert all(g["weight_decay"] == (0.0 if g["dims"] == [1] else 0.1) for g in got["groups"]), got["groups"]
    trained = torch_backend.named_weights()
    assert set(got["weights"]) == set(trained)
    for name, value in got["weights"].items():
        if value.dim() == 1:  # norms: not decayed by megatron
            torch.testing.assert_close(value - trained[name], LR * 0.1 * before[name], atol=1e-6, rtol=0)
        else:
            assert (value - trained[name]).abs().max() <= 0.1 * LR, name


def test_first_step_gates_at_one_process(one_process):
    """slime's gates: the first step's ppo_kl is exactly 0 (the training forward equals the log-prob forward),
    the trainer's log-probs match the rollout's (here the HF model's) within 1e-6 on average."""
    first = one_process["steps"][0]
    assert first["ppo_kl"] == 0.0 and first["kl_loss"] == 0.0
    assert first["train_rollout_logprob_abs_diff"] <= 1e-6
    assert one_process["steps"][1]["ppo_kl"] != 0.0  # the second step is off-policy: the gate is not vacuous


def test_first_step_gates_with_packed_micro_batches(converted, one_process):
    """The gates under --use-dynamic-batch-size with two steps per rollout: each log-prob pass runs the training
    steps' micro-batches, one schedule per step, so ppo_kl and kl_loss are exactly 0 (they were -4e-8 and 4e-8 when
    the passes packed the rank's whole share at once; test_torch_backend checks the packings differ)."""
    config = make_config(batch={"use_dynamic_batch_size": True, "max_tokens_per_gpu": 24, "global_batch_size": 4},
                         optimizer={"lr": LR}, algorithm={"use_kl_loss": True, "kl_loss_coef": 0.1})
    job = make_job(converted["tmp"], "dynamic", converted["hf"], converted["release"], one_process["batch"], config)
    first, second = train_job(0, 1, job)["steps"]
    assert first["ppo_kl"] == 0.0 and first["kl_loss"] == 0.0
    assert first["train_rollout_logprob_abs_diff"] <= 1e-6
    assert second["ppo_kl"] != 0.0


def _compare_with_one_process(run: dict, one_process: dict) -> None:
    """Float rounding only (the TP ranks' partial sums, the PP stages' hand-over): metrics to a relative 1e-5,
    weights after two Adam steps to 0.1 x lr (measured: 7e-6 at TP2, 2e-6 at PP2)."""
    for got, want in zip(run["steps"], one_process["steps"], strict=True):
        assert set(got) == set(want)
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert set(run["weights"]) == set(one_process["weights"])
    worst = max((run["weights"][k] - one_process["weights"][k]).abs().max().item() for k in run["weights"])
    assert worst <= 0.1 * LR


@pytest.mark.slow
def test_tensor_parallel_2_equals_one_process(converted, one_process, tmp_path):
    run = run_world(2, "tp2", tmp_path, converted["hf"], converted["release"], one_process["batch"],
                    two_step_config(tensor_model_parallel_size=2))
    first = run["steps"][0]
    assert first["ppo_kl"] == 0.0  # slime's gates, at TP 2
    assert first["train_rollout_logprob_abs_diff"] <= 1e-6
    _compare_with_one_process(run, one_process)


@pytest.mark.slow
def test_pipeline_parallel_2_equals_one_process(converted, one_process, tmp_path):
    run = run_world(2, "pp2", tmp_path, converted["hf"], converted["release"], one_process["batch"],
                    two_step_config(pipeline_model_parallel_size=2))
    _compare_with_one_process(run, one_process)


@pytest.mark.slow
def test_a_saved_checkpoint_resumes_the_next_rollout_exactly(converted, one_process, tmp_path):
    """Save after rollout 0 (weights, optimizer, LR schedule, RNG, extra state through dist_checkpointing), train
    rollout 1; a new backend resumed from the save trains rollout 1 to the same metrics and weights, bit for bit.
    The checkpoint is Megatron's layout, and the torch backend's reader (what export uses) reads its weights."""
    from slimeflow.checkpoint.torch_dist import read_common, tensor_metadata
    from slimeflow.io.checkpoints import read_tracker
    from slimeflow.io.storage import Storage
    from slimeflow.train.backends.megatron.checkpoint import load_checkpoint, save_checkpoint
    from slimeflow.train.backends.torch.checkpoint import read_weights

    config = make_config(batch={"micro_batch_size": 2, "global_batch_size": 4},
                         optimizer={"lr": LR, "lr_warmup_iters": 1, "lr_decay_style": "linear", "lr_decay_iters": 8,
                                    "weight_decay": 0.01})
    first, second = one_process["batch"], make_batch(seed=1)
    second.rollout_log_probs = first.rollout_log_probs
    job = make_job(tmp_path, "save", converted["hf"], converted["release"], first, config)
    backend = make_backend(job)
    try:
        load_checkpoint(backend, converted["release"], weights_only=True)
        train_steps(backend, first, config, 0, 1)
        ref = save_checkpoint(backend, tmp_path / "save", 0, {"rollout_id": 0, "data": {"epoch": 1}})
        saved = backend.named_weights()
        expected = train_steps(backend, second, config, 0, 1)
        expected_weights = backend.named_weights()
    finally:
        backend.close()
    assert read_tracker(Storage(), str(tmp_path / "save")) == 0 and ref.uri.endswith("iter_0000000")
    common = read_common(ref.uri)
    assert common["iteration"] == 0 and common["args"].num_layers == 2 and "opt_param_scheduler" in common
    assert any(key.startswith("optimizer.state.exp_avg.") for key in tensor_metadata(ref.uri))
    exported = read_weights(ref.uri, converted["hf"])
    assert all(torch.equal(exported[k], saved[k]) for k in saved)

    resumed = make_backend({**job, "checkpoint": ref.uri, "init": (tmp_path / "rendezvous-resumed").as_uri()})
    try:
        assert load_checkpoint(resumed, ref) == {"rollout_id": 0, "data": {"epoch": 1}}
        again = train_steps(resumed, second, config, 0, 1)
        again_weights = resumed.named_weights()
    finally:
        resumed.close()
    assert again == expected
    assert all(torch.equal(again_weights[k], expected_weights[k]) for k in expected_weights)



def test_adam_steps_with_the_fused_kernel_on_a_cpu_after_a_resume_too(converted, tmp_path):
    """Without Transformer Engine or Apex megatron-core builds torch's AdamW unfused (its per-parameter loop); the
    backend switches host parameters to the fused kernel, the torch backend's, and again after loading a state
    whose param groups were saved without the flag (as Megatron-LM and slime save them), which the load restores."""
    from slimeflow.train.backends.megatron.checkpoint import load_checkpoint, save_checkpoint

    config = make_config(batch={"micro_batch_size": 4, "global_batch_size": 8}, optimizer={"lr": LR})
    batch = make_batch()
    job = make_job(tmp_path, "fused", converted["hf"], converted["release"], batch, config)
    backend = make_backend(job)
    try:
        groups = backend.optimizer.optimizer.param_groups  # the torch AdamW inside megatron's FP32Optimizer
        assert groups and all(g["fused"] is True for g in groups)
        load_checkpoint(backend, converted["release"], weights_only=True)
        train_steps(backend, batch, config, 0, 1)
        for group in groups:
            group["fused"] = None  # torch's default, as a checkpoint of Megatron-LM's torch-Adam run records it
        ref = save_checkpoint(backend, tmp_path / "save", 0, {"rollout_id": 0})
        load_checkpoint(backend, ref)
        loaded = backend.optimizer.optimizer.param_groups
        assert all(g["fused"] is True for g in loaded)
    finally:
        backend.close()


def test_an_async_save_commits_in_the_background_what_a_sync_save_commits(converted, tmp_path):
    """--async-save in the Megatron backend: the shards are written before the save returns, the hashing, side files
    and commit run in the background (the tracker moves at its end), and the checkpoint equals a synchronous one."""
    import threading

    from slimeflow.checkpoint.integrity import CHECKSUMS
    from slimeflow.checkpoint.torch_dist import read_dcp_metadata
    from slimeflow.io import checkpoints
    from slimeflow.io.storage import Storage
    from slimeflow.train.backends.megatron.checkpoint import load_checkpoint, save_checkpoint

    config = make_config(batch={"micro_batch_size": 4, "global_batch_size": 8}, optimizer={"lr": LR})
    batch = make_batch()
    backend = make_backend(make_job(tmp_path, "async", converted["hf"], converted["release"], batch, config))
    try:
        load_checkpoint(backend, converted["release"], weights_only=True)
        train_steps(backend, batch, config, 0, 1)
        sync = save_checkpoint(backend, tmp_path / "sync", 0, {"rollout_id": 0})
        proceed = threading.Event()
        ref = save_checkpoint(backend, tmp_path / "async", 0, {"rollout_id": 0}, before_commit=proceed.wait,
                              async_save=True)
        assert checkpoints.read_tracker(Storage(), str(tmp_path / "async")) is None
        train_steps(backend, batch, config, 0, 1)  # training goes on while rank 0 commits
        proceed.set()
        backend.wait_for_save()
        assert checkpoints.find_latest(Storage(), str(tmp_path / "async")) == ref
        written, expected = Path(ref.uri), Path(sync.uri)
        names = sorted(p.relative_to(written).as_posix() for p in written.rglob("*") if p.is_file())
        assert names == sorted(p.relative_to(expected).as_posix() for p in expected.rglob("*") if p.is_file())
        for name in names:  # .metadata records its own staging path and save id; its checksum follows
            if name not in (".metadata", CHECKSUMS):
                assert (written / name).read_bytes() == (expected / name).read_bytes(), name
        assert read_dcp_metadata(written).state_dict_metadata == read_dcp_metadata(expected).state_dict_metadata
        assert load_checkpoint(backend, ref) == {"rollout_id": 0}
    finally:
        backend.close()


def deterministic_job(rank: int, world: int, job: dict) -> dict:
    """train_job, with what --deterministic-mode switched on while the backend lived and what was left after."""
    from slimeflow.train.backends.megatron.checkpoint import load_checkpoint

    backend = make_backend(job, rank, world)
    try:
        during = {"torch": torch.are_deterministic_algorithms_enabled(), "cudnn": torch.backends.cudnn.deterministic,
                  "config": {chunk.config.deterministic_mode for chunk in [*backend.modules, *backend.ref_model]}}
        load_checkpoint(backend, job["checkpoint"], weights_only=True)
        steps = train_steps(backend, job["batch"], job["config"], 0, 1)
        weights = backend.named_weights()
    finally:
        backend.close()
    return {"steps": steps, "weights": weights, "during": during,
            "after": (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic)}


def test_deterministic_mode_reaches_megatron_and_torch_for_the_backends_lifetime(converted, one_process):
    """--deterministic-mode: megatron-core's TransformerConfig.deterministic_mode on the policy and the reference
    model, torch's deterministic algorithms and cuDNN's deterministic mode while the backend lives, all put back by
    close(). On this CPU it computes exactly what a run without it does (the reference run, one_process): the same
    two steps' metrics and weights, bit for bit. (The GPU environment it sets: tests/integration/test_megatron_optimizer_flags.py.)"""
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic)
    job = make_job(converted["tmp"], "deterministic", converted["hf"], converted["release"], one_process["batch"],
                   two_step_config(deterministic_mode=True))
    run = deterministic_job(0, 1, job)
    assert run["during"] == {"torch": True, "cudnn": True, "config": {True}}
    assert run["after"] == before == (False, False)
    assert run["steps"] == one_process["steps"]
    assert all(torch.equal(run["weights"][k], one_process["weights"][k]) for k in one_process["weights"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: NCCL, cuBLAS and their deterministic settings")
def test_deterministic_mode_on_a_gpu_repeats_two_steps_bit_for_bit(converted, monkeypatch):
    """Two runs of the same two steps (KL loss, bf16) with --deterministic-mode on the GPU: every CUDA kernel the
    backend runs has a deterministic form under torch's switch (else torch raises), NCCL, cuBLAS and Transformer
    Engine get slime's settings, and the runs agree bit for bit. Written on a CPU machine: not run there."""
    from slimeflow.train.backends.megatron.determinism import GPU_ENVIRONMENT

    for name in GPU_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    batch = rollout_batch(converted["hf"])
    config = make_config(batch={"micro_batch_size": 2, "global_batch_size": 4}, optimizer={"lr": LR, "bf16": True},
                         algorithm={"use_kl_loss": True, "kl_loss_coef": 0.1}, megatron={"deterministic_mode": True})
    runs = [deterministic_job(0, 1, make_job(converted["tmp"], f"gpu-det-{i}", converted["hf"], converted["release"],
                                             batch, config)) for i in range(2)]
    assert runs[0]["during"] == {"torch": True, "cudnn": True, "config": {True}}
    assert runs[0]["steps"] == runs[1]["steps"]
    assert all(torch.equal(runs[0]["weights"][k], runs[1]["weights"][k]) for k in runs[0]["weights"])
    assert not any(name in os.environ for name in GPU_ENVIRONMENT)  # what the backend set, close() removed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the GPU path (NCCL, no CPU shims)")
def test_one_step_on_a_gpu_equals_the_torch_backend(converted):
    """The same step as test_one_step_equals_the_torch_backend, both backends on the GPU (NCCL world of one)."""
    from slimeflow.train.backends.torch.backend import TorchBackend

    config = make_config(batch={"micro_batch_size": 3}, optimizer={"lr": LR})
    batch = rollout_batch(converted["hf"])
    torch_backend = TorchBackend(converted["hf"], config.optimizer, config.algorithm, config.batch, seed=3)
    expected = train_steps(torch_backend, batch, config, 0, 1)[0]
    got = train_job(0, 1, make_job(converted["tmp"], "gpu", converted["hf"], converted["release"], batch, config))
    assert got["steps"][0]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
    trained = torch_backend.named_weights()
    assert max((got["weights"][k] - trained[k].cpu()).abs().max().item() for k in trained) <= 0.1 * LR


@pytest.mark.slow
def test_data_parallel_2_equals_one_process(converted, one_process, tmp_path):
    """Two replicas, each half of every global batch: gradients summed over them by megatron's DDP."""
    run = run_world(2, "dp2", tmp_path, converted["hf"], converted["release"], one_process["batch"],
                    two_step_config())
    _compare_with_one_process(run, one_process)


def test_the_opd_teacher_is_loaded_and_run_like_the_reference(converted):
    """--use-opd --opd-type megatron on the Megatron backend: the teacher from --opd-teacher-load (here the policy's
    own checkpoint) gives the policy's log-probs, and the reverse KL in the advantages is exactly 0."""
    from slimeflow.train.backends.megatron.checkpoint import load_checkpoint
    from slimeflow.train.train_step import prepare

    config = make_config(algorithm={"use_opd": True, "opd_type": "megatron",
                                    "opd_teacher_load": str(converted["release"])})
    batch = rollout_batch(converted["hf"])
    backend = make_backend(make_job(converted["tmp"], "opd", converted["hf"], converted["release"], batch, config))
    try:
        load_checkpoint(backend, converted["release"], weights_only=True)
        teacher = backend.compute_log_probs(batch, teacher=True).log_probs
        policy = backend.compute_log_probs(batch).log_probs
        prepared = prepare(backend, batch, config, [list(range(len(batch)))], 1)
    finally:
        backend.close()
    assert all(torch.equal(t, p) for t, p in zip(teacher, policy, strict=True))
    assert all(torch.equal(kl, torch.zeros_like(kl)) for kl in prepared.opd_reverse_kl)


def test_slimes_megatron_hooks_run_where_slimes_actor_calls_them(converted, monkeypatch):
    """Plug-ins written to slime's signatures (tests/data/slime_plugins/slime_megatron_hooks.py): the init hook runs
    once the parallel state exists and before any model; the provider builds the policy and the reference model,
    and its model is the one trained; the log-prob hook precedes each pass with slime's store_prefix; the rollout
    data post-process sees rollout 7's data after the advantages; the train-step hook precedes each of the two
    steps. Its effect: the post-process zeroed the advantages of step 0's samples, so step 0 leaves the weights
    exactly as they were (no KL weight, zero gradient) and step 1 moves them."""
    from slimeflow.train.backends.megatron.checkpoint import load_checkpoint
    from slimeflow.train.train_hooks import TrainHooks
    from slimeflow.train.train_step import train_on_rollout

    monkeypatch.syspath_prepend(str(DATA / "slime_plugins"))
    import slime_megatron_hooks as plugin

    plugin.CALLS.clear()
    plugin.PROVIDED.clear()
    paths = {"custom_megatron_init_path": "megatron_init", "custom_model_provider_path": "model_provider",
             "custom_megatron_before_log_prob_hook_path": "before_log_prob",
             "custom_megatron_before_train_step_hook_path": "before_train_step",
             "rollout_data_postprocess_path": "zero_first_half"}
    config = make_config(batch={"micro_batch_size": 2, "global_batch_size": 4}, optimizer={"lr": LR},
                         algorithm={"use_kl_loss": True, "kl_loss_coef": 0.0}, placement={"train_backend": "megatron"},
                         train_hooks={k: f"slime_megatron_hooks:{v}" for k, v in paths.items()})
    hooks = TrainHooks.load(config)
    batch = make_batch()
    job = {**make_job(converted["tmp"], "hooks", converted["hf"], converted["release"], batch, config), "hooks": hooks}
    backend = make_backend(job)
    try:
        load_checkpoint(backend, converted["release"], weights_only=True)
        train_on_rollout(backend, batch, config, rollout_id=7, hooks=hooks)
        policy, ref, optimizer, scheduler = backend.model, backend.ref_model, backend.optimizer, backend.scheduler
        trained = plugin.weight_sum(policy)
        assert backend.modules[0] is plugin.PROVIDED[0] and ref == [plugin.PROVIDED[1]]
    finally:
        backend.close()
    calls = plugin.CALLS
    assert [c[0] for c in calls] == ["init", "provide", "provide", "log_prob", "log_prob", "postprocess",
                                     "train_step", "train_step"]
    assert calls[0] == ("init", True, 2, 0)  # parallel state up, the checkpoint's num_layers, no model built yet
    assert calls[1] == calls[2] == ("provide", True, True, None)
    assert calls[3][1:] == ("", policy, True) and calls[4][1:] == ("ref_", ref, True)
    assert calls[5] == ("postprocess", 7, ["advantages", "log_probs", "loss_masks", "partition", "ref_log_probs",
                                           "response_lengths", "returns", "rewards", "rollout_log_probs", "tokens",
                                           "total_lengths"])
    (_, *step0, sum0), (_, *step1, sum1) = calls[6], calls[7]
    assert step0 == [7, 0, policy, optimizer, scheduler] and step1 == [7, 1, policy, optimizer, scheduler]
    assert sum1 == sum0 and trained != sum1  # step 0 trained on zero advantages; step 1 moved the provider's model


def test_the_output_layer_runs_on_the_response_positions_only(converted):
    """The output layer gets the hidden states of the positions that predict a response token (one per response
    token), not of every position, and the log-probs stay the torch backend's (float rounding: ~1e-7)."""
    from slimeflow.train.backends.megatron.backend import kept_positions_only
    from slimeflow.train.backends.megatron.checkpoint import load_checkpoint
    from slimeflow.train.backends.torch.backend import TorchBackend

    config = make_config(batch={"micro_batch_size": 3})
    batch = rollout_batch(converted["hf"])
    backend = make_backend(make_job(converted["tmp"], "kept", converted["hf"], converted["release"], batch, config))
    rows_seen: list[int] = []
    try:
        load_checkpoint(backend, converted["release"], weights_only=True)
        chunk = backend.modules[0]
        assert kept_positions_only(chunk, sequence_parallel=False)
        assert not kept_positions_only(chunk, sequence_parallel=True)  # its input is split along the sequence
        handle = chunk.output_layer.register_forward_hook(lambda _m, args, _out: rows_seen.append(args[0].shape[0]))
        got = backend.compute_log_probs(batch).log_probs
        handle.remove()
    finally:
        backend.close()
    assert sum(rows_seen) == sum(batch.response_lengths) < sum(batch.total_lengths)
    torch_backend = TorchBackend(converted["hf"], config.optimizer, config.algorithm, config.batch, seed=3,
                                 device="cpu")
    want = torch_backend.compute_log_probs(batch).log_probs
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
