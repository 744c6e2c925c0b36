"""The autograd of rotation units and gathered ops, as modules the emitted graphs call.

A rotation unit's forward steps are emitted inline in the rank's graph and compute on detached
tensors; `RotatedOpRuntime` links their result into autograd. Its backward re-fetches the weight
shards by counter-clockwise rotation (never saved for backward: only the activation is), runs
the rule's backward step for each, and lets a gradient accumulator travel with each shard so it
arrives complete, averaged like DDP's, at the rank that owns it.

`GatheredOpRuntime` is the fallback for ops without a rule: ring all-gather of the parameters,
run the op once, free; backward gathers again, recomputes the op, and ring-reduce-scatters the
gradient.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from rtp_compile.layout import real_part
from rtp_compile.runtime import ring, transaction
from rtp_compile.runtime.events import UnitSchedule, backward_shard
from rtp_compile.runtime.precision import Precision


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
            ring.wait(self.incoming)
            self.acc, self.incoming = ring.unpack(self.incoming, specs), None

    def real_parts(self, shard: int) -> list[torch.Tensor]:
        return [real_part(a, lay.dim or 0, lay.slot(shard))
                for a, lay in zip(self.acc, self.layouts)]

    def pass_on(self, step: int, tag: int) -> None:
        self.incoming = ring.shift_start(self.acc, self.group_name, -1, tag,
                                         f"{self.where}: gradient hop {step}", pooled=False)
        self.acc = None

    def result(self, scale: float) -> list[torch.Tensor]:
        """The own shards' gradients, scaled, in the shards' dtype (a copy only where the
        reduce dtype is another)."""
        return [(a.mul_(scale) if scale != 1 else a).to(lay.dtype)
                for a, lay in zip(self.acc, self.layouts)]


class _UnitGrad(torch.autograd.Function):
    """Links a unit's result into autograd; saves the activation, the rank's own shards and
    whatever the unit keeps from its forward steps (`saved`), never a received shard."""

    @staticmethod
    def forward(ctx, unit, y, x, *tensors):
        ctx.unit, ctx.transaction = unit, transaction.current()
        ctx.bucket = unit.bucket.current if unit.bucket is not None else None
        _save(ctx, (x, *tensors))  # a fused block's externals may be sizes, not tensors
        return y

    @staticmethod
    @transaction.transactional
    def backward(ctx, dy):
        x, *rest = _saved(ctx)
        n_own = len(ctx.unit.roles)  # one own shard per role, then what the steps saved
        own, saved = [p.detach() for p in rest[:n_own]], rest[n_own:]
        needs = ctx.needs_input_grad
        own_needs = needs[3:3 + n_own]
        dx, grads = ctx.unit.backward(dy, x, own, saved, needs[2], any(own_needs), ctx.bucket)
        grads = grads or [None] * len(own)
        return (None, None, dx, *[g if need else None for g, need in zip(grads, own_needs)],
                *[None] * len(saved))


class UnitRuntime(nn.Module):
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

    def forward(self, y, x, *tensors):
        """y: the combined step outputs (computed outside autograd); then this rank's own
        shards, one per role, then what the steps saved for backward."""
        if not torch.is_grad_enabled():
            return y
        return _UnitGrad.apply(self, y, x, *tensors)

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
            if action == "fetch_start":
                fetch.start(j, event.tag)
            elif action == "fetch_wait":
                fetch.wait(j)
            elif action == "release":
                ring.pool.release()
            elif action == "done":
                fetch.done()
            elif action == "input_grad":
                shards = dict(zip(self.roles, own if j == n - 1 else fetch.held(j)))
                self.step_input_grad(s, dy, x, shards, slots, saved, dx, scratch)
            elif action == "receive_grad" and need_dw:
                grads.receive()
            elif action == "weight_grad":
                if need_dw:
                    shards = dict(zip(self.roles, own if j == n - 1 else fetch.held(j)))
                    self._add_weight_grads(s, dy, x, shards, slots, saved,
                                           dict(zip(self.roles, grads.real_parts(s))), scratch)
                del scratches[j]  # the step is done
            elif action == "pass" and need_dw:
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
        ring.wait(self.incoming)
        self.current = ring.unpack(self.incoming, ring.specs_of(self.own))

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
        received = ring.shift_start(held, group_name, 1, tag, f"{where}: gather hop {k}")
        ring.wait(received)
        held = shards[(rank - k) % world_size] = ring.unpack(received, ring.specs_of(own))
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
    @staticmethod
    def forward(ctx, unit, n_inputs, *values):
        inputs, own = values[:n_inputs], values[n_inputs:]
        ctx.unit, ctx.n_inputs, ctx.transaction = unit, n_inputs, transaction.current()
        _save(ctx, values)  # inputs and own shards; the gathered tensors are freed
        outputs = unit.run(inputs, unit.gather(own))
        return tuple(outputs) if isinstance(outputs, list) else outputs

    @staticmethod
    @transaction.transactional
    def backward(ctx, *douts):
        unit, n_inputs = ctx.unit, ctx.n_inputs
        saved = _saved(ctx)
        inputs, own = saved[:n_inputs], saved[n_inputs:]
        needs = ctx.needs_input_grad[2:]
        full = [p.requires_grad_(True) for p in unit.gather([p.detach() for p in own])]
        leaves = [v.detach().requires_grad_(need) if need else v
                  for v, need in zip(inputs, needs[:n_inputs])]
        with torch.enable_grad():
            outputs = unit.run(leaves, full)
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        pairs = [(o, d) for o, d in zip(outputs, douts)
                 if isinstance(o, torch.Tensor) and o.requires_grad and d is not None]
        wanted = [v for v, need in zip(leaves, needs[:n_inputs]) if need] + full
        grads = list(torch.autograd.grad([o for o, _ in pairs], wanted, [d for _, d in pairs],
                                         allow_unused=True) if pairs else [None] * len(wanted))
        input_grads = [grads.pop(0) if need else None for need in needs[:n_inputs]]
        param_grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, full)]
        shard_grads = unit.reduce_scatter(param_grads)
        return (None, None, *input_grads,
                *[g if need else None for g, need in zip(shard_grads, needs[n_inputs:])])


class GatheredOpRuntime(nn.Module):
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

    def extra_repr(self) -> str:
        return f"gathered: {self.reason}; rank {self.rank} of {self.world_size}"

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
        n_inputs = len(tensors) - len(self.param_names)
        if not torch.is_grad_enabled():
            return self.run(tensors[:n_inputs], self.gather(tensors[n_inputs:]))
        return _GatherGrad.apply(self, n_inputs, *tensors)


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
    @staticmethod
    def forward(ctx, runtime, *own):
        ctx.runtime, ctx.transaction = runtime, transaction.current()
        return tuple(runtime.gather(own))

    @staticmethod
    @transaction.transactional
    def backward(ctx, *full_grads):
        r = ctx.runtime
        grads = [torch.zeros(lay.shape, dtype=lay.dtype, device=r.device) if g is None else g
                 for g, lay in zip(full_grads, r.layouts)]
        shards = ring_reduce_scatter(grads, r.layouts, r.rank, r.world_size, r.group_name,
                                     r.schedule.grad_tag, "small parameters", r.grad_scale,
                                     r.precision.reduce(r.layouts[0].dtype))
        # each gradient its own tensor: as views of the one accumulator message, any one of
        # them would keep all of it alive (and MemTracker counts it so)
        return (None, *[g.clone() if g._base is not None else g for g in shards])


class SmallParamsGather(nn.Module):
    """Runtime of the small parameters gathered once per step: their shards all-gathered in one
    message per hop, the full tensors handed to the ops that read them; backward, once autograd
    has summed every use's gradient, one reduce-scatter of all of them."""

    def __init__(self, names, layouts, rank, world_size, group_name, schedule: UnitSchedule,
                 grad_scale, precision: Precision):
        super().__init__()
        self.names, self.layouts, self.rank, self.world_size = list(names), layouts, rank, \
            world_size
        self.group_name, self.schedule, self.grad_scale = group_name, schedule, grad_scale
        self.precision, self.device = precision, None

    def extra_repr(self) -> str:
        return f"gathered once per step: {', '.join(self.names)}; rank {self.rank} of " \
               f"{self.world_size}"

    def gather(self, own):
        return ring_all_gather(self.precision.to_compute(own), self.layouts, self.rank,
                               self.world_size, self.group_name, self.schedule.forward_tag,
                               "small parameters")

    def forward(self, *own):
        self.device = own[0].device
        if not torch.is_grad_enabled():
            return tuple(self.gather(own))
        return _SmallGather.apply(self, *own)
