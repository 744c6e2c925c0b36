"""`rtp::unshard`: the full weight from this rank's shard, how a model sharded in place by
`rtp_compile.shard` reads its parameters (SimpleFSDP's pattern).

Run eagerly it is an all-gather over the ring's group (backward: the gradient summed over the
ranks, this rank's slice kept, scaled by `grad_scale`: 1/N for DDP's mean). Traced by dynamo it
is one node with the full shape (its fake implementation); the compile backend replaces it by a
read of the parameter, which the rank program rotates: nothing is gathered there.
Arguments: the shard, the full `shape`, the shard `dim` (-1: the flattened parameter is cut),
the ring's `group_name` ('' for the whole job) and `grad_scale`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from rtp_compile.runtime.groups import resolve_group


def _gathered(shard: torch.Tensor, group_name: str) -> list[torch.Tensor]:
    if not dist.is_initialized():
        return [shard]
    group = resolve_group(group_name)
    shards = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, shard.contiguous(), group=group)
    return shards


@torch.library.custom_op("rtp::unshard", mutates_args=())
def unshard(
    shard: torch.Tensor, shape: list[int], dim: int, group_name: str, grad_scale: float
) -> torch.Tensor:
    d = max(dim, 0)  # -1: the flattened parameter, cut along its only dim
    full = torch.cat(_gathered(shard, group_name), d)
    full = full.narrow(d, 0, shape[d] if dim >= 0 else math.prod(shape))
    return full.reshape(shape).contiguous()


@unshard.register_fake
def _(shard, shape, dim, group_name, grad_scale):
    return shard.new_empty(shape)


def _backward(ctx, grad: torch.Tensor):
    """The full gradient summed over the ranks, this rank's shard of it (zero padding)."""
    shard_shape, dim, group_name, scale = ctx.shard_shape, ctx.dim, ctx.group_name, ctx.scale
    d = max(dim, 0)
    flat = grad.reshape(-1) if dim < 0 else grad
    n = dist.get_world_size(resolve_group(group_name)) if dist.is_initialized() else 1
    length = shard_shape[d]
    padded = flat.new_zeros(flat.shape[:d] + (length * n,) + flat.shape[d + 1 :])
    padded.narrow(d, 0, flat.shape[d]).copy_(flat)
    if n > 1:
        dist.all_reduce(padded, group=resolve_group(group_name))
    rank = dist.get_rank(resolve_group(group_name)) if n > 1 else 0
    return padded.narrow(d, rank * length, length) * scale, None, None, None, None


def _setup(ctx, inputs, output):
    shard, _, dim, group_name, grad_scale = inputs
    ctx.shard_shape, ctx.dim, ctx.group_name, ctx.scale = (
        tuple(shard.shape),
        dim,
        group_name,
        grad_scale,
    )


unshard.register_autograd(_backward, setup_context=_setup)


def is_unshard(target) -> bool:
    """Whether an fx node's target is this op (dynamo records its default overload)."""
    return target is torch.ops.rtp.unshard.default
