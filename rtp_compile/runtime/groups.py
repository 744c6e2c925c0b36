"""The process groups the ring runs on: a group by name, its timeout, each rank's peers, and
the broken-ring recovery (`mark_broken`, `recover`), plus the collectives over a whole group
(`all_gather`, `broadcast`).

A ring whose hop failed (a peer that timed out, died or raised alone) cannot go on over the
same connections: gloo closes a pair whose wait timed out, and the hops a failed step left
posted would match the next step's. Such a ring is *broken* (`mark_broken`: a failed hop, and
any forward or backward of the rank module that raised, since the peers may be left waiting).
The next forward of the rank's module re-forms it (`recover`): every rank of the group meets
in the job's store, then talks over a new communicator of its own, so nothing of the failed
step can match; what the failed step left in flight is abandoned, never waited for.
"""

from __future__ import annotations

import datetime
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def resolve_group(group_name: str):
    """The process group named `group_name` ('' is the default group); a clear error without one."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "rtp_compile: this rank's module communicates but no torch.distributed process group "
            "is initialised. Start the job with torchrun or rtp_compile.launch(), or call "
            "torch.distributed.init_process_group() before running it."
        )
    if group_name == "":
        return dist.group.WORLD
    # the private function's stub wants a GroupName, a NewType of the str it is
    return dist.distributed_c10d._resolve_process_group(group_name)  # type: ignore[arg-type]


def group_timeout(group) -> datetime.timedelta:
    """The timeout the process group was created with (every wait here honours it)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # backends without options (or without a CPU backend) keep torch's default
        try:
            device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
            return group._get_backend(device).options._timeout
        except Exception:
            return DEFAULT_TIMEOUT


@dataclass(frozen=True)
class Peers:
    """Who a rank sends to and receives from for one shift in one process group (held weakly:
    a destroyed group must not live on in this cache until the interpreter's teardown, where
    its backend's threads would be torn down too late). After a recovery the hops go over the
    ring's own communicator `comm`, to and from the group ranks `dst_in_group`/`src_in_group`."""

    group_ref: weakref.ref
    dst: int  # global rank of (r + shift) in the group
    src: int  # global rank of (r - shift)
    timeout: datetime.timedelta
    comm: Any = None  # the ring's communicator once re-formed (None: the group's)
    dst_in_group: int = 0
    src_in_group: int = 0
    # gloo (and the fake backend) post each send and receive on its own anyway: the hop calls
    # the group's send/recv directly, without batch_isend_irecv's Python (a tenth of a hop)
    direct: bool = False

    @property
    def group(self):
        return self.group_ref()


_peers: dict[tuple[str, int], Peers] = {}


def peers(group_name: str, shift: int) -> Peers:
    """The peers of a shift, looked up once per group: a job that destroys and re-creates its
    process group gets a new group object, and with it new peers and timeout; a re-formed ring
    its new communicator."""
    group = resolve_group(group_name)
    comm = communicator(group_name)
    known = _peers.get((group_name, shift))
    if known is None or known.group is not group or known.comm is not comm:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        dst, src = (rank + shift) % size, (rank - shift) % size
        known = _peers[(group_name, shift)] = Peers(
            weakref.ref(group),
            dist.get_global_rank(group, dst),
            dist.get_global_rank(group, src),
            group_timeout(group),
            comm,
            dst,
            src,
            str(dist.get_backend(group)) in ("gloo", "fake"),
        )
    return known


@dataclass
class RingState:
    """What a process knows of one group's ring beyond its peers: whether a failure broke it
    (`broken`: why), how often it was re-formed (`epoch`), its own communicator since then, and
    what failed steps left in flight (kept alive, never waited for: a late message must not
    land in freed memory); `open_transactions`: the gradient transactions of backwards that
    run on it now (a failed hop rolls them back, `runtime.transaction`)."""

    epoch: int = 0
    broken: str | None = None
    comm: Any = None  # a gloo ProcessGroup of its own once re-formed
    abandoned: list = field(default_factory=list)
    open_transactions: list = field(default_factory=list)


_rings: dict[str, RingState] = {}


def ring_state(group_name: str) -> RingState:
    return _rings.setdefault(group_name, RingState())


def communicator(group_name: str):
    """The ring's own communicator once a recovery re-formed it; None: it talks over its group."""
    state = _rings.get(group_name)
    return None if state is None else state.comm


def recover(group_name: str) -> None:
    """Re-form a broken ring: every rank of the group meets in the job's store (each arrives
    at its next forward after the failure, so the meeting waits up to three group timeouts),
    then the ring talks over a new gloo communicator of its own. A ring that is not broken is
    left as it is. Raises, naming what broke the ring, where it cannot be re-formed."""
    state = ring_state(group_name)
    if state.broken is None:
        return
    group = resolve_group(group_name)
    backend = str(dist.get_backend(group))
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if backend != "gloo":
        raise RuntimeError(
            f"rtp_compile: the ring of rank {rank} broke ({state.broken}) and a {backend} ring "
            "cannot be re-formed in the same process. Restart the job (torchrun "
            "--max-restarts) from the last rtp_compile.checkpoint."
        )
    timeout = group_timeout(group)
    epoch = state.epoch + 1
    store = dist.PrefixStore(
        f"rtp_compile/ring/{group_name or 'WORLD'}/epoch{epoch}/",
        dist.distributed_c10d._get_default_store(),
    )
    try:
        if store.add("arrived", 1) == size:
            store.set("all", "1")
        store.wait(["all"], 3 * timeout)
        comm = dist.ProcessGroupGloo(store, rank, size, timeout)
    except RuntimeError as err:
        raise RuntimeError(
            f"rtp_compile: rank {rank} could not re-form its ring with the {size - 1} other "
            f"ranks of its group within {3 * timeout} after it broke ({state.broken}): a "
            f"peer probably died. Restart the job from the last checkpoint. ({err})"
        ) from err
    if state.comm is not None:
        state.abandoned.append(state.comm)  # its pairs may still hold what a step left
    state.comm, state.epoch, state.broken = comm, epoch, None


def all_gather(out: list[torch.Tensor], tensor: torch.Tensor, group_name: str) -> None:
    """`dist.all_gather` over the ring's connections (its own communicator once re-formed)."""
    comm = communicator(group_name)
    if comm is None:
        dist.all_gather(out, tensor, group=resolve_group(group_name))
    else:
        comm.allgather([out], [tensor]).wait()


def broadcast(flat: torch.Tensor, group_name: str) -> None:
    """Broadcast `flat` from the group's first rank over the ring's connections (its own
    communicator once re-formed)."""
    comm = communicator(group_name)
    if comm is None:
        group = resolve_group(group_name)
        dist.broadcast(flat, dist.get_global_rank(group, 0), group=group)
        return
    options = dist.BroadcastOptions()
    options.rootRank = 0
    comm.broadcast([flat], options).wait()
