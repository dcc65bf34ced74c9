"""Putting an export at its target URI without deleting what it did not write, and without a torn state.

Every export leaves a marker, `.slimeflow-export.json`, at its target: the files it wrote (sha256, size), their
content hash, and a state. What a target may hold, and what this module does with it:

- nothing, or only an earlier export of ours (the files its marker lists, the marker, our staging prefix): it
  is replaced when `overwrite` is on, refused otherwise;
- anything else (a README, a dataset, another model, an export written before markers existed): refused
  whatever `overwrite` says, naming what is there. An export never deletes an object it did not write, so
  `s3://bucket` with other objects in it is refused too, and a bucket is never removed.

Object stores have no rename, so an upload goes through steps, each safe to be killed after:

1. every file is uploaded under `<target>/.slimeflow-staging/<id>/` and verified against its sha256; the old
   export is untouched and its marker still says "complete";
2. the marker is rewritten in state "replacing" (the new files, the old ones, the staging id): from here the
   target reports itself incomplete, and the next run knows every object there is ours;
3. the old config.json is removed, the staged files are copied into place server-side with config.json last
   (an HF reader finds no config.json until every weight is in place), and old files the new export lacks go;
4. the marker is rewritten in state "complete" (the commit), then the staging prefix is removed.

A kill before 2 leaves the old export complete (and a staging prefix the next export removes); after 2, the new
export is whole in staging and the marker says the target is incomplete until an export completes it. A
reader trusts a target only when `committed(...)` says so. Two exports to one target at once are not supported.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import pydantic

from slimeflow.config.base import replace
from slimeflow.errors import NotFoundError, StageInputError, StorageError
from slimeflow.io.manifest import content_hash
from slimeflow.io.storage import ArtifactRecord, Storage, inside, join

MARKER = ".slimeflow-export.json"
STAGING = ".slimeflow-staging"
_LAST = "config.json"  # what an HF reader opens first: copied into place last, removed first


class ExportMarker(pydantic.BaseModel):
    """The marker's contents: the export at this target (`files`), and whether it is complete."""

    state: Literal["complete", "replacing"]
    files: list[ArtifactRecord]
    content: str
    """content_hash(files), the export stage manifest's `hashes.content`."""
    replacing: list[str] = pydantic.Field(default_factory=list)
    """While replacing: the earlier export's files (still ours, removed once the new ones are in place)."""
    staging: str | None = None
    """While replacing: the staging prefix, relative to the target, that holds `files`."""

    def owned(self) -> set[str]:
        return {MARKER, *self.replacing, *(record.path for record in self.files)}


def check_target(storage: Storage, target: str, overwrite: bool) -> ExportMarker | None:
    """The marker of the earlier export at `target` (None if the target is empty or absent).

    StageInputError if `target` holds anything we did not write, or an earlier export and `overwrite` is off.
    """
    present = _relative_files(storage, target)
    if not present:
        return None
    marker = read_marker(storage, target)
    owned = marker.owned() if marker else set()
    foreign = [name for name in present if name not in owned and not name.startswith(STAGING + "/")]
    if foreign:
        raise StageInputError(
            f"--output-dir {target}",
            [f"holds {len(foreign)} file(s) no slimeflow export wrote: {', '.join(foreign[:8])}"
             + (" ..." if len(foreign) > 8 else "")],
            "An export never deletes what it did not write. Choose an empty --output-dir (e.g. a sub-prefix "
            f"{join(target, 'model')}), or move those files away (an export written before {MARKER} markers "
            "existed counts as foreign: remove it yourself).")
    if marker is not None and not overwrite:
        state = "an earlier export" if marker.state == "complete" else "an unfinished export (a run was killed)"
        raise StageInputError(f"--output-dir {target}", [f"holds {state}"],
                              "Pass --overwrite true to replace it, or choose another --output-dir.")
    return marker


def read_marker(storage: Storage, target: str) -> ExportMarker | None:
    """The marker at `target`, None if there is none; StageInputError if it is unreadable."""
    uri = join(target, MARKER)
    try:
        text = storage.read_text(uri)
    except NotFoundError:
        return None
    try:
        return ExportMarker.model_validate_json(text)
    except pydantic.ValidationError as err:
        raise StageInputError(uri, [f"is not an export marker: {err.errors()[0]['msg']}"],
                              "Remove it if you wrote it; an export writes this file itself.") from None


def committed(storage: Storage, target: str, content: str) -> bool:
    """True when `target` holds a complete export whose files have content hash `content`."""
    try:
        marker = read_marker(storage, target)
    except (StageInputError, StorageError):
        return False
    return marker is not None and marker.state == "complete" and marker.content == content


def write_marker(storage: Storage, target: str, records: list[ArtifactRecord]) -> None:
    """The "complete" marker of an export written in place (a local directory, replaced as a whole)."""
    marker = ExportMarker(state="complete", files=records, content=content_hash(records))
    storage.write_text(join(target, MARKER), marker.model_dump_json(indent=1))


def publish(storage: Storage, local: Path, target: str, records: list[ArtifactRecord],
            previous: ExportMarker | None, staging_id: str) -> None:
    """Upload the export in `local` (whose files `records` describe) to `target` in the steps of the docstring."""
    staging = join(STAGING, staging_id)
    storage.copy_tree(str(local), join(target, staging))
    storage.verify_tree(join(target, staging), records)
    old = sorted(previous.owned() - {MARKER}) if previous else []
    marker = ExportMarker(state="replacing", files=records, content=content_hash(records), replacing=old,
                          staging=staging)
    storage.write_text(join(target, MARKER), marker.model_dump_json(indent=1))
    new = {record.path for record in records}
    _remove(storage, target, [_LAST] if _LAST in old else [])
    for name in sorted(new, key=lambda name: name == _LAST):
        storage.copy(join(target, staging, name), join(target, name))
    _remove(storage, target, [name for name in old if name not in new])
    complete = replace(marker, state="complete", replacing=[], staging=None)
    storage.write_text(join(target, MARKER), complete.model_dump_json(indent=1))
    storage.remove(join(target, STAGING), recursive=True)  # ours by name: this run's and any killed run's


def _remove(storage: Storage, target: str, names: Iterable[str]) -> None:
    for name in names:
        try:
            storage.remove(join(target, inside(target, name)))
        except NotFoundError:  # already gone: a killed run removed it
            pass


def _relative_files(storage: Storage, target: str) -> list[str]:
    """Every file under `target`, relative to it; [] when nothing is there."""
    if not storage.exists(target):
        return []
    if not storage.isdir(target):
        raise StageInputError(f"--output-dir {target}", ["is a file"], "Give a directory or a prefix.")
    root = target.rstrip("/")
    return [uri[len(root) + 1:] for uri in storage.list(root, recursive=True)]
