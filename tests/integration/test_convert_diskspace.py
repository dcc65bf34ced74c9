"""A conversion into a filesystem that fills up says "no space left on <path>" with the sizes and the fix, not
torch's `enforce fail at inline_container.cc:672` (a real full disk: a 1 MiB tmpfs, for a 2.8 MiB checkpoint)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from slimeflow.checkpoint import convert as stage
from slimeflow.checkpoint.convert import HFSource, read_hf_source
from slimeflow.checkpoint.diskspace import NoSpaceLeft
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model

FIX = "Free space there, or convert into a --save directory on a larger disk"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> HFSource:
    hf = build_tiny_model(tmp_path_factory.mktemp("hf") / "hf", TinyModelSpec.from_uri("tiny:qwen2?hidden_size=256"))
    source = read_hf_source(hf)
    assert sum(source.sizes.values()) > 2 * 1024**2  # twice the disk
    return source


@pytest.fixture
def small_disk() -> Iterator[Callable[[Path], Path]]:
    """mount(directory): a 1 MiB tmpfs there (needs root and mount rights, else the test is skipped); each is
    unmounted afterwards."""
    mounted: list[Path] = []

    def mount(directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(directory)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): the disk-full cases need one")
        mounted.append(directory)
        return directory

    yield mount
    for directory in mounted:
        subprocess.run(["umount", str(directory)], check=True)


@pytest.mark.timeout(120)
def test_a_full_disk_says_no_space_left_where_how_much_and_what_to_do(source, tmp_path, small_disk):
    disk = small_disk(tmp_path / "disk")
    root = disk / "ckpt"
    with pytest.raises(NoSpaceLeft) as err:
        stage.convert_hf_to_torch_dist(source, root, processes=2)
    message = str(err.value)
    assert re.fullmatch(rf"no space left on {root}/\.release\.tmp-[0-9a-f]{{8}} \(the filesystem mounted at "
                        rf"{disk}\): the checkpoint needs about 2\.8 MiB, \d+\.\d KiB is free there\. {FIX} .*",
                        message), message
    assert list(root.iterdir()) == []


@pytest.mark.timeout(120)
def test_a_rank_that_runs_out_of_space_says_so_in_its_log(source, tmp_path, small_disk):
    """The staging directory alone on the small disk, so that the ranks' logs beside it keep their last words."""
    staging = small_disk(tmp_path / "root" / ".release.tmp-0123abcd")
    with pytest.raises(NoSpaceLeft) as err:
        stage.write_torch_dist(source, staging, processes=2)
    rank_log = str(err.value.__cause__)
    assert re.search(rf"no space left on {staging} \(the filesystem mounted at {staging}\): rank \d's share needs "
                     rf"about \d\.\d MiB, \d+ (bytes|\.\d KiB) is free there\. {FIX}", rank_log), rank_log[-3000:]
    assert "inline_container.cc" not in str(err.value)
