"""Storage against a local directory, file:// URIs and a real S3 protocol server (moto on loopback)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from slimeflow.errors import ChecksumError, NotFoundError, StorageError, UnsafePathError
from slimeflow.io.storage import (
    CHUNK_SIZE,
    ArtifactRecord,
    S3Config,
    Storage,
    inside,
    is_local,
    join,
    local_path,
    split,
)


@dataclass
class Place:
    """A Storage and an empty base URI under it; `fresh()` is a second Storage with no shared state."""

    storage: Storage
    base: str
    s3: S3Config | None = None

    def fresh(self) -> Storage:
        return Storage(self.s3)


@pytest.fixture(params=["local", "file", "s3"])
def place(request, tmp_path) -> Place:
    if request.param == "local":
        return Place(Storage(), str(tmp_path / "base"))
    if request.param == "file":
        return Place(Storage(), (tmp_path / "base").as_uri())
    s3_config = request.getfixturevalue("s3_config")
    bucket = request.getfixturevalue("s3_bucket")
    return Place(Storage(s3_config), join(bucket, "base"), s3_config)


def _record(data: bytes) -> tuple[str, int]:
    return hashlib.sha256(data).hexdigest(), len(data)


def _tree(root: Path) -> dict[str, bytes]:
    files = {
        "config.json": b'{"hidden_size": 8}',
        "model/shard-00001.bin": bytes(range(256)) * 40,
        "model/shard-00002.bin": b"\x00" * 3000,
        "model/nested/empty.txt": b"",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


# -- round trips -----------------------------------------------------------------------------------------------


def test_bytes_text_and_file_round_trips(place, tmp_path):
    storage = place.storage
    uri = join(place.base, "dir", "blob.bin")
    data = bytes(range(256)) * 10
    record = storage.write_bytes(uri, data)
    assert (record.path, (record.sha256, record.size)) == (uri, _record(data))
    assert place.fresh().read_bytes(uri, expect=record) == data
    assert storage.sha256(uri) == record

    text_uri = join(place.base, "note.txt")
    assert storage.write_text(text_uri, "grüße, 世界\n").size == len("grüße, 世界\n".encode())
    assert storage.read_text(text_uri) == "grüße, 世界\n"
    storage.write_text(text_uri, "replaced")
    assert storage.read_text(text_uri) == "replaced"

    src = tmp_path / "src.bin"
    src.write_bytes(b"abc" * 1000)
    put = storage.put_file(src, join(place.base, "remote.bin"))
    assert (put.path, (put.sha256, put.size)) == (join(place.base, "remote.bin"), _record(src.read_bytes()))
    got = storage.get_file(join(place.base, "remote.bin"), tmp_path / "out" / "dst.bin", expect=put)
    assert (tmp_path / "out" / "dst.bin").read_bytes() == src.read_bytes()
    assert (got.path, got.sha256, got.size) == (str(tmp_path / "out" / "dst.bin"), put.sha256, put.size)


def test_list_exists_isdir_remove(place):
    storage = place.storage
    for rel in ("a.txt", "sub/b.txt", "sub/deeper/c.txt"):
        storage.write_text(join(place.base, rel), rel)

    assert storage.list(place.base) == [join(place.base, "a.txt"), join(place.base, "sub")]
    assert storage.list(place.base, recursive=True) == [
        join(place.base, rel) for rel in ("a.txt", "sub/b.txt", "sub/deeper/c.txt")
    ]
    assert storage.exists(join(place.base, "sub/b.txt")) and not storage.exists(join(place.base, "nope.txt"))
    assert storage.isdir(join(place.base, "sub")) and not storage.isdir(join(place.base, "a.txt"))
    with pytest.raises(StorageError, match="is a file"):
        storage.list(join(place.base, "a.txt"))
    with pytest.raises(NotFoundError, match="missing-dir"):
        storage.list(join(place.base, "missing-dir"), recursive=True)

    with pytest.raises(StorageError, match="recursive=True"):
        storage.remove(join(place.base, "sub"))
    storage.remove(join(place.base, "sub"), recursive=True)
    storage.remove(join(place.base, "a.txt"))
    assert not storage.exists(join(place.base, "sub/deeper/c.txt"))
    assert not storage.exists(join(place.base, "a.txt"))
    with pytest.raises(NotFoundError, match="a.txt"):
        storage.remove(join(place.base, "a.txt"))


def test_makedirs_creates_local_dirs(tmp_path):
    Storage().makedirs(str(tmp_path / "x" / "y"))
    assert (tmp_path / "x" / "y").is_dir()


def test_makedirs_on_s3_requires_the_bucket(s3_config, s3_bucket):
    storage = Storage(s3_config)
    storage.makedirs(join(s3_bucket, "any/prefix"))  # an existing bucket: nothing to do
    with pytest.raises(NotFoundError, match="s3://no-such-bucket-x1 does not exist"):
        storage.makedirs("s3://no-such-bucket-x1/prefix")


# -- errors ----------------------------------------------------------------------------------------------------


def test_missing_objects_and_directories_are_reported(place, tmp_path):
    storage = place.storage
    missing = join(place.base, "missing.bin")
    for call in (storage.read_bytes, storage.sha256):
        with pytest.raises(NotFoundError, match="missing.bin"):
            call(missing)
    with pytest.raises(NotFoundError, match="missing.bin"):
        storage.get_file(missing, tmp_path / "got.bin")
    assert not (tmp_path / "got.bin").exists()
    with pytest.raises(NotFoundError, match="no-tree"):
        storage.copy_tree(join(place.base, "no-tree"), str(tmp_path / "dst"))

    storage.write_text(join(place.base, "sub/a.txt"), "x")
    with pytest.raises(StorageError, match="is a directory"):
        storage.read_bytes(join(place.base, "sub"))


@pytest.mark.parametrize("uri", ["gs://bucket/key", "ftp://host/file", "hdfs://nn/path"])
def test_unsupported_scheme_names_the_supported_ones(uri):
    with pytest.raises(StorageError, match=r"not supported.*s3://") as info:
        Storage().exists(uri)
    assert uri in str(info.value)
    with pytest.raises(StorageError, match="not supported"):
        Storage().write_bytes(uri, b"x")


# -- checksums -------------------------------------------------------------------------------------------------


def test_read_back_with_a_wrong_record_raises(place, tmp_path):
    uri = join(place.base, "blob.bin")
    record = place.storage.write_bytes(uri, b"payload")
    for field, value in [("sha256", "0" * 64), ("size", 999)]:
        with pytest.raises(ChecksumError) as info:
            place.storage.read_bytes(uri, expect=record.model_copy(update={field: value}))
        message = str(info.value)
        assert uri in message and str(value) in message and record.sha256 in message

    dest = tmp_path / "download" / "blob.bin"
    with pytest.raises(ChecksumError, match="blob.bin"):
        place.storage.get_file(uri, dest, expect=record.model_copy(update={"sha256": "f" * 64}))
    assert list(dest.parent.iterdir()) == []  # neither the file nor a temporary sibling


# -- atomicity -------------------------------------------------------------------------------------------------


def _pending_uploads(place: Place) -> list:
    """Multipart uploads started and neither completed nor aborted (S3 bills them; nothing lists them)."""
    if place.s3 is None:
        return []
    import s3fs

    fs = s3fs.S3FileSystem(
        key=place.s3.access_key_id,
        secret=place.s3.secret_access_key.get_secret_value(),
        client_kwargs={"endpoint_url": place.s3.endpoint_url},
        skip_instance_cache=True,
    )
    return fs.list_multipart_uploads(place.base.removeprefix("s3://").split("/")[0])


def test_open_write_shows_nothing_until_exit(place):
    uri = join(place.base, "streamed.bin")
    with place.storage.open_write(uri) as writer:
        writer.write(b"part one, ")
        writer.write(memoryview(b"part two"))
        assert not place.storage.exists(uri)
    assert writer.record == ArtifactRecord(
        path=uri, sha256=hashlib.sha256(b"part one, part two").hexdigest(), size=18
    )
    assert place.storage.read_bytes(uri) == b"part one, part two"
    assert place.storage.list(place.base) == [uri]  # no temporary sibling left


def test_failed_writes_leave_nothing_behind(place):
    storage = place.storage
    old_uri = join(place.base, "model.bin")
    old = storage.write_bytes(old_uri, b"old weights")

    new_uri = join(place.base, "half.bin")
    with pytest.raises(RuntimeError, match="half-way"):
        with storage.open_write(new_uri) as writer:
            writer.write(b"x" * 10_000)
            raise RuntimeError("failed half-way")
    with pytest.raises(KeyboardInterrupt):
        with storage.open_write(old_uri) as writer:
            writer.write(b"new wei")
            raise KeyboardInterrupt

    fresh = place.fresh()
    assert not fresh.exists(new_uri)
    assert fresh.read_bytes(old_uri, expect=old) == b"old weights"
    assert fresh.list(place.base, recursive=True) == [old_uri]  # no temporary object either
    assert _pending_uploads(place) == []


def test_large_s3_writes_stream_through_an_uncommitted_upload(s3_config, s3_bucket):
    storage = Storage(s3_config)
    place = Place(storage, join(s3_bucket, "big"), s3_config)
    data = bytes(range(256)) * (CHUNK_SIZE // 256 + 1)  # past what is held in memory for a single PUT
    uri = join(place.base, "weights.bin")
    with storage.open_write(uri) as writer:
        for start in range(0, len(data), 2**20):
            writer.write(data[start : start + 2**20])
        assert not storage.exists(uri)
    assert storage.sha256(uri) == ArtifactRecord(path=uri, sha256=_record(data)[0], size=len(data))

    with pytest.raises(RuntimeError, match="half-way"):
        with storage.open_write(join(place.base, "half.bin")) as writer:
            writer.write(data)
            raise RuntimeError("failed half-way")
    assert storage.list(place.base) == [uri]
    assert _pending_uploads(place) == []


# -- trees -----------------------------------------------------------------------------------------------------


def test_copy_tree_there_and_back(place, tmp_path):
    files = _tree(tmp_path / "src")
    seen: list[int] = []
    records = place.storage.copy_tree((tmp_path / "src").as_uri(), place.base, progress=seen.append)

    assert [r.path for r in records] == sorted(files)
    assert {r.path: (r.sha256, r.size) for r in records} == {
        rel: _record(data) for rel, data in files.items()
    }
    assert sum(seen) == sum(len(data) for data in files.values())
    place.storage.verify_tree(place.base, records)

    back = place.storage.copy_tree(place.base, str(tmp_path / "back"))
    assert back == records
    assert {rel: (tmp_path / "back" / rel).read_bytes() for rel in files} == files
    Storage().verify_tree(str(tmp_path / "back"), records)


def test_verify_tree_reports_every_bad_file(place, tmp_path):
    _tree(tmp_path / "src")
    records = place.storage.copy_tree(str(tmp_path / "src"), place.base)
    place.storage.write_bytes(join(place.base, "config.json"), b'{"hidden_size": 9}')
    place.storage.remove(join(place.base, "model/shard-00002.bin"))

    with pytest.raises(ChecksumError) as info:
        place.storage.verify_tree(place.base, records)
    message = str(info.value)
    assert "2 of 4 files" in message
    assert "config.json: expected size 18" in message
    assert "model/shard-00002.bin: missing" in message
    assert "shard-00001" not in message


# -- configuration and URI helpers ----------------------------------------------------------------------------


def test_no_s3_credentials_names_the_object_and_the_fix(moto_server, monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata probe
    storage = Storage(S3Config(endpoint_url=moto_server, region="us-east-1"))
    with pytest.raises(StorageError, match=r"s3://bucket/key.json: no S3 credentials found .*AWS_ACCESS_KEY_ID"
                                           r".*--s3-credentials-block"):
        storage.read_bytes("s3://bucket/key.json")
    with pytest.raises(StorageError, match=r"s3://bucket/dir: no S3 credentials"):
        storage.exists("s3://bucket/dir")


def test_s3_config_from_env_prefers_specific_variables():
    config = S3Config.from_env(
        {
            "AWS_ENDPOINT_URL": "http://general:9000",
            "AWS_ENDPOINT_URL_S3": "http://s3-only:9000",
            "AWS_ACCESS_KEY_ID": "key",
            "AWS_SECRET_ACCESS_KEY": "s3cr3t-value",
            "AWS_DEFAULT_REGION": "eu-west-1",
            "AWS_REGION": "eu-central-1",
        }
    )
    assert config.endpoint_url == "http://s3-only:9000"
    assert config.access_key_id == "key"
    assert (
        config.secret_access_key is not None and config.secret_access_key.get_secret_value() == "s3cr3t-value"
    )
    assert config.region == "eu-central-1"
    assert "s3cr3t-value" not in repr(config)


def test_s3_config_from_env_treats_empty_as_unset():
    config = S3Config.from_env({"AWS_ENDPOINT_URL_S3": "", "AWS_ENDPOINT_URL": "http://e", "AWS_REGION": ""})
    assert config == S3Config(endpoint_url="http://e")


def test_merged_over_takes_set_fields_from_self():
    env = S3Config(endpoint_url="http://env", access_key_id="env-key", region="us-west-2")
    merged = S3Config(endpoint_url="http://config").merged_over(env)
    assert merged == S3Config(endpoint_url="http://config", access_key_id="env-key", region="us-west-2")


def test_uri_helpers(tmp_path):
    assert join("s3://bucket", "a", "/b/", "c.txt") == "s3://bucket/a/b/c.txt"
    assert join("s3://bucket/", "") == "s3://bucket/"
    assert join("/data/", "x") == "/data/x"
    assert join("file:///", "x") == "file:///x"
    assert join("/", "x") == "/x"
    assert split("s3://bucket/ckpt/iter_0000020/") == ("s3://bucket/ckpt", "iter_0000020")
    assert split("release") == (".", "release")
    assert split("/iter_0000001") == ("/", "iter_0000001")
    assert is_local("/data/x") and is_local("file:///data/x") and not is_local("s3://b/k")
    assert local_path(tmp_path.as_uri()) == tmp_path
    assert local_path("rel/x") == Path("rel/x")
    with pytest.raises(StorageError, match="not a local path"):
        local_path("s3://bucket/key")


# -- paths from data stay inside their root -------------------------------------------------------------------


@pytest.mark.parametrize("relative", ["../x", "a/../../x", "/etc/passwd", "a/..", "..", "", "a\\..\\x", "a\0b"])
def test_inside_refuses_paths_that_leave_their_root(relative):
    with pytest.raises(UnsafePathError, match="under s3://b/root"):
        inside("s3://b/root", relative)


def test_inside_normalises_harmless_paths():
    assert inside("r", "a//./b/c.txt") == "a/b/c.txt" and inside("r", "x..y/.hidden") == "x..y/.hidden"


def test_copy_tree_refuses_an_s3_key_that_would_land_outside_the_destination(tmp_path, s3_config, s3_bucket):
    storage = Storage(s3_config)
    storage.write_text(join(s3_bucket, "models/llama/config.json"), "{}")
    storage.write_text(join(s3_bucket, "models/llama/../../../../escape/x.txt"), "not yours")
    destination = tmp_path / "1" / "2" / "3" / "4" / "dst"
    with pytest.raises(UnsafePathError, match=r"'\.\./\.\./\.\./\.\./escape/x\.txt'"):
        storage.copy_tree(join(s3_bucket, "models/llama"), str(destination))
    assert not list(tmp_path.rglob("x.txt")) and not destination.exists()  # refused before anything was written


def test_verify_tree_refuses_a_record_path_outside_the_tree(tmp_path):
    (tmp_path / "tree").mkdir()
    (tmp_path / "outside.txt").write_text("x")
    record = Storage().sha256(str(tmp_path / "outside.txt")).model_copy(update={"path": "../outside.txt"})
    with pytest.raises(UnsafePathError, match="outside.txt"):
        Storage().verify_tree(str(tmp_path / "tree"), [record])
