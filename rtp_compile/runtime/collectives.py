"""The ring collectives the runtimes share: all-gather and reduce-scatter of a list of
shards around the ring, and the gradient accumulator that travels with each shard
(`GradientRing`)."""

from __future__ import annotations

import torch

from rtp_compile.core.layout import real_part
from rtp_compile.runtime import packing, ring
from rtp_compile.runtime.events import backward_shard


class GradientRing:
    """Ring reduce-scatter driven step by step: at step j a rank adds its gradient for shard
    (rank+1+j) mod N, in place, to the accumulator that arrived from rank+1, and passes it on to
    rank-1; after the last step each rank holds the complete gradient of its own shard. The
    accumulators are `dtype` (mixed precision: the reduce dtype) on `like`'s device."""

    def __init__(
        self, layouts, group_name: str, where: str, like: torch.Tensor, dtype: torch.dtype
    ):
        self.layouts, self.group_name, self.where = layouts, group_name, where
        self.like, self.dtype = like, dtype
        self.acc: list[torch.Tensor] | None = None
        self.sent: list[torch.Tensor] = []  # what the last hop sends
        self.incoming: int | torch.Tensor | None = None  # the hop bringing the next accumulator

    def receive(self) -> None:
        specs = [(lay.shard_shape, self.dtype) for lay in self.layouts]
        if self.incoming is None:  # one flat buffer: each hop passes it on without packing
            dtype, total, _ = packing.flat_layout(specs)
            self.acc = packing.unpack(self.like.new_zeros(total, dtype=dtype), specs)
        else:
            self.acc = packing.unpack(ring.hop_wait(self.incoming, self.sent), specs)
            self.incoming, self.sent = None, []  # sent: let it go

    def real_parts(self, shard: int) -> list[torch.Tensor]:
        assert self.acc is not None, "no accumulator received"
        return [
            real_part(a, lay.dim or 0, lay.slot(shard)) for a, lay in zip(self.acc, self.layouts)
        ]

    def pass_on(self, step: int, tag: int) -> None:
        assert self.acc is not None, "no accumulator to pass on"
        self.incoming = ring.hop_start(
            self.acc, self.group_name, -1, tag, f"{self.where}: gradient hop {step}", pooled=False
        )
        self.sent, self.acc = self.acc, None

    def result(self, scale: float) -> list[torch.Tensor]:
        """The own shards' gradients, scaled, in the shards' dtype, each a tensor of its own:
        the accumulators are views of one message, and a view autograd keeps as `.grad` would
        hold the whole message alive (as `BucketState.reduce_scatter` copies too)."""
        assert self.acc is not None, "no accumulator received"
        return [torch.mul(a, scale).to(lay.dtype) for a, lay in zip(self.acc, self.layouts)]


def ring_all_gather(
    own: list[torch.Tensor],
    layouts,
    rank: int,
    world_size: int,
    group_name: str,
    tag: int,
    where: str,
) -> list[torch.Tensor]:
    """Full parameters from every rank's shard, by N-1 clockwise hops."""
    shards = {rank: own}
    held = own
    for k in range(1, world_size):
        hop = ring.shift_start(held, group_name, 1, tag, f"{where}: gather hop {k}")
        held = shards[(rank - k) % world_size] = packing.unpack(
            ring.wait(hop), packing.specs_of(own)
        )
    packing.pool.release()
    return [lay.unshard([shards[s][i] for s in range(world_size)]) for i, lay in enumerate(layouts)]


def ring_reduce_scatter(
    full_grads: list[torch.Tensor],
    layouts,
    rank: int,
    world_size: int,
    group_name: str,
    tag: int,
    where: str,
    scale: float,
    dtype: torch.dtype,
):
    """Each rank's shard of the sum over ranks of `full_grads` (times `scale`), by N-1
    counter-clockwise hops of one accumulator message in `dtype`, in the shards' dtype."""
    grads = GradientRing(layouts, group_name, f"{where} backward", full_grads[0], dtype)
    for j in range(world_size):
        s = backward_shard(rank, j, world_size)
        grads.receive()
        for part, g, lay in zip(grads.real_parts(s), full_grads, layouts):
            part.add_(lay.real_part_of(g, s))
        if j < world_size - 1:
            grads.pass_on(j, tag)
    return grads.result(scale)
