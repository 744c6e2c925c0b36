"""`SmallParamsGather`: the small parameters (norm affines, layer scales) gathered whole
once per step, all in one message per hop, and their gradients reduce-scattered back."""

from __future__ import annotations

import torch

from rtp_compile.runtime import transaction
from rtp_compile.runtime.collectives import ring_all_gather, ring_reduce_scatter
from rtp_compile.runtime.events import UnitSchedule
from rtp_compile.runtime.precision import Precision
from rtp_compile.runtime.registry import Keyed, distinct, graph_op, lookup


class _SmallGather(torch.autograd.Function):
    """The small parameters in autograd: forward `rtp::small_gather`, backward
    `rtp::small_reduce_scatter` of the summed gradients of every use."""

    @staticmethod
    def forward(ctx, key, *own):
        ctx.key = key
        return tuple(small_gather(key, list(own)))

    @staticmethod
    def backward(ctx, *full_grads):
        grads = small_reduce_scatter(ctx.key, list(full_grads))
        return (None, *[g if need else None for g, need in zip(grads, ctx.needs_input_grad[1:])])


class SmallParamsGather(Keyed):
    """Runtime of the small parameters gathered once per step: their shards all-gathered in one
    message per hop, the full tensors handed to the ops that read them; backward, once autograd
    has summed every use's gradient, one reduce-scatter of all of them."""

    def __init__(
        self,
        names,
        layouts,
        rank,
        world_size,
        group_name,
        schedule: UnitSchedule,
        grad_scale,
        precision: Precision,
    ):
        super().__init__()
        self.names, self.layouts, self.rank, self.world_size = (
            list(names),
            layouts,
            rank,
            world_size,
        )
        self.group_name, self.schedule, self.grad_scale = group_name, schedule, grad_scale
        self.precision = precision
        self.register("small_params")

    def extra_repr(self) -> str:
        return (
            f"gathered once per step: {', '.join(self.names)}; rank {self.rank} of "
            f"{self.world_size}"
        )

    def gather(self, own):
        """`rtp::small_gather`: the full small parameters."""
        return distinct(
            ring_all_gather(
                self.precision.to_compute(own),
                self.layouts,
                self.rank,
                self.world_size,
                self.group_name,
                self.schedule.forward_tag,
                "small parameters",
            ),
            own,
        )

    @transaction.transactional
    def reduce_scatter(self, full_grads):
        """`rtp::small_reduce_scatter`: this rank's shards of the summed full gradients."""
        shards = ring_reduce_scatter(
            full_grads,
            self.layouts,
            self.rank,
            self.world_size,
            self.group_name,
            self.schedule.grad_tag,
            "small parameters",
            self.grad_scale,
            self.precision.reduce(self.layouts[0].dtype),
        )
        # each gradient its own tensor: as views of the one accumulator message, any one of
        # them would keep all of it alive (and MemTracker counts it so)
        return [g.clone() if g._base is not None else g for g in shards]

    def forward(self, *own):
        if not torch.is_grad_enabled():
            return tuple(small_gather(self.rtp_key, list(own)))
        return _SmallGather.apply(self.rtp_key, *own)


@graph_op("small_gather")
def small_gather(key: str, own: list[torch.Tensor]) -> list[torch.Tensor]:
    """Graph op: the small parameters of `SmallParamsGather` `key`, all-gathered."""
    return lookup(key).gather(own)


@small_gather.op.register_fake
def _(key, own):
    runtime = lookup(key)
    return [
        o.new_empty(lay.shape, dtype=runtime.precision.compute(lay.dtype))
        for o, lay in zip(own, runtime.layouts)
    ]


@graph_op("small_reduce_scatter")
def small_reduce_scatter(key: str, full_grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Graph op: the small parameters' full gradients reduce-scattered into this rank's shards'."""
    return lookup(key).reduce_scatter(full_grads)


@small_reduce_scatter.op.register_fake
def _(key, full_grads):
    return [
        g.new_empty(lay.shard_shape, dtype=lay.dtype)
        for g, lay in zip(full_grads, lookup(key).layouts)
    ]
