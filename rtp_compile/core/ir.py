"""The rank-generic program's vocabulary: the marker calls the passes write into the graph
(codegen replaces each one for a rank) and the label capture leaves on a node computed inside
an activation checkpoint."""
from __future__ import annotations

import torch.fx as fx

CHECKPOINT_KEY = "rtp_checkpoint"  # fx `custom` node meta: the activation checkpoint a node is in


def checkpoint_region(node: fx.Node) -> int | None:
    """The activation checkpoint a captured node was computed in (numbered in the order the
    forward entered them), None outside any."""
    return node.meta.get("custom", {}).get(CHECKPOINT_KEY)


def rotated_op(name: str, x, *params):
    """Marker of a rotated op in the rank-generic graph; codegen unrolls it for a rank."""
    raise RuntimeError(f"rotation unit {name!r} belongs to the rank-generic program: run the "
                       "module of a rank, prog.module(rank), not prog.graph")


def fused_block(name: str, x, *params_then_externals):
    """Marker of a fused block in the rank-generic graph; codegen unrolls it for a rank."""
    raise RuntimeError(f"fused block {name!r} belongs to the rank-generic program: run the "
                       "module of a rank, prog.module(rank), not prog.graph")


def gathered_op(name: str, *inputs):
    """Marker of a gathered op in the rank-generic graph; codegen calls its GatheredOpRuntime."""
    raise RuntimeError(f"gathered op {name!r} belongs to the rank-generic program: run the "
                       "module of a rank, prog.module(rank), not prog.graph")


def gathered_small(*params):
    """Marker of the small parameters gathered once per step (all of them, in one message per
    hop); codegen calls the runtime that gathers them and returns them whole."""
    raise RuntimeError("the small parameters belong to the rank-generic program: run the module "
                       "of a rank, prog.module(rank), not prog.graph")


def bucket_params(name: str, *own):
    """Marker: bucket `name`'s parameters pass through its runtime before its units read them
    (its backward reduce-scatters the bucket's gradients, `runtime.bucket`)."""
    raise RuntimeError(f"bucket {name!r} belongs to the rank-generic program: run "
                       "prog.module(rank)")


def unit_step(name: str, step: int, x, *held_then_externals):
    """Marker of forward step `step` of unit `name`; codegen traces the step for the shard the
    rank holds then."""
    raise RuntimeError(f"unit {name!r} belongs to the rank-generic program: run the module of a "
                       "rank, prog.module(rank), not prog.graph")


def unit_combine(name: str, parts):
    """Marker: the steps' partial outputs of unit `name` combined (codegen concatenates them
    in shard order, or sums them in step order right after each step)."""
    raise RuntimeError(f"unit {name!r} belongs to the rank-generic program: run prog.module(rank)")


def unit_autograd(name: str, y, x, *params_then_externals):
    """Marker: unit `name`'s runtime module, which links its combined output `y` into autograd
    (its backward executes the unit's backward events)."""
    raise RuntimeError(f"unit {name!r} belongs to the rank-generic program: run prog.module(rank)")
