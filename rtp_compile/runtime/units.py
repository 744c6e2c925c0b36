"""The autograd of rotation units and gathered ops, as modules the emitted graphs call.

A rotation unit's forward steps are emitted inline in the rank's graph and compute on detached
tensors; `RotatedOpRuntime` links their result into autograd. Its backward re-fetches the weight
shards by counter-clockwise rotation (never saved for backward: only the activation is), runs
the rule's backward step for each, and lets a gradient accumulator travel with each shard so it
arrives complete, averaged like DDP's, at the rank that owns it.

`GatheredOpRuntime` is the fallback for ops without a rule: ring all-gather of the parameters,
run the op once, free; backward gathers again, recomputes the op, and ring-reduce-scatters the
gradient.

So that a compiler can trace a rank's whole module (`torch.compile(gm, fullgraph=True)`), the
autograd Functions here hold no Python object: each passes its runtime module's key
(`registry.Keyed`) and what it saved to one custom op per backward (and per communicating
forward), whose implementation finds the module and runs it eagerly.
"""
from __future__ import annotations

import copy

import torch
import torch.fx as fx
from torch import nn

from rtp_compile.core.layout import real_part
from rtp_compile.core.ir import Action
from rtp_compile.runtime import ring, transaction
from rtp_compile.runtime.events import UnitSchedule, backward_shard
from rtp_compile.runtime.precision import Precision
from rtp_compile.runtime.registry import (Keyed, autograd_in_op, decode, distinct, encode,
                                          graph_op, laid_out_like, lookup)


class GradientRing:
    """Ring reduce-scatter driven step by step: at step j a rank adds its gradient for shard
    (rank+1+j) mod N, in place, to the accumulator that arrived from rank+1, and passes it on to
    rank-1; after the last step each rank holds the complete gradient of its own shard. The
    accumulators are `dtype` (mixed precision: the reduce dtype) on `like`'s device."""

    def __init__(self, layouts, group_name: str, where: str, like: torch.Tensor,
                 dtype: torch.dtype):
        self.layouts, self.group_name, self.where = layouts, group_name, where
        self.like, self.dtype = like, dtype
        self.acc: list[torch.Tensor] | None = None
        self.incoming: list[torch.Tensor] | None = None

    def receive(self) -> None:
        specs = [(lay.shard_shape, self.dtype) for lay in self.layouts]
        if self.incoming is None:  # one flat buffer: each hop passes it on without packing
            dtype, total, _ = ring.flat_layout(specs)
            self.acc = ring.unpack(self.like.new_zeros(total, dtype=dtype), specs)
        else:
            self.acc, self.incoming = ring.unpack(ring.wait(self.incoming), specs), None

    def real_parts(self, shard: int) -> list[torch.Tensor]:
        return [real_part(a, lay.dim or 0, lay.slot(shard))
                for a, lay in zip(self.acc, self.layouts)]

    def pass_on(self, step: int, tag: int) -> None:
        self.incoming = ring.shift_start(self.acc, self.group_name, -1, tag,
                                         f"{self.where}: gradient hop {step}", pooled=False)
        self.acc = None

    def result(self, scale: float) -> list[torch.Tensor]:
        """The own shards' gradients, scaled, in the shards' dtype, each a tensor of its own:
        the accumulators are views of one message, and a view autograd keeps as `.grad` would
        hold the whole message alive (as `BucketState.reduce_scatter` copies too)."""
        return [torch.mul(a, scale).to(lay.dtype) for a, lay in zip(self.acc, self.layouts)]


class _UnitGrad(torch.autograd.Function):
    """Links a unit's result into autograd; saves the activation, the rank's own shards (one per
    role, `n_own`) and whatever the unit keeps from its forward steps, never a received shard;
    in a bucket, the `ticket` of the bucket's forward. Backward: `rtp::unit_backward`."""

    @staticmethod
    def forward(ctx, key, n_own, ticket, y, x, *tensors):
        ctx.key, ctx.n_own = key, n_own
        _save(ctx, (ticket, x, *tensors))  # a fused block's externals may be sizes, not tensors
        return y

    @staticmethod
    def backward(ctx, dy):
        values = _saved(ctx)
        ticket, n_own = values[0], ctx.n_own
        needs = ctx.needs_input_grad
        # in a bucket the shards' gradients go into the bucket's rows; the ticket's gradient
        # (zero) makes the bucket's backward wait for every unit's
        need_dx, own_needs = needs[4], needs[5:5 + n_own]
        grads = iter(unit_backward(ctx.key, dy, *encode(values), need_dx, any(own_needs)))
        d_ticket = next(grads) if ticket is not None else None
        dx = next(grads) if need_dx else None
        own = [next(grads) if any(own_needs) and ticket is None else None for _ in own_needs]
        return (None, None, d_ticket, None, dx,
                *[g if need else None for g, need in zip(own, own_needs)],
                *[None] * (len(values) - 2 - n_own))


class UnitRuntime(Keyed):
    """Runtime of one unit on one rank: executes the backward events its schedule hands it
    (weights re-fetched from rank+1, gradient accumulators passed to rank-1; in a bucket, both
    through the bucket's state, `runtime.bucket`); subclasses say what one step computes."""

    bucket = None  # the BucketRuntime of the unit's bucket, if it is in one

    def __init__(self, name, roles, layouts, rank, world_size, group_name,
                 schedule: UnitSchedule, grad_scale, precision: Precision):
        super().__init__()
        self.unit_name, self.roles, self.layouts = name, list(roles), layouts
        self.rank, self.world_size, self.group_name = rank, world_size, group_name
        self.schedule, self.grad_scale, self.precision = schedule, grad_scale, precision
        self.compute_dtype = precision.compute(layouts[0].dtype)
        self.reduce_dtype = precision.reduce(layouts[0].dtype)
        self.shapes = {r: lay.shape for r, lay in zip(self.roles, layouts)}
        self.slots = [{r: lay.slot(s) for r, lay in zip(self.roles, layouts)}
                      for s in range(world_size)]  # per shard: where each role's part lies
        self.register(name)

    def forward(self, y, x, *tensors, ticket=None):
        """y: the combined step outputs (computed outside autograd); then this rank's own
        shards, one per role, then what the steps saved for backward; `ticket`: in a bucket,
        the bucket's forward (`BucketRuntime`)."""
        if not torch.is_grad_enabled():
            return y
        return _UnitGrad.apply(self.rtp_key, len(self.roles), ticket, y, x, *tensors)

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

    def step_input_grad(self, shard, dy, x, shards, slots, saved, dx, scratch):
        """This step's part of dx (added into `dx`, None when not needed). `scratch` is a dict
        that lives for one step (from its input grad to its weight grad), for what both step
        functions need."""
        raise NotImplementedError

    def step_weight_grads(self, shard, dy, x, shards, slots, saved, into, scratch):
        """This rank's gradient of each shard's real part, added into `into[role]`."""
        raise NotImplementedError

    def backward(self, dy, x, own, saved, need_dx: bool, need_dw: bool, bucket=None):
        """dx and this rank's (averaged) shard gradients, by the unit's backward events; in a
        bucket (`bucket`: the forward's BucketState) the gradients go into the bucket's rows
        and the unit returns none."""
        n, where = self.world_size, f"{self.unit_name} backward"
        dx = torch.zeros_like(x) if need_dx else None
        own = self.precision.to_compute(own)  # cast once: the weights rotate in it
        if bucket is not None:
            fetch = _BucketFetch(bucket, self.unit_name)
            grads = _BucketGrads(bucket, self.unit_name) if need_dw else None
        else:
            fetch = _UnitFetch(own, self.group_name, where)
            grads = GradientRing(self.layouts, self.group_name, where, own[0],
                                 self.reduce_dtype) if need_dw else None
        scratches = {}
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
                ring.pool.release()
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
                    self._add_weight_grads(s, dy, x, shards, slots, saved,
                                           dict(zip(self.roles, grads.real_parts(s))), scratch)
                del scratches[j]  # the step is done
            elif action == Action.PASS and need_dw:
                grads.pass_on(j, event.tag)
        return dx, grads.result(self.grad_scale) if need_dw else None

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

    def __init__(self, own, group_name, where):
        self.own, self.group_name, self.where = own, group_name, where
        self.current, self.incoming = own, None

    def start(self, step, tag):
        self.incoming = ring.shift_start(self.current, self.group_name, -1, tag,
                                         f"{self.where}: weight hop {step}")

    def wait(self, step):
        self.current = ring.unpack(ring.wait(self.incoming), ring.specs_of(self.own))

    def held(self, step):
        return self.current

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

    def __init__(self, name, call, mode, layouts, rank, world_size, group_name, schedule,
                 grad_scale, precision):
        super().__init__(name, call.params, layouts, rank, world_size, group_name, schedule,
                         grad_scale, precision)
        self.rule, self.mode, self.call = call.rule, mode, call

    def extra_repr(self) -> str:
        dims = ", ".join(f"{r}: dim {lay.dim}" for r, lay in zip(self.roles, self.layouts))
        return f"{self.rule.name} {self.mode} ({dims}), rank {self.rank} of {self.world_size}"

    def step_input_grad(self, shard, dy, x, shards, slots, saved, dx, scratch):
        if dx is not None:
            self.rule.input_grad(self.mode, self.call.run_options(saved), dy, x, shards, slots,
                                 self.shapes, dx)

    def step_weight_grads(self, shard, dy, x, shards, slots, saved, into, scratch):
        self.rule.weight_grads(self.mode, self.call.run_options(saved), dy, x, shards, slots,
                               self.shapes, into)


def ring_all_gather(own: list[torch.Tensor], layouts, rank: int, world_size: int,
                    group_name: str, tag: int, where: str) -> list[torch.Tensor]:
    """Full parameters from every rank's shard, by N-1 clockwise hops."""
    shards = {rank: own}
    held = own
    for k in range(1, world_size):
        hop = ring.shift_start(held, group_name, 1, tag, f"{where}: gather hop {k}")
        held = shards[(rank - k) % world_size] = ring.unpack(ring.wait(hop), ring.specs_of(own))
    ring.pool.release()
    return [lay.unshard([shards[s][i] for s in range(world_size)])
            for i, lay in enumerate(layouts)]


def ring_reduce_scatter(full_grads: list[torch.Tensor], layouts, rank: int, world_size: int,
                        group_name: str, tag: int, where: str, scale: float,
                        dtype: torch.dtype):
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


def _save(ctx, values) -> None:
    """save_for_backward for a mix of tensors and other values (sizes read from the graph)."""
    ctx.is_tensor = [isinstance(v, torch.Tensor) for v in values]
    ctx.others = [v for v in values if not isinstance(v, torch.Tensor)]
    ctx.save_for_backward(*[v for v in values if isinstance(v, torch.Tensor)])


def _saved(ctx) -> list:
    tensors, others = iter(ctx.saved_tensors), iter(ctx.others)
    return [next(tensors) if t else next(others) for t in ctx.is_tensor]


class _GatherGrad(torch.autograd.Function):
    """A gathered op in autograd: forward `rtp::gathered_forward` (gather, run the op), saving
    its inputs and own shards; backward `rtp::gathered_backward`. `single`: the op returns one
    tensor, not a tuple."""

    @staticmethod
    def forward(ctx, key, single, *values):
        ctx.key = key
        _save(ctx, values)  # inputs and own shards; the gathered tensors are freed
        outputs = gathered_forward(key, *encode(values))
        return outputs[0] if single else tuple(outputs)

    @staticmethod
    def backward(ctx, *douts):
        values = _saved(ctx)
        needs = ctx.needs_input_grad[2:]
        grads = iter(gathered_backward(ctx.key, list(douts), *encode(values), list(needs)))
        return (None, None, *[next(grads) if need else None for need in needs])


class GatheredOpRuntime(Keyed):
    """Runtime of one gathered op: `body` is a small GraphModule (the op and the parameter-only
    ops feeding it) whose parameters are placeholders filled with the gathered tensors."""

    def __init__(self, name, body, param_names, layouts, rank, world_size, group_name,
                 schedule: UnitSchedule, grad_scale, reason, precision: Precision):
        super().__init__()
        self.unit_name, self.param_names = name, list(param_names)
        self.body, self.fills = _without_parameters(body, self.param_names)
        self.layouts, self.rank, self.world_size = layouts, rank, world_size
        self.group_name, self.schedule = group_name, schedule
        self.grad_scale, self.reason, self.precision = grad_scale, reason, precision
        self.single = isinstance(self.body.graph.output_node().args[0], fx.Node)
        self.register(name)

    def extra_repr(self) -> str:
        return f"gathered: {self.reason}; rank {self.rank} of {self.world_size}"

    def full_like(self, own) -> list[torch.Tensor]:
        """Empty tensors shaped like the gathered parameters (for fake implementations)."""
        return [o.new_empty(lay.shape, dtype=self.precision.compute(lay.dtype))
                for o, lay in zip(own, self.layouts)]

    def forward_op(self, values, full=None) -> list[torch.Tensor]:
        """`rtp::gathered_forward`: the op's outputs on the gathered parameters (`full`: given,
        else gathered)."""
        n_inputs = len(values) - len(self.param_names)
        inputs, own = values[:n_inputs], values[n_inputs:]
        outputs = self.run(inputs, self.gather(own) if full is None else full)
        return distinct([outputs] if self.single else list(outputs), values)

    @transaction.transactional
    def backward_op(self, douts, values, needs) -> list[torch.Tensor]:
        """`rtp::gathered_backward`: gather again, recompute the op, the gradients of the
        values that need one (an input's: zeros where the op does not read it)."""
        n_inputs = len(values) - len(self.param_names)
        inputs, own = values[:n_inputs], values[n_inputs:]
        full = [p.requires_grad_(True) for p in self.gather([p.detach() for p in own])]
        leaves = [v.detach().requires_grad_(need) if need else v
                  for v, need in zip(inputs, needs[:n_inputs])]
        with torch.enable_grad():
            outputs = self.run(leaves, full)
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        pairs = [(o, d) for o, d in zip(outputs, douts)
                 if isinstance(o, torch.Tensor) and o.requires_grad]
        wanted = [v for v, need in zip(leaves, needs[:n_inputs]) if need] + full
        grads = list(torch.autograd.grad([o for o, _ in pairs], wanted, [d for _, d in pairs],
                                         allow_unused=True) if pairs else [None] * len(wanted))
        input_grads = [torch.zeros_like(v) if g is None else g
                       for g, v in zip(grads, wanted[:len(wanted) - len(full)])]
        param_grads = [torch.zeros_like(p) if g is None else g
                       for g, p in zip(grads[len(input_grads):], full)]
        shard_grads = self.reduce_scatter(param_grads)
        return distinct(input_grads + [g for g, need in zip(shard_grads, needs[n_inputs:])
                                       if need], [*douts, *values])  # an add's dx is its dout

    def gather(self, own):
        return ring_all_gather(self.precision.to_compute(own), self.layouts, self.rank,
                               self.world_size, self.group_name, self.schedule.forward_tag,
                               self.unit_name)

    def run(self, inputs, full):
        tensors = {name: t for names, t in zip(self.fills, full) for name in names}
        try:
            return torch.func.functional_call(self.body, tensors, tuple(inputs), strict=False,
                                              tie_weights=False)
        except (RuntimeError, TypeError) as err:
            if self.precision.param_dtype is None:
                raise
            raise RuntimeError(
                f"rtp_compile: gathered op {self.unit_name} (parameters "
                f"{', '.join(lay.name for lay in self.layouts)}) failed with its parameters in "
                f"{self.precision.param_dtype} (mp_policy.param_dtype): {err}. The op may need "
                f"another dtype; FSDP2 would run it in {self.precision.param_dtype} too. Cast "
                f"in the model, or compile without mp_policy.param_dtype.") from err

    def reduce_scatter(self, full_grads):
        return ring_reduce_scatter(full_grads, self.layouts, self.rank, self.world_size,
                                   self.group_name, self.schedule.grad_tag, self.unit_name,
                                   self.grad_scale, self.precision.reduce(self.layouts[0].dtype))

    def forward(self, *tensors):
        if not torch.is_grad_enabled():
            outputs = gathered_forward(self.rtp_key, *encode(tensors))
            return outputs[0] if self.single else tuple(outputs)
        return _GatherGrad.apply(self.rtp_key, self.single, *tensors)


def _without_parameters(body: nn.Module, param_names: list[str]):
    """A copy of `body` that registers no parameter (its placeholders would otherwise show in
    the rank module's `parameters()`), and for each of `param_names` every name under which the
    body reads that parameter (a tied one: several)."""
    body = copy.deepcopy(body)  # the program's body serves every rank's module
    held = dict(body.named_parameters(remove_duplicate=False))
    names_of: dict[int, list[str]] = {}
    for name, p in held.items():
        names_of.setdefault(id(p), []).append(name)
    fills = [names_of[id(held[n])] if n in held else [n] for n in param_names]
    for name in held:
        owner, _, leaf = name.rpartition(".")
        del body.get_submodule(owner)._parameters[leaf]
    return body, fills


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

    def __init__(self, names, layouts, rank, world_size, group_name, schedule: UnitSchedule,
                 grad_scale, precision: Precision):
        super().__init__()
        self.names, self.layouts, self.rank, self.world_size = list(names), layouts, rank, \
            world_size
        self.group_name, self.schedule, self.grad_scale = group_name, schedule, grad_scale
        self.precision = precision
        self.register("small_params")

    def extra_repr(self) -> str:
        return f"gathered once per step: {', '.join(self.names)}; rank {self.rank} of " \
               f"{self.world_size}"

    def gather(self, own):
        """`rtp::small_gather`: the full small parameters."""
        return distinct(ring_all_gather(self.precision.to_compute(own), self.layouts, self.rank,
                                        self.world_size, self.group_name,
                                        self.schedule.forward_tag, "small parameters"), own)

    @transaction.transactional
    def reduce_scatter(self, full_grads):
        """`rtp::small_reduce_scatter`: this rank's shards of the summed full gradients."""
        shards = ring_reduce_scatter(full_grads, self.layouts, self.rank, self.world_size,
                                     self.group_name, self.schedule.grad_tag, "small parameters",
                                     self.grad_scale, self.precision.reduce(self.layouts[0].dtype))
        # each gradient its own tensor: as views of the one accumulator message, any one of
        # them would keep all of it alive (and MemTracker counts it so)
        return [g.clone() if g._base is not None else g for g in shards]

    def forward(self, *own):
        if not torch.is_grad_enabled():
            return tuple(small_gather(self.rtp_key, list(own)))
        return _SmallGather.apply(self.rtp_key, *own)


@graph_op("unit_backward")
def unit_backward(key: str, dy: torch.Tensor, tensors: list[torch.Tensor], ints: list[int],
                  floats: list[float], kinds: list[int], need_dx: bool,
                  need_dw: bool) -> list[torch.Tensor]:
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
    own = rest[:len(lookup(key).roles)]
    return ([] if ticket is None else [ticket]) + ([x] if need_dx else []) + \
        (own if need_dw and ticket is None else [])


@unit_backward.op.register_fake
def _(key, dy, tensors, ints, floats, kinds, need_dx, need_dw):
    return [torch.empty_like(t) for t in _unit_grad_refs(key, decode(tensors, ints, floats, kinds),
                                                          need_dx, need_dw)]


@graph_op("gathered_forward")
def gathered_forward(key: str, tensors: list[torch.Tensor], ints: list[int],
                     floats: list[float], kinds: list[int]) -> list[torch.Tensor]:
    """Graph op: the gathered op registered under `key` on its inputs and own shards."""
    return lookup(key).forward_op(decode(tensors, ints, floats, kinds))


@gathered_forward.op.register_fake
def _(key, tensors, ints, floats, kinds):
    unit, values = lookup(key), decode(tensors, ints, floats, kinds)
    return unit.forward_op(values, unit.full_like(values[len(values) - len(unit.param_names):]))


@graph_op("gathered_backward")
def gathered_backward(key: str, douts: list[torch.Tensor], tensors: list[torch.Tensor],
                      ints: list[int], floats: list[float], kinds: list[int],
                      needs: list[bool]) -> list[torch.Tensor]:
    """Graph op: the backward of the gathered op registered under `key`: the gradients of
    those of its inputs and own shards that `needs` says."""
    values = decode(tensors, ints, floats, kinds)
    with autograd_in_op():  # it differentiates the op
        grads = lookup(key).backward_op(douts, values, needs)
    return laid_out_like(grads, [v for v, need in zip(values, needs) if need])


@gathered_backward.op.register_fake
def _(key, douts, tensors, ints, floats, kinds, needs):
    values = decode(tensors, ints, floats, kinds)
    return [torch.empty_like(v) for v, need in zip(values, needs) if need]


@graph_op("small_gather")
def small_gather(key: str, own: list[torch.Tensor]) -> list[torch.Tensor]:
    """Graph op: the small parameters of `SmallParamsGather` `key`, all-gathered."""
    return lookup(key).gather(own)


@small_gather.op.register_fake
def _(key, own):
    runtime = lookup(key)
    return [o.new_empty(lay.shape, dtype=runtime.precision.compute(lay.dtype))
            for o, lay in zip(own, runtime.layouts)]


@graph_op("small_reduce_scatter")
def small_reduce_scatter(key: str, full_grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Graph op: the small parameters' full gradients reduce-scattered into this rank's shards'."""
    return lookup(key).reduce_scatter(full_grads)


@small_reduce_scatter.op.register_fake
def _(key, full_grads):
    return [g.new_empty(lay.shard_shape, dtype=lay.dtype)
            for g, lay in zip(full_grads, lookup(key).layouts)]
