"""The model's activation checkpoints in a rank's GraphModule: each region's nodes outlined into
a `runtime.recompute.CheckpointedRegion`, called where they were.

Capture labels every node the model computed inside `torch.utils.checkpoint.checkpoint` with its
checkpoint (`core.ir.checkpoint_region`); the passes keep the label on the nodes they copy and on
each unit's autograd node, and never let a unit's ring hops (prefetch, buckets) cross a region's
border. A rank node belongs to the region of its label, or of its unit's autograd node. A
region's span runs from its first node to its last; nodes in between that belong to no region
go with it (parameter reads are hoisted in front and passed in), so everything its nodes need
from before becomes an input and everything used after it an output; a buffer is read by the
region itself (BatchNorm updates its statistics in place, which checkpoint refuses of an input).
"""

from __future__ import annotations

import operator

import torch.fx as fx

from rtp_compile.core.ir import checkpoint_region, unit_of
from rtp_compile.runtime.recompute import CheckpointedRegion


def node_regions(graph: fx.Graph) -> dict[fx.Node, int | None]:
    """Every node's activation checkpoint (None: outside any)."""
    of_unit = {
        unit_of(node): checkpoint_region(node)
        for node in graph.nodes
        if unit_of(node) is not None and checkpoint_region(node) is not None
    }
    return {
        node: checkpoint_region(node)
        if checkpoint_region(node) is not None
        else of_unit.get(unit_of(node))
        for node in graph.nodes
    }


def outline_checkpoints(gm: fx.GraphModule) -> fx.GraphModule:
    """Outline every activation checkpoint region of `gm` (in place) into a checkpointed call."""
    for region in dict.fromkeys(r for r in node_regions(gm.graph).values() if r is not None):
        regions, order = node_regions(gm.graph), list(gm.graph.nodes)
        at = [i for i, node in enumerate(order) if regions[node] == region]
        span = order[at[0] : at[-1] + 1]
        others = {regions[n] for n in span} - {region, None}
        if others:
            raise ValueError(
                f"rtp_compile: activation checkpoint {region} of the model is interleaved with "
                f"checkpoint(s) {sorted(others)} in the rank's program, so it cannot be "
                "recomputed on its own. Checkpoint whole blocks whose outputs feed the next one "
                "(e.g. x = checkpoint(block, x, use_reentrant=False) per block)."
            )
        _outline(gm, span, regions, region)
    gm.graph.lint()
    gm.recompile()
    return gm


def _outline(gm: fx.GraphModule, span: list[fx.Node], regions, region: int) -> None:
    inside = set(span)
    for node in span[1:]:  # parameter reads, the small parameters' gather: in front, passed in
        if regions[node] is None and not any(a in inside for a in node.all_input_nodes):
            span[0].prepend(node)
            inside.remove(node)
    span = [n for n in span if n in inside]
    # a buffer the region updates in place (BatchNorm's statistics) is read by the body itself:
    # passed in, checkpoint's saved-tensor version check would refuse the update
    buffers = {name for name, _ in gm.named_buffers()}
    needed = dict.fromkeys(a for n in span for a in n.all_input_nodes if a not in inside)
    read = [a for a in needed if a.op == "get_attr" and a.target in buffers]
    inputs = [a for a in needed if a not in read]
    outputs = [n for n in span if any(u not in inside for u in n.users)]
    body = fx.Graph()
    env = {a: body.placeholder(a.name) for a in inputs}
    env.update({a: body.get_attr(a.target) for a in read})
    for node in span:
        env[node] = body.node_copy(node, lambda a: env[a])
    body.output(tuple(env[n] for n in outputs))
    name = f"rtp_checkpoints.region{region}"
    gm.add_submodule(name, CheckpointedRegion(fx.GraphModule(gm, body, "CheckpointedBody"), region))
    with gm.graph.inserting_before(span[0]):
        call = gm.graph.call_module(name, tuple(inputs))
        results = [gm.graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    for node, result in zip(outputs, results):
        result.meta = dict(node.meta)
        node.replace_all_uses_with(result, delete_user_cb=lambda user: user not in inside)
    for node in reversed(span):
        gm.graph.erase_node(node)
