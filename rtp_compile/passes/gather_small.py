"""Very small elementwise units (a norm's affine, a layer scale, a bias alone) -> gathered once
per step, all of them together, instead of rotated one by one.

A rotated unit sends 3 (N - 1) ring messages a step whatever its size, and on a CPU every
message costs gloo a few hundred microseconds: for a norm's affine that is all cost and no
memory saved. Every elementwise unit whose parameters hold at most
`ctx.options.small_param_bytes` (full size) becomes kind "small": the shards of all of them
are all-gathered in one message per hop before the first needs them, and their gradients are
reduce-scattered in one message per hop once backward has summed every use. They are then held
whole through the step: together a few KiB (`prog.report()` lists them).

Invariant: a parameter is small only if every unit that reads it is small (nothing is both
rotated and held whole); layouts are unchanged, so shards, optimizer state and checkpoints stay
1/N of every parameter.
"""

from __future__ import annotations

import math

import torch.fx as fx

from rtp_compile.core.ir import UnitKind
from rtp_compile.passes.manager.pipeline import InvariantError, graph_pass
from rtp_compile.passes.plan import check_plan

REASON = "small: gathered once per step with the other small parameters"


def _check(gm: fx.GraphModule, ctx) -> None:
    check_plan(gm, ctx)
    units = ctx.plan.units
    small = {p for u in units if u.kind == UnitKind.SMALL for p in u.params.values()}
    mixed = sorted(
        {p for u in units if u.kind != UnitKind.SMALL for p in u.params.values()} & small
    )
    if mixed:
        raise InvariantError(f"parameters both small and rotated or gathered: {mixed}")
    if any(u.kind == UnitKind.SMALL and u.call.rule.name != "elementwise" for u in units):
        raise InvariantError("a unit other than an elementwise one was made small")


def unit_bytes(plan, unit) -> int:
    """The full (unsharded) bytes of a unit's parameters."""
    return sum(
        math.prod(plan.params[p].shape) * plan.params[p].dtype.itemsize
        for p in unit.params.values()
    )


@graph_pass(check=_check, plans_only=True)
def gather_small_params(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Mark, in `ctx.plan`, the elementwise units of at most `small_param_bytes` as small."""
    plan, limit = ctx.plan, ctx.options.small_param_bytes
    candidates = {
        u.name
        for u in plan.units
        if u.kind == UnitKind.ROTATE
        and u.call.rule.name == "elementwise"
        and unit_bytes(plan, u) <= limit
    }
    elsewhere = {p for u in plan.units if u.name not in candidates for p in u.params.values()}
    for unit in plan.units:
        if unit.name in candidates and not set(unit.params.values()) & elsewhere:
            unit.kind, unit.reason = UnitKind.SMALL, REASON
    return gm
