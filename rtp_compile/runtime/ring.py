"""Ring communication for rotation units: shift a list of shards one hop around the ring.

`ring_shift_start` sends the given tensors to rank (r + shift) and starts receiving same-shaped
tensors from rank (r - shift), all of them as one flat message; it returns the hop's handle (a
0-dim int64 tensor). `ring_wait(hop, sent)` blocks until both directions finished and returns
the received message. They are functional `torch.library` custom ops (with fake
implementations), so emitted graphs trace, functionalize and compile like any graph: the
receive buffer is never a graph value before its wait (no compiler can read it early), the
pending work is found by the handle's value (a compiler may copy or move the handle), and
`sent` keeps what the hop sends alive in the graph until the wait (a compiler may not reuse its
memory while it is being sent).

The groups it runs on and their recovery are `runtime.groups`; how a message is packed,
`runtime.packing`.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rtp_compile.runtime.groups import peers, ring_state
from rtp_compile.runtime.packing import flat_layout, pack, pool, specs_of


@dataclass
class _PendingShift:
    works: list
    buffers: list  # the sent and received tensors: alive while the hop may still touch them
    timeout: datetime.timedelta
    where: str
    peers: tuple[int, int]  # (sends to, receives from): global ranks
    group_name: str

    @property
    def received(self) -> torch.Tensor:
        """The receive buffer: filled once the hop is done, handed out by its wait."""
        return self.buffers[1]


_pending: dict[int, _PendingShift] = {}  # hop handle -> its work
_handles = itertools.count()
traffic = {"hops": 0, "bytes": 0}  # what this process sent around the ring (benchmarks read it)


def mark_broken(group_name: str, why: str) -> None:
    """The ring of `group_name` must be re-formed before its next hop: a hop failed, or this
    rank's step raised while its peers may be waiting on it. What is in flight is abandoned."""
    state = ring_state(group_name)
    state.broken = state.broken or why
    for key in [k for k, p in _pending.items() if p.group_name == group_name]:
        state.abandoned.append(_pending.pop(key))


def labelled(what: str):
    """A `torch.profiler` label ("rtp.send ...", "rtp.wait ...") while a profiler records,
    else nothing (so an unprofiled hop pays no label)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(what)
    return contextlib.nullcontext()


def shift_start(
    tensors: list[torch.Tensor],
    group_name: str,
    shift: int,
    tag: int,
    where: str,
    pooled: bool = True,
) -> int:
    """Start sending `tensors` to rank r+shift and receiving their successors from r-shift, as
    one flat message; returns the hop's handle, which `wait` turns into the received message
    (see `unpack`). Weights travel in pooled buffers; gradient accumulators (`pooled=False`) in
    their own, since the last one becomes the parameters' gradients."""
    ring = peers(group_name, shift)
    with labelled(f"rtp.send {where}"):
        outgoing = pack(tensors, pooled)
        received = (
            pool.take(outgoing.numel(), outgoing.dtype, outgoing)
            if pooled
            else torch.empty_like(outgoing)
        )
        if ring.comm is not None or ring.direct:
            comm = ring.group if ring.comm is None else ring.comm
            works = [
                comm.send([outgoing], ring.dst_in_group, tag),
                comm.recv([received], ring.src_in_group, tag),
            ]
        else:
            works = dist.batch_isend_irecv(
                [
                    dist.P2POp(dist.isend, outgoing, ring.dst, ring.group, tag),
                    dist.P2POp(dist.irecv, received, ring.src, ring.group, tag),
                ]
            )
    traffic["hops"] += 1
    traffic["bytes"] += outgoing.numel() * outgoing.element_size()
    hop = next(_handles)
    _pending[hop] = _PendingShift(
        works, [outgoing, received], ring.timeout, where, (ring.dst, ring.src), group_name
    )
    return hop


def wait(hop: int) -> torch.Tensor:
    """Block until hop `hop` (a `shift_start` handle) has finished, within the group timeout;
    the message it received."""
    return wait_for_key(hop)


def wait_for_key(key: int) -> torch.Tensor:
    """`wait` for the hop registered under `key` (its handle)."""
    pending = _pending.pop(key, None)
    if pending is None:
        raise RuntimeError(f"rtp_compile: ring_wait on hop {key}, which is not in flight")
    timeout = pending.timeout
    dst, src = pending.peers
    with labelled(f"rtp.wait {pending.where}"):
        for work, doing in zip(
            pending.works, (f"sending to rank {dst}", f"receiving from rank {src}")
        ):
            try:
                work.wait(timeout)
            except RuntimeError as err:
                state = ring_state(pending.group_name)
                state.abandoned.append(pending)
                mark_broken(pending.group_name, f"a hop of {pending.where} failed")
                for transaction in list(state.open_transactions):  # a traced backward's
                    transaction.roll_back()
                raise RuntimeError(
                    f"rtp_compile: rank {dist.get_rank()} timed out or failed in the ring "
                    f"during {pending.where}, {doing} (timeout {timeout}). Rank {src} or "
                    f"{dst} probably failed, left, or runs a different program: {err}"
                ) from err
    return pending.received


def finish_leftover_hops() -> None:
    """Wait out every hop still in flight: those of a step that raised between a hop's start
    and its wait (every rank of the ring started the same hops, so they complete); a broken
    ring's are abandoned instead. After it, no receive is pending."""
    while _pending:
        key = next(iter(_pending))
        pending = _pending[key]
        if ring_state(pending.group_name).broken is not None:
            mark_broken(pending.group_name, "")  # abandons them
            continue
        pending.where += " (left in flight by a step that raised)"
        wait_for_key(key)


@torch.library.custom_op("rtp::ring_shift_start", mutates_args=())
def ring_shift_start(
    tensors: list[torch.Tensor],
    group_name: str,
    shift: int,
    tag: int,
    where: str,
    pooled: bool = True,
    after: torch.Tensor | None = None,
) -> torch.Tensor:
    """Graph op: start one ring hop of `tensors`; returns its handle for `ring_wait`. `after`:
    a value the hop must follow (a traced backward's incoming gradient: else a partitioner may
    start a backward's first weight hop, which reads only the own shards, in the forward and
    save what it received)."""
    return torch.tensor(shift_start(tensors, group_name, shift, tag, where, pooled))


@ring_shift_start.register_fake
def _(tensors, group_name, shift, tag, where, pooled=True, after=None):
    return torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op("rtp::ring_wait", mutates_args=())
def ring_wait(hop: torch.Tensor, sent: list[torch.Tensor]) -> torch.Tensor:
    """Graph op: wait for hop `hop` (and for our own send of `sent` to finish); returns the
    flat message it received, which `unpack` views as tensors like `sent`."""
    return wait(int(hop))


@ring_wait.register_fake
def _(hop, sent):
    dtype, total, _ = flat_layout(specs_of(sent))
    return sent[0].new_empty(total, dtype=dtype)


@torch.library.custom_op("rtp::ring_release", mutates_args=())
def ring_release(after: torch.Tensor) -> None:
    """Graph op, after a unit's last hop (`after`: what it received): the pooled weight
    buffers are let go."""
    pool.release()


@ring_release.register_fake
def _(after):
    return None


@torch.library.custom_op("rtp::follow", mutates_args=("x",))
def follow(x: torch.Tensor, after: torch.Tensor) -> None:
    """Graph op: changes nothing, but counts as writing `x` once `after` exists, so whatever
    reads `x` later runs after what made `after`. A traced unit backward's dx follows its last
    hop this way, and so the next unit's hops follow it: every rank's compiled backward runs
    its hops in the one order the units' schedules give (a compiler ordering hops that no
    value links by the rank's shapes would order them differently on two ranks, each waiting
    for the other)."""


@follow.register_fake
def _(x, after):
    return None


def hop_start(
    tensors: list[torch.Tensor],
    group_name: str,
    shift: int,
    tag: int,
    where: str,
    pooled: bool = True,
    after: torch.Tensor | None = None,
) -> int | torch.Tensor:
    """`shift_start` as the caller runs: the graph op `ring_shift_start` in a graph being
    compiled (a backward the compiler traces; `after`: see the op), else the call itself (no
    dispatch)."""
    if torch.compiler.is_compiling():
        return torch.ops.rtp.ring_shift_start(tensors, group_name, shift, tag, where, pooled, after)
    return shift_start(tensors, group_name, shift, tag, where, pooled)


def hop_wait(hop: int | torch.Tensor, sent: list[torch.Tensor]) -> torch.Tensor:
    """`wait` for a `hop_start` handle (`sent`: what the hop sends, alive in a graph until the
    wait), the graph op `ring_wait` in a graph being compiled."""
    if torch.compiler.is_compiling():
        return torch.ops.rtp.ring_wait(hop, sent)
    return wait(int(hop))


def release_pool(after: torch.Tensor) -> None:
    """After a unit's last weight hop (`after`: what it received): the pool's buffers go, the
    graph op `ring_release` in a graph being compiled."""
    if torch.compiler.is_compiling():
        torch.ops.rtp.ring_release(after)
    else:
        pool.release()
