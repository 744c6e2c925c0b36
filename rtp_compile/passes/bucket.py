"""Consecutive units -> buckets whose shards travel in one ring message per step.

Every rotated or fused unit sends its own messages: N - 1 forward, N - 1 backward weight
fetches and N - 1 gradient accumulators, whatever its size; on a CPU ring each message costs a
fixed few hundred microseconds. A bucket packs the shards of consecutive units (graph order;
small and gathered units, which travel their own way, do not break a run) into one message
per step: its first unit's steps carry the hops, the later units compute from what arrived.
Since a unit needs the whole output of the one before, a later unit's shards must be kept from
the step they arrive until it runs: a bucket is held gathered through its forward and its
backward (its weights and its gradients, as FSDP2 holds a block's), and its gradients are
reduce-scattered in one message per hop after its last unit's backward (the schedule pass
writes the steps, `runtime.bucket` runs them).

`ctx.options.bucket_bytes` bounds what a bucket holds gathered: N times its message, i.e. the
full bytes of its weights, padding included (0: no buckets, every unit its own messages;
"auto": the bound `ctx.bucket_chooser` picks among the groupings `group_units` makes, which the
compiler sets to the time model's fastest under the memory budget).

Invariant: every bucket has at least two units, each a rotated or fused unit in at most one
bucket; a bucket's units follow each other in the graph with no other rotated or fused unit
between; no unit of a bucket reads a parameter that another unit reads too (a tied weight
would travel twice, or its gradient, added into the other unit's, would keep the bucket's
whole gradient message alive); a bucket's
parameters have one dtype (its gradient rows add as one flat tensor); a bucket's units are in
the same activation checkpoint of the model, or in none (a recomputed region re-runs its own
hops only); a bucket holds at most `bucket_bytes`.
"""

from __future__ import annotations

import torch.fx as fx

from rtp_compile.core.ir import checkpoint_region, fused_block, rotated_op
from rtp_compile.passes.manager.pipeline import InvariantError, graph_pass


def bucket_message_bytes(plan, units) -> int:
    """The bytes of one step's message of these units' shards."""
    return sum(plan.params[p].shard_bytes for u in units for p in u.params.values())


def _tied(plan) -> set[str]:
    """The units that read a parameter some other unit reads too."""
    readers: dict[str, list[str]] = {}
    for u in plan.units:
        for p in set(u.params.values()):
            readers.setdefault(p, []).append(u.name)
    return {u for names in readers.values() if len(names) > 1 for u in names}


def _dtypes(plan, units) -> set:
    return {plan.params[p].dtype for u in units for p in u.params.values()}


def rotating_units_in_order(gm: fx.GraphModule, ctx) -> list:
    """The rotated and fused units of the plan in the order their markers run."""
    units = {u.name: u for u in ctx.plan.units}
    return [units[n.args[0]] for n in gm.graph.nodes if n.target in (rotated_op, fused_block)]


def checkpoint_regions(gm: fx.GraphModule) -> dict[str, int | None]:
    """Each rotated and fused unit's activation checkpoint of the model (None: none)."""
    return {
        n.args[0]: checkpoint_region(n)
        for n in gm.graph.nodes
        if n.target in (rotated_op, fused_block)
    }


def default_budget(ctx, units) -> int:
    """What the largest unit holds gathered (N times its message): by default no bucket holds
    more than its largest unit would whole."""
    return ctx.world_size * max((bucket_message_bytes(ctx.plan, [u]) for u in units), default=0)


def bucket_budget(ctx, units) -> int:
    """`bucket_bytes`, the chosen one where it is "auto", or by default `default_budget`."""
    if ctx.options.bucket_bytes == "auto":
        return ctx.bucket_choice.chosen
    if ctx.options.bucket_bytes is not None:
        return ctx.options.bucket_bytes
    return default_budget(ctx, units)


def _check(gm: fx.GraphModule, ctx) -> None:
    rotating = rotating_units_in_order(gm, ctx)
    order, budget = [u.name for u in rotating], bucket_budget(ctx, rotating)
    position = {name: i for i, name in enumerate(order)}
    regions, tied = checkpoint_regions(gm), _tied(ctx.plan)
    units = {u.name: u for u in ctx.plan.units}
    seen: set[str] = set()
    for name, members in ctx.buckets.items():
        if len(members) < 2 or seen & set(members):
            raise InvariantError(f"bucket {name}: {members} (fewer than two, or shared units)")
        seen |= set(members)
        at = position[members[0]]
        if list(order[at : at + len(members)]) != list(members):
            raise InvariantError(f"bucket {name}: {members} do not follow each other")
        if tied.intersection(members):
            raise InvariantError(f"bucket {name}: a unit reads a parameter another unit reads")
        if len(_dtypes(ctx.plan, [units[m] for m in members])) != 1:
            raise InvariantError(f"bucket {name}: its parameters' dtypes differ")
        if len({regions[m] for m in members}) > 1:
            raise InvariantError(
                f"bucket {name}: its units are in different activation checkpoints"
            )
        held = ctx.world_size * bucket_message_bytes(ctx.plan, [units[m] for m in members])
        if held > budget:
            raise InvariantError(f"bucket {name} holds {held} bytes, over bucket_bytes {budget}")


def group_units(gm: fx.GraphModule, ctx, budget: int) -> dict[str, tuple[str, ...]]:
    """The buckets (name -> unit names) of consecutive rotated and fused units, greedily in
    graph order, while what a bucket holds fits `budget` and its parameters share a dtype and
    an activation checkpoint; units of tied weights stay alone."""
    n, units = ctx.world_size, rotating_units_in_order(gm, ctx)
    if n == 1 or budget == 0:
        return {}
    runs: list[list] = [[]]
    tied, regions = _tied(ctx.plan), checkpoint_regions(gm)
    for unit in units:
        current = runs[-1]
        if unit.name in tied:
            runs += [[unit], []]
            continue
        if current and (
            len(_dtypes(ctx.plan, [*current, unit])) > 1
            or regions[current[0].name] != regions[unit.name]
            or n * bucket_message_bytes(ctx.plan, [*current, unit]) > budget
        ):
            runs.append([])
        runs[-1].append(unit)
    return {f"{run[0].name}_bucket": tuple(u.name for u in run) for run in runs if len(run) > 1}


@graph_pass(check=_check, plans_only=True)
def bucket_units(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """`ctx.buckets` = `group_units` at `bucket_bytes` (with "auto": at the size
    `ctx.bucket_chooser` picks, recorded in `ctx.bucket_choice`)."""
    if ctx.options.bucket_bytes == "auto" and ctx.bucket_choice is None:
        if ctx.bucket_chooser is None:
            raise InvariantError('bucket_bytes="auto" needs a bucket_chooser in the context')
        ctx.bucket_choice = ctx.bucket_chooser(ctx, lambda budget: group_units(gm, ctx, budget))
    ctx.buckets = group_units(gm, ctx, bucket_budget(ctx, rotating_units_in_order(gm, ctx)))
    return gm
