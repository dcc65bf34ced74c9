"""Storage by URI: plain local paths, ``file://`` and ``s3://bucket/key``, through fsspec (s3fs for S3).

Every write is atomic (an object appears complete or not at all) and returns an `ArtifactRecord` (sha256 and
size, computed while streaming), so a stage can publish what it wrote and a later stage can verify what it
reads. Files are streamed in chunks of `CHUNK_SIZE`; nothing reads a whole model into memory.

URIs stay in the form the caller gave: `list("s3://b/x")` returns ``s3://`` URIs, `list("runs/x")` relative
paths. ``file://`` URIs are not percent-decoded (as in fsspec): ``file:///a b`` names the path ``/a b``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import cached_property, partial
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import pydantic
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from slimeflow.config.base import replace
from slimeflow.errors import ChecksumError, NotFoundError, StorageError, UnsafePathError

logger = logging.getLogger(__name__)

CHUNK_SIZE = 8 * 2**20
SUPPORTED_SCHEMES = ("local path", "file://", "s3://")


class S3Config(pydantic.BaseModel):
    """Where and as whom to reach S3. Unset fields fall back to botocore's defaults (its credential chain)."""

    model_config = pydantic.ConfigDict(frozen=True, extra="forbid")

    endpoint_url: str | None = None
    access_key_id: str | None = None
    secret_access_key: pydantic.SecretStr | None = None
    region: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> S3Config:
        """Read the standard AWS variables from `environ` (pass `os.environ` explicitly); empty values count as unset.

        AWS_ENDPOINT_URL_S3 wins over AWS_ENDPOINT_URL and AWS_REGION over AWS_DEFAULT_REGION, as in the AWS CLI.
        """

        def first(*names: str) -> str | None:
            return next((environ[name] for name in names if environ.get(name)), None)

        return cls(
            endpoint_url=first("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
            access_key_id=first("AWS_ACCESS_KEY_ID"),
            secret_access_key=first("AWS_SECRET_ACCESS_KEY"),
            region=first("AWS_REGION", "AWS_DEFAULT_REGION"),
        )

    def merged_over(self, other: S3Config) -> S3Config:
        """A config with this one's non-None fields, the rest taken from `other` (config over environment)."""
        return replace(other, **{name: value for name, value in self if value is not None})


class ArtifactRecord(pydantic.BaseModel):
    """What was stored: `path` is the URI (or, in a tree, the posix path relative to its root), `size` in bytes."""

    model_config = pydantic.ConfigDict(frozen=True)

    path: str
    sha256: str
    size: int


def join(uri: str, *parts: str) -> str:
    """Join `parts` onto `uri` with '/', for s3:// URIs and local paths alike; empty parts are skipped."""
    pieces = [part.strip("/") for part in parts if part.strip("/")]
    if not pieces:
        return uri
    scheme, sep, rest = uri.rpartition("://")
    return "/".join([scheme + sep + rest.rstrip("/"), *pieces])


def inside(root: str, relative: str) -> str:
    """`relative`, a path taken from data, normalised ('a//./b' -> 'a/b'); UnsafePathError unless it stays
    inside `root` (named in the message): absolute paths, '..' parts, backslashes and NULs are refused.

    Every path read from data goes through here before it is joined onto a directory or a prefix: an object key
    such as 'model/../../etc/x' or an index entry '../outside.safetensors' must fail, naming itself, not escape.
    """
    parts = [part for part in relative.split("/") if part not in ("", ".")]
    bad = relative.startswith("/") or "\\" in relative or "\0" in relative or ".." in parts or not parts
    if bad:
        raise UnsafePathError(
            f"{relative!r} (under {root}) is not a plain relative path inside it; refusing a path from data "
            "that is absolute, empty or holds '..', a backslash or a NUL: rename or remove it at its source"
        )
    return "/".join(parts)


def split(uri: str) -> tuple[str, str]:
    """(parent, last name) of `uri`, ignoring a trailing '/'; the parent of a bare relative name is '.'."""
    scheme, sep, rest = uri.rpartition("://")
    head, slash, name = rest.rstrip("/").rpartition("/")
    if not slash:
        head = "" if sep else "."
    elif not head:
        head = "/"
    return scheme + sep + head, name


def _scheme(uri: str) -> str:
    return uri.split("://", 1)[0].lower() if "://" in uri else ""


def is_local(uri: str) -> bool:
    """True for plain paths and file:// URIs."""
    return _scheme(uri) in ("", "file")


def local_path(uri: str) -> Path:
    """The filesystem path of a plain path or file:// URI; StorageError for any other scheme."""
    if not is_local(uri):
        raise StorageError(f"{uri!r} is not a local path; expected a plain path or a file:// URI")
    return Path(uri[len("file://") :] if _scheme(uri) == "file" else uri)


def _mismatch(expect: ArtifactRecord, actual: ArtifactRecord) -> str | None:
    """How `actual` differs from `expect` in size or sha256, or None when they match."""
    if (expect.size, expect.sha256) == (actual.size, actual.sha256):
        return None
    return (
        f"expected size {expect.size} sha256 {expect.sha256}, got size {actual.size} sha256 {actual.sha256}"
    )


def _check(uri: str, expect: ArtifactRecord, actual: ArtifactRecord) -> None:
    if difference := _mismatch(expect, actual):
        raise ChecksumError(
            f"{uri}: {difference}; the object is corrupt or was replaced since the record was made: "
            "rewrite it, or refresh the record if the change was intended"
        )


class _Sink(Protocol):
    """Where an atomic write goes: bytes are written, then either committed into place or discarded."""

    def write(self, data: bytes | bytearray | memoryview) -> object: ...
    def flush(self) -> None: ...
    def commit(self) -> None: ...
    def discard(self) -> None: ...


class ArtifactWriter:
    """The binary file object `Storage.open_write` yields: forwards writes to a temporary target, hashing them.

    `record` describes the bytes written so far; once the `with` block has exited normally it describes the
    object stored under `uri`. Not seekable (it streams).
    """

    def __init__(self, uri: str, sink: _Sink) -> None:
        self.uri = uri
        self._sink = sink
        self._hash = hashlib.sha256()
        self._size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self._hash.update(data)
        self._size += memoryview(data).nbytes
        self._sink.write(data)
        return memoryview(data).nbytes

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        self._sink.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    @property
    def record(self) -> ArtifactRecord:
        return ArtifactRecord(path=self.uri, sha256=self._hash.hexdigest(), size=self._size)


class _LocalSink:
    """Writes a hidden sibling, then renames it into place: os.replace is atomic within one filesystem."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._final = path
        self._tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
        self._file: BinaryIO = open(self._tmp, "wb")  # closed by commit() or discard()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._file.write(data)

    def flush(self) -> None:
        self._file.flush()

    def commit(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())  # the rename must not outrun the data after a crash
        self._file.close()
        os.replace(self._tmp, self._final)

    def discard(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)


class _ObjectSink:
    """Writes an object store key so that it appears only once complete, without a temporary key.

    Up to `small` bytes are held in memory and sent as one PUT at commit. Past that, they stream into a
    multipart upload opened with fsspec's autocommit off: S3 shows the object only when commit() completes the
    upload, and discard() aborts it. No second copy of a multi-GB object, no temporary name in any listing.
    """

    def __init__(self, fs: AbstractFileSystem, path: str, small: int = CHUNK_SIZE) -> None:
        self._fs, self._path, self._small = fs, path, small
        self._head = bytearray()
        self._upload: Any = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._upload is None and len(self._head) + memoryview(data).nbytes <= self._small:
            self._head += data
            return
        if self._upload is None:
            self._upload = self._fs.open(self._path, "wb", autocommit=False)
            self._upload.write(bytes(self._head))
            self._head = bytearray()
        self._upload.write(data)

    def flush(self) -> None:
        """Nothing to do: parts go out as they fill; a partial object can never be made visible."""

    def commit(self) -> None:
        if self._upload is None:
            self._fs.pipe_file(self._path, bytes(self._head))
            return
        self._upload.close()
        self._upload.commit()

    def discard(self) -> None:
        if self._upload is None:
            return
        try:
            self._upload.close()
        finally:
            self._upload.discard()


def _s3_filesystem(config: S3Config) -> AbstractFileSystem:
    import s3fs  # imported here: it pulls in aiobotocore, which local-only callers need not pay for

    client_kwargs = {"endpoint_url": config.endpoint_url, "region_name": config.region}
    secret = config.secret_access_key.get_secret_value() if config.secret_access_key else None
    return s3fs.S3FileSystem(
        key=config.access_key_id,
        secret=secret,
        client_kwargs={name: value for name, value in client_kwargs.items() if value},
        skip_instance_cache=True,
        # Other processes (training ranks, other stages) write the same buckets: a listings cache would go stale.
        use_listings_cache=False,
    )


NO_CREDENTIALS_FIX = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment of the process that runs the stage (the "
    "Prefect worker's, for a deployment; the shell's, for `slimeflow run`), or save them in a Prefect Secret block "
    "and name it with --s3-credentials-block"
)


class _CredentialsNamed:
    """An s3 filesystem whose calls say which object they were for, and how to fix it, when botocore finds no
    credentials: botocore's own "Unable to locate credentials" is raised at the first request, far from any config,
    and names neither."""

    def __init__(self, fs: AbstractFileSystem) -> None:
        self._fs = fs

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._fs, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            # botocore comes with s3fs, which built the filesystem this wraps
            from botocore.exceptions import NoCredentialsError

            try:
                return attribute(*args, **kwargs)
            except NoCredentialsError as err:
                where = f"s3://{args[0]}" if args and isinstance(args[0], str) else "s3"
                raise StorageError(f"{where}: no S3 credentials found ({err}); {NO_CREDENTIALS_FIX}") from err

        return call


class Storage:
    """Files and objects by URI. One instance holds its filesystem clients; pass it around rather than a config.

    On s3 there are no directories: a prefix exists while objects are under it, and `makedirs` only ensures the
    bucket exists.
    """

    def __init__(self, s3: S3Config | None = None) -> None:
        self._s3_config = s3 or S3Config()

    @cached_property
    def _local(self) -> AbstractFileSystem:
        return LocalFileSystem()

    @cached_property
    def _s3(self) -> AbstractFileSystem:
        return _CredentialsNamed(_s3_filesystem(self._s3_config))  # type: ignore[return-value]  # same calls

    def _locate(self, uri: str) -> tuple[AbstractFileSystem, str]:
        """The filesystem for `uri` and the path it uses (absolute posix path locally, bucket/key on s3)."""
        scheme = _scheme(uri)
        if scheme in ("", "file"):
            return self._local, os.path.abspath(local_path(uri))
        if scheme == "s3":
            return self._s3, uri[len("s3://") :].rstrip("/")
        raise StorageError(
            f"unsupported storage URI {uri!r}: scheme '{scheme}://' is not supported; "
            f"use one of: {', '.join(SUPPORTED_SCHEMES)}"
        )

    # -- queries ---------------------------------------------------------------------------------------------

    def exists(self, uri: str) -> bool:
        fs, path = self._locate(uri)
        return fs.exists(path)

    def isdir(self, uri: str) -> bool:
        fs, path = self._locate(uri)
        return fs.isdir(path)

    def list(self, uri: str, recursive: bool = False) -> list[str]:
        """Sorted URIs under the directory `uri` (files and subdirectories; with `recursive`, all files below).

        NotFoundError if nothing exists under `uri`; StorageError if it is a file.
        """
        fs, path = self._locate(uri)
        self._require_dir(uri, fs, path)
        names = fs.find(path) if recursive else fs.ls(path, detail=False)
        return [join(uri, rel) for rel in _relative_to(path, names)]

    def sha256(self, uri: str) -> ArtifactRecord:
        """The record of the object at `uri`, hashed while streaming it."""
        digest, size = hashlib.sha256(), 0
        for chunk in self._chunks(uri):
            digest.update(chunk)
            size += len(chunk)
        return ArtifactRecord(path=uri, sha256=digest.hexdigest(), size=size)

    # -- reading ---------------------------------------------------------------------------------------------

    def read_bytes(self, uri: str, expect: ArtifactRecord | None = None) -> bytes:
        """The whole object; with `expect`, ChecksumError unless its size and sha256 match."""
        data = b"".join(self._chunks(uri))
        if expect is not None:
            _check(
                uri, expect, ArtifactRecord(path=uri, sha256=hashlib.sha256(data).hexdigest(), size=len(data))
            )
        return data

    def read_text(self, uri: str, expect: ArtifactRecord | None = None) -> str:
        return self.read_bytes(uri, expect).decode("utf-8")

    def open_read(self, uri: str) -> BinaryIO:
        """The object at `uri` opened for streaming reads (seekable: parquet readers need it); close it after use."""
        return self._open_read(uri)

    def _open_read(self, uri: str) -> BinaryIO:
        """The object at `uri` opened for reading; NotFoundError if absent, StorageError if a directory."""
        fs, path = self._locate(uri)
        try:
            if fs.info(path)["type"] == "directory":  # s3fs would open a prefix and read it as empty
                raise StorageError(f"{uri} is a directory; expected a file or object")
            return fs.open(path, "rb")
        except (FileNotFoundError, NotADirectoryError) as exc:  # the latter: a local path under a file
            raise NotFoundError(
                f"{uri}: no such file or object; check the path (and bucket/endpoint for s3://)"
            ) from exc

    def _chunks(self, uri: str) -> Iterator[bytes]:
        with self._open_read(uri) as file:
            yield from iter(partial(file.read, CHUNK_SIZE), b"")

    # -- writing ---------------------------------------------------------------------------------------------

    @contextmanager
    def open_write(self, uri: str) -> Iterator[ArtifactWriter]:
        """Write `uri` atomically: a complete object appears on normal exit; if the body raises, nothing does.

        Yields an `ArtifactWriter`; its `.record` (sha256, size) describes the stored object after the block.
        Locally it writes a hidden sibling `.{name}.tmp-{uuid}` and renames it; on s3 it holds the upload
        uncommitted until the block ends. An existing object under `uri` is replaced only on success.
        """
        fs, path = self._locate(uri)
        sink: _Sink = _LocalSink(Path(path)) if isinstance(fs, LocalFileSystem) else _ObjectSink(fs, path)
        writer = ArtifactWriter(uri, sink)
        try:
            yield writer
        except BaseException:
            _discard_quietly(uri, sink)
            raise
        sink.commit()

    def write_bytes(self, uri: str, data: bytes) -> ArtifactRecord:
        with self.open_write(uri) as writer:
            writer.write(data)
        return writer.record

    def write_text(self, uri: str, text: str) -> ArtifactRecord:
        return self.write_bytes(uri, text.encode("utf-8"))

    def makedirs(self, uri: str) -> None:
        """Create the local directory `uri` and its parents. On s3, which has no directories, check only that
        the bucket exists: Storage never creates buckets (that takes permissions and settings it does not own)."""
        fs, path = self._locate(uri)
        if isinstance(fs, LocalFileSystem):
            fs.makedirs(path, exist_ok=True)
            return
        bucket = path.split("/", 1)[0]
        if not fs.exists(bucket):
            raise NotFoundError(
                f"{uri}: bucket s3://{bucket} does not exist or is not accessible; create it first"
            )

    def remove(self, uri: str, recursive: bool = False) -> None:
        """Delete the file at `uri`, or with `recursive` the directory and everything under it."""
        fs, path = self._locate(uri)
        if fs.isdir(path):
            if not recursive:
                raise StorageError(
                    f"{uri} is a directory; pass recursive=True to remove it and everything under it"
                )
            fs.rm(path, recursive=True)
        elif fs.exists(path):
            fs.rm(path)
        else:
            raise NotFoundError(f"{uri}: nothing to remove; no such file or object")

    # -- copying ---------------------------------------------------------------------------------------------

    def put_file(self, local_path: str | os.PathLike[str], uri: str) -> ArtifactRecord:
        """Upload one local file to `uri` (atomically, streaming); the record's path is `uri`."""
        return self._copy(os.fspath(local_path), uri)

    def get_file(
        self, uri: str, local_path: str | os.PathLike[str], expect: ArtifactRecord | None = None
    ) -> ArtifactRecord:
        """Download `uri` to `local_path` atomically; with `expect`, a mismatch raises ChecksumError and leaves
        `local_path` untouched. The record's path is `local_path`."""
        return self._copy(uri, os.fspath(local_path), expect=expect)

    def copy(self, src_uri: str, dst_uri: str) -> None:
        """Copy one object, atomically: server-side within one object store (no bytes pass through here),
        streamed otherwise. NotFoundError if `src_uri` is absent."""
        src_fs, src = self._locate(src_uri)
        dst_fs, dst = self._locate(dst_uri)
        if src_fs is not dst_fs or isinstance(src_fs, LocalFileSystem):
            self._copy(src_uri, dst_uri)
            return
        try:
            src_fs.copy(src, dst)  # S3 CopyObject (multipart copy when large): visible once complete
        except FileNotFoundError as exc:
            raise NotFoundError(f"{src_uri}: no such object to copy to {dst_uri}") from exc

    def copy_tree(
        self, src_uri: str, dst_uri: str, progress: Callable[[int], None] | None = None
    ) -> list[ArtifactRecord]:
        """Copy every file under `src_uri` to the same relative path under `dst_uri`, each atomically.

        Returns records with paths relative to the tree root (posix), sorted. `progress(nbytes)` is called
        after each chunk copied; the calls sum to the total size. UnsafePathError, before anything is copied,
        for a key that would land outside `dst_uri` (one holding '..', say).
        """
        fs, path = self._locate(src_uri)
        self._require_dir(src_uri, fs, path)
        # Every key is checked before anything is written: a key holding '..' must not land outside dst_uri.
        targets = {rel: join(dst_uri, inside(src_uri, rel)) for rel in _relative_to(path, fs.find(path))}
        return [
            replace(self._copy(join(src_uri, rel), target, progress=progress), path=rel)
            for rel, target in targets.items()
        ]

    def verify_tree(self, uri: str, records: list[ArtifactRecord]) -> None:
        """ChecksumError listing every record whose file under `uri` is missing or differs in size or sha256."""
        problems = []
        for record in records:
            target = join(uri, inside(uri, record.path))
            try:
                difference = _mismatch(record, self.sha256(target))
            except NotFoundError:
                difference = "missing"
            if difference:
                problems.append(f"{record.path}: {difference}")
        if problems:
            raise ChecksumError(
                f"{uri}: {len(problems)} of {len(records)} files do not match their records:\n  "
                + "\n  ".join(problems)
            )

    def _copy(
        self,
        src_uri: str,
        dst_uri: str,
        expect: ArtifactRecord | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> ArtifactRecord:
        # The source is opened first, so a missing one fails before anything is created at the destination.
        with self._open_read(src_uri) as src, self.open_write(dst_uri) as writer:
            for chunk in iter(partial(src.read, CHUNK_SIZE), b""):
                writer.write(chunk)
                if progress is not None:
                    progress(len(chunk))
            if expect is not None:
                _check(src_uri, expect, writer.record)
        return writer.record

    def _require_dir(self, uri: str, fs: AbstractFileSystem, path: str) -> None:
        if fs.isdir(path):
            return
        if fs.exists(path):
            raise StorageError(f"{uri} is a file; expected a directory")
        raise NotFoundError(f"{uri}: no such directory (nothing exists under it)")


def _relative_to(root: str, paths: list[str]) -> list[str]:
    """Sorted posix paths of `paths` relative to `root` (both as the filesystem names them)."""
    prefix = root.rstrip("/") + "/"
    return sorted(
        path[len(prefix) :] for path in paths if path.startswith(prefix) and len(path) > len(prefix)
    )


def _discard_quietly(uri: str, sink: _Sink) -> None:
    """Discard a failed write; a cleanup failure is logged, so the body's own exception is the one raised."""
    try:
        sink.discard()
    except Exception as exc:  # the body's exception matters more than the cleanup one
        logger.warning("could not clean up the failed write to %s: %s", uri, exc)
