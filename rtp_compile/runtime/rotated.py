"""The autograd of rotation units, as the modules the emitted graphs call.

A rotation unit's forward steps are emitted inline in the rank's graph and compute on detached
tensors; `RotatedOpRuntime` links their result into autograd. Its backward re-fetches the weight
shards by counter-clockwise rotation (never saved for backward: only the activation is), runs
the rule's backward step for each, and lets a gradient accumulator travel with each shard so it
arrives complete, averaged like DDP's, at the rank that owns it (`collectives.GradientRing`).

Eager, a unit's backward runs its events in Python (`UnitRuntime.backward`) inside one custom
op (`rtp::unit_backward`, which finds the module by its key, `registry.Keyed`). A compiler that
traces a rank's module (`torch.compile(gm, fullgraph=True)`) traces that same code into the
backward graph instead (`UnitRuntime.graph_backward`): the events are constants of the
schedule, so the trace is the unit's backward steps themselves, each step's input and weight
gradients and the fetch and accumulator hops as the graph ops `ring_shift_start` /
`ring_wait`, which the compiler orders and fuses around. A unit in a bucket shares its
bucket's fetches and gradient rows, which eagerly live in the bucket's per-forward state;
traced, no state outlives a backward, so they travel through autograd (`_LinkedUnitGrad`,
`UnitRuntime.linked_backward`): the bucket's units pass links forward, and each unit's
backward hands what it fetched and the rows so far, as the links' gradients, to the unit
before it.
"""

from __future__ import annotations

from typing import Any

import torch

from rtp_compile.core.ir import Action
from rtp_compile.runtime import packing, ring, transaction
from rtp_compile.runtime.bucket import BucketState, reduce_rows
from rtp_compile.runtime.collectives import GradientRing
from rtp_compile.runtime.events import UnitSchedule, backward_shard
from rtp_compile.runtime.precision import Precision
from rtp_compile.runtime.registry import (
    Keyed,
    autograd_in_op,
    decode,
    distinct,
    encode,
    graph_op,
    laid_out_like,
    lookup,
    save_values,
    saved_values,
)
from rtp_compile.runtime.transaction import open_transaction


class _UnitGrad(torch.autograd.Function):
    """Links a unit's result into autograd; saves the activation, the rank's own shards (one per
    role, `n_own`) and whatever the unit keeps from its forward steps, never a received shard;
    in a bucket, the `ticket` of the bucket's forward. Backward: `rtp::unit_backward`, or, being
    traced outside a bucket, the unit's `graph_backward`."""

    @staticmethod
    def forward(ctx, runtime, n_own, ticket, y, x, *tensors):
        ctx.runtime, ctx.key, ctx.n_own = runtime, runtime.rtp_key, n_own
        save_values(
            ctx, (ticket, x, *tensors)
        )  # a fused block's externals may be sizes, not tensors
        return y

    @staticmethod
    def backward(ctx, dy):
        values = saved_values(ctx)
        ticket, n_own = values[0], ctx.n_own
        needs = ctx.needs_input_grad
        # in a bucket the shards' gradients go into the bucket's rows; the ticket's gradient
        # (zero) makes the bucket's backward wait for every unit's
        need_dx, own_needs = needs[4], needs[5 : 5 + n_own]
        if ticket is None and torch.compiler.is_compiling():
            grads = iter(ctx.runtime.graph_backward(dy, values, need_dx, any(own_needs)))
        else:
            grads = iter(unit_backward(ctx.key, dy, *encode(values), need_dx, any(own_needs)))
        d_ticket = next(grads) if ticket is not None else None
        dx = next(grads) if need_dx else None
        own = [next(grads) if any(own_needs) and ticket is None else None for _ in own_needs]
        return (
            None,
            None,
            d_ticket,
            None,
            dx,
            *[g if need else None for g, need in zip(own, own_needs)],
            *[None] * (len(values) - 2 - n_own),
        )


class _LinkedUnitGrad(torch.autograd.Function):
    """A unit of a bucket in a forward a compiler traces: as `_UnitGrad`, with the bucket's
    links (`bucket._LinkedBucketParams`) passed through: the unit reads the earlier unit's and
    returns its own for the next. Backward (`UnitRuntime.linked_backward`) gets from the
    next unit's backward, as its links' gradients, the weights it fetched and the gradient
    rows so far, and hands them, its own gradients added, to the earlier unit's."""

    @staticmethod
    def forward(ctx, runtime, n_own, y, x, *rest):
        n_links = runtime.bucket.n_links
        ctx.runtime, ctx.n_own, ctx.n_rest = runtime, n_own, len(rest) - n_links
        save_values(ctx, (None, x, *rest[n_links:]))  # the bucket's other units' own shards,
        # then the unit's (own shards, what its steps saved)
        return (y, *runtime.bucket.link_placeholders(y))

    @staticmethod
    def backward(ctx, dy, *d_links):
        values = saved_values(ctx)
        needs = ctx.needs_input_grad
        n_links, n_others = len(d_links), len(ctx.runtime.bucket.layouts) - ctx.n_own
        first_own = 4 + n_links + n_others
        need_dx, need_dw = needs[3], any(needs[first_own : first_own + ctx.n_own])
        dx, links = ctx.runtime.linked_backward(dy, values, list(d_links), need_dx, need_dw)
        return (None, None, None, dx, *links, *[None] * ctx.n_rest)


class UnitRuntime(Keyed):
    """Runtime of one unit on one rank: executes the backward events its schedule hands it
    (weights re-fetched from rank+1, gradient accumulators passed to rank-1; in a bucket, both
    through the bucket's state, `runtime.bucket`); subclasses say what one step computes."""

    bucket: Any = None  # the BucketRuntime of the unit's bucket, if it is in one

    def __init__(
        self,
        name,
        roles,
        layouts,
        rank,
        world_size,
        group_name,
        schedule: UnitSchedule,
        grad_scale,
        precision: Precision,
    ):
        super().__init__()
        self.unit_name, self.roles, self.layouts = name, list(roles), layouts
        self.rank, self.world_size, self.group_name = rank, world_size, group_name
        self.schedule, self.grad_scale, self.precision = schedule, grad_scale, precision
        self.compute_dtype = precision.compute(layouts[0].dtype)
        self.reduce_dtype = precision.reduce(layouts[0].dtype)
        self.shapes = {r: lay.shape for r, lay in zip(self.roles, layouts)}
        self.slots = [
            {r: lay.slot(s) for r, lay in zip(self.roles, layouts)} for s in range(world_size)
        ]  # per shard: where each role's part lies
        self.register(name)

    def forward(self, y, x, *tensors, ticket=None):
        """y: the combined step outputs (computed outside autograd); then this rank's own
        shards, one per role, then what the steps saved for backward; `ticket`: in a bucket,
        the bucket's forward (`BucketRuntime`)."""
        if self.bucket is None:
            if not torch.is_grad_enabled():
                return y
            return _UnitGrad.apply(self, len(self.roles), None, y, x, *tensors)
        # in a bucket: (y, the ticket or links for the bucket's next unit)
        if not torch.is_grad_enabled():
            return y, ticket
        if isinstance(ticket, tuple):  # traced: the links, then the bucket's own shards
            n_links, at = self.bucket.n_links, self.bucket.slices[self.unit_name]
            shards = ticket[n_links:]
            others = (*shards[: at.start], *shards[at.stop :])  # the unit's own: in `tensors`
            out = _LinkedUnitGrad.apply(
                self, len(self.roles), y, x, *ticket[:n_links], *others, *tensors
            )
            return out[0], (*out[1:], *shards)
        return _UnitGrad.apply(self, len(self.roles), ticket, y, x, *tensors), ticket

    @transaction.transactional
    def backward_op(self, dy, values, need_dx: bool, need_dw: bool) -> list[torch.Tensor]:
        """`rtp::unit_backward`: the ticket's gradient (in a bucket), dx (if needed), the own
        shards' gradients (if needed, outside a bucket)."""
        ticket, x, *rest = values
        n_own = len(self.roles)  # one own shard per role, then what the steps saved
        own, saved = [p.detach() for p in rest[:n_own]], rest[n_own:]
        bucket = None if ticket is None else self.bucket.state(ticket)
        dx, grads = self.backward(dy, x, own, saved, need_dx, need_dw, bucket)
        out = [] if ticket is None else [torch.zeros_like(ticket)]
        return distinct(out + ([dx] if need_dx else []) + (grads or []), [dy, *values])

    def graph_backward(self, dy, values, need_dx: bool, need_dw: bool) -> list[torch.Tensor]:
        """`backward_op` for a compiler to trace (a unit outside a bucket): the same events, its
        hops graph ops, the transaction opened by the graph op `rtp::open_transaction` (a
        traced backward has no Python around it to open or roll back). Returns dx (if needed),
        then the own shards' gradients (if needed)."""
        opened = open_transaction(self.rtp_key, dy)
        _, x, *rest = values
        n_own = len(self.roles)
        own, saved = [p.detach() for p in rest[:n_own]], rest[n_own:]
        dx, grads = self.backward(dy, x, own, saved, need_dx, need_dw, after=opened)
        return ([dx] if need_dx else []) + (grads or [])

    def linked_backward(self, dy, values, d_links, need_dx: bool, need_dw: bool):
        """`graph_backward` for a unit of a bucket (`_LinkedUnitGrad`): the bucket's state is
        what the next unit's backward handed on (`d_links`), or, for the bucket's last unit,
        whose backward runs first, new. Returns dx (None if not needed) and the links for the
        earlier unit: the fetched messages, the gradient rows with this unit's added."""
        opened = open_transaction(self.rtp_key, dy)
        _, x, *rest = values
        bucket, n = self.bucket, self.world_size
        n_own, at = len(self.roles), bucket.slices[self.unit_name]
        others, rest = rest[: len(bucket.layouts) - n_own], rest[len(bucket.layouts) - n_own :]
        own, saved = [p.detach() for p in rest[:n_own]], rest[n_own:]
        stored = [t.detach() for t in (*others[: at.start], *own, *others[at.start :])]
        if self.unit_name == bucket.last_unit:
            state = BucketState(bucket, stored)
        else:
            state = BucketState(bucket, stored, d_links[: n - 1], list(d_links[n - 1 :]))
        state.after = opened
        dx, _ = self.backward(dy, x, own, saved, need_dx, need_dw, state)
        links: list[torch.Tensor | None] = list(state.links())
        last = state.messages.get(n - 2) if self.unit_name == bucket.last_unit else None
        if self.unit_name == bucket.first_unit:  # the rows are complete: reduce-scatter them
            rows = links[n - 1 :]
            last = reduce_rows(bucket, rows)
            links = links[: n - 1] + [last] + [None] * (n - 1)
        if dx is not None and last is not None:
            ring.follow(dx, last)  # the next unit's hops follow this one's (`ring.follow`)
        return dx, links

    def step_input_grad(self, shard, dy, x, shards, slots, saved, dx, scratch):
        """This step's part of dx (added into `dx`, None when not needed). `scratch` is a dict
        that lives for one step (from its input grad to its weight grad), for what both step
        functions need."""
        raise NotImplementedError

    def step_weight_grads(self, shard, dy, x, shards, slots, saved, into, scratch):
        """This rank's gradient of each shard's real part, added into `into[role]`."""
        raise NotImplementedError

    def backward(self, dy, x, own, saved, need_dx: bool, need_dw: bool, bucket=None, after=None):
        """dx and this rank's (averaged) shard gradients, by the unit's backward events; in a
        bucket (`bucket`: the forward's BucketState) the gradients go into the bucket's rows
        and the unit returns none. `after`: in a traced backward, what its hops follow."""
        n, where = self.world_size, f"{self.unit_name} backward"
        dx = torch.zeros_like(x) if need_dx else None
        own = self.precision.to_compute(own)  # cast once: the weights rotate in it
        fetch: _BucketFetch | _UnitFetch
        # a GradientRing, or a bucket's share of one (real_parts and result only: a bucket's
        # units have no receive or pass events, the bucket's runtime moves the accumulators)
        grads: Any
        if bucket is not None:
            fetch = _BucketFetch(bucket, self.unit_name)
            grads = _BucketGrads(bucket, self.unit_name) if need_dw else None
        else:
            fetch = _UnitFetch(own, self.group_name, where, after)
            grads = (
                GradientRing(self.layouts, self.group_name, where, own[0], self.reduce_dtype)
                if need_dw
                else None
            )
        scratches: dict[int, dict] = {}
        for event in self.schedule.backward:
            j, action = event.step, event.action
            shards = None  # a step's views go when it is done: the pool reuses their buffer
            scratch = scratches.setdefault(j, {})
            s = backward_shard(self.rank, j, n)
            slots = self.slots[s]
            if action == Action.FETCH_START:
                fetch.start(j, event.tag)
            elif action == Action.FETCH_WAIT:
                fetch.wait(j)
            elif action == Action.RELEASE:
                fetch.release()
            elif action == Action.DONE:
                fetch.done()
            elif action == Action.INPUT_GRAD:
                shards = dict(zip(self.roles, own if j == n - 1 else fetch.held(j)))
                self.step_input_grad(s, dy, x, shards, slots, saved, dx, scratch)
            elif action == Action.RECEIVE_GRAD and need_dw:
                grads.receive()
            elif action == Action.WEIGHT_GRAD:
                if need_dw:
                    shards = dict(zip(self.roles, own if j == n - 1 else fetch.held(j)))
                    self._add_weight_grads(
                        s,
                        dy,
                        x,
                        shards,
                        slots,
                        saved,
                        dict(zip(self.roles, grads.real_parts(s))),
                        scratch,
                    )
                del scratches[j]  # the step is done
            elif action == Action.PASS and need_dw:
                grads.pass_on(j, event.tag)
        result = grads.result(self.grad_scale) if need_dw else None
        if torch.compiler.is_compiling() and dx is not None and bucket is None:
            # the unit's last hop: the accumulator's last receive, else the last weight fetch
            last = grads.acc[0] if need_dw else fetch.held(0)[0]
            ring.follow(dx, last)
        return dx, result

    def _add_weight_grads(self, shard, dy, x, shards, slots, saved, into, scratch):
        """`step_weight_grads` into the accumulators `into`; under mixed precision computed in
        the compute dtype, as autograd would, then added into the reduce-dtype accumulators."""
        if self.compute_dtype == self.reduce_dtype:
            return self.step_weight_grads(shard, dy, x, shards, slots, saved, into, scratch)
        local = {r: torch.zeros_like(a, dtype=self.compute_dtype) for r, a in into.items()}
        self.step_weight_grads(shard, dy, x, shards, slots, saved, local, scratch)
        for r, a in into.items():
            a.add_(local[r])


class _UnitFetch:
    """A unit's own weight fetches: each hop sends on what the one before brought."""

    def __init__(self, own, group_name, where, after=None):
        self.own, self.group_name, self.where, self.after = own, group_name, where, after
        self.current = self.sent = own
        self.incoming: int | torch.Tensor | None = None

    def start(self, step, tag):
        self.sent = self.current
        self.incoming = ring.hop_start(
            self.current,
            self.group_name,
            -1,
            tag,
            f"{self.where}: weight hop {step}",
            after=self.after,
        )

    def wait(self, step):
        assert self.incoming is not None, "waited on a hop never started"
        arrived = ring.hop_wait(self.incoming, self.sent)
        self.current = packing.unpack(arrived, packing.specs_of(self.own))
        self.sent = self.own  # the sent shards go (the pool reuses their buffer)

    def held(self, step):
        return self.current

    def release(self):
        ring.release_pool(self.current[0])

    def done(self):
        pass


class _BucketFetch:
    """The weight fetches of a unit in a bucket: the bucket's, done once for all its units."""

    def __init__(self, state, unit):
        self.state, self.unit = state, unit

    def start(self, step, tag):
        self.state.fetch_start(step, tag)

    def wait(self, step):
        self.state.fetch_wait(step)

    def held(self, step):
        return self.state.held(self.unit, step)

    def release(self):
        packing.pool.release()

    def done(self):
        self.state.unit_done(self.unit)


class _BucketGrads:
    """A unit's gradients in a bucket: added into the bucket's rows, returned by its
    reduce-scatter, not by the unit."""

    def __init__(self, state, unit):
        self.state, self.unit = state, unit

    def real_parts(self, shard):
        return self.state.grad_parts(self.unit, shard)

    def result(self, scale):
        return None


class RotatedOpRuntime(UnitRuntime):
    """One rotated op: its rule's step backward, nothing saved but the activation (and the
    values its parameter chain reads, such as a dtype: `saved`)."""

    def __init__(
        self,
        name,
        call,
        mode,
        layouts,
        rank,
        world_size,
        group_name,
        schedule,
        grad_scale,
        precision,
    ):
        super().__init__(
            name,
            call.params,
            layouts,
            rank,
            world_size,
            group_name,
            schedule,
            grad_scale,
            precision,
        )
        self.rule, self.mode, self.call = call.rule, mode, call

    def extra_repr(self) -> str:
        dims = ", ".join(f"{r}: dim {lay.dim}" for r, lay in zip(self.roles, self.layouts))
        return f"{self.rule.name} {self.mode} ({dims}), rank {self.rank} of {self.world_size}"

    def step_input_grad(self, shard, dy, x, shards, slots, saved, dx, scratch):
        if dx is not None:
            self.rule.input_grad(
                self.mode, self.call.run_options(saved), dy, x, shards, slots, self.shapes, dx
            )

    def step_weight_grads(self, shard, dy, x, shards, slots, saved, into, scratch):
        self.rule.weight_grads(
            self.mode, self.call.run_options(saved), dy, x, shards, slots, self.shapes, into
        )


@graph_op("unit_backward")
def unit_backward(
    key: str,
    dy: torch.Tensor,
    tensors: list[torch.Tensor],
    ints: list[int],
    floats: list[float],
    kinds: list[int],
    need_dx: bool,
    need_dw: bool,
) -> list[torch.Tensor]:
    """Graph op: the backward of the unit registered under `key`, on what its forward saved
    (`registry.encode`d): the ticket's gradient (in a bucket), dx, the own shards' gradients."""
    values = decode(tensors, ints, floats, kinds)
    with autograd_in_op():  # a fused block's backward differentiates its region
        grads = lookup(key).backward_op(dy, values, need_dx, need_dw)
    return laid_out_like(grads, _unit_grad_refs(key, values, need_dx, need_dw))


def _unit_grad_refs(key, values, need_dx, need_dw) -> list[torch.Tensor]:
    """What `unit_backward` returns the gradients of: the ticket (in a bucket), x if
    `need_dx`, the own shards if `need_dw` (outside a bucket)."""
    ticket, x, *rest = values
    own = rest[: len(lookup(key).roles)]
    return (
        ([] if ticket is None else [ticket])
        + ([x] if need_dx else [])
        + (own if need_dw and ticket is None else [])
    )


@unit_backward.op.register_fake
def _(key, dy, tensors, ints, floats, kinds, need_dx, need_dw):
    return [
        torch.empty_like(t)
        for t in _unit_grad_refs(key, decode(tensors, ints, floats, kinds), need_dx, need_dw)
    ]
