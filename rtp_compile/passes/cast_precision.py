"""Mixed precision at the program's boundary, where FSDP2 applies its policy to the root
module: floating inputs cast to `param_dtype` (`cast_forward_inputs`), floating outputs to
`output_dtype` (`core.graph_ops.cast_floating`; backward casts their gradients back).

Invariant: without an `mp_policy` the graph is unchanged; with one that casts inputs, every
input is read only through its cast; with an `output_dtype`, every value returned is cast.
"""

from __future__ import annotations

import torch.fx as fx

from rtp_compile.core.graph_ops import cast_floating
from rtp_compile.passes.manager.pipeline import InvariantError, graph_pass


def _input_dtype(ctx):
    policy = ctx.options.mp_policy
    return policy.param_dtype if policy is not None and policy.cast_forward_inputs else None


def _output_dtype(ctx):
    policy = ctx.options.mp_policy
    return policy.output_dtype if policy is not None else None


def _is_cast(node) -> bool:
    return isinstance(node, fx.Node) and node.target is cast_floating


def _check(gm: fx.GraphModule, ctx) -> None:
    if _input_dtype(ctx) is not None:
        for node in gm.graph.find_nodes(op="placeholder"):
            if not all(_is_cast(user) for user in node.users):
                raise InvariantError(f"input {node.name} is read without its cast")
    if _output_dtype(ctx) is not None:
        returned = []
        fx.node.map_arg(gm.graph.output_node().args, returned.append)
        if not all(_is_cast(node) for node in returned):
            raise InvariantError("a returned value is not cast to mp_policy.output_dtype")


@graph_pass(check=_check, required=True)
def cast_precision(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Cast the program's floating inputs and outputs as `ctx.options.mp_policy` says."""
    graph = gm.graph
    dtype = _input_dtype(ctx)
    if dtype is not None:
        for node in list(graph.find_nodes(op="placeholder")):
            if node.users:
                with graph.inserting_after(node):
                    cast = graph.call_function(cast_floating, (node, dtype))
                node.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)
    dtype = _output_dtype(ctx)
    if dtype is not None:
        output, casts = graph.output_node(), {}

        def cast(node: fx.Node) -> fx.Node:
            if node not in casts:
                with graph.inserting_before(output):
                    casts[node] = graph.call_function(cast_floating, (node, dtype))
            return casts[node]

        output.args = fx.node.map_arg(output.args, cast)
    gm.recompile()
    return gm
