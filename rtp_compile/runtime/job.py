"""The job a rank module was emitted for: the check that runs first in every forward
(`JobCheck`, `check_job`), the buffers broadcast from rank 0 (`BufferBroadcast`), and
`job_of(gm)`, the job a module keeps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rtp_compile.runtime.groups import broadcast, recover, resolve_group
from rtp_compile.runtime.registry import Keyed, effectful, graph_op, lookup
from rtp_compile.runtime.ring import finish_leftover_hops


class JobCheck(Keyed):
    """First op of every rank's module: the job must match the program before any
    communication. Also where the module's job is kept (`job_of`): its ring (world
    size, rank, group name) and, on a 2-D mesh, its place among the data-parallel replicas
    (`replica` of `replicas`, their group `replica_group_name`; 0 of 1 and None without).
    Ranks with the same `rank` hold the same shards; one replica, e.g. `replica == 0`, is
    enough to save them."""

    def __init__(
        self,
        world_size: int,
        rank: int,
        group_name: str,
        replica: int = 0,
        replicas: int = 1,
        replica_group_name: str | None = None,
    ):
        super().__init__()
        self.world_size, self.rank, self.group_name = world_size, rank, group_name
        self.replica, self.replicas = replica, replicas
        self.replica_group_name = replica_group_name
        self.register("job")

    def extra_repr(self) -> str:
        ring = f"rank {self.rank} of {self.world_size}, group {self.group_name or 'WORLD'!r}"
        if self.replica_group_name is None:
            return ring
        return (
            f"{ring}; replica {self.replica} of {self.replicas}, group {self.replica_group_name!r}"
        )

    def forward(self) -> torch.Tensor:
        return check_job(self.rtp_key)

    def check(self) -> None:
        finish_leftover_hops()  # of a step before that raised after starting a hop
        if (
            self.world_size == 1
            and self.replica_group_name is None
            and not (dist.is_available() and dist.is_initialized())
        ):
            return  # a one-rank program needs no process group
        group = resolve_group(self.group_name)
        if self.world_size > 1:
            recover(self.group_name)  # a ring a failed step broke
        size, actual = dist.get_world_size(group), dist.get_rank(group)
        if size != self.world_size:
            raise RuntimeError(
                f"rtp_compile: this module was compiled for world_size={self.world_size} but the "
                f"process group has {size} ranks. Transform with world_size={size}, or run in a "
                f"job of {self.world_size} processes."
            )
        if actual != self.rank:
            raise RuntimeError(
                f"rtp_compile: this is the module of rank {self.rank}, but it runs on rank "
                f"{actual} of the process group. Use prog.module(torch.distributed.get_rank()) "
                "on every rank."
            )
        if self.replica_group_name is not None:
            replicas = resolve_group(self.replica_group_name)
            if (dist.get_world_size(replicas), dist.get_rank(replicas)) != (
                self.replicas,
                self.replica,
            ):
                raise RuntimeError(
                    f"rtp_compile: this is the module of replica {self.replica} of "
                    f"{self.replicas}, but it runs as replica {dist.get_rank(replicas)} of "
                    f"{dist.get_world_size(replicas)}. Use prog.module(mesh=mesh) on every rank."
                )


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
