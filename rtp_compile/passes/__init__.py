"""The passes of rtp_compile: `PIPELINE`, in the order they run.

Each pass is `(gm, ctx) -> gm` with one job and the invariant its docstring states, checked
after it runs (`passes.manager.pipeline`). Graph passes rewrite the graph; planning passes
(plan_sharding, fuse_blocks, gather_small_params, bucket_units) only write the plan in `ctx`
and leave every node as it was, which the pipeline checks. `transform(..., disable=[names])`
skips optional ones and `transform(..., debug=True)` logs and keeps each one's graph diff
(`prog.pass_log`). The graph analyses they share are in `passes.analysis`, the context and the
runner in `passes.manager`.

May import: `passes.analysis`, `passes.manager`, `runtime`, `core`.
"""

from rtp_compile.passes.bucket import bucket_units
from rtp_compile.passes.cast_precision import cast_precision
from rtp_compile.passes.fold_parameter_metadata import fold_parameter_metadata
from rtp_compile.passes.fuse import fuse_blocks
from rtp_compile.passes.gather_small import gather_small_params
from rtp_compile.passes.lower_modules import lower_modules
from rtp_compile.passes.manager.pipeline import run_pipeline
from rtp_compile.passes.plan import plan_sharding
from rtp_compile.passes.rotate import rotate
from rtp_compile.passes.schedule import schedule
from rtp_compile.passes.split_norm_affine import split_norm_affine

PIPELINE = [
    lower_modules,  # fx module calls -> torch functions (function level)
    fold_parameter_metadata,  # w.shape, w.size() -> constants (function level)
    split_norm_affine,  # norm(x, w, b) -> norm(x) * w + b: the affine rotates
    plan_sharding,  # ctx.plan: a layout per parameter, a unit per weight-bearing op
    fuse_blocks,  # ctx.plan: MLP / attention blocks as one unit where exact
    gather_small_params,  # ctx.plan: norm affines and other tiny units gathered per step
    rotate,  # weight-bearing ops -> unit markers, bodies into ctx.bodies
    bucket_units,  # ctx.buckets: consecutive units sharing one message per step
    cast_precision,  # mixed precision: inputs to param_dtype, outputs to output_dtype
    schedule,  # markers -> steps and ring hops; backward events into ctx
]


def plan_graph(gm, ctx):
    """Run the pipeline on `gm` up to `schedule`: the plan, bodies and buckets in `ctx`, the
    units as markers in the graph (its size that of the model's graph, whatever N)."""
    return run_pipeline(PIPELINE[: PIPELINE.index(schedule)], gm, ctx, pipeline=PIPELINE)


def write_steps(gm, ctx):
    """Run the rest of the pipeline on what `plan_graph` made: every unit's N steps and hops
    written into the graph (O(units x N) nodes; only rank emission and inspection read them)."""
    return run_pipeline(PIPELINE[PIPELINE.index(schedule) :], gm, ctx, pipeline=PIPELINE)


__all__ = ["PIPELINE", "plan_graph", "write_steps"]
