"""Weight-bearing nodes -> rank-generic unit markers.

Every rotated node becomes `rotated_op(name, x, *params, *run_inputs)` (run-time inputs: what
its parameter chains read when it runs, e.g. `x.dtype`); a fused block (its column linears,
region and tail) becomes `fused_block(name, x, *params, *externals)` with its region kept as a
body GraphModule (externals: what the region reads from outside, e.g. an attention mask). A
marker's *extras* are what it carries after its weights: the one or the other;
every gathered node becomes `gathered_op(name, *inputs, *params)`, and the gathered op (with
the parameter-only ops that feed it, such as `w.t()`) moves into a small body GraphModule run
on the gathered tensors. The schedule pass then writes each rotated or fused marker's steps.

Invariant: after this pass no node other than a unit marker reads a parameter, so no emitted
op can see a shard where it expects the full tensor; every rotated or fused unit of the plan
has its marker, every fused or gathered one its body in `ctx.bodies`. Every marker is labelled
`NodeLabel(unit, None, kind)` (`core.ir`).
"""

from __future__ import annotations

import copy
import operator

import torch
import torch.fx as fx

from rtp_compile.core.ir import (
    NodeLabel,
    UnitKind,
    fused_block,
    gathered_op,
    gathered_small,
    label_of,
    rotated_op,
    set_label,
    unit_of,
)
from rtp_compile.core.subgraph import extract_graph
from rtp_compile.passes.analysis.match import parameter_reads
from rtp_compile.passes.fuse import region_body
from rtp_compile.passes.manager.pipeline import InvariantError, graph_pass
from rtp_compile.passes.plan import consumer_closure, parameter_only_nodes


def _meta_copy(value):
    if isinstance(value, torch.nn.Parameter):
        return torch.nn.Parameter(torch.empty_like(value, device="meta"), value.requires_grad)
    if isinstance(value, torch.nn.Module):
        module = copy.deepcopy(value)
        for sub in module.modules():
            for name, p in list(sub.named_parameters(recurse=False)):
                setattr(sub, name, _meta_copy(p))
        return module
    return value


def gather_body(
    gm: fx.GraphModule, node: fx.Node, closure: list[fx.Node]
) -> tuple[fx.GraphModule, list[fx.Node]]:
    """The gathered op and its parameter-only inputs as a GraphModule over its other inputs.

    Its parameters are meta tensors: the GatheredOpRuntime passes the gathered ones to
    functional_call.
    """
    inside = set(closure)
    inputs = list(
        dict.fromkeys(i for n in (*closure, node) for i in n.all_input_nodes if i not in inside)
    )
    graph = extract_graph([(i, i.name) for i in inputs], closure + [node], node)
    root = {}
    for n in graph.nodes:
        if n.op in ("get_attr", "call_module"):
            root[n.target] = _meta_copy(operator.attrgetter(n.target)(gm))
    return fx.GraphModule(root, graph, class_name=f"Gathered_{node.name}"), inputs


MARKERS = {rotated_op: UnitKind.ROTATE, fused_block: UnitKind.FUSED, gathered_op: UnitKind.GATHER}


def _gather_small(
    graph: fx.Graph, first: fx.Node, params: list[str], units: list[str]
) -> dict[str, fx.Node]:
    """Before `first` (the first small op, or op of a small parameter's chain): one
    gathered_small node over every small parameter, and a getitem per parameter (its whole
    tensor, named `<parameter>_full` so the code reads which one an op takes)."""
    with graph.inserting_before(first):
        marker = graph.call_function(gathered_small, tuple(graph.get_attr(p) for p in params))
        set_label(marker, NodeLabel(units[0], None, UnitKind.SMALL, units=tuple(units)))
        marker.meta["is_wrapped"] = True
        full = {}
        for i, p in enumerate(params):
            full[p] = graph.call_function(operator.getitem, (marker, i))
            full[p]._rename(f"{p.replace('.', '_')}_full")
        return full


def parameters_read_only_by_units(gm: fx.GraphModule) -> None:
    """Every user of a parameter read is a node of a unit (it carries a unit label)."""
    for read in parameter_reads(gm):
        others = [u.name for u in read.users if not unit_of(u)]
        if others:
            raise InvariantError(f"parameter {read.target} is read outside a unit by {others}")


def _check(gm: fx.GraphModule, ctx) -> None:
    parameters_read_only_by_units(gm)
    markers = {n.args[0]: n.target for n in gm.graph.nodes if n.target in MARKERS}
    small = [n for n in gm.graph.nodes if n.target is gathered_small]
    covered = set(label_of(small[0]).units) if small else set()
    if len(small) > 1 or covered != {u.name for u in ctx.plan.units if u.kind == UnitKind.SMALL}:
        raise InvariantError("the small units are not all gathered by one gathered_small node")
    for u in ctx.plan.units:
        if u.kind == UnitKind.SMALL:
            continue
        if MARKERS.get(markers.get(u.name)) != u.kind:
            raise InvariantError(f"unit {u.name} ({u.kind}) has no marker of its kind")
        if u.kind != UnitKind.ROTATE and u.name not in ctx.bodies:
            raise InvariantError(f"unit {u.name} ({u.kind}) has no body")


@graph_pass(check=_check, required=True)
def rotate(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Replace every planned node by its unit marker; the bodies go to `ctx.bodies`."""
    plan = ctx.plan
    reads = parameter_reads(gm)
    param_only = parameter_only_nodes(gm, reads)
    by_node = plan.unit_for_node()
    bodies: dict[str, fx.GraphModule] = {}
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}  # units rewritten so far map to their markers
    small = [u for u in plan.units if u.kind == UnitKind.SMALL]
    small_params = list(dict.fromkeys(p for u in small for p in u.params.values()))
    # a small op and its parameter chain stay; they read the gathered whole tensors
    small_ops = {
        n: consumer_closure(n, param_only)
        for n in graph.nodes
        if n.name in by_node and by_node[n.name].kind == UnitKind.SMALL
    }
    if small_ops:
        chained = {n for closure in small_ops.values() for n in closure if n not in reads}
        first = next(n for n in graph.nodes if n in small_ops or n in chained)
        gathered = _gather_small(graph, first, small_params, [u.name for u in small])
        for user in {n for node, closure in small_ops.items() for n in (node, *closure)}:
            for read in [i for i in user.all_input_nodes if i in reads]:
                user.replace_input_with(read, gathered[reads[read]])
    for node in list(graph.nodes):
        unit = by_node.get(node.name)
        if unit is None or unit.kind == UnitKind.SMALL:
            continue
        with graph.inserting_before(node):
            param_reads = [graph.get_attr(p) for p in unit.params.values()]
            if unit.kind == UnitKind.ROTATE:
                x = by_name[unit.call.input]
                run_inputs = [
                    graph.call_function(getattr, (by_name[e], attr)) if attr else by_name[e]
                    for e, attr in unit.call.run_inputs
                ]
                marker = graph.call_function(rotated_op, (unit.name, x, *param_reads, *run_inputs))
            elif unit.kind == UnitKind.FUSED:
                bodies[unit.name] = region_body(by_name, unit.fusion)
                x = by_name[unit.fusion.columns[0].call.input]
                externals = [by_name[e] for e in unit.fusion.externals]
                marker = graph.call_function(fused_block, (unit.name, x, *param_reads, *externals))
            else:
                body, inputs = gather_body(gm, node, consumer_closure(node, param_only))
                bodies[unit.name] = body
                marker = graph.call_function(gathered_op, (unit.name, *inputs, *param_reads))
        marker.meta.update(node.meta)
        set_label(marker, NodeLabel(unit.name, None, unit.kind))
        marker.meta["is_wrapped"] = True  # fx records it as a call when re-tracing (pickling)
        node.replace_all_uses_with(marker)
        by_name[node.name] = marker
        graph.erase_node(node)
        if (
            unit.kind == UnitKind.FUSED
        ):  # the block's hidden ops and first layers now live in the unit
            for name in [*reversed(unit.fusion.region), *(h.node for h in unit.fusion.columns)]:
                graph.erase_node(by_name[name])
    # only the parameter reads and parameter-only ops the units took over may go
    graph.eliminate_dead_code(is_impure_node=lambda n: n not in param_only)
    gm.recompile()
    ctx.bodies.update(bodies)
    return gm
