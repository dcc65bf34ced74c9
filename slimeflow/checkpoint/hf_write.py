"""torch_dist -> HF: a torch_dist checkpoint (ours, Megatron's or a training backend's) as HF safetensors.

One Megatron tensor (all its layers) is loaded at a time, mapped back to HF names with the padding stripped and
written as its own safetensors shard(s), so memory stays near the largest stacked tensor, not the model.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import torch

from slimeflow.checkpoint.hf_source import INDEX_FILE
from slimeflow.checkpoint.integrity import verify_checkpoint
from slimeflow.checkpoint.mapping import ModelShape, global_rules, megatron_to_hf
from slimeflow.checkpoint.torch_dist import load_torch_dist, read_common, tensor_metadata, unstack_layers
from slimeflow.errors import StageInputError
from slimeflow.families import FLAGS, FamilySpec, family_for, supported_architectures, switch_value
from slimeflow.io.guard import claimed_dir, remove_abandoned, staging_prefix

MAX_SHARD_BYTES = 4 * 1024**3
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def origin_family(origin: Path) -> tuple[dict, FamilySpec]:
    """The origin HF config and its family; StageInputError when it is missing or unsupported."""
    config_file = origin / "config.json"
    if not config_file.is_file():
        raise StageInputError(f"--origin-hf-dir {origin}", ["has no config.json"],
                              "Give the HF directory the checkpoint was converted from (config and tokenizer).")
    hf_config = json.loads(config_file.read_text(encoding="utf-8"))
    family = family_for(hf_config.get("architectures"))
    if family is None:
        raise StageInputError(f"--origin-hf-dir {origin}",
                              [f"unsupported architecture {hf_config.get('architectures')}"],
                              f"Supported: {', '.join(supported_architectures())}.")
    return hf_config, family


def switch_mismatches(shape: ModelShape, family: FamilySpec, hf_config: dict) -> list[str]:
    """Where the origin config's switches (attention_bias, use_qk_norm, ...) do not describe the checkpoint's layers
    (its Megatron flags), or ask for what the family cannot convert: the config written beside the weights would
    then be wrong."""
    wanted = family.flags(hf_config)
    fields = {flag: " / ".join(f"{s.field} {switch_value(hf_config, s)}" for s in family.switches if flag in s.flags)
              for flag in FLAGS}
    return family.switch_problems(hf_config) + [
        f"the checkpoint's {flag} is {shape.flags[flag]}, but the origin config.json "
        f"({fields[flag] or family.name + ' fixes it'}) means {wanted[flag]}"
        for flag in FLAGS if shape.flags[flag] != wanted[flag]]


def write_hf(checkpoint_dir: Path, output: Path, origin: Path, vocab_size: int | None = None,
             max_shard_bytes: int = MAX_SHARD_BYTES) -> int:
    """Write the HF directory of a torch_dist checkpoint directory to `output` (atomically: staged, renamed).

    Returns the number of tensors written. `vocab_size` defaults to the origin config's; shards hold at most
    `max_shard_bytes` (a single larger tensor is a shard of its own).
    """
    verify_checkpoint(checkpoint_dir)  # CheckpointError naming a damaged file, before anything is written
    hf_config, family = origin_family(origin)
    args = read_common(checkpoint_dir)["args"]
    shape = ModelShape.from_megatron_args(args, family, vocab_size or hf_config["vocab_size"],
                                          source=str(Path(checkpoint_dir) / "common.pt"))
    problems = switch_mismatches(shape, family, hf_config)
    if problems:
        raise StageInputError(f"torch_dist checkpoint {checkpoint_dir} with --origin-hf-dir {origin}", problems,
                              "Give the HF directory this checkpoint was converted from, or fix its config.json.")
    plan = _plan(shape, tensor_metadata(checkpoint_dir), checkpoint_dir)
    prefix = staging_prefix(output.name)  # claimed while written: what a killed export left is removed here next time
    remove_abandoned(output.parent, prefix)
    with claimed_dir(output.parent, prefix) as staging:
        try:
            weight_map = _write_shards(checkpoint_dir, staging, shape, plan, max_shard_bytes)
            _copy_non_weights(origin, staging)
            replace_dir(staging, output)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return len(weight_map)


def _plan(shape: ModelShape, available: dict, checkpoint_dir: Path) -> list[tuple[str, tuple[int, ...], str]]:
    """(Megatron checkpoint key, the layers it holds, its rule's Megatron name) for every tensor to convert;
    StageInputError if any is missing. Layers are stacked in one key per rule, or keyed one by one where they differ
    (mapping.ModelShape.homogeneous)."""
    rules = shape.info.layer_rules
    if shape.homogeneous:
        every = tuple(range(shape.num_layers))
        layer_keys = [("decoder.layers." + r.megatron, every, r.megatron) for r in rules if shape.applies(r, 0)]
    else:
        layer_keys = [(f"decoder.layers.{i}.{r.megatron}", (i,), r.megatron)
                      for i in range(shape.num_layers) for r in rules if shape.applies(r, i)]
    plan = [(rule.megatron, (), rule.megatron) for rule in global_rules(shape)] + layer_keys
    missing = [key for key, _, _ in plan if key not in available]
    if missing:
        raise StageInputError(f"torch_dist checkpoint {checkpoint_dir}", [f"no tensor {key}" for key in missing],
                              f"It is not a {shape.family} checkpoint with this shape; check --origin-hf-dir.")
    return plan


def _write_shards(checkpoint_dir: Path, staging: Path, shape: ModelShape,
                  plan: list[tuple[str, tuple[int, ...], str]], max_shard_bytes: int) -> dict[str, str]:
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    total = 0
    parts: list[Path] = []
    for key, layers, name in plan:
        loaded, _ = load_torch_dist(checkpoint_dir, [key])
        hf = megatron_to_hf(unstack_layers(loaded), shape, layers, () if layers else (name,), rules=(name,))
        for tensors in _chunks(hf, max_shard_bytes):
            parts.append(staging / f"part-{len(parts):05d}.safetensors")
            save_file(tensors, str(parts[-1]), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, parts[-1].name))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        del loaded, hf
    names_now = {}
    for number, part in enumerate(parts, start=1):  # HF's shard names, now that the count is known
        names_now[part.name] = f"model-{number:05d}-of-{len(parts):05d}.safetensors"
        part.rename(part.with_name(names_now[part.name]))
    weight_map = {name: names_now[filename] for name, filename in weight_map.items()}
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (staging / INDEX_FILE).write_text(json.dumps(index, indent=2), encoding="utf-8")
    return weight_map


def _chunks(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Split a dict of tensors into shards of at most `max_bytes` (a single larger tensor is its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def _copy_non_weights(origin: Path, staging: Path) -> None:
    """Config, generation config, tokenizer and chat template: every top-level file that is not weights."""
    for path in sorted(origin.iterdir()):
        if path.is_file() and path.name != INDEX_FILE and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, staging / path.name)


def replace_dir(staging: Path, output: Path) -> None:
    """Rename `staging` to `output`, moving an existing `output` aside first and deleting it afterwards."""
    old = None
    if output.exists():
        old = output.with_name(f".{output.name}.old-{uuid.uuid4().hex[:8]}")
        output.rename(old)
    staging.rename(output)
    if old is not None:
        shutil.rmtree(old)
