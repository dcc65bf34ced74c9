"""HF -> torch_dist: read and validate an HF checkpoint (read_hf_source), then write its torch_dist checkpoint
with N cooperating worker processes (worker.py), each writing its share of the layers and of a MoE model's
routed experts (assign_shares), into a claimed staging directory (write_torch_dist) that publish_release makes
`<root>/release/`, setting the tracker last.

The convert stage and the training backends (a start model given as HF) both call it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from slimeflow.checkpoint.diskspace import no_space_left, ran_out_of_space
from slimeflow.checkpoint.hf_source import INDEX_FILE, inspect_hf_dir
from slimeflow.checkpoint.hf_write import replace_dir
from slimeflow.checkpoint.integrity import Ledger
from slimeflow.checkpoint.launch import Launcher, launch
from slimeflow.checkpoint.mapping import (
    ModelShape,
    expected_hf_tensors,
    expert_hf_tensors,
    global_rules,
    megatron_args,
)
from slimeflow.checkpoint.torch_dist import save_torch_dist
from slimeflow.checkpoint.worker import Job, Share, share_tensors
from slimeflow.errors import CheckpointError, StageInputError
from slimeflow.families import FamilySpec, family_for, supported_architectures
from slimeflow.io import checkpoints
from slimeflow.io.checkpoints import RELEASE
from slimeflow.io.guard import (
    CONVERT_JOB_PREFIX,
    claimed_dir,
    claimed_scratch,
    remove_abandoned,
    staging_prefix,
)
from slimeflow.io.storage import Storage, inside, is_local, join, local_path

ITERATION = 1  # a converted model is saved as iteration 1 and published as release/, as Megatron's tools do


@dataclass(frozen=True)
class HFSource:
    """A validated HF checkpoint: where it is, its family and shape, and where each tensor lives."""

    path: Path
    family: FamilySpec
    shape: ModelShape
    weight_map: dict[str, str]
    sizes: dict[str, int]
    """Bytes of each tensor."""
    dtype: str
    """torch dtype name of the embedding (the model's parameter dtype)."""


def read_hf_source(path: Path, make_vocab_size_divisible_by: int = 128,
                   tensor_model_parallel_size: int = 1) -> HFSource:
    """Validate an HF directory for conversion; StageInputError listing every problem, before any write."""
    inspect_hf_dir(path)  # config, tokenizer, whole (untruncated) safetensors files
    hf_config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    family = family_for(hf_config.get("architectures"))
    where = f"HF checkpoint {path} cannot be converted"
    if family is None:
        raise StageInputError(where, [f"unsupported architecture {hf_config.get('architectures')} "
                                      f"(model_type {hf_config.get('model_type')!r})"],
                              f"Supported: {', '.join(supported_architectures())}. A new family is a spec in "
                              "slimeflow/families/ plus its round-trip test.")
    try:
        shape = ModelShape.from_hf_config(hf_config, family, make_vocab_size_divisible_by, tensor_model_parallel_size)
    except KeyError as err:
        raise StageInputError(where, [f"config.json has no {err.args[0]!r}"], "Re-save the config with transformers.") from None
    problems = shape.problems()
    if problems:
        raise StageInputError(where, problems, "Fix config.json so that it describes these weights.")
    weight_map, headers = _read_headers(path)
    mtp = _mtp_layers(headers, shape.num_layers)
    if mtp:
        raise StageInputError(where, [f"layers {mtp} after the {shape.num_layers} decoder layers are multi-token "
                                      f"prediction layers (num_nextn_predict_layers: "
                                      f"{hf_config.get('num_nextn_predict_layers')}), which are not converted yet"],
                              "Convert a copy without the model.layers.<n>.* tensors of those layers (training "
                              "without MTP, as --mtp-num-layers is refused too).")
    problems = _tensor_problems(headers, expected_hf_tensors(shape))
    if problems:
        raise StageInputError(where, problems, "The weights do not match config.json: re-save the model with "
                              "save_pretrained, or fix the config.")
    sizes = {name: _nbytes(shape_, dtype) for name, (shape_, dtype) in headers.items()}
    dtype = _TORCH_DTYPES[headers["model.embed_tokens.weight"][1]]
    return HFSource(path, family, shape, weight_map, sizes, dtype)


_TORCH_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    count = _ITEMSIZE.get(dtype, 4)
    for dim in shape:
        count *= dim
    return count


def _read_headers(path: Path) -> tuple[dict[str, str], dict[str, tuple[tuple[int, ...], str]]]:
    """(tensor -> file, tensor -> (shape, safetensors dtype)) from the safetensors headers, no data read."""
    from safetensors import safe_open

    index = path / INDEX_FILE
    files = (sorted({inside(str(path), name)  # index entries are data: none may point outside the checkpoint
                     for name in json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()})
             if index.is_file() else ["model.safetensors"])
    weight_map, headers = {}, {}
    for filename in files:
        with safe_open(path / filename, framework="pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                weight_map[name] = filename
                headers[name] = (tuple(piece.get_shape()), piece.get_dtype())
    return weight_map, headers


def _mtp_layers(headers: dict[str, Any], num_layers: int) -> list[int]:
    """Layer numbers at or past num_layers (DeepSeek's and GLM-4.5's checkpoints keep their MTP layers there)."""
    numbers = {name.split(".")[2] for name in headers if name.startswith("model.layers.")}
    return sorted(int(n) for n in numbers if n.isdigit() and int(n) >= num_layers)


def _tensor_problems(headers: dict[str, tuple[tuple[int, ...], str]], expected: dict[str, tuple[int, ...]]
                     ) -> list[str]:
    missing = [n for n in expected if n not in headers]
    unexpected = [n for n in headers if n not in expected]
    wrong = [f"{n} has shape {list(headers[n][0])}, config.json implies {list(s)}"
             for n, s in expected.items() if n in headers and headers[n][0] != s]
    odd = [f"{n} has dtype {headers[n][1]}; supported: {', '.join(_TORCH_DTYPES)}"
           for n in headers if headers[n][1] not in _TORCH_DTYPES]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {', '.join(missing[:8])}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {', '.join(unexpected[:8])}")
    return problems + wrong[:8] + odd[:8]


def assign_shares(source: HFSource, processes: int) -> list[Share]:
    """Split the model over `processes` ranks, as expert parallelism does: rank r converts the routed experts
    [r*E/N, (r+1)*E/N) of every MoE layer (contiguous, sizes differing by at most one), and the rest (each
    layer's other tensors, the globals) goes, largest first, to the rank with the fewest bytes so far."""
    shape = source.shape
    bounds = [rank * shape.num_experts // processes for rank in range(processes + 1)]
    experts = [(bounds[rank], bounds[rank + 1]) for rank in range(processes)]
    loads = [sum(source.sizes[name] for layer in range(shape.num_layers)
                 for name in expert_hf_tensors(shape, layer, range(*span))) for span in experts]
    routed = {name for layer in range(shape.num_layers)
              for name in expert_hf_tensors(shape, layer, range(shape.num_experts))}
    items: list[tuple[int, int | str]] = []
    for rule in global_rules(shape):
        items.append((sum(source.sizes[n] for n in rule.hf), rule.megatron))
    for layer in range(shape.num_layers):
        prefix = f"model.layers.{layer}."
        items.append((sum(size for name, size in source.sizes.items()
                          if name.startswith(prefix) and name not in routed), layer))
    picked: list[list[int | str]] = [[] for _ in range(processes)]
    for size, item in sorted(items, key=lambda pair: -pair[0]):
        rank = loads.index(min(loads))
        loads[rank] += size
        picked[rank].append(item)
    return [Share(tuple(sorted(i for i in p if isinstance(i, int))), tuple(i for i in p if isinstance(i, str)),
                  span) for p, span in zip(picked, experts, strict=True)]


def convert_hf_to_torch_dist(source: HFSource, root: Path, processes: int = 1, make_vocab_size_divisible_by: int = 128,
                             tensor_model_parallel_size: int = 1, iteration: int = ITERATION,
                             staging_name: str = RELEASE, launcher: Launcher = "local", ray_address: str | None = None
                             ) -> tuple[Path, list[dict[str, Any]]]:
    """Write the torch_dist checkpoint of `source` into a staging directory under `root` (write_torch_dist);
    returns the staging directory and each rank's report. The caller publishes it.

    `iteration` goes into common.pt and the staging directory is `.<staging_name>.tmp-*`: a conversion keeps
    the defaults (release), a training backend saving its weights passes its iteration and `iter_XXXXXXX`."""
    with claimed_dir(root, staging_prefix(staging_name)) as staging:
        ranks = write_torch_dist(source, staging, processes, make_vocab_size_divisible_by, tensor_model_parallel_size,
                                 iteration, launcher, ray_address)
    return staging, ranks


def stage_torch_dist(weights: Mapping[str, torch.Tensor], hf_dir: Path, root: Path, iteration: int,
                     staging_name: str, make_vocab_size_divisible_by: int = 128, ledger: Ledger | None = None,
                     beside: Callable[[Path], object] | None = None) -> Path:
    """convert_hf_to_torch_dist for HF-named weights in this process's memory (a training backend's save): the same
    files, written by this process alone, with no HF file in between and no worker process (a fresh interpreter
    importing torch cost more than writing a 538 MB model). `hf_dir`: the model's HF directory (its config gives
    the shape). Returns the staging directory `<root>/.<staging_name>.tmp-*`; the caller publishes it. `ledger`:
    the data files are hashed as they are written (integrity.Ledger), for the caller's write_checksums.
    `beside(staging)`: the caller's own files, written in a thread while the weights are (a failure of either
    fails the staging)."""
    source = read_hf_source(hf_dir, make_vocab_size_divisible_by)
    missing = sorted(set(expected_hf_tensors(source.shape)) - set(weights))
    if missing:
        raise CheckpointError(f"cannot save a checkpoint of {hf_dir}'s model: the weights lack {missing[:5]} "
                              f"({len(missing)} tensors); were they taken from this architecture?")
    args = megatron_args(source.shape, weights["model.embed_tokens.weight"].dtype, make_vocab_size_divisible_by, 1)
    remove_abandoned(root)
    with claimed_dir(root, staging_prefix(staging_name)) as staging:
        try:
            with _alongside(beside, staging):
                save_torch_dist(share_tensors(weights, source.shape, assign_shares(source, 1)[0]), args, staging,
                                iteration, collective=False, ledger=ledger)
        except BaseException as err:
            shutil.rmtree(staging, ignore_errors=True)
            _raise_if_out_of_space(err, staging, sum(source.sizes.values()))
            raise
    return staging


@contextmanager
def _alongside(work: Callable[[Path], object] | None, staging: Path) -> Iterator[None]:
    """Run `work(staging)` in a thread while the block runs; the block's error first, else `work`'s, is raised."""
    if work is None:
        yield
        return
    with ThreadPoolExecutor(1, thread_name_prefix="beside") as pool:
        done = pool.submit(work, staging)
        try:
            yield
        finally:
            wait([done])
        done.result()


def write_torch_dist(source: HFSource, staging: Path, processes: int = 1, make_vocab_size_divisible_by: int = 128,
                     tensor_model_parallel_size: int = 1, iteration: int = ITERATION, launcher: Launcher = "local",
                     ray_address: str | None = None) -> list[dict[str, Any]]:
    """Write the torch_dist checkpoint of `source` into the (claimed, empty) directory `staging` with `processes`
    worker processes, started by `launcher` (launch.py: local subprocesses, or Ray tasks on the cluster at
    `ray_address`, None: a local Ray); returns each rank's report. On failure `staging` is removed.

    The job's files live in a claimed `.convert-job-*` beside `staging`, removed at the end; first, what crashed
    conversions left beside it is removed (io.guard.remove_abandoned)."""
    remove_abandoned(staging.parent)
    with claimed_scratch(staging.parent, CONVERT_JOB_PREFIX) as scratch:
        job = Job(hf_dir=str(source.path), weight_map=source.weight_map, shape=source.shape.__dict__,
                  dtype=source.dtype, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                  tensor_model_parallel_size=tensor_model_parallel_size, checkpoint_dir=str(staging),
                  iteration=iteration, init_method=(scratch / "rendezvous").resolve().as_uri(),
                  shares=assign_shares(source, processes))
        try:
            job.write(scratch / "job.json")
            launch(scratch / "job.json", processes, launcher, ray_address)
            return [json.loads((scratch / f"rank-{r}.json").read_text(encoding="utf-8")) for r in range(processes)]
        except BaseException as err:
            shutil.rmtree(staging, ignore_errors=True)
            _raise_if_out_of_space(err, staging, sum(source.sizes.values()))
            raise


def _raise_if_out_of_space(err: BaseException, staging: Path, needed: int) -> None:
    """NoSpaceLeft, from `err`, when the conversion failed for want of space in `staging` (ran_out_of_space: the
    ranks' logs beside it may have lost their words, but the checkpoint still does not fit)."""
    if isinstance(err, Exception) and ran_out_of_space(err, staging, needed):
        raise no_space_left(staging, "the checkpoint", needed) from err


def publish_release(storage: Storage, staged: Path, root: str) -> checkpoints.CheckpointRef:
    """Move a complete staged checkpoint to `<root>/release/` (replacing one that is there), then set the tracker."""
    missing = checkpoints.missing_markers(storage, str(staged))
    if missing:
        raise CheckpointError(f"staged checkpoint {staged} is incomplete: missing {', '.join(missing)}")
    target = join(root, RELEASE)
    if is_local(root):
        replace_dir(staged, local_path(target))
    else:
        if storage.exists(target):
            storage.remove(target, recursive=True)
        storage.copy_tree(str(staged), target)
    return checkpoints.commit(storage, root, RELEASE)
