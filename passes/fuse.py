"""Column-split linear(s) -> pointwise ops -> linear: one rotation unit for the block.

An MLP or SwiGLU block rotates as one unit: step k holds shard k of every linear in it (the
first layers cut along their outputs, the last along its inputs, all on the hidden dim),
computes the block's hidden slice and its contribution to the output, which is summed. One ring
pass carries all the block's shards, and the hidden activation is never concatenated.

Invariant: a region is fused only where that is exact: its ops act elementwise on the hidden dim,
nothing outside the region reads the hidden activation, and no parameter of the block is read
anywhere else. Views in the region (GPT-2 flattens around its Conv1D matmuls) only regroup the
leading dims; they are fused when the heads' output and the tail's input have the same shape,
and the region then runs without them.
"""
from __future__ import annotations

import dataclasses
import operator

import networkx as nx
import torch
import torch.fx as fx
import torch.nn.functional as F

from rtp_compile.passes.plan import Plan, Unit, unique_name

aten = torch.ops.aten

POINTWISE = {
    F.gelu, F.relu, F.silu, torch.tanh, torch.sigmoid, torch.relu, torch.erf, torch.exp,
    operator.mul, operator.add, operator.sub, operator.truediv, operator.neg, operator.pow,
    torch.mul, torch.add, torch.sub, torch.pow,
    aten.gelu.default, aten.relu.default, aten.silu.default, aten.tanh.default,
    aten.sigmoid.default, aten.erf.default, aten.exp.default, aten.neg.default,
    aten.mul.Tensor, aten.mul.Scalar, aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor,
    aten.div.Tensor, aten.div.Scalar, aten.pow.Tensor_Scalar,
}
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
DROPOUTS = {F.dropout, aten.dropout.default}


@dataclasses.dataclass
class Fusion:
    """The block a fused unit runs: its column-split heads, pointwise region and tail."""
    heads: list[Unit]                  # column-split linears reading the block's input
    tail: Unit                         # the linear reading the region's output, cut on inputs
    region: list[str]                  # pointwise nodes (and views, run as identity), in order
    hidden: int                        # the hidden width every shard dim of the block cuts


def _last_dim(node: fx.Node):
    val = node.meta.get("val")
    return val.shape[-1] if isinstance(val, torch.Tensor) and val.dim() else None


def _is_region_op(node: fx.Node, hidden: int) -> bool:
    """Elementwise on the hidden dim: a pointwise op, a p=0 dropout, a view keeping it last."""
    if node.op not in ("call_function", "call_method"):
        return False
    if node.target in POINTWISE:
        return True
    if node.target in DROPOUTS:
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        return p == 0
    if node.target in VIEWS:  # aten level: shapes are known, the hidden dim must stay last
        inp = node.args[0]
        return _last_dim(node) == hidden and isinstance(inp, fx.Node) and _last_dim(inp) == hidden
    return False


def _shape(node: fx.Node) -> str | None:
    """The node's shape as export recorded it, as text (sizes may be symbols, e.g. s0*s1)."""
    val = node.meta.get("val")
    return str(list(val.shape)) if isinstance(val, torch.Tensor) else None


def _linear_dims(unit: Unit) -> tuple[int, int]:
    """(output dim, input dim) of a linear unit's stored weight."""
    return (1, 0) if unit.call.options.get("transposed") else (0, 1)


def _block_name(units: list[Unit]) -> str:
    paths = [u.params["weight"].split(".")[:-2] for u in units]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    return "_".join(common) or units[-1].name


def _find_block(tail: Unit, nodes, units_by_node, hidden: int):
    """(heads, region nodes) feeding `tail` through elementwise ops only, or None."""
    region, heads, stack, seen = [], [], [nodes[tail.call.input]], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        unit = units_by_node.get(node.name)
        if unit is not None:
            if not (unit.kind == "rotate" and unit.call.rule.name == "linear"
                    and unit.mode == "col"):
                return None
            heads.append(unit)
            continue
        if not _is_region_op(node, hidden):
            return None
        region.append(node)
        # a view's other inputs are sizes, not tensors of the block
        stack.extend([node.args[0]] if node.target in VIEWS else node.all_input_nodes)
    if not heads:
        return None
    if any(n.target in VIEWS for n in region):  # views must cancel out to be run as identity
        shapes = {_shape(nodes[h.node]) for h in heads} | {_shape(nodes[tail.call.input])}
        if len(shapes) != 1 or None in shapes:
            return None
    return heads, region


def fuse_blocks(gm: fx.GraphModule, plan: Plan) -> Plan:
    """Merge every exact column-split -> pointwise -> linear block into one fused unit."""
    nodes = {n.name: n for n in gm.graph.nodes}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    graph = nx.DiGraph((i, n) for n in gm.graph.nodes for i in n.all_input_nodes)
    units_by_node = plan.unit_for_node()
    readers = {name: len(plan.units_of(name)) for name in plan.params}
    for tail in [u for u in plan.units if u.kind == "rotate" and u.call.rule.name == "linear"]:
        if tail not in plan.units or readers[tail.params["weight"]] != 1:
            continue
        hidden = plan.params[tail.params["weight"]].shape[_linear_dims(tail)[1]]
        found = _find_block(tail, nodes, units_by_node, hidden)
        if found is None:
            continue
        heads, region = found
        members = set(region) | {nodes[h.node] for h in heads}
        inputs = {h.call.input for h in heads}
        if len(inputs) != 1 or any(h not in plan.units for h in heads):
            continue
        if any(set(graph.successors(m)) - members - {nodes[tail.node]} for m in members):
            continue  # the hidden activation is read outside the block
        params = [p for u in heads + [tail] for p in u.params.values()]
        if any(readers[p] != 1 for p in params):
            continue  # a tied or reused parameter keeps its own layout
        if any(plan.params[h.params["weight"]].shape[_linear_dims(h)[0]] != hidden for h in heads):
            continue
        heads.sort(key=lambda h: order[nodes[h.node]])
        _record_fusion(plan, heads, tail, sorted(region, key=order.get), hidden)
    plan.units.sort(key=lambda u: order[nodes[u.node]])
    return plan


def _record_fusion(plan: Plan, heads: list[Unit], tail: Unit, region: list[fx.Node],
                   hidden: int) -> None:
    """Replace the block's units by one fused unit; the tail's weight is cut on its inputs."""
    weight = tail.params["weight"]
    plan.params[weight] = dataclasses.replace(plan.params[weight], dim=_linear_dims(tail)[1])
    params = {f"head{i}.{role}": name for i, h in enumerate(heads) for role, name in h.params.items()}
    params.update({f"tail.{role}": name for role, name in tail.params.items()})
    for unit in heads + [tail]:
        plan.units.remove(unit)
    name = unique_name(_block_name(heads + [tail]), plan.names())
    plan.units.append(Unit(name, tail.node, "fused", params, tail.call, "row",
                           target="+".join(u.target for u in heads + [tail]),
                           fusion=Fusion(heads, tail, [n.name for n in region], hidden)))


def region_body(gm: fx.GraphModule, fusion: Fusion) -> fx.GraphModule:
    """The block's pointwise ops as a GraphModule: head outputs in, the tail's input out.

    Views are left out (they only regroup leading dims, see the module docstring), so the body
    runs on a hidden slice of any width and any leading shape."""
    nodes = {n.name: n for n in gm.graph.nodes}
    graph, env = fx.Graph(), {}
    for i, head in enumerate(fusion.heads):
        env[nodes[head.node]] = graph.placeholder(f"head{i}")
    for name in fusion.region:
        node = nodes[name]
        env[node] = env[node.args[0]] if node.target in VIEWS else \
            graph.node_copy(node, lambda a: env[a])
    graph.output(env[nodes[fusion.tail.call.input]])
    return fx.GraphModule(torch.nn.Module(), graph, class_name="FusedRegion")
