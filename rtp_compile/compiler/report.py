"""`prog.report()`: every weight-bearing op of a program, how it runs and why."""

from __future__ import annotations

from rtp_compile.core.ir import UnitKind
from rtp_compile.passes.manager.context import Context


def report(ctx: Context) -> str:
    """Every weight-bearing op: rotated (rule, mode, dims) or gathered (why), bytes per rank."""
    lines = [f"rtp_compile program for {ctx.world_size} ranks"]
    precision = ctx.precision
    if precision.param_dtype or precision.reduce_dtype:
        lines.append(
            f"  mixed precision: shards kept in their dtype; compute and rotation "
            f"in {precision.param_dtype or 'their dtype'}, gradients reduced in "
            f"{precision.reduce_dtype or precision.param_dtype}"
        )
    for u in ctx.plan.units:
        layouts = [ctx.plan.params[p] for p in u.params.values()]
        held = sum(lay.shard_bytes for lay in layouts)
        dims = ", ".join(f"{p} dim {ctx.plan.params[p].dim}" for p in u.params.values())
        if u.kind == UnitKind.ROTATE:
            lines.append(
                f"  rotated  {u.name}: {u.call.rule.name} {u.mode} [{u.target}] "
                f"({dims}); {held:,} B/rank"
            )
        elif u.kind == UnitKind.FUSED and u.fusion.attention:
            f = u.fusion
            lines.append(
                f"  fused    {u.name}: attention heads of {len(f.columns)} "
                f"projection(s) through {f.tail.params['weight'].rpartition('.')[0]}, "
                f"{f.groups} head "
                f"group(s) cut whole, up to {-(-f.groups // ctx.world_size)} per "
                f"rank; one ring pass, heads never concatenated [{u.target}] "
                f"({dims}); {held:,} B/rank"
            )
        elif u.kind == UnitKind.FUSED:
            lines.append(
                f"  fused    {u.name}: {len(u.fusion.columns)} linear(s) -> "
                f"{len(u.fusion.region)} pointwise op(s) -> linear, one ring pass, "
                f"hidden {u.fusion.hidden} never concatenated [{u.target}] "
                f"({dims}); {held:,} B/rank"
            )
        elif u.kind == UnitKind.SMALL:
            lines.append(
                f"  small    {u.name}: {u.target} ({', '.join(u.params.values())}) "
                f"gathered once per step with the other small parameters (one "
                f"message per hop for all); {held:,} B/rank"
            )
        else:
            lines.append(
                f"  gathered {u.name}: {u.target} ({', '.join(u.params.values())}) "
                f"because {u.reason}; {held:,} B/rank"
            )
    for tail, why in ctx.plan.unfused.items():
        lines.append(
            f"  attention through {tail} not fused (its projections rotate one by "
            f"one) because {why}"
        )
    unused = [n for n in ctx.plan.params if ctx.plan.strategy(n) == "unused"]
    if unused:
        lines.append(f"  unused parameters (sharded, never read): {', '.join(unused)}")
    return "\n".join(lines)
