"""Per-rank memory and traffic of one training step, as sympy expressions in N (ranks) and A
(the activations the model keeps for one batch): RTP from its plan, DDP and FSDP2 from the
same model, so they can be compared before anything runs.

Model state is exact: a parameter cut into N padded shards holds ceiling(extent/N) slices, its
gradient the same, AdamW two more (its `step` counters are scalars). Activations are measured
(`cost.profile`: the order in which a forward on fake tensors saves them, next to the moments
each parameter is last used). The peak walks that order: forward end (all activations),
backward (activations of the ops not yet differentiated + gradients already produced), the
optimizer step (gradients + its temporaries), each with the transient buffers of that phase.

Invariant: `param_bytes`, `grad_bytes`, `optimizer_bytes` and `traffic_bytes` equal what the
emitted programs allocate and send (tests measure them); the peak is a model (tests hold it
within 10% of MemTracker's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import sympy
import torch

from rtp_compile.core.ir import UnitKind
from rtp_compile.cost.profile import Profile
from rtp_compile.cost.time import StepTime
from rtp_compile.runtime.precision import Precision

N, A = sympy.symbols("N A", positive=True, integer=True)
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1, "adagrad": 1}
_POWERS_OF_TWO = [2**k for k in range(11)]


@dataclass
class Cost:
    """Per-rank bytes of one training step (`expressions`: the same as sympy in N and A)."""

    kind: str
    world_size: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    transient_bytes: int
    activation_bytes: int
    peak_bytes: int
    traffic_bytes: int
    expressions: dict[str, sympy.Expr] = field(default_factory=dict, repr=False)
    time: StepTime | None = None  # the time model's step, where a hardware was given

    @property
    def step_time(self) -> float | None:
        """Predicted seconds of the step (`time`: its parts), None without a hardware."""
        return None if self.time is None else self.time.step_s

    FIELDS = (
        "param_bytes",
        "grad_bytes",
        "optimizer_bytes",
        "transient_bytes",
        "activation_bytes",
        "peak_bytes",
        "traffic_bytes",
    )

    def at(self, world_size: int) -> Cost:
        """These expressions evaluated for another number of ranks: the same plan with
        shards of that size (`prog.for_world_size(n).cost(...)` plans for n itself); no step
        time (that needs the plan for n)."""
        return _evaluate(self.kind, world_size, self.expressions, self.activation_bytes)

    def __str__(self) -> str:
        rows = [
            (
                f.removesuffix("_bytes"),
                f"{getattr(self, f) / 2**20:,.2f}",
                str(self.expressions.get(f, "")),
            )
            for f in self.FIELDS
        ]
        width = [max(len(r[i]) for r in rows) for i in range(2)]
        head = f"{self.kind} cost per rank, N={self.world_size} (MiB; A = activation bytes)"
        return "\n".join(
            [head]
            + [f"  {a.ljust(width[0])}  {b.rjust(width[1])}   {c}" for a, b, c in rows]
            + ([f"  {self.time}"] if self.time is not None else [])
        )


# -- the three kinds of parallelism ----------------------------------------------------------
def shard_expr(extent: int, rest: int, element: int, granule: int = 1) -> sympy.Expr:
    """Bytes of one padded shard: ceiling(extent / (N granule)) granules of `rest` elements."""
    return sympy.ceiling(sympy.Integer(extent) / (N * granule)) * granule * rest * element


def _layout_expr(layout, element: int) -> sympy.Expr:
    extent = layout.extent
    rest = math.prod(layout.shape) // max(extent, 1) if layout.dim is not None else 1
    return shard_expr(extent, rest, element, getattr(layout, "granule", 1))


def _optimizer_states(optimizer: str) -> int:
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(
            f"rtp_compile.cost: optimizer must be one of {sorted(OPTIMIZER_STATES)}, "
            f"got {optimizer!r}"
        )
    return OPTIMIZER_STATES[optimizer]


def _curve(
    profile: Profile,
    grad_of: dict[str, sympy.Expr],
    buffers_at: dict[int, sympy.Expr],
    backward: bool,
) -> sympy.Expr:
    """Max over the points of a forward (activations saved so far) or backward (activations not
    yet freed + gradients already produced), plus the buffers the op at that point has in flight.

    Candidates are the points that are maximal for some N in 1, 2, 4, ..., 1024 (a large model
    has thousands of points; only these can be the maximum in that range)."""
    cumulative = [0]
    for b in profile.saved:
        cumulative.append(cumulative[-1] + b)
    produced_at: dict[int, list[str]] = {}
    for name, point in profile.last_use.items():
        produced_at.setdefault(point, []).append(name)

    def numbers(e) -> list[float]:
        return [
            float(e.subs(N, n)) if isinstance(e, sympy.Expr) else float(e) for n in _POWERS_OF_TWO
        ]

    by_expr = {e: numbers(e) for e in set(grad_of.values())}  # blocks repeat their shards'
    grad_numbers = {name: by_expr[e] for name, e in grad_of.items()}
    buffer_numbers = {e: numbers(e) for e in set(buffers_at.values())}
    zero = [0.0] * len(_POWERS_OF_TWO)
    extra_numbers, grads = {}, zero
    for i in range(len(profile.saved), -1, -1):  # backward walks the forward order in reverse
        if backward:
            for name in produced_at.get(i, []):
                grads = [g + d for g, d in zip(grads, grad_numbers.get(name, zero))]
        held = buffer_numbers[buffers_at[i]] if i in buffers_at else zero
        extra_numbers[i] = [g + h for g, h in zip(grads, held)]
    # the maximum is sought numerically; only the points that win for some N get expressions
    keep = {
        max(extra_numbers, key=lambda i: cumulative[i] + extra_numbers[i][k])
        for k in range(len(_POWERS_OF_TWO))
    }

    def extra(i) -> sympy.Expr:
        produced = (
            [grad_of.get(name, 0) for p, names in produced_at.items() if p >= i for name in names]
            if backward
            else []
        )
        return sympy.Add(*produced) + buffers_at.get(i, 0)

    scale = A / max(profile.activation_bytes, 1)  # activations enter as a share of A
    curve = [cumulative[i] * scale + extra(i) for i in sorted(keep)]
    return _max(*curve)


def _max(*args) -> sympy.Expr:
    """The largest of `args`, as an unevaluated sympy Max of the distinct ones: sympy's own
    simplification of a Max compares every pair of arguments symbolically, which costs seconds
    on a deep model's memory curve; the numbers come from substituting N and A (`_evaluate`)."""
    distinct = list(dict.fromkeys(sympy.sympify(a) for a in args))
    return distinct[0] if len(distinct) == 1 else sympy.Max(*distinct, evaluate=False)


def _buffers_at(units: list[tuple[set[int], sympy.Expr]]) -> dict:
    """Point -> the largest buffers of a unit (or bucket) held at that point (each distinct
    set of candidates made into one expression once: the blocks of a model repeat them)."""
    at: dict[int, list] = {}
    for points, buffers in units:
        for point in points:
            at.setdefault(point, []).append(buffers)
    largest: dict[tuple, sympy.Expr] = {}
    for b in map(tuple, at.values()):
        if b not in largest:
            largest[b] = _max(*b)
    return {p: largest[tuple(b)] for p, b in at.items()}


def _evaluate(kind, world_size, exprs, activation_bytes) -> Cost:
    at = {N: sympy.Integer(world_size), A: sympy.Integer(activation_bytes)}
    values = {  # xreplace: both symbols at once, so each Max is rebuilt on numbers only
        f: int(sympy.ceiling(e.xreplace(at))) if isinstance(e, sympy.Expr) else int(e)
        for f, e in exprs.items()
    }
    return Cost(kind, world_size, **values, expressions=exprs)


def _state(param_exprs: dict[str, sympy.Expr], n_params: int, optimizer: str):
    params = sympy.Add(*param_exprs.values())
    states = _optimizer_states(optimizer)
    steps = 4 * n_params if states else 0  # AdamW/Adam/Adagrad keep a float32 step per tensor
    return params, params, states * params + steps


def _ring_dtypes(plan, dtype, precision: Precision):
    """Parameter -> the dtype its weights rotate in, and the one its gradients are summed in."""
    stored = {n: dtype or lay.dtype for n, lay in plan.params.items()}
    return (
        {n: precision.compute(d) for n, d in stored.items()},
        {n: precision.reduce(d) for n, d in stored.items()},
    )


def _message(plan, names, dtypes) -> sympy.Expr:
    """One flat message of the shards of `names` in `dtypes` (weights: as they rotate)."""
    message = sympy.Add(*[_layout_expr(plan.params[n], dtypes[n].itemsize) for n in names])
    if len({dtypes[n] for n in names}) > 1:  # aligned byte message
        message += 16 * len(names)
    return message


def rtp_messages(
    plan, buckets: dict, world_size: int, dtype=None, precision: Precision = Precision()
) -> dict[str, tuple[float, float]]:
    """Unit or bucket name (and "small": all small units) -> bytes of its weight message and of
    its gradient message, one hop each, at `world_size` (what `rtp_cost` counts as traffic)."""
    rotating, reducing = _ring_dtypes(plan, dtype, precision)

    def both(names) -> tuple[float, float]:
        return tuple(  # type: ignore[return-value]
            float(_message(plan, names, d).subs(N, world_size)) for d in (rotating, reducing)
        )

    units = {u.name: u for u in plan.units}
    out = {
        b: both([p for m in members for p in units[m].params.values()])
        for b, members in buckets.items()
    }
    small = list(
        dict.fromkeys(p for u in plan.units if u.kind == UnitKind.SMALL for p in u.params.values())
    )
    if small:
        out["small"] = both(small)
    for u in plan.units:
        if u.kind != UnitKind.SMALL:
            out[u.name] = both(list(u.params.values()))
    return out


def rtp_cost(
    plan,
    profile: Profile,
    optimizer: str = "adamw",
    dtype=None,
    buckets=(),
    precision: Precision = Precision(),
) -> Cost:
    """RTP: every parameter, gradient and optimizer state is a 1/N shard. A rotated unit has
    its flat messages in flight (2 forward: held + incoming; 4 backward: weights and gradient
    accumulators, held + incoming); a gathered op its full tensors. Every unit sends
    3 (N - 1) messages a step (forward, backward weights, gradient accumulators); the small
    units together 2 (N - 1) (one all-gather, one reduce-scatter), held whole. A bucket
    (`buckets`: tuples of unit names) sends 3 (N - 1) messages of all its units' shards and
    holds, from its first unit's parameter read to its last, the messages that arrived
    (max(2, N - 1) with the outgoing one) forward, those and its N gradient rows backward.
    Under mixed precision (`precision`) weights travel in the compute dtype, gradient
    accumulators in the reduce dtype; the state stays in the parameters' dtype."""
    element = {n: (dtype or lay.dtype).itemsize for n, lay in plan.params.items()}
    shard = {n: _layout_expr(lay, element[n]) for n, lay in plan.params.items()}
    rotating, reducing = _ring_dtypes(plan, dtype, precision)
    params, grads, opt = _state(shard, len(plan.params), optimizer)
    ring = sympy.Min(N - 1, 1)  # one rank has no ring: nothing in flight
    forward_units, backward_units, traffic = [], [], sympy.Integer(0)

    def read_at(names) -> set[int]:
        return {p for n in names for p in profile.uses.get(n, [])}

    def message_of(names, dtypes=rotating):
        return _message(plan, names, dtypes)

    def full_of(names):
        return sum(math.prod(plan.params[n].shape) * rotating[n].itemsize for n in names)

    small = list(
        dict.fromkeys(p for u in plan.units if u.kind == UnitKind.SMALL for p in u.params.values())
    )
    if small:  # one all-gather forward, one reduce-scatter backward, for all of them
        message, grad = message_of(small), message_of(small, reducing)
        traffic += (N - 1) * (message + grad)
        full = full_of(small)
        forward_units.append((read_at(small), full + 2 * ring * message))
        backward_units.append((read_at(small), 2 * full + 2 * ring * grad))
    units = {u.name: u for u in plan.units}
    bucketed = {m for members in buckets for m in members}
    for members in buckets:
        names = [p for m in members for p in units[m].params.values()]
        message, grad = message_of(names), message_of(names, reducing)
        traffic += (N - 1) * (2 * message + grad)
        uses = read_at(names)
        span = set(range(min(uses), max(uses) + 1)) if uses else set()
        arrived = ring * _max(2, N - 1) * message
        forward_units.append((span, arrived))
        backward_units.append((span, arrived + ring * N * grad))
    for unit in plan.units:
        if unit.kind == UnitKind.SMALL or unit.name in bucketed:
            continue
        names = list(unit.params.values())
        message, grad = message_of(names), message_of(names, reducing)
        traffic += (N - 1) * (2 * message + grad)
        if unit.kind == UnitKind.GATHER:
            full = full_of(names)
            forward_units.append((read_at(names), full + 2 * ring * message))
            backward_units.append((read_at(names), 2 * full + 2 * ring * grad))  # + grads
        else:
            forward_units.append((read_at(names), 2 * ring * message))
            backward_units.append((read_at(names), 2 * ring * (message + grad)))
    transient = _max(*[b for _, b in backward_units]) if backward_units else sympy.Integer(0)
    largest_shard = _max(*shard.values()) if shard else sympy.Integer(0)
    exprs = {
        "param_bytes": params,
        "grad_bytes": grads,
        "optimizer_bytes": opt,
        "transient_bytes": transient,
        "activation_bytes": A,
        "traffic_bytes": traffic,
    }
    forward = _curve(profile, shard, _buffers_at(forward_units), backward=False)
    backward = (
        _curve(profile, shard, _buffers_at(backward_units), backward=True) + profile.output_bytes
    )  # the output's gradient
    step = grads + 2 * largest_shard  # single-tensor AdamW: two shard-sized temporaries
    exprs["peak_bytes"] = params + opt + _max(forward, backward, step)
    return _evaluate("rtp", plan.world_size, exprs, profile.activation_bytes)


def ddp_cost(
    params: dict[str, torch.Tensor],
    profile: Profile,
    world_size: int,
    optimizer: str = "adamw",
    dtype=None,
) -> Cost:
    """DDP: full replicas of parameters, gradients and optimizer state, plus its gradient
    buckets (a second copy of the gradients, kept for the life of the module); a ring
    all-reduce of the gradients each step."""
    full = {n: sympy.Integer(p.numel() * (dtype or p.dtype).itemsize) for n, p in params.items()}
    p_bytes, grads, opt = _state(full, len(params), optimizer)
    buckets = grads
    exprs = {
        "param_bytes": p_bytes,
        "grad_bytes": grads,
        "optimizer_bytes": opt,
        "transient_bytes": buckets,
        "activation_bytes": A,
        "traffic_bytes": 2 * (N - 1) / N * grads,
    }
    backward = _curve(profile, full, {}, backward=True) + profile.output_bytes
    step = grads + 2 * _max(*full.values())
    exprs["peak_bytes"] = p_bytes + opt + buckets + _max(A, backward, step)
    return _evaluate("ddp", world_size, exprs, profile.activation_bytes)


def fsdp_cost(
    params: dict[str, torch.Tensor],
    profile: Profile,
    world_size: int,
    blocks: list[list[str]],
    optimizer: str = "adamw",
    dtype=None,
) -> Cost:
    """FSDP2 (`fully_shard` per block, then the root): 1/N of every parameter, gradient and
    optimizer state (each cut evenly on dim 0); a block's parameters all-gathered while the
    next one's are prefetched, in backward also its unsharded gradients before the
    reduce-scatter. Traffic: all-gather forward and backward, reduce-scatter (the root's
    parameters, unsharded from forward to backward, are gathered once)."""
    element = {n: (dtype or p.dtype).itemsize for n, p in params.items()}
    shard = {
        n: sympy.ceiling(sympy.Integer(p.shape[0] if p.dim() else 1) / N)
        * (p.numel() // max(p.shape[0], 1) if p.dim() else 1)
        * element[n]
        for n, p in params.items()
    }
    p_bytes, grads, opt = _state(shard, len(params), optimizer)
    ring = sympy.Min(N - 1, 1)
    forward_units, backward_units = [], []
    sizes = [sympy.Integer(sum(params[n].numel() * element[n] for n in names)) for names in blocks]
    root = ring * sum(
        (size for names, size in zip(blocks, sizes) if names is blocks[-1]), sympy.Integer(0)
    )  # the root stays unsharded from forward to backward

    def read_at(names) -> set[int]:
        return {p for n in names for p in profile.uses.get(n, [])}

    for names, full in zip(blocks[:-1], sizes):
        forward_units.append((read_at(names), root + 2 * ring * full))  # + the prefetched one
        backward_units.append((read_at(names), root + 3 * ring * full))  # + unsharded grads
    forward_units.append((read_at(blocks[-1]), root))
    backward_units.append((read_at(blocks[-1]), 2 * root))
    total = sympy.Integer(sum(p.numel() * element[n] for n, p in params.items()))
    exprs = {
        "param_bytes": p_bytes,
        "grad_bytes": grads,
        "optimizer_bytes": opt,
        "transient_bytes": _max(*[b for _, b in backward_units]),
        "activation_bytes": A,
        "traffic_bytes": (N - 1) / N * (3 * total - sizes[-1]),  # the root: gathered once
    }
    forward = _curve(profile, shard, _buffers_at(forward_units), backward=False)
    backward = (
        _curve(profile, shard, _buffers_at(backward_units), backward=True) + profile.output_bytes
    )
    step = grads + 2 * _max(*shard.values())
    exprs["peak_bytes"] = p_bytes + opt + _max(forward, backward, step)
    return _evaluate("fsdp2", world_size, exprs, profile.activation_bytes)


def fsdp_blocks(names: list[str]) -> list[list[str]]:
    """How `fully_shard` per block groups parameters: each element of a ModuleList (a path
    component that is a number) is a block; everything else belongs to the root, listed last."""
    blocks: dict[str, list[str]] = {"": []}
    for name in names:
        parts = name.split(".")
        index = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        key = ".".join(parts[: index + 1]) if index is not None else ""
        blocks.setdefault(key, []).append(name)
    root = blocks.pop("")
    return list(blocks.values()) + [root]
