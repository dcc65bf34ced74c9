"""Every model family through the pipeline in every backend (issue 32): model -> convert -> preprocess -> train
(2 rollouts, a save) -> evaluate -> export, per family x layout, with slime's gates on each cell:

- the first step's ppo_kl is exactly 0 (the trainer's log-probs are the ones the engine sampled from);
- the trainer's and the engine's log-probs of the sampled tokens agree within 1e-5 in both rollouts (the first
  sampled from the HF weights the engine loaded, the second from the weights pushed after step 0);
- after the last push the engine serves exactly the trained weights (slime_megatron_hooks:snapshot_engine_weights);
- the exported model loads with transformers' from_pretrained and holds exactly the trained weights.

The families come from the registry (slimeflow.families.FAMILIES): a family added later joins the matrix. Each family's
tiny model is built, converted and its data preprocessed once for the module; the cells share the session's Ray.
Layouts: the torch backend; Megatron at TP 1; Megatron at the family's natural layout (natural_layout). A cell the
product cannot run is refused when the run starts, and REFUSED holds the reason the test expects.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from train_helpers import DATA

from slimeflow.families import FAMILIES, FamilySpec
from slimeflow.families.hf import load_causal_lm

pytestmark = pytest.mark.slow

SEED = 3
LAYOUTS = ("torch", "megatron-tp1", "megatron-natural")
REFUSED: dict[tuple[str, str], str] = {}
"""(family, layout) -> a regular expression the refusal at start must match: what the product cannot run yet."""


def natural_layout(family: FamilySpec) -> dict:
    """The Megatron flags of a family's natural layout on 2 ranks, as slime's scripts lay them out: experts split
    over the ranks (EP 2) for a mixture of experts; tensor parallelism with sequence parallelism (TP 2 + SP) for a
    dense model and for multi-latent attention (with experts too: TP 2 x EP 2, experts whole on each rank, as
    slime's DeepSeek-V3 scripts)."""
    flags: dict = {"actor-num-gpus-per-node": 2}
    if family.has_experts:
        flags.update({"expert-model-parallel-size": 2, "expert-tensor-parallel-size": 1})
    if family.multi_latent_attention or not family.has_experts:
        flags.update({"tensor-model-parallel-size": 2, "sequence-parallel": True})
    return flags


def layout_flags(family: FamilySpec, layout: str) -> dict:
    if layout == "torch":
        return {"train-backend": "torch"}
    # slime's before-train-step hook, in every TrainActor of a Megatron run (appends "rank rollout step" to a file).
    hook = {"train-backend": "megatron",
            "custom-megatron-before-train-step-hook-path": "slime_megatron_hooks:log_step_to_save_dir"}
    if layout == "megatron-tp1":
        return hook
    return {**hook, **natural_layout(family)}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """`get(family)`: the family's tiny model (model stage), its torch_dist conversion (convert stage) and the demo
    data (preprocess stage, once), built once for the module."""
    from slimeflow.config.convert import ConvertConfig
    from slimeflow.config.model import ModelConfig
    from slimeflow.config.preprocess import PreprocessConfig
    from slimeflow.io.storage import Storage
    from slimeflow.stages.base import StageContext
    from slimeflow.stages.convert.stage import run as convert_run
    from slimeflow.stages.model.stage import run as model_run
    from slimeflow.stages.preprocess.stage import run as preprocess_run

    root = tmp_path_factory.mktemp("matrix")
    ctx = StageContext(Storage(), root, str(root))
    data = preprocess_run(PreprocessConfig(input=[str(DATA / "increment-train.jsonl")], input_key="prompt",
                                           eval_input={"increment": str(DATA / "increment-eval.jsonl")},
                                           label_key="label"), ctx).outputs
    built: dict[str, dict] = {}

    def get(family: str) -> dict:
        if family not in built:
            fctx = StageContext(Storage(), root / family, str(root / family))
            hf = model_run(ModelConfig(hf_checkpoint=f"tiny:{family}?seed={SEED}"), fctx).outputs["hf_checkpoint"]
            ref = convert_run(ConvertConfig(hf_checkpoint=hf, save=str(root / family / "ref"), processes=1),
                              fctx).outputs["torch_dist"]
            built[family] = {"hf": hf, "ref": ref, "prompt_data": data["train"], "eval": data["eval.increment"]}
        return built[family]

    return get


def hf_dir_with(origin: str, tensors: dict[str, torch.Tensor], target: Path) -> Path:
    """A copy of HF directory `origin` (config, tokenizer) holding `tensors` as its weights."""
    target.mkdir()
    for item in Path(origin).iterdir():
        if item.is_file() and not item.name.startswith("model") and not item.name.startswith("."):
            (target / item.name).write_bytes(item.read_bytes())
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(target / "model.safetensors"))
    return target


def cell_config(model: dict, flags: dict, save: Path):
    from slimeflow.config.pipeline import load_stage_config

    section = {
        "hf-checkpoint": model["hf"], "ref-load": model["ref"], "save": str(save),
        "prompt-data": model["prompt_data"], "eval-prompt-data": {"increment": model["eval"]},
        # Rewards drawn at random (seeded per sample, whatever the model answers): with this seed some group of
        # each rollout is split, so every step moves the weights and the gates compare something that changed.
        "rm-type": "random", "rollout-seed": 1, "rollout-batch-size": 2, "n-samples-per-prompt": 2,
        "num-rollout": 2, "rollout-max-response-len": 2, "rollout-temperature": 1.5, "lr": 1.0e-3,
        "save-interval": 2, "eval-interval": 2, "skip-eval-before-train": True,
        "eval-function-path": "slime_megatron_hooks:snapshot_engine_weights",
        **flags}
    return load_stage_config("train", section)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_evaluates_and_exports(family, layout, prepared, tmp_path, slime_plugins_importable):
    from slimeflow.config.evaluate import EvaluateConfig
    from slimeflow.config.export import ExportConfig
    from slimeflow.errors import StageInputError
    from slimeflow.io.storage import Storage
    from slimeflow.stages.base import StageContext
    from slimeflow.stages.evaluate.stage import run as evaluate_run
    from slimeflow.stages.export.stage import run as export_run
    from slimeflow.stages.train.stage import run as train_run
    from slimeflow.train.backends.torch.checkpoint import read_weights

    model = prepared(family)
    config = cell_config(model, layout_flags(FAMILIES[family], layout), tmp_path / "ckpt")
    ctx = StageContext(Storage(), tmp_path, str(tmp_path))
    if (family, layout) in REFUSED:
        with pytest.raises(StageInputError, match=REFUSED[family, layout]):
            train_run(config, ctx)
        return
    manifest = train_run(config, ctx)
    checkpoint = manifest.outputs["checkpoint"]
    assert manifest.counts["rollouts_run"] == 2 and checkpoint.endswith("iter_0000001")
    lines = (tmp_path / "train" / "rollouts.jsonl").read_text().splitlines()
    rows = [row for row in map(json.loads, lines) if "ppo_kl" in row]  # the rollouts' (not the evaluation's)
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["ppo_kl"] == 0.0
    drift = [r["train_rollout_logprob_abs_diff"] for r in rows]
    assert max(drift) < 1e-5, drift

    if layout != "torch":  # the hook ran in each TrainActor before each rollout's one step, with the rollout id
        ranks = config.placement.actor_num_gpus_per_node
        calls = (tmp_path / "ckpt" / "hook_calls.txt").read_text().split("\n")
        assert sorted(filter(None, calls)) == [f"{rank} {rollout} 0" for rank in range(ranks) for rollout in (0, 1)]

    trained = read_weights(checkpoint, model["hf"])
    initial = read_weights(model["ref"], model["hf"])
    moved = [name for name in trained if not torch.equal(trained[name], initial[name])]
    assert moved, "two steps left every weight as converted: the gates below would compare nothing that changed"
    # After the last push (step 1's weights, which the final checkpoint holds) the engine serves exactly them.
    served = load_file(tmp_path / "ckpt" / "engine_weights_2.safetensors")
    assert set(trained) <= set(served)
    unequal = [name for name in trained if not torch.equal(served[name], trained[name].to(served[name].dtype))]
    assert not unequal, unequal

    evaluated = evaluate_run(EvaluateConfig(load=checkpoint, hf_checkpoint=model["hf"], rm_type="prefix_match",
                                            eval_prompt_data={"increment": model["eval"]}, eval_temperature=0.0,
                                            eval_max_response_len=1), ctx)
    assert evaluated.outputs["checkpoint"] == checkpoint and "eval/increment/avg_at_1" in evaluated.metrics

    exported = export_run(ExportConfig(input_dir=checkpoint, origin_hf_dir=model["hf"]), ctx)
    hf_model = Path(exported.outputs["hf_model"])
    files = {name: t for shard in hf_model.glob("*.safetensors") for name, t in load_file(shard).items()}
    assert files.keys() == trained.keys()
    assert not [name for name in trained if not torch.equal(files[name], trained[name])]
    # transformers loads it (fusing a mixture's experts as it does) into what it loads from the trained weights.
    loaded = load_causal_lm(hf_model, dtype=torch.float32).state_dict()
    want = load_causal_lm(hf_dir_with(model["hf"], trained, tmp_path / "want"), dtype=torch.float32).state_dict()
    assert loaded.keys() == want.keys()
    assert not [name for name in want if not torch.equal(loaded[name], want[name])]
