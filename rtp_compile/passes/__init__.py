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


def compile_graph(gm, ctx):
    """Run the whole pipeline on `gm` for `ctx` (the rank-generic program comes out)."""
    return run_pipeline(PIPELINE, gm, ctx)


__all__ = ["PIPELINE", "compile_graph"]
