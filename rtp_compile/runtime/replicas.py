"""Data-parallel replicas of an RTP group: FSDP2's HSDP convention on a 2-D device mesh.

The mesh's last dim is the ring; its first dim holds replicas, ranks that own the same shards
and train on other batches. Once the ring has reduced a shard's gradient within its group, the
replicas all-reduce it, so every replica holds DDP's gradient over all ranks of the mesh (mean
by default: the ring divides by its size, this by the number of replicas).

As DDP's reducer does, the shards' gradients are packed into buckets of at most `BUCKET_BYTES`
in reverse parameter order (about the order backward produces them), and a bucket's all-reduce
starts from the parameters' post-accumulate-grad hooks as soon as its last gradient is in,
while backward goes on. Buckets start in one fixed order on every replica (bucket i only after
bucket i - 1), so the replicas' collectives match whatever order their gradients arrive in;
what no hook started (a parameter without a gradient, a copied module whose parameters lost
their hooks) starts at the end of backward.

The reduction is part of the module's gradient transaction (`runtime.transaction`): it begins
with the transaction, works on this backward's gradients only (the set-aside ones are added
after it) and writes `.grad` only once every bucket has arrived. A backward that raises, or a
reduction that fails, rolls back to the gradients before the backward: never half-reduced.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from rtp_compile.runtime import groups

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


class ReplicaGradReduction:
    """All-reduce of one rank module's shard gradients over its replica group.

    Invariant: between `begin` and `finish`/`abandon`, bucket i's all-reduce is started only
    after bucket i - 1's, and `.grad` is not written; after `finish`, each parameter's `.grad`
    is the (scaled) sum of the replicas' gradients of this backward, None where no replica
    produced one (as DDP with `find_unused_parameters` leaves a parameter no rank used)."""

    def __init__(self, params: list[torch.nn.Parameter], group_name: str, scale: float):
        self.group_name, self.scale = group_name, scale
        self.buckets = _buckets(list(reversed(params)), BUCKET_BYTES)
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.active = False
        self._reset()
        for p in params:
            p.register_post_accumulate_grad_hook(self._ready)

    def _reset(self) -> None:
        self.arrived = [0] * len(self.buckets)  # per bucket: gradients in
        self.started: list[tuple[dist.Work, torch.Tensor]] = []  # in bucket order

    def begin(self) -> None:
        """A backward starts (its transaction opened): hooks start buckets from now on."""
        self._reset()
        self.active = True

    def _ready(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: start every bucket that is complete and next in order."""
        if not self.active:
            return  # a backward of the shards outside the module's transaction
        self.arrived[self.bucket_of[id(param)]] += 1
        while len(self.started) < len(self.buckets) and self.arrived[len(self.started)] == len(
            self.buckets[len(self.started)]
        ):
            self._start(len(self.started))

    def _start(self, index: int) -> None:
        """All-reduce bucket `index`: its gradients flat (zeros where none), then one flag per
        parameter (1 where this rank has a gradient), so each rank learns who produced one."""
        bucket = self.buckets[index]
        parts = [
            p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in bucket
        ]
        parts.append(
            torch.tensor(
                [float(p.grad is not None) for p in bucket],
                dtype=bucket[0].dtype,
                device=bucket[0].device,
            )
        )
        flat = torch.cat(parts)
        work = dist.all_reduce(flat, group=groups.resolve_group(self.group_name), async_op=True)
        self.started.append((work, flat))

    def finish(self) -> None:
        """End of backward: start what no hook started, wait for every bucket, then write the
        reduced gradients into `.grad`."""
        self.active = False
        for index in range(len(self.started), len(self.buckets)):
            self._start(index)
        started, self.started = self.started, []
        timeout = groups.group_timeout(groups.resolve_group(self.group_name))
        for work, _ in started:
            try:
                work.wait(timeout)
            except RuntimeError as err:
                raise RuntimeError(
                    f"rtp_compile: rank {dist.get_rank()} timed out or failed in the gradient "
                    f"all-reduce over its replicas (timeout {timeout}). A replica probably "
                    f"failed, left, or runs a different program: {err}"
                ) from err
        for bucket, (_, flat) in zip(self.buckets, started):
            flags = flat[-len(bucket) :].tolist()
            offset = 0
            for p, flag in zip(bucket, flags):
                reduced = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                if flag == 0:
                    continue  # no replica produced a gradient: it stays None
                if self.scale != 1:
                    reduced.mul_(self.scale)
                if p.grad is None:
                    p.grad = reduced.clone()
                else:
                    p.grad.copy_(reduced)

    def abandon(self) -> None:
        """The backward failed: wait out the all-reduces already started (the replicas that
        failed alike started the same ones; where one is gone, waiting fails too and the first
        error is the one raised) and drop them."""
        self.active = False
        started, self.started = self.started, []
        for work, _ in started:
            with contextlib.suppress(Exception):
                work.wait()
        self._reset()


def _buckets(params: list[torch.nn.Parameter], cap: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters of one dtype and device, at most `cap` bytes a bucket (a larger
    parameter alone)."""
    buckets: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        last = buckets[-1] if buckets else None
        if (
            last is None
            or (last[0].dtype, last[0].device) != (p.dtype, p.device)
            or size + nbytes > cap
        ):
            buckets.append([p])
            size = nbytes
        else:
            last.append(p)
            size += nbytes
    return buckets
