"""Norms with affine parameters -> the same norm without them, then `affine(x, weight, bias, dim)`.

The statistics of a norm need the whole normalised extent, but its weight and bias act
elementwise; split off, they can be rotated in shards like any elementwise parameter.

Invariant: the graph computes the same values (up to floating-point rounding of one fused
multiply-add); no norm reads a parameter any more; norms whose weight and bias are not
parameters are left as they were.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from rtp_compile.core.graph_ops import affine, batch_norm_module
from rtp_compile.passes.analysis.chains import op_key
from rtp_compile.passes.analysis.match import parameter_reads
from rtp_compile.passes.manager.pipeline import InvariantError, graph_pass

aten = torch.ops.aten

# norm op -> (weight arg name, bias arg name or None, `affine` dim: -1 right-aligned, 1 channel)
NORMS = {
    F.layer_norm: ("weight", "bias", -1),
    aten.layer_norm.default: ("weight", "bias", -1),
    F.rms_norm: ("weight", None, -1),
    aten.rms_norm.default: ("weight", None, -1),
    F.group_norm: ("weight", "bias", 1),
    aten.group_norm.default: ("weight", "bias", 1),
    F.batch_norm: ("weight", "bias", 1),
    aten.batch_norm.default: ("weight", "bias", 1),
    batch_norm_module: ("weight", "bias", 1),
    aten.native_layer_norm.default: ("weight", "bias", -1),  # (out, mean, rstd): affine on out
}
TUPLE_NORMS = {aten.native_layer_norm.default}


def _norm_arguments(node: fx.Node, gm: fx.GraphModule) -> dict | None:
    """A norm node's arguments by name; None for other nodes (or norms fx cannot normalise)."""
    if node.op != "call_function" or op_key(node.target) not in NORMS:
        return None
    bound = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True)
    return None if bound is None else dict(bound.kwargs)


def _check(gm: fx.GraphModule, ctx) -> None:
    reads = parameter_reads(gm)
    left = [
        n.name
        for n in gm.graph.nodes
        if (kwargs := _norm_arguments(n, gm)) is not None
        and any(v in reads for v in kwargs.values() if isinstance(v, fx.Node))
    ]
    if left:
        raise InvariantError(f"split_norm_affine left norms reading parameters: {left}")


@graph_pass(check=_check)
def split_norm_affine(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Move the weight and bias of every norm with parameters into an `affine` node after it."""
    reads = parameter_reads(gm)
    for node in list(gm.graph.nodes):
        kwargs = _norm_arguments(node, gm)
        if kwargs is None:
            continue
        target = op_key(node.target)
        weight_arg, bias_arg, dim = NORMS[target]
        weight = kwargs.get(weight_arg)
        bias = kwargs.get(bias_arg) if bias_arg else None
        if not any(v in reads for v in (weight, bias) if isinstance(v, fx.Node)):
            continue
        kwargs[weight_arg] = None
        if bias_arg:
            kwargs[bias_arg] = None
        node.args, node.kwargs = (), kwargs
        outputs = (
            [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
            if target in TUPLE_NORMS
            else [node]
        )
        for out in outputs:
            with gm.graph.inserting_after(out):
                scaled = gm.graph.call_function(affine, (out, weight, bias, dim))
            scaled.meta.update(out.meta)
            out.replace_all_uses_with(scaled, delete_user_cb=lambda user, s=scaled: user is not s)
    gm.recompile()
    return gm
