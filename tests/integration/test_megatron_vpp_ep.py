"""The Megatron backend's interleaved pipeline (VPP), expert parallelism on a tiny MoE, and resuming a checkpoint
at another parallel layout, each against a one-process run (CPU, fp32, gloo; helpers of test_megatron_backend);
the MoE routers' statistics unchanged by padding.

The multi-process runs save a checkpoint after the first rollout and train the second (an uninterrupted run); a
one-process backend resumed from that checkpoint trains the second rollout again: the same state, two layouts.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from megatron_steps import make_backend, make_batch, make_config, make_job, run_world, train_job, train_steps
from test_megatron_backend import LR, _compare_with_one_process, converted, rollout_batch, two_step_config

from slimeflow.config.train import MegatronConfig
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model

__all__ = ["converted"]  # the 2-layer Llama fixture, shared


def _convert(tmp: Path, spec: TinyModelSpec) -> dict[str, Path]:
    from slimeflow.checkpoint.convert import convert_hf_to_torch_dist, read_hf_source

    hf = build_tiny_model(tmp / "hf", spec)
    staged, _ = convert_hf_to_torch_dist(read_hf_source(hf), tmp / "ckpt")
    staged.rename(tmp / "ckpt" / "release")
    return {"hf": hf, "release": tmp / "ckpt" / "release", "tmp": tmp}


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> dict[str, Path]:
    """A 4-layer tiny Llama: PP 2 x 2 virtual stages of one layer each."""
    return _convert(tmp_path_factory.mktemp("vpp"), TinyModelSpec(seed=7, num_hidden_layers=4))


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> dict[str, Path]:
    """The tiny Qwen3-MoE: 4 experts, top-2, 2 layers."""
    return _convert(tmp_path_factory.mktemp("moe"), TinyModelSpec(family="qwen3_moe", seed=7))


def resume_config(**megatron):
    """two_step_config with a warm-up and a decaying LR and weight decay: a resume that lost the schedule or the
    optimizer state shows in the next rollout's lr and weights."""
    return make_config(batch={"micro_batch_size": 2, "global_batch_size": 4},
                       optimizer={"lr": LR, "lr_warmup_iters": 1, "lr_decay_style": "linear", "lr_decay_iters": 8,
                                  "weight_decay": 0.01},
                       algorithm={"use_kl_loss": True, "kl_loss_coef": 0.1}, megatron=megatron)


def save_then_resume_in_one_process(model: dict[str, Path], tmp: Path, world: int, **megatron) -> dict:
    """`world` ranks at `megatron`'s layout train rollout 0, save, train rollout 1; one process resumes the save and
    trains rollout 1 again. Returns both runs and the checkpoint's directory."""
    from slimeflow.io.checkpoints import resolve
    from slimeflow.io.storage import Storage

    first = rollout_batch(model["hf"])
    second = make_batch(seed=1)
    second.rollout_log_probs = first.rollout_log_probs
    uninterrupted = run_world(world, "saved", tmp, model["hf"], model["release"], first, resume_config(**megatron),
                              save=str(tmp / "save"), next_batch=second)
    saved = resolve(Storage(), str(tmp / "save")).uri
    job = {**make_job(tmp, "resumed", model["hf"], Path(saved), second, resume_config()), "resume": True,
           "ref_load": str(model["release"])}
    return {"uninterrupted": uninterrupted, "resumed": train_job(0, 1, job), "saved": Path(saved)}


@pytest.mark.slow
def test_interleaved_pipeline_trains_as_one_process_and_saves_megatrons_layout(four_layers, tmp_path):
    """PP 2 x VPP 2 (each rank two model chunks, interleaved 1F1B, gloo p2p unbatched): its first rollout passes
    slime's gates, its checkpoint holds the same tensors under the same keys and shapes as the converted one (model
    chunks do not show in the files) plus their optimizer state, and one process resumed from it trains the next
    rollout as the interleaved pipeline did (tolerances: _compare_with_one_process)."""
    from slimeflow.checkpoint.torch_dist import read_common, tensor_metadata

    runs = save_then_resume_in_one_process(four_layers, tmp_path, 2, pipeline_model_parallel_size=2,
                                           num_layers_per_virtual_pipeline_stage=1)
    assert runs["uninterrupted"]["chunks"] == 2 and runs["resumed"]["chunks"] == 1
    first = runs["uninterrupted"]["first_steps"][0]
    assert first["ppo_kl"] == 0.0 and first["train_rollout_logprob_abs_diff"] <= 1e-6
    saved = tensor_metadata(runs["saved"])
    converted_keys = tensor_metadata(four_layers["release"])
    model_keys = {k: v for k, v in saved.items() if not k.startswith("optimizer.")}
    assert model_keys == converted_keys  # keys, global shapes, dtypes
    assert {f"optimizer.state.exp_avg.{k}" for k in model_keys} <= set(saved)
    assert read_common(runs["saved"])["args"].num_layers_per_virtual_pipeline_stage == 1
    assert runs["resumed"]["steps"][0]["lr"] == runs["uninterrupted"]["steps"][0]["lr"] > 0
    _compare_with_one_process(runs["resumed"], runs["uninterrupted"])


@pytest.mark.slow
def test_a_checkpoint_saved_at_tp2_resumes_at_tp1(converted, tmp_path):
    """Save at TP 2, resume at TP 1: weights and optimizer state resharded by dist_checkpointing (the RNG states,
    per rank, are skipped as Megatron-LM skips them); the next rollout equals the uninterrupted TP 2 run."""
    runs = save_then_resume_in_one_process(converted, tmp_path, 2, tensor_model_parallel_size=2)
    assert runs["resumed"]["steps"][0]["grad_norm"] > 0.1
    _compare_with_one_process(runs["resumed"], runs["uninterrupted"])


@pytest.fixture(scope="module")
def moe_one_process(qwen3_moe) -> dict:
    batch = rollout_batch(qwen3_moe["hf"])
    job = make_job(qwen3_moe["tmp"], "moe-one", qwen3_moe["hf"], qwen3_moe["release"], batch, two_step_config())
    return {"batch": batch, **train_job(0, 1, job)}


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory) -> dict[str, Path]:
    """The tiny DeepSeek-V3: multi-latent attention, a dense first layer, sigmoid router with expert bias."""
    return _convert(tmp_path_factory.mktemp("dsv3"), TinyModelSpec(family="deepseek_v3", seed=7))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_the_megatron_backend_trains_moe_families_as_the_torch_backend(family, request):
    """One step on the tiny MoE model, both backends (megatron's SequentialMLP experts, router and MLA against HF's),
    tolerances as test_one_step_equals_the_torch_backend's. DeepSeek's expert-score correction bias is the one
    difference: megatron moves it by --moe-router-bias-update-rate x sign(mean load - expert's load) after each step
    (slime's training does), HF's training leaves it."""
    from slimeflow.train.backends.torch.backend import TorchBackend

    model = request.getfixturevalue(family)
    config = make_config(batch={"micro_batch_size": 3}, optimizer={"lr": LR})
    batch = rollout_batch(model["hf"])
    torch_backend = TorchBackend(model["hf"], config.optimizer, config.algorithm, config.batch, seed=3, device="cpu")
    expected = train_steps(torch_backend, batch, config, 0, 1)[0]
    got = train_job(0, 1, make_job(model["tmp"], "moe-vs-torch", model["hf"], model["release"], batch, config))
    step = got["steps"][0]
    for key, value in expected.items():
        assert step[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert step["grad_norm"] > 0.1
    trained = torch_backend.checkpoint_weights()
    assert set(got["weights"]) == set(trained) and any(".experts.3." in k for k in trained)
    biases = [k for k in trained if k.endswith("e_score_correction_bias")]
    assert bool(biases) == (family == "deepseek_v3")
    for name in biases:
        moved = (got["weights"][name] - trained[name]).abs()
        rate = config.megatron.moe_router_bias_update_rate
        assert torch.all((moved < 1e-7) | ((moved - rate).abs() < 1e-7)) and moved.max() > 0, moved
    assert max((got["weights"][k] - trained[k]).abs().max().item() for k in trained if k not in biases) <= 0.1 * LR


def four_step_config(**megatron):
    """two_step_config's, each Adam step on one group (2 samples)."""
    return make_config(batch={"micro_batch_size": 2, "global_batch_size": 2}, optimizer={"lr": LR},
                       algorithm={"use_kl_loss": True, "kl_loss_coef": 0.1}, megatron=megatron)


@pytest.fixture(scope="module")
def deepseek_v3_one_process(deepseek_v3) -> dict:
    batch = rollout_batch(deepseek_v3["hf"])
    job = make_job(deepseek_v3["tmp"], "dsv3-one", deepseek_v3["hf"], deepseek_v3["release"], batch,
                   four_step_config())
    return {"batch": batch, **train_job(0, 1, job)}


def train_then_save(rank: int, world: int, job: dict) -> dict | None:
    """Train the job's batch from its checkpoint's weights, then save under job["save"] (rollout 0): rank 0's steps
    and weights."""
    from slimeflow.train.backends.megatron.checkpoint import load_checkpoint, save_checkpoint

    backend = make_backend(job, rank, world)
    try:
        load_checkpoint(backend, job["checkpoint"], weights_only=True)
        steps = train_steps(backend, job["batch"], job["config"], backend.dp_rank, backend.dp_size)
        save_checkpoint(backend, job["save"], 0, {"rollout_id": 0})
        weights = backend.named_weights()
    finally:
        backend.close()
    return {"steps": steps, "weights": weights} if rank == 0 else None


@pytest.mark.slow
@pytest.mark.parametrize("experts", [{}, {"expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1,
                                          "moe_token_dispatcher_type": "alltoall"}], ids=["ep1", "ep2-etp1"])
def test_mla_at_tp2_with_sequence_parallelism_equals_one_process(deepseek_v3, deepseek_v3_one_process, tmp_path,
                                                                  experts):
    """The tiny DeepSeek-V3 at TP 2 + SP in 2 processes (ep1: its experts split over the TP ranks; ep2-etp1: 2 of its
    4 experts whole on each rank, tokens sent all-to-all, as slime's DeepSeek-V3 scripts split them), four Adam steps
    of one group each, against one process: MLA's down projections whole on each rank, their gradients and the
    latent norms' summed over the TP ranks that each saw part of the sequence (layer_spec). Tolerances
    _compare_with_one_process's (float rounding of the ranks' partial sums; measured: weights within 1e-5, grad norms
    1e-7 relative; with the down projections split as before, the grad norm 2.7e-5 relative, weights 4e-3 after two
    steps). The TP 2 save declares the converted checkpoint's keys and global shapes, and one process loads from it
    exactly the weights the TP 2 run trained."""
    from slimeflow.checkpoint.torch_dist import tensor_metadata
    from slimeflow.io.checkpoints import resolve
    from slimeflow.io.storage import Storage
    from slimeflow.train.backends.megatron.checkpoint import load_checkpoint

    hf, release, batch = deepseek_v3["hf"], deepseek_v3["release"], deepseek_v3_one_process["batch"]
    parallel = {"tensor_model_parallel_size": 2, "sequence_parallel": True, **experts}
    run = run_world(2, "tp2sp", tmp_path, hf, release, batch, four_step_config(**parallel),
                    work=train_then_save, save=str(tmp_path / "tp2"))
    assert len(run["steps"]) == 4 and run["steps"][0]["ppo_kl"] == 0.0
    assert run["steps"][0]["train_rollout_logprob_abs_diff"] <= 1e-6
    _compare_with_one_process(run, deepseek_v3_one_process)
    saved = Path(resolve(Storage(), str(tmp_path / "tp2")).uri)
    assert {k: v for k, v in tensor_metadata(saved).items() if not k.startswith("optimizer.")} == \
        tensor_metadata(release)
    backend = make_backend(make_job(tmp_path, "tp1", hf, saved, batch, four_step_config()))
    try:
        load_checkpoint(backend, saved)
        loaded = backend.named_weights()
    finally:
        backend.close()
    assert loaded.keys() == run["weights"].keys()
    assert all(torch.equal(loaded[k], v) for k, v in run["weights"].items())


def _etp1_dynamic_batch_config():
    """TP 2 x EP 2 with experts whole on each rank (--expert-tensor-parallel-size 1), tokens gathered, micro-batches
    packed under --max-tokens-per-gpu 16: in the first step one data-parallel rank packs one, the other two (checked
    below), so the first splits its micro-batch to run as many."""
    from slimeflow.train.packing import pack_micro_batches
    from slimeflow.train.train_step import plan_steps

    config = make_config(batch={"use_dynamic_batch_size": True, "max_tokens_per_gpu": 16, "global_batch_size": 4},
                         optimizer={"lr": LR}, algorithm={"use_kl_loss": True, "kl_loss_coef": 0.1},
                         megatron={"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2,
                                   "expert_tensor_parallel_size": 1, "sequence_parallel": True,
                                   "moe_token_dispatcher_type": "allgather"})
    batch = make_batch()
    counts = {len(pack_micro_batches([batch.total_lengths[i] for i in plan_steps(batch, 4, rank, 2, True)[0][1]], 16))
              for rank in range(2)}
    assert counts == {1, 2}, counts
    return config


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["etp1-allgather-dynamic-batch", "etp2-alltoall"])
def test_tensor_x_expert_parallel_equals_one_process(qwen3_moe, moe_one_process, tmp_path, layout):
    """TP 2 x EP 2 (4 ranks, 2 data-parallel replicas; each rank holds 2 of the 4 experts), sequence parallel
    (megatron-core's MoE layer requires it with TP). etp1: the experts whole on each rank, tokens gathered over the
    expert-parallel ranks, micro-batches packed under a token budget (a replica that packs fewer splits its own to
    run as many as the other). etp2: the experts split over the tensor-parallel ranks too, tokens sent all-to-all
    (slime's scripts' choice) with uneven gathers over the expert-tensor-parallel ranks (CPU shims in _compat).
    Micro-batches padded to one shape for gloo's even gathers; tolerances _compare_with_one_process's (measured:
    weights within 6.5e-6). EP 2 alone: test_an_expert_parallel_checkpoint_resumes_at_another_expert_parallel_size."""
    if layout.startswith("etp1"):
        config = _etp1_dynamic_batch_config()
    else:
        config = two_step_config(tensor_model_parallel_size=2, expert_model_parallel_size=2, sequence_parallel=True,
                                 moe_token_dispatcher_type="alltoall")
    run = run_world(4, layout, tmp_path, qwen3_moe["hf"], qwen3_moe["release"], moe_one_process["batch"], config)
    first = run["steps"][0]
    assert first["train_rollout_logprob_abs_diff"] <= 1e-6
    # Packed by tokens too: the log-prob passes run the training steps' micro-batches (ppo_kl was 4e-8 when they
    # packed each rank's whole share at once).
    assert first["ppo_kl"] == 0.0
    _compare_with_one_process(run, moe_one_process)


def test_the_load_balancing_loss_reaches_only_the_router(qwen3_moe, tmp_path):
    """--moe-aux-loss-coeff (load-balancing type aux_loss, Megatron's default): the routers train in training mode,
    so megatron adds their loss. One Adam step without clipping: the weights the routers' scores depend on move
    otherwise than without it; those after the last router (its layer's experts, the final norm, the output layer)
    exactly as without it. The coefficient is large (30; each of the 2 micro-batches' losses weighs 1/2, as in
    slime): Adam's first step moves a weight by about lr x sign(gradient), so a small extra gradient on the weights
    it reaches only through the last router (that layer's attention norms) would leave them as they were."""
    def one_step(coeff: float) -> dict:
        config = make_config(batch={"micro_batch_size": 4}, optimizer={"lr": LR, "clip_grad": 0.0},
                             megatron={"moe_aux_loss_coeff": coeff})
        return train_job(0, 1, make_job(tmp_path, f"aux-{coeff}", qwen3_moe["hf"], qwen3_moe["release"], batch,
                                        config))

    batch = make_batch()
    without, with_loss = one_step(0.0), one_step(30.0)
    assert with_loss["steps"][0]["ppo_kl"] == 0.0  # the loss does not change the forward
    same = sorted(k for k, v in with_loss["weights"].items() if torch.equal(v, without["weights"][k]))
    last_experts = sorted(k for k in without["weights"] if k.startswith("model.layers.1.mlp.experts."))
    assert same == ["lm_head.weight", *last_experts, "model.norm.weight"], same


def test_virtual_pipeline_stages_follow_megatron_lms_rule():
    from slimeflow.train.backends.megatron.layout import virtual_pipeline_stages

    assert virtual_pipeline_stages(8, MegatronConfig(pipeline_model_parallel_size=2)) is None
    assert virtual_pipeline_stages(8, MegatronConfig(pipeline_model_parallel_size=2,
                                                     num_layers_per_virtual_pipeline_stage=2)) == 2
    with pytest.raises(ValueError, match="do not split"):
        virtual_pipeline_stages(6, MegatronConfig(pipeline_model_parallel_size=2,
                                                  num_layers_per_virtual_pipeline_stage=2))
    with pytest.raises(ValueError, match="needs --pipeline-model-parallel-size > 1"):
        virtual_pipeline_stages(4, MegatronConfig(num_layers_per_virtual_pipeline_stage=2))


def test_moe_settings_a_model_or_a_cpu_cannot_run_are_refused():
    from types import SimpleNamespace

    from slimeflow.train.backends.megatron.layout import check_moe

    with pytest.raises(ValueError, match="--expert-model-parallel-size --moe-aux-loss-coeff: .* dense model"):
        check_moe(SimpleNamespace(num_experts=None), MegatronConfig(expert_model_parallel_size=2,
                                                                   moe_aux_loss_coeff=0.1), "ckpt")
    check_moe(SimpleNamespace(num_experts=4), MegatronConfig(expert_model_parallel_size=2, moe_aux_loss_coeff=0.1),
              "ckpt")
    with pytest.raises(ValueError, match="ckpt is an MoE model: .* add --sequence-parallel"):
        check_moe(SimpleNamespace(num_experts=4), MegatronConfig(tensor_model_parallel_size=2), "ckpt")
    check_moe(SimpleNamespace(num_experts=4, multi_latent_attention=True),
              MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True), "ckpt")
    with pytest.raises(ValueError, match="ckpt uses multi-latent attention: .* add --sequence-parallel"):
        check_moe(SimpleNamespace(num_experts=None, multi_latent_attention=True),
                  MegatronConfig(tensor_model_parallel_size=2), "ckpt")
    check_moe(SimpleNamespace(num_experts=4), MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True),
              "ckpt")


def test_the_start_up_check_names_what_ep_and_vpp_cannot_run():
    from train_helpers import flag_config as train_config

    from slimeflow.train.backends.megatron.preflight import megatron_backend_problems

    def problems(*flags: str) -> list[str]:
        return [p for p in megatron_backend_problems(train_config("--train-backend", "megatron", "--ref-load", "r",
                                                                  *flags))]

    assert problems("--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "2") == []
    assert problems("--actor-num-gpus-per-node", "4", "--pipeline-model-parallel-size", "2",
                    "--num-layers-per-virtual-pipeline-stage", "1") == []
    found = problems("--num-layers-per-virtual-pipeline-stage", "1", "--expert-model-parallel-size", "2",
                     "--expert-tensor-parallel-size", "2", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64",
                     "--moe-token-dispatcher-type", "flex")
    assert [p.split(" ", 1)[0] for p in found] == [
        "--num-layers-per-virtual-pipeline-stage", "--expert-tensor-parallel-size", "1", "--moe-token-dispatcher-type"
    ], found
    tp_ep = ("--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2")
    assert problems(*tp_ep, "--sequence-parallel") == []
    assert problems(*tp_ep, "--sequence-parallel", "--expert-tensor-parallel-size", "1") == []
    assert "--sequence-parallel" in problems(*tp_ep)[0]
    mla = ("--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2", "--multi-latent-attention")
    assert problems(*mla, "--sequence-parallel") == []
    assert problems(*mla)[0].startswith("an MoE model or multi-latent attention at --tensor-model-parallel-size 2")
    assert problems(*tp_ep, "--sequence-parallel", "--expert-tensor-parallel-size", "4")[0].startswith(
        "--expert-tensor-parallel-size 4: ")


def resume_save_train(rank: int, world: int, job: dict) -> dict | None:
    """Resume the job's checkpoint, save it again at this layout (job["save"], rollout 0) before training, then
    train the job's batch: rank 0's steps and weights."""
    from slimeflow.train.backends.megatron.checkpoint import load_checkpoint, save_checkpoint

    backend = make_backend(job, rank, world)
    try:
        load_checkpoint(backend, job["checkpoint"])
        save_checkpoint(backend, job["save"], 0, {"rollout_id": 0})
        steps = train_steps(backend, job["batch"], job["config"], backend.dp_rank, backend.dp_size)
        weights = backend.named_weights()
    finally:
        backend.close()
    return {"steps": steps, "weights": weights} if rank == 0 else None


@pytest.mark.slow
def test_an_expert_parallel_checkpoint_resumes_at_another_expert_parallel_size(qwen3_moe, tmp_path):
    """EP 2 (two optimizers: dense and expert parameters) saves after rollout 0 and trains rollout 1; one process
    (EP 1, one optimizer) resumes that save, saves it again at EP 1 and trains rollout 1: as the EP 2 run within
    _compare_with_one_process's tolerances. EP 2 resumed from the EP 1 save trains rollout 1 exactly as the
    uninterrupted run: weights, Adam states, step count and schedule went EP 2 -> EP 1 -> EP 2 unchanged. Both saves
    hold the same keys, global shapes and dtypes (experts by their global index; Adam states under the parameters'
    keys, without chained_N. prefixes, as Megatron-LM saves them)."""
    from slimeflow.checkpoint.torch_dist import tensor_metadata
    from slimeflow.io.checkpoints import resolve
    from slimeflow.io.storage import Storage

    first = rollout_batch(qwen3_moe["hf"])
    second = make_batch(seed=1)
    second.rollout_log_probs = first.rollout_log_probs
    config = resume_config(expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall")
    uninterrupted = run_world(2, "saved", tmp_path, qwen3_moe["hf"], qwen3_moe["release"], first, config,
                              save=str(tmp_path / "ep2"), next_batch=second)
    at_ep2 = resolve(Storage(), str(tmp_path / "ep2")).uri
    job = {**make_job(tmp_path, "ep1", qwen3_moe["hf"], Path(at_ep2), second, resume_config()),
           "ref_load": str(qwen3_moe["release"]), "save": str(tmp_path / "ep1")}
    at_ep1_run = resume_save_train(0, 1, job)
    _compare_with_one_process(at_ep1_run, uninterrupted)
    at_ep1 = resolve(Storage(), str(tmp_path / "ep1")).uri
    saved = tensor_metadata(Path(at_ep2))
    assert saved == tensor_metadata(Path(at_ep1))
    assert not any(key.startswith("chained_") for key in saved)
    assert any(key.startswith("optimizer.state.exp_avg.") and ".experts." in key for key in saved)
    resumed = run_world(2, "resumed", tmp_path, qwen3_moe["hf"], Path(at_ep1), second, config, resume=True,
                        ref_load=str(qwen3_moe["release"]))
    assert resumed["steps"] == uninterrupted["steps"]
    assert all(torch.equal(resumed["weights"][k], v) for k, v in uninterrupted["weights"].items())


def test_an_optimizer_split_change_is_refused_where_it_does_not_reshard(monkeypatch):
    """A checkpoint of two optimizers (dense and expert: EP > 1) resumed by one (EP 1): resharded when saved without
    chained_N. prefixes; refused by name when saved with them (an earlier slimeflow's) or with the distributed
    optimizer (not built)."""
    from types import SimpleNamespace

    from slimeflow.errors import CheckpointError
    from slimeflow.train.backends.megatron import checkpoint as megatron_checkpoint

    monkeypatch.setattr(megatron_checkpoint, "read_common", lambda directory: {"optimizer": {0: {}, 1: {}}})
    sharding = megatron_checkpoint.SHARDING

    def changed(optimizers: int, distributed: bool = False, **metadata) -> bool:
        backend = SimpleNamespace(optimizer=SimpleNamespace(chained_optimizers=[None] * optimizers),
                                  parallel=MegatronConfig(use_distributed_optimizer=distributed))
        return megatron_checkpoint._optimizer_split_changed(backend, "ckpt", Path("."), {**sharding, **metadata})

    assert not changed(2) and changed(1)
    with pytest.raises(CheckpointError, match="ckpt holds the optimizer state split .* chained_0. / chained_1."):
        changed(1, chained_optim_avoid_prefix=False)
    with pytest.raises(CheckpointError, match="--use-distributed-optimizer that resharding is not built"):
        changed(1, distributed=True)


def _router_statistics(backend, batch, micro_batches, extra_columns, monkeypatch) -> dict:
    """One forward-backward of `micro_batches` with every micro-batch padded by `extra_columns` more positions: each
    router's token counts (what the expert-bias update reads), the expert biases after the update, the aux and
    z-loss values megatron's tracker logged, and the gradients."""
    from megatron.core.transformer.moe import moe_utils

    from slimeflow.train.backends.megatron import backend as megatron_backend

    round_up = megatron_backend._round_up
    monkeypatch.setattr(megatron_backend, "_round_up", lambda value, unit: round_up(value, unit) + extra_columns)
    modules = backend.modules[0]
    routers = [m for m in modules.modules() if hasattr(m, "expert_bias") and m.expert_bias is not None]
    biases = [r.expert_bias.clone() for r in routers]
    counts = []
    config = modules.config
    finalize = config.finalize_model_grads_func

    def counting(*args, **kwargs):
        counts.extend(r.local_tokens_per_expert.clone() for r in routers)
        return finalize(*args, **kwargs)

    def loss_of(indices, part):
        return types.SimpleNamespace(loss=sum(lp.sum() for lp in part.log_probs) / 100, metrics={})

    moe_utils.clear_aux_losses_tracker()
    config.finalize_model_grads_func = counting
    try:
        backend.forward_backward(batch, micro_batches, loss_of)
    finally:
        config.finalize_model_grads_func = finalize
    out = {"counts": counts, "before": biases, "biases": [r.expert_bias.clone() for r in routers],
           "losses": {name: entry["values"].clone() for name, entry in  # the tracker is megatron's global:
                      moe_utils.get_moe_layer_wise_logging_tracker().items() if entry["values"].any()},  # this run's
           "grads": torch.cat([p.main_grad.flatten() for p in modules.parameters() if p.requires_grad])}
    for router, bias in zip(routers, biases, strict=True):
        router.expert_bias.copy_(bias)
    for chunk in backend.model:
        chunk.zero_grad_buffer()
    moe_utils.clear_aux_losses_tracker()
    return out


def _padding_invariance(model: dict, tmp_path, monkeypatch) -> bool:
    """The checks of test_padding_changes_no_router_statistic; whether the backend built Transformer Engine's spec."""
    from slimeflow.train.backends.megatron.checkpoint import load_checkpoint

    batch = make_batch()
    config = make_config(batch={"micro_batch_size": 4}, megatron={"moe_router_load_balancing_type": "seq_aux_loss",
                                                                   "moe_aux_loss_coeff": 0.01,
                                                                   "moe_z_loss_coeff": 1e-3})
    backend = make_backend(make_job(tmp_path, "padding", model["hf"], model["release"], batch, config))
    try:
        load_checkpoint(backend, model["release"], weights_only=True)
        fours = [[0, 1, 2, 3], [4, 5, 6, 7]]
        padded = _router_statistics(backend, batch, fours, 0, monkeypatch)
        more = _router_statistics(backend, batch, fours, 5, monkeypatch)
        single = _router_statistics(backend, batch, [[i] for i in range(8)], 0, monkeypatch)
        topk, te_spec = backend.modules[0].config.moe_router_topk, backend.kernels.te_spec
    finally:
        backend.close()
    real_tokens = sum(batch.total_lengths)
    assert padded["counts"] and all(float(c.sum()) == topk * real_tokens for c in padded["counts"])
    for run in (more, single):
        assert all(torch.equal(a, b) for a, b in zip(padded["counts"], run["counts"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(padded["biases"], run["biases"], strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(padded["before"], padded["biases"], strict=True))  # moved
    assert set(padded["losses"]) == {"seq_load_balancing_loss", "z_loss"}
    for name, values in padded["losses"].items():
        assert values.abs().sum() > 0
        torch.testing.assert_close(more["losses"][name], values, rtol=1e-6, atol=0)
    torch.testing.assert_close(more["grads"], padded["grads"], rtol=1e-5, atol=1e-7)
    return te_spec


def test_padding_changes_no_router_statistic(deepseek_v3, tmp_path, monkeypatch):
    """The tiny DeepSeek-V3 (sigmoid router, expert bias), seq_aux_loss and a z-loss on, one process: micro-batches
    of 4 unequal samples padded as the backend pads them and with 5 more padding positions give the same token
    counts per expert (exactly; their total is top-k x the real tokens), the same expert-bias update, the same aux
    and z-loss values (1e-6 relative) and gradients (1e-5 relative: rounding of other matrix shapes); one sample
    per micro-batch (no padding at all) counts the same tokens and moves the biases the same way. Without the
    padding mask the counts held 184 tokens x experts for 136 (measured)."""
    _padding_invariance(deepseek_v3, tmp_path, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (and Transformer Engine): the TE layer spec")
def test_padding_changes_no_router_statistic_in_transformer_engines_spec(deepseek_v3, tmp_path, monkeypatch):
    """The same checks with the layers Transformer Engine's spec builds (MoE layer, router and dense MLP take the
    padding mask as the local spec's do). Written on a CPU machine: not run there."""
    pytest.importorskip("transformer_engine")
    assert _padding_invariance(deepseek_v3, tmp_path, monkeypatch)


AUX, Z = 0.1, 0.01
"""The routers' loss coefficients of the aux-loss scale tests (--moe-aux-loss-coeff, --moe-z-loss-coeff)."""


def _last_router_gradient(backend, batch, micro_batches: list[list[int]], step_tokens: int) -> dict:
    """forward_backward over this rank's `micro_batches` with a zero policy loss: the last router's weight gradient
    (only its own load-balancing and z losses reach it: no later router reads what it routes), after the step's
    reduction over DP ranks, and the same gradient by hand from slime's formula: each micro-batch's losses (from
    the router's inputs and real tokens, recomputed here in plain torch) weighted 1 / (micro-batches x DP ranks),
    or with --calculate-per-token-loss (router tokens of the micro-batch) / `step_tokens` (the step's loss tokens,
    each sample's at least 1, over all DP ranks); by hand the rank's own share (the DP ranks' shares add up)."""
    from megatron.core.transformer.moe.router import TopKRouter

    router = [m for m in backend.modules[0].modules() if isinstance(m, TopKRouter)][-1]
    seen = []
    hook = router.register_forward_hook(lambda module, args, out: seen.append((args[0].detach(), args[1])))

    def loss_of(indices, part):
        return types.SimpleNamespace(loss=sum(lp.sum() for lp in part.log_probs) * 0.0, metrics={})

    try:
        backend.forward_backward(batch, micro_batches, loss_of)
    finally:
        hook.remove()
    got = router.weight.main_grad.clone()
    for chunk in backend.model:
        chunk.zero_grad_buffer()
    config, weight = router.config, router.weight.detach().clone().requires_grad_(True)
    experts, topk = config.num_moe_experts, config.moe_router_topk
    total = torch.zeros(())
    for hidden, padding in seen:
        logits = (hidden.reshape(-1, hidden.shape[-1]) @ weight.T)[~padding.reshape(-1)]  # real tokens only
        tokens = logits.shape[0]
        probs = logits.softmax(-1)
        routed = torch.zeros_like(probs).scatter(1, probs.topk(topk).indices, 1.0)
        aux = AUX * experts * ((routed.sum(0) / (tokens * topk)) * probs.mean(0)).sum()
        z = Z * logits.logsumexp(-1).square().mean()
        share = (tokens / step_tokens if backend.algorithm.calculate_per_token_loss
                 else 1 / (len(micro_batches) * backend.dp_size))
        total = total + share * (aux + z)
    total.backward()
    assert len(seen) == len(micro_batches)
    return {"got": got, "by_hand": weight.grad}


def _aux_config(per_token: bool, micro_batch_size: int = 4):
    return make_config(batch={"micro_batch_size": micro_batch_size}, algorithm={"calculate_per_token_loss": per_token},
                       megatron={"moe_aux_loss_coeff": AUX, "moe_z_loss_coeff": Z})


def _step_tokens(batch) -> int:
    """slime's token count of a step over the whole batch (loss_function's num_tokens summed)."""
    return sum(max(int(mask.sum()), 1) for mask in batch.loss_masks)


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
def test_the_router_losses_weigh_as_in_slime(qwen3_moe, tmp_path, per_token):
    """The tiny Qwen3-MoE, aux_loss and z-loss on, one process: the last router's gradient from its own losses is
    slime's formula by hand (_last_router_gradient), for micro-batches of 4 samples and of 1 (the same samples):
    1e-5 relative to the largest entry (measured: 2e-5 relative on one entry of 3e-9, fp32 rounding). Before issue 19 megatron's per-token scaling left each micro-batch's losses multiplied by its
    token count (measured: 33 x)."""
    from slimeflow.train.backends.megatron.checkpoint import load_checkpoint

    batch = make_batch()
    backend = make_backend(make_job(tmp_path, "aux", qwen3_moe["hf"], qwen3_moe["release"], batch,
                                    _aux_config(per_token)))
    try:
        load_checkpoint(backend, qwen3_moe["release"], weights_only=True)
        fours = _last_router_gradient(backend, batch, [[0, 1, 2, 3], [4, 5, 6, 7]], _step_tokens(batch))
        ones = _last_router_gradient(backend, batch, [[i] for i in range(8)], _step_tokens(batch))
    finally:
        backend.close()
    for run in (fours, ones):
        assert run["by_hand"].abs().max() > 1e-4
        torch.testing.assert_close(run["got"], run["by_hand"], rtol=1e-5, atol=1e-5 * run["by_hand"].abs().max())
    assert not torch.allclose(fours["got"], ones["got"])  # the split is slime's formula's: per micro-batch


def _router_gradients_at_dp2(rank: int, world: int, job: dict) -> dict | None:
    """Both modes at DP 2 (one backend each): rank 0 runs 2 micro-batches, rank 1 one (slime's weight is per rank's
    count); the router's reduced gradient and the ranks' by-hand shares summed; the output layer's gradient of a
    policy loss (sum of log-probs / 100), which megatron's scaling must leave as it is in both modes."""
    from slimeflow.train.backends.megatron.checkpoint import load_checkpoint

    batch, out = job["batch"], {}
    for per_token in (False, True):
        backend = make_backend({**job, "config": _aux_config(per_token), "init": f"{job['init']}-{per_token}"},
                               rank, world)
        try:
            load_checkpoint(backend, job["checkpoint"], weights_only=True)
            micro_batches = [[[0, 1], [2, 3]], [[4, 5, 6, 7]]][backend.dp_rank]
            run = _last_router_gradient(backend, batch, micro_batches, _step_tokens(batch))
            torch.distributed.all_reduce(run["by_hand"])
            backend.forward_backward(batch, micro_batches, lambda indices, part: types.SimpleNamespace(
                loss=sum(lp.sum() for lp in part.log_probs) / 100, metrics={}))
            run["policy"] = backend.modules[0].output_layer.weight.main_grad.clone()  # no router loss reaches it
            out[per_token] = run
        finally:
            backend.close()
    return out if rank == 0 else None


@pytest.mark.slow
def test_the_router_losses_weigh_as_in_slime_at_dp2(qwen3_moe, tmp_path):
    """As test_the_router_losses_weigh_as_in_slime over 2 data-parallel ranks with unequal micro-batch counts:
    megatron's reduced gradient equals the sum of the ranks' shares of slime's formula, with and without
    --calculate-per-token-loss (tolerance as test_the_router_losses_weigh_as_in_slime's). The policy loss's
    gradient is the same in both modes (1e-6 relative: megatron divides by what the backend multiplied by; the
    per-sample mode's is checked against the torch backend by test_data_parallel_2_equals_one_process)."""
    runs = run_world(2, "aux-dp2", tmp_path, qwen3_moe["hf"], qwen3_moe["release"], make_batch(), _aux_config(False),
                     work=_router_gradients_at_dp2)
    for run in runs.values():
        assert run["by_hand"].abs().max() > 1e-4
        torch.testing.assert_close(run["got"], run["by_hand"], rtol=1e-5, atol=1e-5 * run["by_hand"].abs().max())
    assert runs[False]["policy"].abs().max() > 1e-3
    torch.testing.assert_close(runs[True]["policy"], runs[False]["policy"], rtol=1e-6,
                               atol=1e-6 * runs[False]["policy"].abs().max())
