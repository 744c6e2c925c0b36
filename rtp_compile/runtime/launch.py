"""Local multi-process launcher for Rotated Tensor Parallel programs.

`launch` runs a function on `world_size` new processes on this
machine, each with an initialised default ``torch.distributed`` process group,
and hands every rank's return value back to the caller. It is the single-host
runner behind the tests, notebooks and the CLI: the function travels with
cloudpickle so notebook-defined code works, results travel as ``torch.save``
bytes, a failure on any rank is re-raised in the caller as :class:`RankError`
carrying the remote traceback, and no child process outlives the call.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import queue
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rtp_compile.core.checks import check_world_size

_POLL_S = 0.1  # how long the parent waits for a report before checking for dead ranks
_DEADLINE_SLACK_S = 60.0  # the whole launch may run this much longer than the group timeout
_EXIT_GRACE_S = 10.0  # ranks that reported get this long to exit on their own
_KILL_GRACE_S = 5.0  # a rank sent SIGTERM gets this long before SIGKILL
_CRASH_GRACE_S = 1.0  # how long a reported failure waits for a crashed peer to show as the cause


class RankError(RuntimeError):
    """A rank of a :func:`launch` failed.

    ``remote_traceback`` is the rank's formatted traceback, or None when the
    process died without reporting (crash, signal, ``os._exit``).
    """

    def __init__(self, rank: int, message: str, remote_traceback: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback

    def __reduce__(self):
        # The extra constructor arguments would otherwise break pickling the exception.
        return type(self), (self.rank, self.args[0], self.remote_traceback)


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that the OS reported free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    backend: str | None = None,
    timeout: float = 300.0,
    env: Mapping[str, Any] | None = None,
) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes.

    Each process is forked from a fork server that has imported torch and rtp_compile once
    (``spawn`` where the platform has none) and has a default process
    group (``nccl`` with one GPU per rank when enough GPUs exist, else ``gloo``;
    ``backend`` overrides) whose collectives time out after ``timeout`` seconds.
    ``fn`` and ``args`` are serialised with cloudpickle, so closures and
    notebook-defined functions work. ``env`` adds environment variables to the
    children; the rendezvous variables (MASTER_ADDR, MASTER_PORT, RANK,
    WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) are always set by the launcher.

    Returns the ranks' return values in rank order.

    Raises:
        ValueError: ``world_size`` is not an int >= 1.
        RankError: a rank raised or died; the other ranks are terminated.
        TimeoutError: the ranks had not all finished within ``timeout + 60`` s.
    """
    check_world_size(world_size, "rtp_compile.launch")
    import cloudpickle  # lazy: only launching needs it

    payload = cloudpickle.dumps((fn, tuple(args)))
    backend = backend or _default_backend(world_size)
    shared_env = {
        **{key: str(value) for key, value in (env or {}).items()},
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
    }
    ctx = _rank_context()
    reports = ctx.Queue()
    procs: list = []
    try:
        for rank in range(world_size):
            rank_env = {**shared_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            child_args = (rank, world_size, backend, timeout, payload, reports)
            procs.append(_start_rank(ctx, rank_env, child_args))
        results = _gather(reports, procs, timeout + _DEADLINE_SLACK_S)
        _join_all(procs, _EXIT_GRACE_S)
        return [torch.load(io.BytesIO(results[r]), weights_only=False) for r in range(world_size)]
    finally:
        _reap(procs)
        reports.close()


def _default_backend(world_size: int) -> str:
    """Pick NCCL when every rank can have a GPU of its own, otherwise gloo."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


@contextlib.contextmanager
def _patched_environ(overrides: Mapping[str, str]) -> Iterator[None]:
    """Temporarily set ``overrides`` in ``os.environ``, restoring previous values after."""
    saved = {key: os.environ.get(key) for key in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# What every rank imports anyway: a fork server that has imported them once starts ranks in
# ~0.1 s instead of the ~5 s of CPU an interpreter spends importing them.
_PRELOAD = ["torch", "torch.distributed", "cloudpickle", "rtp_compile"]
_PRELOAD_IF_IMPORTED = ["transformers"]  # heavy, and ranks of a parent that uses it import it


def _rank_context() -> Any:
    """The fork server (ranks forked from one process that imported `_PRELOAD` and never ran a
    kernel, so no thread or CUDA state is forked) where the platform has one, else spawn."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD + [m for m in _PRELOAD_IF_IMPORTED if m in sys.modules])
    return ctx


def _start_rank(ctx: Any, rank_env: Mapping[str, str], child_args: tuple) -> Any:
    """Start one rank's process with ``rank_env`` in its environment."""
    # A spawned child copies os.environ at exec (import-time variables apply); one forked from
    # the fork server has the server's environment and path, so it takes the caller's first.
    process = ctx.Process(
        target=_run_rank,
        name=f"rtp-rank-{rank_env['RANK']}",
        args=(*child_args, {**os.environ, **rank_env}, list(sys.path)),
    )
    with _patched_environ(rank_env):
        process.start()
    return process


def _run_rank(
    rank: int,
    world_size: int,
    backend: str,
    timeout: float,
    payload: bytes,
    reports: Any,
    environ: Mapping[str, str],
    path: list[str],
) -> None:
    """Child entry point: run the user function and report its result or its traceback."""
    os.environ.clear()
    os.environ.update(environ)
    sys.path[:] = path
    try:
        import cloudpickle

        torch.set_num_threads(int(os.environ.get("RTP_NUM_THREADS", "1")))
        fn, args = cloudpickle.loads(payload)
        _init_process_group(rank, world_size, backend, timeout)
        report: tuple[int, bool, object] = (rank, True, _to_bytes(fn(rank, world_size, *args)))
    except BaseException as exc:
        summary = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        report = (rank, False, (summary, traceback.format_exc()))
    reports.put(report)
    # Flush before leaving the group, so peers failing because this rank left report after it.
    reports.close()
    reports.join_thread()
    if dist.is_initialized():
        dist.destroy_process_group()


def _init_process_group(rank: int, world_size: int, backend: str, timeout: float) -> None:
    """Join the default process group through the env:// rendezvous set up by the parent."""
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
    )


def _to_bytes(value: Any) -> bytes:
    """Serialise a rank's result with torch.save so tensors outlive the child process."""
    import cloudpickle

    buffer = io.BytesIO()
    # cloudpickle lets results of classes defined only in a notebook or closure travel back.
    torch.save(value, buffer, pickle_module=cloudpickle)
    return buffer.getvalue()


def _gather(reports: Any, procs: list, limit_s: float) -> dict[int, bytes]:
    """Drain rank reports until every rank succeeded; raise on a failure or at the deadline."""
    deadline = time.monotonic() + limit_s
    received: dict[int, tuple[bool, Any]] = {}
    while True:
        exited = {rank for rank, process in enumerate(procs) if process.exitcode is not None}
        try:
            rank, ok, body = reports.get(timeout=_POLL_S)
            received[rank] = (ok, body)
            if len(received) < len(procs):
                continue
        except queue.Empty:
            pass
        # A report is in the pipe before its rank exits: exited before an empty read means silent.
        if not all(ok for ok, _ in received.values()) and not exited - received.keys():
            # a failure report is often a peer's echo of a crash not yet seen: give it a moment
            _join_all([p for r, p in enumerate(procs) if r not in received], _CRASH_GRACE_S)
            exited = {r for r, process in enumerate(procs) if process.exitcode is not None}
            while True:  # the reports of ranks that exited meanwhile are in the pipe by now
                try:
                    rank, ok, body = reports.get(timeout=_POLL_S)
                except queue.Empty:
                    break
                received[rank] = (ok, body)
        _raise_for_failure(procs, exited - received.keys(), received)
        if len(received) == len(procs):
            return {rank: body for rank, (_, body) in received.items()}
        if time.monotonic() > deadline:
            pending = sorted(set(range(len(procs))) - received.keys())
            raise TimeoutError(
                f"launch did not finish within {limit_s:g} s; ranks {pending} had not finished"
            )


def _raise_for_failure(
    procs: list, silent: set[int], received: Mapping[int, tuple[bool, Any]]
) -> None:
    """Raise RankError for a rank that died silently, else for the first reported error."""
    # A crashed rank is the likelier root cause: its peers mostly just lost their connection to it.
    if silent:
        rank = min(silent)
        exit_text = _describe_exit(procs[rank].exitcode)
        raise RankError(
            rank, f"rank {rank} failed: process died with {exit_text} without reporting a result"
        )
    for rank, (ok, body) in received.items():
        if not ok:
            summary, remote_traceback = body
            message = f"rank {rank} failed: {summary}\n\nRemote traceback:\n{remote_traceback}"
            raise RankError(rank, message, remote_traceback)


def _describe_exit(code: int) -> str:
    """Render an exit code, naming the signal when the process was killed by one."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"exit code {code} ({signal.Signals(-code).name})"
    except ValueError:  # real-time signals have no name
        return f"exit code {code} (signal {-code})"


def _join_all(procs: list, grace_s: float) -> None:
    """Wait up to ``grace_s`` seconds in total for all processes to exit."""
    end = time.monotonic() + grace_s
    for process in procs:
        process.join(max(0.0, end - time.monotonic()))


def _reap(procs: list) -> None:
    """Terminate every rank still running: SIGTERM first, SIGKILL for any that outlive the grace."""
    alive = [process for process in procs if process.is_alive()]
    for process in alive:
        process.terminate()
    _join_all(alive, _KILL_GRACE_S)
    for process in alive:
        if process.is_alive():
            process.kill()
        process.join()
