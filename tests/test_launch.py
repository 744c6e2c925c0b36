"""Tests for rtp_compile.runtime.launch, run with real spawned processes and no mocks."""

import dataclasses
import multiprocessing
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

from rtp_compile.runtime.launch import RankError, free_port, launch

BIG_NUMEL = 5 * 2**20  # float32 elements in a 20 MiB tensor


def _rank_report(rank, world_size):
    """Return this rank's identity as seen by torch.distributed and the environment."""
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    facts = {
        "dist_rank": dist.get_rank(),
        "dist_world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "local_rank": os.environ["LOCAL_RANK"],
        "extra": os.environ["RTP_TEST_EXTRA"],
        "threads": torch.get_num_threads(),
    }
    return rank, world_size, torch.full((3,), float(rank)), total.item(), facts


def _fail_on_rank_one(rank, world_size, pid_dir):
    """Record the pid, then fail on rank 1 while the other ranks wait in a collective."""
    (pid_dir / f"{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        _wait_for_files(pid_dir, world_size)
        raise ValueError("rank one exploded")
    dist.all_reduce(torch.ones(1))


def _wait_for_files(directory, count):
    """Poll until ``count`` files exist, so every rank's pid is on record before the failure."""
    while len(list(directory.iterdir())) < count:
        time.sleep(0.05)


def _exit_on_rank_one(rank, world_size):
    """Kill rank 1 without a report while rank 0 waits in a collective."""
    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def _large_tensor(rank, world_size):
    """Return a 20 MiB tensor whose contents depend on the rank."""
    return torch.arange(BIG_NUMEL, dtype=torch.float32) + rank


def _pid_exists(pid):
    """Whether a process with this pid exists (zombies included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_results_come_back_in_rank_order(world_size):
    results = launch(_rank_report, world_size, env={"RTP_TEST_EXTRA": "set"})

    assert len(results) == world_size
    for rank, (got_rank, got_world_size, tensor, total, facts) in enumerate(results):
        assert (got_rank, got_world_size) == (rank, world_size)
        assert torch.equal(tensor, torch.full((3,), float(rank)))
        assert total == sum(range(world_size))
        assert facts == {
            "dist_rank": rank,
            "dist_world_size": world_size,
            "backend": "gloo",
            "local_rank": str(rank),
            "extra": "set",
            "threads": 1,
        }
    assert "RTP_TEST_EXTRA" not in os.environ


@pytest.mark.timeout(120)
def test_exception_on_one_rank_is_reraised_and_others_are_stopped(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankError) as excinfo:
        launch(_fail_on_rank_one, 3, args=(tmp_path,), timeout=60)
    elapsed = time.monotonic() - start

    error = excinfo.value
    assert isinstance(error, RuntimeError)
    assert error.rank == 1
    assert str(error).startswith("rank 1 failed:")
    assert "ValueError: rank one exploded" in str(error)
    assert "_fail_on_rank_one" in error.remote_traceback
    assert elapsed < 30
    assert multiprocessing.active_children() == []
    pids = [int(path.read_text()) for path in tmp_path.iterdir()]
    assert len(pids) == 3
    assert not any(_pid_exists(pid) for pid in pids)


@pytest.mark.timeout(120)
def test_rank_dying_without_report_is_named_with_exit_code():
    with pytest.raises(RankError) as excinfo:
        launch(_exit_on_rank_one, 2, timeout=60)

    assert excinfo.value.rank == 1
    assert str(excinfo.value).startswith("rank 1 failed:")
    assert "exit code 3" in str(excinfo.value)
    assert excinfo.value.remote_traceback is None
    assert multiprocessing.active_children() == []


@pytest.mark.timeout(120)
def test_closure_and_local_result_class_travel_with_cloudpickle():
    @dataclasses.dataclass
    class Point:
        value: int

    offset = 10

    def local_fn(rank, world_size, scale):
        return Point(offset + scale * rank)

    assert launch(local_fn, 2, args=(3,)) == [Point(10), Point(13)]


@pytest.mark.timeout(120)
def test_large_result_comes_back_intact():
    results = launch(_large_tensor, 2)

    expected = torch.arange(BIG_NUMEL, dtype=torch.float32)
    for rank, tensor in enumerate(results):
        assert tensor.nbytes == 20 * 2**20
        assert torch.equal(tensor, expected + rank)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [0, -2, 1.5, "2", True, None])
def test_bad_world_size_raises_value_error(world_size):
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        launch(_large_tensor, world_size)


@pytest.mark.timeout(120)
def test_free_port_can_be_bound():
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", port))
