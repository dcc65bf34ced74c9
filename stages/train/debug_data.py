"""Rollouts on disk for slime's debug modes: --save-debug-rollout-data writes each rollout's samples,
--load-debug-rollout-data reads them back in place of generating (--debug-train-only).

A file is slime's layout, `{"rollout_id": k, "samples": [Sample.to_dict(), ...]}`, plus the group size it was
generated with, written with torch.save. It holds only dicts, lists, strings and numbers, so it is read with
`torch.load(weights_only=True)`: a file that asks to build any other object is refused, never run. The samples are
the ones the trainer got (kept groups, in order, rewards raw as scored), so a replay trains on the same batch.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import pickle
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slimeflow.checkpoint.safe_pickle import RestrictedUnpickler

if TYPE_CHECKING:  # the driver reads only rollout_path: torch stays out of its start-up (see test_loop)
    from slimeflow.rollout.types import Sample


def rollout_path(template: str, rollout_id: int) -> Path:
    """The file of rollout `rollout_id` (slime: `template.format(rollout_id=...)`)."""
    return Path(template.format(rollout_id=rollout_id))


def save_rollout(template: str, rollout_id: int, samples: Sequence[Sample], n_samples_per_prompt: int) -> Path:
    """Write the samples of rollout `rollout_id` (atomically: a killed run leaves the old file or the new one)."""
    import torch

    path = rollout_path(template, rollout_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save({"rollout_id": rollout_id, "n_samples_per_prompt": n_samples_per_prompt,
                "samples": [s.to_dict() for s in samples]}, staged)
    os.replace(staged, path)
    return path


def load_rollout(template: str, rollout_id: int, n_samples_per_prompt: int) -> list[Sample]:
    """The samples saved for rollout `rollout_id`; raises naming the file and what is wrong with it."""
    import torch

    path = rollout_path(template, rollout_id)
    where = f"--load-debug-rollout-data {template}: rollout {rollout_id}'s file {path}"
    if not path.is_file():
        raise FileNotFoundError(f"{where} does not exist; write it with a run given --save-debug-rollout-data "
                                f"{template} (one file per rollout), or lower --num-rollout")
    try:
        data = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"{where} holds more than plain data (lists, numbers, strings), so it is not loaded: "
                         f"{first}; only files written by --save-debug-rollout-data are replayed") from None
    return _samples(data, where, n_samples_per_prompt)


def content_problem(template: str, rollout_id: int) -> str | None:
    """Why rollout `rollout_id`'s file would be refused by load_rollout, found without torch (a start-up check, in
    a fraction of a second): its pickle read by the restricted unpickler (safe_pickle), which runs nothing; any
    global in it is more than plain data. None when it holds only plain data (tensors' storages are not read)."""
    path = rollout_path(template, rollout_id)
    where = f"--load-debug-rollout-data {template}: rollout {rollout_id}'s file {path}"
    try:
        with zipfile.ZipFile(path) as archive:
            name = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            if name is None:
                return f"{where} is not a torch.save file (no data.pkl in it); write it with --save-debug-rollout-data"
            unpickler = _PlainData(archive.open(name))
            unpickler.load()
    except (OSError, zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as err:
        # TypeError/AttributeError: an allowed tensor rebuilt without its storage, which is not read here
        return f"{where} cannot be read ({type(err).__name__}: {err}); write it with --save-debug-rollout-data"
    if unpickler.unloaded:
        return (f"{where} holds more than plain data (lists, numbers, strings): it names "
                f"{', '.join(sorted(unpickler.unloaded))}, so it is not loaded; only files written by "
                "--save-debug-rollout-data are replayed")
    return None


class _PlainData(RestrictedUnpickler):
    """The restricted unpickler with torch's storage references left unread (only the globals matter here)."""

    def persistent_load(self, pid: Any) -> None:
        return None


def _samples(data: Any, where: str, n_samples_per_prompt: int) -> list[Sample]:
    from slimeflow.rollout.types import Sample

    fields = {f.name for f in dataclasses.fields(Sample)}
    if not isinstance(data, dict) or not isinstance(data.get("samples"), list):
        raise ValueError(f"{where} is not a saved rollout (a dict with 'rollout_id' and a 'samples' list)")
    saved_n = data.get("n_samples_per_prompt")
    if saved_n is not None and saved_n != n_samples_per_prompt:
        raise ValueError(f"{where} was generated with --n-samples-per-prompt {saved_n}, this run has "
                         f"{n_samples_per_prompt}: advantages are computed per group, so set {saved_n}")
    samples = []
    for i, record in enumerate(data["samples"]):
        unknown = sorted(set(record) - fields) if isinstance(record, dict) else None
        if unknown is None or unknown or "status" not in record:
            raise ValueError(f"{where}, sample {i}: not a slimeflow sample "
                             f"({'unknown fields ' + ', '.join(unknown) if unknown else 'no status field'}); "
                             "replay files written by slimeflow's --save-debug-rollout-data")
        samples.append(Sample.from_dict(record))
    return samples


def row_ids(samples: Sequence[Sample]) -> list[list[str]]:
    """The prompt row ids of each group (as RolloutManager.generate reports them)."""
    groups = itertools.groupby(samples, key=lambda s: s.group_index)
    return [[str(s.metadata.get("row_id", s.prompt)) for s in group] for _, group in groups]
