"""Reads of a parameter's metadata (`w.shape`, `w.size(0)`, `w.dtype`, `w.dim()`) -> constants.

They describe the full parameter and need none of its values; left in the graph they would be
"uses" of the parameter, and gathering a whole weight to read its shape would be absurd.

Invariant: every folded node had a parameter read as its only tensor input and computes
metadata that is fixed for the parameter's lifetime (shape, dtype, device, ndim); no such read
is left. Function level only: export has folded them already.
"""

from __future__ import annotations

import builtins
import operator

import torch
import torch.fx as fx

from rtp_compile.passes.manager.pipeline import InvariantError, graph_pass

_ATTRIBUTES = {"shape", "dtype", "device", "ndim", "is_cuda", "layout"}
_METHODS = {"size", "dim", "ndimension", "numel"}


def _metadata(node: fx.Node, params: dict[str, torch.Tensor]):
    """(True, value) when `node` reads metadata of a parameter; else (False, None)."""
    source = node.args[0] if node.args else None
    if not (isinstance(source, fx.Node) and source.op == "get_attr" and source.target in params):
        return False, None
    param = params[source.target]
    if (
        node.op == "call_function"
        and node.target is builtins.getattr
        and node.args[1] in _ATTRIBUTES
    ):
        return True, getattr(param, node.args[1])
    if node.op == "call_method" and node.target in _METHODS:
        return True, getattr(param, node.target)(*node.args[1:], **node.kwargs)
    return False, None


def _check(gm: fx.GraphModule, ctx) -> None:
    if ctx.level != "function":
        return
    params = dict(gm.named_parameters(remove_duplicate=False))
    left = [n.name for n in gm.graph.nodes if _metadata(n, params)[0]]
    if left:
        raise InvariantError(f"fold_parameter_metadata left metadata reads of parameters: {left}")


@graph_pass(check=_check)
def fold_parameter_metadata(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Replace metadata reads of parameters (and indexing into them) by their values."""
    if ctx.level != "function":
        return gm
    params = dict(gm.named_parameters(remove_duplicate=False))
    folded: dict[fx.Node, object] = {}
    for node in list(gm.graph.nodes):
        is_meta, value = _metadata(node, params)
        if (
            not is_meta
            and node.op == "call_function"
            and node.target is operator.getitem
            and node.args[0] in folded
        ):
            is_meta, value = True, folded[node.args[0]][node.args[1]]
        if is_meta:
            folded[node] = value
            node.replace_all_uses_with(value if not isinstance(value, torch.Size) else tuple(value))
    for node in reversed(list(folded)):
        gm.graph.erase_node(node)
    gm.recompile()
    return gm
