"""A conversion's processes live and die together: real SIGKILLs of a rank and of the main process fail the
conversion within seconds, naming what died, and leave no process behind.

A conversion is kept from finishing without any test hook: rank 0's data file `__0_0.distcp` is made a FIFO
that nobody reads, so rank 0 blocks opening it until it is killed (and rank 1 waits for it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import psutil
import pytest

from slimeflow.checkpoint.convert import assign_shares, convert_hf_to_torch_dist, read_hf_source
from slimeflow.checkpoint.launch import launch
from slimeflow.checkpoint.worker import Job
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model
from slimeflow.io.guard import claimed_dir

T = TypeVar("T")
SOON_S = 5.0
"""A death must fail the conversion within this many seconds (the machine is shared and slow)."""


@pytest.fixture(scope="module")
def small_hf(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("hf") / "hf", TinyModelSpec.from_uri("tiny:qwen2?seed=3"))


def blocked_job(hf: Path, tmp: Path, processes: int = 2) -> Path:
    """A job file whose rank 0 blocks opening its data file, a FIFO that nobody reads."""
    source = read_hf_source(hf)
    checkpoint = tmp / "ckpt"
    checkpoint.mkdir()
    os.mkfifo(checkpoint / "__0_0.distcp")
    job = Job(hf_dir=str(hf), weight_map=source.weight_map, shape=source.shape.__dict__, dtype=source.dtype,
              make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, checkpoint_dir=str(checkpoint),
              iteration=1, init_method=(tmp / "rendezvous").as_uri(), shares=assign_shares(source, processes))
    job.write(tmp / "job.json")
    return tmp / "job.json"


def wait_for(find: Callable[[], T | None], what: str, timeout: float = 90.0) -> T:
    deadline = time.monotonic() + timeout
    while (found := find()) is None:
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.02)
    return found


def wait_past_rendezvous(checkpoint: Path) -> None:
    """Until rank 1 writes its data file: both ranks have then met in the rendezvous, so both are past their
    start-up (and asked the kernel to end them with their parent) and rank 0 is on its way to the FIFO."""
    wait_for(lambda: (checkpoint / "__1_0.distcp").exists() or None, "rank 1's data file")


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for_end(proc: psutil.Process, timeout: float) -> None:
    wait_for(lambda: None if alive(proc) else True, f"end of {proc}", timeout)


class Processes:
    """The conversion processes this test sees (ranks: their command line names the job file), remembered so
    that the test can check that none outlives it, wherever it was reparented."""

    def __init__(self, root: psutil.Process, job: Path):
        self.root, self.job, self.seen = root, str(job), []

    def rank(self, rank: int) -> psutil.Process | None:
        for proc in self.root.children():
            try:
                if proc.cmdline()[3:5] == [self.job, str(rank)]:
                    return self._remember(proc)
            except psutil.NoSuchProcess:
                continue
        return None

    def _remember(self, proc: psutil.Process) -> psutil.Process:
        if proc not in self.seen:
            self.seen.append(proc)
        return proc

    def left(self) -> list[psutil.Process]:
        """Those still running, each then killed (so that a failing test leaks nothing)."""
        left = [proc for proc in self.seen if alive(proc)]
        for proc in left:
            proc.kill()
        return left


@pytest.fixture
def watched(tmp_path) -> Iterator[Callable[[Path], Processes]]:
    made: list[Processes] = []

    def make(job: Path, root: psutil.Process | None = None) -> Processes:
        made.append(Processes(root or psutil.Process(), job))
        return made[-1]

    yield make
    for processes in made:
        left = processes.left()
        assert not left, f"processes outlived the test: {left}"


@contextmanager
def blocked_conversion(hf: Path, tmp: Path, watched: Callable[..., Processes]
                       ) -> Iterator[tuple[Future, psutil.Process, psutil.Process]]:
    """A two-rank launch() on a thread of its own, that cannot finish (blocked_job), once both ranks run: (the
    conversion, rank 0, rank 1). Afterwards every process it started is killed (which unblocks a hung launch) and
    it is awaited."""
    job = blocked_job(hf, tmp)
    processes = watched(job)
    pool = ThreadPoolExecutor(1)
    future = pool.submit(launch, job, 2)
    pool.shutdown(wait=False)
    try:
        ranks = wait_for(lambda: processes.rank(0), "rank 0"), wait_for(lambda: processes.rank(1), "rank 1")
        wait_past_rendezvous(tmp / "ckpt")
        yield future, *ranks
    finally:
        processes.left()
        future.exception(timeout=60)


def failure_within(future: Future, seconds: float) -> str:
    """The error the conversion ended with, which must come within `seconds`."""
    started = time.monotonic()
    try:
        future.result(timeout=seconds)
    except TimeoutError:
        raise AssertionError(f"the conversion did not fail within {seconds} s") from None
    except RuntimeError as err:
        print(f"failed after {time.monotonic() - started:.2f} s")
        return str(err)
    raise AssertionError("the conversion succeeded")


@pytest.mark.timeout(150)
def test_a_killed_rank_fails_the_conversion_naming_it_and_the_other_rank_is_stopped(small_hf, tmp_path, watched):
    with blocked_conversion(small_hf, tmp_path, watched) as (future, rank0, rank1):
        rank0.send_signal(signal.SIGKILL)
        message = failure_within(future, SOON_S)
        wait_for_end(rank1, SOON_S)
    assert message.startswith("conversion rank 0 was killed by SIGKILL (SIGKILL: often the kernel's out-of-memory")


MAIN = """
import sys
from pathlib import Path
from slimeflow.checkpoint.convert import convert_hf_to_torch_dist, read_hf_source
convert_hf_to_torch_dist(read_hf_source(Path(sys.argv[1])), Path(sys.argv[2]), processes=2)
"""


def kill_main_mid_conversion(hf: Path, root: Path, watched: Callable[..., Processes]) -> None:
    """Start a conversion in a process of its own that cannot finish (rank 0's data file a FIFO, made in the
    staging directory before the ranks, still importing torch, get there), SIGKILL that process once both ranks
    have met and check that they follow it within SOON_S."""
    main = subprocess.Popen([sys.executable, "-c", MAIN, str(hf), str(root)])
    try:
        staging = wait_for(lambda: next(root.glob(".release.tmp-*"), None), "staging directory")
        os.mkfifo(staging / "__0_0.distcp")
        job = wait_for(lambda: next(root.glob(".convert-job-*/job.json"), None), "job file")
        processes = watched(job, psutil.Process(main.pid))
        rank0 = wait_for(lambda: processes.rank(0), "rank 0")
        orphans = [rank0, wait_for(lambda: processes.rank(1), "rank 1")]
        wait_past_rendezvous(staging)
        main.kill()
        main.wait()
        for proc in orphans:
            wait_for_end(proc, SOON_S)
    finally:
        if main.poll() is None:
            main.kill()
            main.wait()


@pytest.mark.timeout(180)
def test_a_killed_main_process_takes_its_ranks_along_and_the_next_run_removes_what_it_left(small_hf, tmp_path,
                                                                                            watched):
    root = tmp_path / "ckpt"
    kill_main_mid_conversion(small_hf, root, watched)
    left = sorted(p.name[:13] for p in root.iterdir())
    assert left == [".convert-job-", ".release.tmp-"], left
    others = [root / ".release.tmp-not-ours", root / ".convert-job-0123abcd.txt", root / "notes"]
    others[0].mkdir()
    others[1].write_text("a file, not a staging directory")
    others[2].mkdir()
    with claimed_dir(root, ".release.tmp-") as live:  # a conversion running beside this one
        staged, _ = convert_hf_to_torch_dist(read_hf_source(small_hf), root, processes=1)
        assert sorted(root.iterdir()) == sorted([live, staged, *others])
