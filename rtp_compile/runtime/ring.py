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

A ring whose hop failed (a peer that timed out, died or raised alone) cannot go on over the
same connections: gloo closes a pair whose wait timed out, and the hops a failed step left
posted would match the next step's. Such a ring is *broken* (`mark_broken`: a failed hop, and
any forward or backward of the rank module that raised, since the peers may be left waiting).
The next forward of the rank's module re-forms it (`recover`): every rank of the group meets
in the job's store, then talks over a new communicator of its own, so nothing of the failed
step can match; what the failed step left in flight is abandoned, never waited for.
"""
from __future__ import annotations

import contextlib
import datetime
import itertools
import math
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rtp_compile.runtime.registry import Keyed, effectful, graph_op, lookup

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


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
    return dist.distributed_c10d._resolve_process_group(group_name)


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
    dst: int                    # global rank of (r + shift) in the group
    src: int                    # global rank of (r - shift)
    timeout: datetime.timedelta
    comm: object = None         # the ring's communicator once re-formed (None: the group's)
    dst_in_group: int = 0
    src_in_group: int = 0

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
            weakref.ref(group), dist.get_global_rank(group, dst),
            dist.get_global_rank(group, src), group_timeout(group), comm, dst, src)
    return known


@dataclass
class RingState:
    """What a process knows of one group's ring beyond its peers: whether a failure broke it
    (`broken`: why), how often it was re-formed (`epoch`), its own communicator since then, and
    what failed steps left in flight (kept alive, never waited for: a late message must not
    land in freed memory)."""
    epoch: int = 0
    broken: str | None = None
    comm: object = None
    abandoned: list = field(default_factory=list)


_rings: dict[str, RingState] = {}


def ring_state(group_name: str) -> RingState:
    return _rings.setdefault(group_name, RingState())


def communicator(group_name: str):
    """The ring's own communicator once a recovery re-formed it; None: it talks over its group."""
    state = _rings.get(group_name)
    return None if state is None else state.comm


def mark_broken(group_name: str, why: str) -> None:
    """The ring of `group_name` must be re-formed before its next hop: a hop failed, or this
    rank's step raised while its peers may be waiting on it. What is in flight is abandoned."""
    state = ring_state(group_name)
    state.broken = state.broken or why
    for key in [k for k, p in _pending.items() if p.group_name == group_name]:
        state.abandoned.append(_pending.pop(key))


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
            "--max-restarts) from the last rtp_compile.checkpoint.")
    timeout = group_timeout(group)
    epoch = state.epoch + 1
    store = dist.PrefixStore(f"rtp_compile/ring/{group_name or 'WORLD'}/epoch{epoch}/",
                             dist.distributed_c10d._get_default_store())
    try:
        if store.add("arrived", 1) == size:
            store.set("all", "1")
        store.wait(["all"], 3 * timeout)
        comm = dist.ProcessGroupGloo(store, rank, size, timeout)
    except RuntimeError as err:
        raise RuntimeError(
            f"rtp_compile: rank {rank} could not re-form its ring with the {size - 1} other "
            f"ranks of its group within {3 * timeout} after it broke ({state.broken}): a "
            f"peer probably died. Restart the job from the last checkpoint. ({err})") from err
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


def flat_layout(specs: list[tuple[tuple[int, ...], torch.dtype]]):
    """Where each (shape, dtype) sits in one flat message: (flat dtype, total length, offsets).
    One dtype: a flat tensor of it. Mixed dtypes: bytes, each tensor 16-byte aligned."""
    dtypes = {dtype for _, dtype in specs}
    if len(dtypes) == 1:
        sizes = [math.prod(shape) for shape, _ in specs]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        return dtypes.pop(), sum(sizes), offsets
    offsets, end = [], 0
    for shape, dtype in specs:
        end = -(-end // 16) * 16
        offsets.append(end)
        end += math.prod(shape) * dtype.itemsize
    return torch.uint8, end, offsets


def unpack(flat: torch.Tensor, specs) -> list[torch.Tensor]:
    """Views of a flat message shaped and typed like `specs` [(shape, dtype)] (`flat` may be an
    fx Proxy: everything but the tensor ops is computed from `specs`)."""
    flat_dtype, _, offsets = flat_layout(specs)
    views = []
    for (shape, dtype), offset in zip(specs, offsets):
        if flat_dtype == dtype:
            views.append(flat.narrow(0, offset, math.prod(shape)).view(shape))
        else:
            nbytes = math.prod(shape) * dtype.itemsize
            views.append(flat.narrow(0, offset, nbytes).view(dtype).view(shape))
    return views


def specs_of(tensors: list[torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(t.shape), t.dtype) for t in tensors]


class BufferPool:
    """Flat weight messages reused across the hops of a unit instead of one allocation per hop.

    A buffer is handed out again only when nothing but the pool refers to its storage (no view
    of it alive, no hop still sending it): each hop receives into the buffer the hop before
    last arrived in, so a unit's N - 1 hops use two buffers. A unit lets the pool go after its
    last hop, so no idle buffer waits through the last step's compute or between units (a
    pool kept across units would hold two of the largest unit's messages through the whole
    pass: +3% peak on the memory benchmark at N=2; the device's caching allocator reuses
    memory across units without that). A request no free buffer matches drops the free ones."""

    def __init__(self):
        self.buffers: list[torch.Tensor] = []

    @staticmethod
    def _unused(buffer: torch.Tensor) -> bool:
        storage = buffer.untyped_storage()  # this wrapper and `buffer` hold the only references
        return torch._C._storage_Use_Count(storage._cdata) <= 2

    def take(self, numel: int, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
        """A flat `dtype` tensor of `numel` elements on `like`'s device (contents undefined)."""
        free = [b for b in self.buffers if self._unused(b)]
        match = [b for b in free if (b.numel(), b.dtype, b.device) == (numel, dtype, like.device)]
        if not match:
            self.buffers = [b for b in self.buffers if not any(b is f for f in free)]
            match = [torch.empty(numel, dtype=dtype, device=like.device)]
            self.buffers.append(match[0])
        return match[0].view(-1)  # a view: while it lives, the storage counts as in use

    def release(self) -> None:
        self.buffers = []


pool = BufferPool()


def pack(tensors: list[torch.Tensor], pooled: bool = False) -> torch.Tensor:
    """One flat message holding `tensors`: no copy when they already lie in one buffer the way
    `unpack` lays them out (what arrived by the ring is passed on as it is); else a copy, into
    a buffer of the pool if `pooled`."""
    specs = specs_of(tensors)
    dtype, total, offsets = flat_layout(specs)
    item = dtype.itemsize
    storage, start = tensors[0].untyped_storage(), tensors[0].data_ptr()
    in_place = (start - storage.data_ptr()) % item == 0 and \
        start - storage.data_ptr() + total * item <= storage.nbytes() and \
        all(t.is_contiguous() and t.untyped_storage().data_ptr() == storage.data_ptr()
            and t.data_ptr() == start + offset * item for t, offset in zip(tensors, offsets))
    if in_place:
        return tensors[0].new_empty(0, dtype=dtype).set_(
            storage, (start - storage.data_ptr()) // item, (total,))
    flat = pool.take(total, dtype, tensors[0]) if pooled else tensors[0].new_empty(total, dtype=dtype)
    for view, t in zip(unpack(flat, specs), tensors):
        view.copy_(t)
    return flat


def labelled(what: str):
    """A `torch.profiler` label ("rtp.send ...", "rtp.wait ...") while a profiler records,
    else nothing (so an unprofiled hop pays no label)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(what)
    return contextlib.nullcontext()


def shift_start(tensors: list[torch.Tensor], group_name: str, shift: int, tag: int,
                where: str, pooled: bool = True) -> int:
    """Start sending `tensors` to rank r+shift and receiving their successors from r-shift, as
    one flat message; returns the hop's handle, which `wait` turns into the received message
    (see `unpack`). Weights travel in pooled buffers; gradient accumulators (`pooled=False`) in
    their own, since the last one becomes the parameters' gradients."""
    ring = peers(group_name, shift)
    with labelled(f"rtp.send {where}"):
        outgoing = pack(tensors, pooled)
        received = pool.take(outgoing.numel(), outgoing.dtype, outgoing) if pooled else \
            torch.empty_like(outgoing)
        if ring.comm is None:
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, outgoing, ring.dst, ring.group, tag),
                dist.P2POp(dist.irecv, received, ring.src, ring.group, tag)])
        else:
            works = [ring.comm.send([outgoing], ring.dst_in_group, tag),
                     ring.comm.recv([received], ring.src_in_group, tag)]
    traffic["hops"] += 1
    traffic["bytes"] += outgoing.numel() * outgoing.element_size()
    hop = next(_handles)
    _pending[hop] = _PendingShift(works, [outgoing, received], ring.timeout, where,
                                  (ring.dst, ring.src), group_name)
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
        for work, doing in zip(pending.works, (f"sending to rank {dst}",
                                               f"receiving from rank {src}")):
            try:
                work.wait(timeout)
            except RuntimeError as err:
                ring_state(pending.group_name).abandoned.append(pending)
                mark_broken(pending.group_name, f"a hop of {pending.where} failed")
                raise RuntimeError(
                    f"rtp_compile: rank {dist.get_rank()} timed out or failed in the ring "
                    f"during {pending.where}, {doing} (timeout {timeout}). Rank {src} or "
                    f"{dst} probably failed, left, or runs a different program: {err}") from err
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
def ring_shift_start(tensors: list[torch.Tensor], group_name: str, shift: int, tag: int,
                     where: str) -> torch.Tensor:
    """Graph op: start one ring hop of `tensors`; returns its handle for `ring_wait`."""
    return torch.tensor(shift_start(tensors, group_name, shift, tag, where))


@ring_shift_start.register_fake
def _(tensors, group_name, shift, tag, where):
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


class JobCheck(Keyed):
    """First op of every rank's module: the job must match the program before any
    communication. Also where the module's job is kept (`job_of`): its ring (world
    size, rank, group name) and, on a 2-D mesh, its place among the data-parallel replicas
    (`replica` of `replicas`, their group `replica_group_name`; 0 of 1 and None without).
    Ranks with the same `rank` hold the same shards; one replica, e.g. `replica == 0`, is
    enough to save them."""

    def __init__(self, world_size: int, rank: int, group_name: str, replica: int = 0,
                 replicas: int = 1, replica_group_name: str | None = None):
        super().__init__()
        self.world_size, self.rank, self.group_name = world_size, rank, group_name
        self.replica, self.replicas = replica, replicas
        self.replica_group_name = replica_group_name
        self.register("job")

    def extra_repr(self) -> str:
        ring = f"rank {self.rank} of {self.world_size}, group {self.group_name or 'WORLD'!r}"
        if self.replica_group_name is None:
            return ring
        return f"{ring}; replica {self.replica} of {self.replicas}, group " \
               f"{self.replica_group_name!r}"

    def forward(self) -> torch.Tensor:
        return check_job(self.rtp_key)

    def check(self) -> None:
        finish_leftover_hops()  # of a step before that raised after starting a hop
        if self.world_size == 1 and self.replica_group_name is None and \
                not (dist.is_available() and dist.is_initialized()):
            return  # a one-rank program needs no process group
        group = resolve_group(self.group_name)
        if self.world_size > 1:
            recover(self.group_name)  # a ring a failed step broke
        size, actual = dist.get_world_size(group), dist.get_rank(group)
        if size != self.world_size:
            raise RuntimeError(
                f"rtp_compile: this module was compiled for world_size={self.world_size} but the "
                f"process group has {size} ranks. Transform with world_size={size}, or run in a "
                f"job of {self.world_size} processes.")
        if actual != self.rank:
            raise RuntimeError(
                f"rtp_compile: this is the module of rank {self.rank}, but it runs on rank "
                f"{actual} of the process group. Use prog.module(torch.distributed.get_rank()) "
                "on every rank.")
        if self.replica_group_name is not None:
            replicas = resolve_group(self.replica_group_name)
            if (dist.get_world_size(replicas), dist.get_rank(replicas)) != \
                    (self.replicas, self.replica):
                raise RuntimeError(
                    f"rtp_compile: this is the module of replica {self.replica} of "
                    f"{self.replicas}, but it runs as replica {dist.get_rank(replicas)} of "
                    f"{dist.get_world_size(replicas)}. Use prog.module(mesh=mesh) on every rank.")


class BufferBroadcast(Keyed):
    """DDP's `broadcast_buffers`: before each forward every rank takes the buffers (BatchNorm
    statistics, rotary caches, position ids) of the first rank, one broadcast per dtype and
    group. `group_names`: the ring's group, then on a 2-D mesh the replicas': every ring takes
    its first rank's buffers, then every replica the first replica's, so all end with the
    mesh's first rank's."""

    def __init__(self, group_names: tuple[str, ...]):
        super().__init__()
        self.group_names = group_names
        self.register("buffers")

    def forward(self, *buffers: torch.Tensor) -> None:
        if buffers:
            broadcast_buffers(self.rtp_key, list(buffers))

    def copy_first_ranks(self, buffers: list[torch.Tensor]) -> None:
        """`rtp::broadcast_buffers`: the first rank's values into `buffers`."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in buffers:
            by_dtype.setdefault(b.dtype, []).append(b)
        for name in self.group_names:
            if dist.get_world_size(resolve_group(name)) == 1:
                continue
            with torch.no_grad():
                for same in by_dtype.values():
                    flat = torch._utils._flatten_dense_tensors(same)
                    broadcast(flat, name)
                    for b, value in zip(same, torch._utils._unflatten_dense_tensors(flat, same)):
                        b.copy_(value)


@graph_op("check_job")
def check_job(key: str) -> torch.Tensor:
    """Graph op, first in every rank's module: its `JobCheck` (registered under `key`). It
    returns an empty ticket because inductor (2.13, layout optimisation: a conv's weight
    converted to channels-last) frees graph inputs before a kernel it moves past an effectful
    op that neither takes nor returns a tensor (UnboundLocalError in the generated code)."""
    lookup(key).check()
    return torch.empty(0)


@check_job.op.register_fake
def _(key):
    return torch.empty(0)


@graph_op("broadcast_buffers", mutates_args=("buffers",))
def broadcast_buffers(key: str, buffers: list[torch.Tensor]) -> None:
    """Graph op: the first rank's `buffers`, by the `BufferBroadcast` registered under `key`."""
    lookup(key).copy_first_ranks(buffers)


@broadcast_buffers.op.register_fake
def _(key, buffers):
    return None


effectful(torch.ops.rtp.ring_shift_start, torch.ops.rtp.ring_wait, torch.ops.rtp.ring_release)


def job_of(gm: torch.nn.Module) -> JobCheck:
    """The job an emitted module was built for: world size, rank and group name of its ring;
    `replica`, `replicas` and `replica_group_name` of its data-parallel replicas (a 2-D mesh;
    0, 1 and None without)."""
    job = getattr(gm, "rtp_job", None)
    if not isinstance(job, JobCheck):
        raise ValueError("rtp_compile: this module was not emitted by RTPProgram.module(rank)")
    return job

