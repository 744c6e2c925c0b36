"""A part of a graph copied out as a graph of its own: what a gathered op or a fused block's
region runs on its inputs (`rotate`'s bodies)."""

from __future__ import annotations

import copy

import torch.fx as fx


def extract_graph(
    inputs: list[tuple[fx.Node, str]],
    nodes: list[fx.Node],
    output: fx.Node,
    graph: fx.Graph | None = None,
    edit=None,
) -> fx.Graph:
    """A graph that takes `inputs` (nodes of the source graph, each as a placeholder of the
    given name), computes copies of `nodes` (in order) and returns `output`'s copy.

    `graph`: one to append to (it may hold placeholders of its own first); `edit(node, args,
    kwargs)`: may rewrite a copy's arguments (already mapped into the new graph) in place."""
    graph = graph if graph is not None else fx.Graph()
    env = {node: graph.placeholder(name) for node, name in inputs}
    for node in nodes:
        args = list(fx.node.map_arg(node.args, env.__getitem__))
        kwargs = dict(fx.node.map_arg(node.kwargs, env.__getitem__))
        if edit is not None:
            edit(node, args, kwargs)
        env[node] = graph.create_node(node.op, node.target, tuple(args), kwargs, name=node.name)
        env[node].meta = copy.copy(node.meta)
    graph.output(env[output])
    return graph
