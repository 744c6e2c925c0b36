"""The runtime of a bucket: consecutive units whose shards travel in one message per step.

Forward, the emitted graph runs the hops within the bucket's first unit and keeps what arrived
for the later ones. `BucketRuntime` is what the bucket's parameters pass through before its
units read them: each forward makes a `BucketState`, found by the forward's ticket (a 0-dim
tensor the units' autograd takes along and saves) until its backward is over.
Backward, whichever unit of the bucket runs first drives the weight fetches (one message per
step for all of them, kept until every unit of the bucket is done: the bucket held gathered),
each unit adds its gradient of every shard into the bucket's gradient rows (one flat message
per shard), and once autograd has run every unit, the parameters' pass-through reduce-scatters
the rows around the ring, one message per hop, into each rank's own shards' gradients. Each
unit's backward gives the ticket a (zero) gradient, so that the reduce-scatter runs after every
unit of the bucket.
Traced by a compiler, a forward has no state to find: the bucket's parameters give the units
links instead of a ticket (`_LinkedBucketParams`), the bucket's last unit, whose backward runs
first, fetches, and the messages and rows reach the earlier units as the links' gradients
(`rotated._LinkedUnitGrad`); the first unit, whose backward runs last, reduce-scatters the
rows (`reduce_rows`, the same hops as graph ops) and hands the parameters' backward the own
shards' gradients.
"""

from __future__ import annotations

import itertools

import torch

from rtp_compile.core.layout import real_part
from rtp_compile.runtime import packing, ring, transaction
from rtp_compile.runtime.events import UnitSchedule, backward_shard
from rtp_compile.runtime.precision import Precision
from rtp_compile.runtime.registry import Keyed, graph_op, lookup


class BucketState:
    """One forward of a bucket: its units' own shards, what backward fetched, its gradient
    rows (shard -> flat message of every unit's gradient of that shard)."""

    def __init__(
        self,
        runtime: BucketRuntime,
        own: list[torch.Tensor],
        messages: list[torch.Tensor] | None = None,
        rows: list[torch.Tensor | None] | None = None,
    ):
        """`messages`, `rows`: what a later unit's traced backward fetched and added (see
        `links`), for the state of a traced backward that a later unit's began."""
        self.runtime, self.stored = runtime, own
        self._own: list[torch.Tensor] | None = None
        self.after: torch.Tensor | None = None  # a traced backward's start (`ring.hop_start`)
        self.incoming: dict[int, int | torch.Tensor] = {}  # backward step -> its weights' hop
        self.sent: dict[int, list[torch.Tensor]] = {}  # backward step -> what its hop sends
        self.messages: dict[int, torch.Tensor] = dict(enumerate(messages or []))
        self.fetched: dict[int, list[torch.Tensor]] = {
            j: packing.unpack(m, runtime.specs) for j, m in self.messages.items()
        }
        self.rows: list[torch.Tensor | None] | None = rows
        self.row_views: dict[int, list[torch.Tensor]] = {}  # shard -> views of its row
        self.done: set[str] = set()

    @property
    def own(self) -> list[torch.Tensor]:
        """The own shards in the compute dtype (cast once, by backward: the weights rotate in
        it; a plain cache, not functools.cached_property, whose lock dynamo cannot trace)."""
        if self._own is None:
            self._own = self.runtime.precision.to_compute(self.stored)
        return self._own

    def fetch_start(self, step: int, tag: int) -> None:
        """Start the hop of backward step `step`'s weights (once for the whole bucket)."""
        if step in self.fetched or step in self.incoming:
            return
        rt = self.runtime
        sending = self.sent[step] = self.own if step == 0 else self.fetched[step - 1]
        self.incoming[step] = ring.hop_start(
            sending,
            rt.group_name,
            -1,
            tag,
            f"{rt.bucket_name} backward: weight hop {step}",
            after=self.after,
        )

    def fetch_wait(self, step: int) -> None:
        if step in self.fetched:
            return
        arrived = ring.hop_wait(self.incoming.pop(step), self.sent.pop(step))
        self.messages[step] = arrived
        self.fetched[step] = packing.unpack(arrived, self.runtime.specs)
        if step == self.runtime.world_size - 2:  # the last weight hop of the bucket
            ring.release_pool(arrived)

    def held(self, unit: str, step: int) -> list[torch.Tensor]:
        """The shards unit `unit` holds at backward step `step` (the last: its own)."""
        at = self.runtime.slices[unit]
        return (self.own if step == self.runtime.world_size - 1 else self.fetched[step])[at]

    def grad_parts(self, unit: str, shard: int) -> list[torch.Tensor]:
        """Views of the real parts of unit `unit`'s gradients of `shard`, to add into."""
        rt = self.runtime
        if self.rows is None:
            dtype, total, _ = packing.flat_layout(rt.grad_specs)
            self.rows = [self.stored[0].new_zeros(total, dtype=dtype) for _ in range(rt.world_size)]
        at = rt.slices[unit]
        views = self.row_views.get(shard)
        if views is None:  # once per row, not per unit
            row = self.rows[shard]
            assert row is not None, "a gradient row read after it was sent"
            views = self.row_views[shard] = packing.unpack(row, rt.grad_specs)
        views = views[at]
        return [
            real_part(v, lay.dim or 0, lay.slot(shard)) for v, lay in zip(views, rt.layouts[at])
        ]

    def unit_done(self, unit: str) -> None:
        """Unit `unit`'s backward is over: after the bucket's last, its weights go."""
        self.done.add(unit)
        if self.done >= set(self.runtime.slices):
            self.fetched, self.messages = {}, {}
            self._own = None  # the cast copy, if any

    def links(self) -> list[torch.Tensor]:
        """What a traced backward hands the bucket's earlier units (as the gradients of the
        links they passed forward, `BucketRuntime.forward`): the fetched messages, then the
        gradient rows."""
        rt = self.runtime
        if self.rows is None:
            self.grad_parts(next(iter(rt.slices)), 0)  # the rows, zero
        assert self.rows is not None and all(r is not None for r in self.rows)
        return [self.messages[j] for j in range(rt.world_size - 1)] + list(self.rows)  # type: ignore[arg-type]

    def reduce_scatter(self) -> list[torch.Tensor] | None:
        """This rank's gradients of its own shards, summed over the ranks (times the gradient
        scale), by N - 1 counter-clockwise hops of one accumulator message; None if no unit
        computed a weight gradient."""
        rows, self.rows, self.fetched, self.row_views = self.rows, None, {}, {}
        if rows is None:
            return None
        return shard_grads(self.runtime, reduce_rows(self.runtime, rows))


def reduce_rows(rt: BucketRuntime, rows: list[torch.Tensor | None]) -> torch.Tensor:
    """The flat message of the own shards' gradients from the bucket's gradient rows (one per
    shard, each every rank's gradient of that shard): N - 1 counter-clockwise hops of one
    accumulator message, each adding this rank's row of the shard it next carries, then the
    gradient scale. A row is dropped from `rows` once sent."""
    n, rank = rt.world_size, rt.rank
    acc = rows[backward_shard(rank, 0, n)]
    assert acc is not None
    for j in range(1, n):
        incoming = ring.hop_start(
            [acc],
            rt.group_name,
            -1,
            rt.schedule.grad_tag,
            f"{rt.bucket_name} backward: gradient hop {j}",
            pooled=False,
        )
        rows[backward_shard(rank, j - 1, n)] = None  # sent: nothing else reads it
        row = rows[backward_shard(rank, j, n)]
        assert row is not None
        acc = ring.hop_wait(incoming, [acc]).add_(row)
    if rt.grad_scale != 1:
        acc.mul_(rt.grad_scale)
    return acc


def shard_grads(rt: BucketRuntime, acc: torch.Tensor) -> list[torch.Tensor]:
    """The own shards' gradients, each a tensor of its own, from their flat message."""
    # each gradient its own tensor: autograd keeps some of a message's views as .grad and
    # copies others (measured: the bucket's first units' copied), and one view kept would
    # hold the whole message alive besides the copies (a cast to the shards' dtype copies)
    return [
        g.clone() if g.dtype == lay.dtype else g.to(lay.dtype)
        for g, lay in zip(packing.unpack(acc, rt.grad_specs), rt.layouts)
    ]


KEPT_STATES = 1024


class _BucketParams(torch.autograd.Function):
    """Forward: the bucket's own shards as they are, and the forward's ticket
    (`rtp::bucket_forward`). Backward: runs after every unit of the bucket (they all read its
    outputs and give the ticket a gradient), whose gradients went into the bucket's rows, not
    through autograd: the reduce-scatter of the rows (`rtp::bucket_reduce_scatter`)."""

    @staticmethod
    def forward(ctx, key, *own):
        ticket = bucket_forward(key, list(own))
        ctx.key = key
        ctx.save_for_backward(ticket)
        ctx.set_materialize_grads(False)
        return (*[o.view_as(o) for o in own], ticket)

    @staticmethod
    def backward(ctx, *grads):
        (ticket,) = ctx.saved_tensors
        d_ticket = grads[-1] if grads[-1] is not None else torch.zeros_like(ticket)
        shards = bucket_reduce_scatter(ctx.key, ticket, d_ticket)
        return (None, *[g if need else None for g, need in zip(shards, ctx.needs_input_grad[1:])])


class _LinkedBucketParams(torch.autograd.Function):
    """The bucket's parameters in a forward a compiler traces, whose backward graph holds no
    per-forward state: the own shards as they are, and the links (`link_placeholders`) that
    the bucket's units pass from one to the next (`rotated._LinkedUnitGrad`), so that each
    unit's backward hands the earlier ones what it fetched and the gradient rows so far as
    the links' gradients. Backward: the own shards' gradients, which the bucket's first unit
    reduce-scattered and handed back as its first row link's gradient."""

    @staticmethod
    def forward(ctx, runtime, *own):
        ctx.runtime = runtime
        return (*[o.view_as(o) for o in own], *runtime.link_placeholders(own[0]))

    @staticmethod
    def backward(ctx, *grads):
        rt = ctx.runtime
        n_own = len(rt.layouts)
        shards = shard_grads(rt, grads[n_own + rt.world_size - 1])
        return (None, *[g if need else None for g, need in zip(shards, ctx.needs_input_grad[1:])])


class BucketRuntime(Keyed):
    """Runtime of one bucket on one rank; its units' runtimes refer to it (`unit.bucket`).

    `units`: (unit name, number of parameters) in bucket order; `layouts`: the parameters'
    layouts in the same order; `schedule`: the bucket's first unit's (its tags). Called on the
    own shards, it returns them and the ticket of this forward (None without autograd)."""

    def __init__(
        self,
        name,
        units,
        layouts,
        rank,
        world_size,
        group_name,
        schedule: UnitSchedule,
        grad_scale,
        precision: Precision,
    ):
        super().__init__()
        self.bucket_name, self.layouts = name, list(layouts)
        self.rank, self.world_size, self.group_name = rank, world_size, group_name
        self.schedule, self.grad_scale, self.precision = schedule, grad_scale, precision
        # the shards as they rotate, and their gradient rows (mixed precision: two dtypes)
        self.specs = [(lay.shard_shape, precision.compute(lay.dtype)) for lay in self.layouts]
        self.grad_specs = [(lay.shard_shape, precision.reduce(lay.dtype)) for lay in self.layouts]
        self.slices, at = {}, 0
        for unit, count in units:
            self.slices[unit] = slice(at, at + count)
            at += count
        self.last_unit = next(reversed(self.slices))  # the first whose backward runs
        self.first_unit = next(iter(self.slices))  # the last: it reduce-scatters, traced
        self.n_links = 2 * world_size - 1  # of a traced forward (`link_placeholders`)
        self.states: dict[int, BucketState] = {}  # per forward whose backward is to come
        self._tickets = itertools.count()
        self.register(name)

    def extra_repr(self) -> str:
        return f"bucket of {', '.join(self.slices)}; rank {self.rank} of {self.world_size}"

    def open(self, own: list[torch.Tensor]) -> torch.Tensor:
        """`rtp::bucket_forward`: a new forward's state, and its ticket. A state costs no
        tensor memory until its backward runs (it holds the shards' aliases); of forwards
        whose backward never runs, the newest `KEPT_STATES` are kept."""
        number = next(self._tickets)
        self.states[number] = BucketState(self, [o.detach() for o in own])
        self.states.pop(number - KEPT_STATES, None)
        return torch.tensor(float(number), dtype=torch.float64, device=own[0].device)

    def state(self, ticket: torch.Tensor) -> BucketState:
        """The state of the forward `ticket` names."""
        state = self.states.get(int(ticket))
        if state is None:
            raise RuntimeError(
                f"rtp_compile: bucket {self.bucket_name}: the backward of a forward {KEPT_STATES} "
                "or more forwards ago runs after its state was dropped (or a second time); "
                "call backward before running the module that many more times"
            )
        return state

    @transaction.transactional
    def reduce_scatter(self, ticket: torch.Tensor) -> list[torch.Tensor]:
        """`rtp::bucket_reduce_scatter`: the own shards' gradients of the ticket's forward
        (zeros where no unit computed one); its backward is over, so is its state."""
        grads = self.state(ticket).reduce_scatter()
        self.states.pop(int(ticket))
        if grads is None:
            return [
                torch.zeros(lay.shard_shape, dtype=lay.dtype, device=ticket.device)
                for lay in self.layouts
            ]
        return grads

    def __getstate__(self):
        state = dict(super().__getstate__())
        state.pop("_tickets")
        state["states"] = {}
        return state

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._tickets = itertools.count()

    def forward(self, *own):
        if not torch.is_grad_enabled() or not any(o.requires_grad for o in own):
            return (*own, None)
        if torch.compiler.is_compiling():
            out = _LinkedBucketParams.apply(self, *own)
            views = out[: len(own)]
            return (*views, (*out[len(own) :], *views))
        return _BucketParams.apply(self.rtp_key, *own)

    def link_placeholders(self, like: torch.Tensor) -> list[torch.Tensor]:
        """A traced forward's links (`_LinkedBucketParams`): one per fetched message (N - 1),
        then one per gradient row (N), each an empty tensor of the message's shape and dtype.
        Only their gradients carry data; no unit reads them, so a compiler drops them. (Dense,
        not zero-stride: dynamo traces a backward on gradients laid out like the outputs, and
        a unit's backward adds into the rows it is handed.)"""
        fetch_dtype, fetch_total, _ = packing.flat_layout(self.specs)
        row_dtype, row_total, _ = packing.flat_layout(self.grad_specs)
        n = self.world_size
        fetches = [like.new_empty(fetch_total, dtype=fetch_dtype) for _ in range(n - 1)]
        return fetches + [like.new_empty(row_total, dtype=row_dtype) for _ in range(n)]


@graph_op("bucket_forward")
def bucket_forward(key: str, own: list[torch.Tensor]) -> torch.Tensor:
    """Graph op: a forward of the bucket registered under `key`; its ticket."""
    return lookup(key).open(own)


@bucket_forward.op.register_fake
def _(key, own):
    return own[0].new_empty((), dtype=torch.float64)


@graph_op("bucket_reduce_scatter")
def bucket_reduce_scatter(
    key: str, ticket: torch.Tensor, units_done: torch.Tensor
) -> list[torch.Tensor]:
    """Graph op: the own shards' gradients of the bucket `key`'s forward `ticket`, once every
    unit has added its own into the rows (`units_done`: the ticket's gradient)."""
    return lookup(key).reduce_scatter(ticket)


@bucket_reduce_scatter.op.register_fake
def _(key, ticket, units_done):
    return [ticket.new_empty(lay.shard_shape, dtype=lay.dtype) for lay in lookup(key).layouts]
