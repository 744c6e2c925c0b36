"""The runtime of a bucket: consecutive units whose shards travel in one message per step.

Forward, the emitted graph runs the hops within the bucket's first unit and keeps what arrived
for the later ones. `BucketRuntime` is what the bucket's parameters pass through before its
units read them: each forward makes a `BucketState`, which the units' autograd takes along.
Backward, whichever unit of the bucket runs first drives the weight fetches (one message per
step for all of them, kept until every unit of the bucket is done: the bucket held gathered),
each unit adds its gradient of every shard into the bucket's gradient rows (one flat message
per shard), and once autograd has run every unit, the parameters' pass-through reduce-scatters
the rows around the ring, one message per hop, into each rank's own shards' gradients.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from rtp_compile.layout import real_part
from rtp_compile.runtime import ring, transaction
from rtp_compile.runtime.events import UnitSchedule, backward_shard
from rtp_compile.runtime.precision import Precision


class BucketState:
    """One forward of a bucket: its units' own shards, what backward fetched, its gradient
    rows (shard -> flat message of every unit's gradient of that shard)."""

    def __init__(self, runtime: "BucketRuntime", own: list[torch.Tensor]):
        self.runtime, self.master = runtime, own
        self.incoming: dict[int, torch.Tensor] = {}
        self.fetched: dict[int, list[torch.Tensor]] = {}
        self.rows: list[torch.Tensor] | None = None
        self.done: set[str] = set()

    @functools.cached_property
    def own(self) -> list[torch.Tensor]:
        """The own shards in the compute dtype (cast once, by backward: the weights rotate in
        it)."""
        return self.runtime.precision.to_compute(self.master)

    def fetch_start(self, step: int, tag: int) -> None:
        """Start the hop of backward step `step`'s weights (once for the whole bucket)."""
        if step in self.fetched or step in self.incoming:
            return
        rt = self.runtime
        sending = self.own if step == 0 else self.fetched[step - 1]
        self.incoming[step] = ring.shift_start(sending, rt.group_name, -1, tag,
                                               f"{rt.bucket_name} backward: weight hop {step}")

    def fetch_wait(self, step: int) -> None:
        if step in self.fetched:
            return
        ring.wait(self.incoming[step])
        self.fetched[step] = ring.unpack(self.incoming.pop(step), self.runtime.specs)
        if step == self.runtime.world_size - 2:  # the last weight hop of the bucket
            ring.pool.release()

    def held(self, unit: str, step: int) -> list[torch.Tensor]:
        """The shards unit `unit` holds at backward step `step` (the last: its own)."""
        at = self.runtime.slices[unit]
        return (self.own if step == self.runtime.world_size - 1 else self.fetched[step])[at]

    def grad_parts(self, unit: str, shard: int) -> list[torch.Tensor]:
        """Views of the real parts of unit `unit`'s gradients of `shard`, to add into."""
        rt = self.runtime
        if self.rows is None:
            dtype, total, _ = ring.flat_layout(rt.grad_specs)
            self.rows = [self.master[0].new_zeros(total, dtype=dtype)
                         for _ in range(rt.world_size)]
        at = rt.slices[unit]
        views = ring.unpack(self.rows[shard], rt.grad_specs)[at]
        return [real_part(v, lay.dim or 0, lay.slot(shard))
                for v, lay in zip(views, rt.layouts[at])]

    def unit_done(self, unit: str) -> None:
        """Unit `unit`'s backward is over: after the bucket's last, its weights go."""
        self.done.add(unit)
        if self.done >= set(self.runtime.slices):
            self.fetched = {}
            self.__dict__.pop("own", None)  # the cast copy, if any

    def reduce_scatter(self) -> list[torch.Tensor] | None:
        """This rank's gradients of its own shards, summed over the ranks (times the gradient
        scale), by N - 1 counter-clockwise hops of one accumulator message; None if no unit
        computed a weight gradient."""
        rt = self.runtime
        rows, self.rows, self.fetched = self.rows, None, {}
        if rows is None:
            return None
        n, rank = rt.world_size, rt.rank
        acc = rows[backward_shard(rank, 0, n)]
        for j in range(1, n):
            incoming = ring.shift_start([acc], rt.group_name, -1, rt.schedule.grad_tag,
                                        f"{rt.bucket_name} backward: gradient hop {j}",
                                        pooled=False)
            rows[backward_shard(rank, j - 1, n)] = None  # sent: nothing else reads it
            ring.wait(incoming)
            acc = incoming.add_(rows[backward_shard(rank, j, n)])
        if rt.grad_scale != 1:
            acc.mul_(rt.grad_scale)
        # each gradient its own tensor: autograd keeps some of a message's views as .grad and
        # copies others (measured: the bucket's first units' copied), and one view kept would
        # hold the whole message alive besides the copies (a cast to the shards' dtype copies)
        return [g.clone() if g.dtype == lay.dtype else g.to(lay.dtype)
                for g, lay in zip(ring.unpack(acc, rt.grad_specs), rt.layouts)]


class _BucketParams(torch.autograd.Function):
    """Forward: the bucket's own shards as they are. Backward: runs after every unit of the
    bucket (they all read its outputs), whose gradients went into the bucket's rows, not
    through autograd: the reduce-scatter of the rows."""

    @staticmethod
    def forward(ctx, state, *own):
        ctx.state, ctx.transaction = state, transaction.current()
        ctx.set_materialize_grads(False)
        return tuple(o.view_as(o) for o in own)

    @staticmethod
    @transaction.transactional
    def backward(ctx, *ignored):
        grads = ctx.state.reduce_scatter()
        needs = ctx.needs_input_grad[1:]
        if grads is None:
            return (None,) * (1 + len(needs))
        return (None, *[g if need else None for g, need in zip(grads, needs)])


class BucketRuntime(nn.Module):
    """Runtime of one bucket on one rank; its units' runtimes refer to it (`unit.bucket`).

    `units`: (unit name, number of parameters) in bucket order; `layouts`: the parameters'
    layouts in the same order; `schedule`: the bucket's first unit's (its tags)."""

    def __init__(self, name, units, layouts, rank, world_size, group_name,
                 schedule: UnitSchedule, grad_scale, precision: Precision):
        super().__init__()
        self.bucket_name, self.layouts = name, list(layouts)
        self.rank, self.world_size, self.group_name = rank, world_size, group_name
        self.schedule, self.grad_scale, self.precision = schedule, grad_scale, precision
        # the shards as they rotate, and their gradient rows (mixed precision: two dtypes)
        self.specs = [(lay.shard_shape, precision.compute(lay.dtype)) for lay in self.layouts]
        self.grad_specs = [(lay.shard_shape, precision.reduce(lay.dtype))
                           for lay in self.layouts]
        self.slices, at = {}, 0
        for unit, count in units:
            self.slices[unit] = slice(at, at + count)
            at += count
        self.current: BucketState | None = None

    def extra_repr(self) -> str:
        return f"bucket of {', '.join(self.slices)}; rank {self.rank} of {self.world_size}"

    def forward(self, *own):
        self.current = BucketState(self, [o.detach() for o in own])
        if not torch.is_grad_enabled() or not any(o.requires_grad for o in own):
            return tuple(own)
        return _BucketParams.apply(self.current, *own)
