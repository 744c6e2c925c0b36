"""Sharding plan: for every parameter a layout (shard dim, padded shard length) and for every
weight-bearing node a unit: rotated with its rule's mode, or gathered (and why).

Invariants: every parameter is sharded (no rank ever keeps a full replica); a parameter read by
several nodes (tied weights, a layer called twice) has one layout that all its rotated uses share;
a node whose op has no rule, or whose shard dims conflict with that layout, is gathered; sizes
not divisible by N are padded, the padding is zero and never reaches a result. A parameter whose
layout is fixed (`Options.fixed_layouts`: already sharded, by `rtp_compile.shard` or a graph the
compile backend transformed before) keeps that dim and granule; a use that cannot shard along
it is gathered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import torch
import torch.fx as fx

from rtp_compile.core.ir import Split, UnitKind, target_name
from rtp_compile.core.layout import ParamLayout
from rtp_compile.core.op_rules import OpCall
from rtp_compile.core.tables import format_table
from rtp_compile.passes.analysis.chains import chain_input, dtype_inputs
from rtp_compile.passes.analysis.match import match_op, parameter_reads, why_not_sharded
from rtp_compile.passes.manager.pipeline import InvariantError, graph_pass


@dataclass
class Unit:
    """One weight-bearing node of the graph and how it runs."""

    name: str  # attribute-safe, unique
    node: str  # node name in the captured graph
    kind: UnitKind
    params: dict[str, str]  # role -> parameter name
    call: OpCall | None = None  # rotate: the rule view of the node
    mode: Split | str | None = None  # rotate: the rule's mode (a Split, or elementwise "dimK")
    reason: str = ""  # gather: why it was not rotated
    target: str = ""  # what the node calls, for reports
    fusion: object = None  # fused: the block it runs (passes.fuse.Fusion)


@dataclass
class Plan:
    """The sharding plan of a model for `world_size` ranks."""

    world_size: int
    params: dict[str, ParamLayout]
    units: list[Unit] = field(default_factory=list)
    unfused: dict[str, str] = field(default_factory=dict)  # attention tail unit -> why not fused

    def names(self) -> set[str]:
        return {u.name for u in self.units}

    def strategy(self, name: str) -> str:
        kinds = {u.kind for u in self.units if name in u.params.values()}
        return "gather" if kinds & {"gather", "small"} else "rotate" if kinds else "unused"

    def units_of(self, name: str) -> list[Unit]:
        return [u for u in self.units if name in u.params.values()]

    def unit_for_node(self) -> dict[str, Unit]:
        return {u.node: u for u in self.units}

    def __str__(self) -> str:
        rows = [("parameter", "shape", "strategy", "dim", "units", "shard", "bytes/rank")]
        for name, lay in self.params.items():
            units = ",".join(u.name for u in self.units_of(name)) or "-"
            rows.append(
                (
                    name,
                    "x".join(map(str, lay.shape)) or "scalar",
                    self.strategy(name),
                    "flat" if lay.dim is None else str(lay.dim),
                    units,
                    "x".join(map(str, lay.shard_shape)),
                    f"{lay.shard_bytes:,}",
                )
            )
        lines = [format_table(rows, align="left")]
        total = sum(lay.shard_bytes for lay in self.params.values())
        lines.append(
            f"world size {self.world_size}: {len(self.params)} parameters, "
            f"{sum(u.kind == UnitKind.ROTATE for u in self.units)} rotated ops, "
            f"{sum(u.kind == UnitKind.FUSED for u in self.units)} fused blocks, "
            f"{sum(u.kind == UnitKind.GATHER for u in self.units)} gathered ops, "
            f"{sum(u.kind == UnitKind.SMALL for u in self.units)} small ones gathered per "
            f"step, "
            f"{total:,} parameter bytes per rank"
        )
        return "\n".join(lines)


def unique_name(base: str, taken: set[str]) -> str:
    """An attribute-safe name from `base`, not in `taken` (which it joins)."""
    name = base.replace(".", "_") or "unit"
    candidate, i = name, 1
    while candidate in taken:
        candidate, i = f"{name}_{i}", i + 1
    taken.add(candidate)
    return candidate


def parameter_only_nodes(gm: fx.GraphModule, reads: dict[fx.Node, str]) -> nx.DiGraph:
    """Parameter reads and the nodes computed from parameters and constants alone (w.t(), w*2,
    w.to(x.dtype): a cast reads only the dtype of its other inputs), as a dependency graph
    (edge: input -> user); its graph's `order` attribute: every node's position in `gm`."""
    constant = {n for n in gm.graph.nodes if n.op == "get_attr"}
    only = nx.DiGraph(order={n: i for i, n in enumerate(gm.graph.nodes)})
    only.add_nodes_from(reads)
    for node in gm.graph.nodes:
        inputs, dtypes = node.all_input_nodes, dtype_inputs(node)
        values = [i for i in inputs if i not in dtypes]
        if (
            node.op in ("call_function", "call_method")
            and values
            and all(i in only or i in constant for i in values)
            and any(i in only for i in values)
        ):
            only.add_edges_from((i, node) for i in inputs if i in only)
    return only


def consumer_closure(node: fx.Node, param_only: nx.DiGraph) -> list[fx.Node]:
    """The parameter-only nodes `node` reads, transitively, in graph order."""
    direct = [i for i in node.all_input_nodes if i in param_only]
    if not direct:  # most nodes: nothing to order, no walk over the graph
        return []
    seen = set(direct).union(*(nx.ancestors(param_only, d) for d in direct))
    return sorted(seen, key=param_only.graph["order"].__getitem__)


def check_plan(gm: fx.GraphModule, ctx) -> None:
    """Every parameter has one layout for this world size; units have unique names, name nodes
    of the graph and parameters of the plan; no parameter is in two fused blocks."""
    plan = ctx.plan
    if plan is None or set(plan.params) != set(ctx.params):
        raise InvariantError("the plan does not lay out exactly the model's parameters")
    if any(lay.world_size != ctx.world_size for lay in plan.params.values()):
        raise InvariantError(f"a layout is not cut for {ctx.world_size} ranks")
    names = [u.name for u in plan.units]
    if len(set(names)) != len(names):
        raise InvariantError(f"unit names repeat: {names}")
    nodes = {n.name for n in gm.graph.nodes}
    for u in plan.units:
        if u.node not in nodes or not set(u.params.values()) <= set(plan.params):
            raise InvariantError(f"unit {u.name} names a node or parameter that does not exist")
    fused = [p for u in plan.units if u.kind == UnitKind.FUSED for p in u.params.values()]
    if len(set(fused)) != len(fused):
        raise InvariantError("a parameter belongs to two fused blocks")


@graph_pass(check=check_plan, required=True, plans_only=True)
def plan_sharding(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Write into `ctx.plan` a layout for every parameter and a unit for every weight-bearing
    node (the graph is unchanged)."""
    ctx.plan = make_plan(gm, ctx.world_size, ctx.params, ctx.aliases, ctx.options.fixed)
    return gm


def make_plan(
    gm: fx.GraphModule,
    world_size: int,
    params: dict[str, torch.Tensor],
    aliases: dict[str, list[str]],
    fixed: dict[str, tuple] | None = None,
) -> Plan:
    """Choose a layout for every parameter and a unit for every weight-bearing node.

    `params`: the model's parameters by canonical name; `aliases`: every name of each;
    `fixed`: name -> (dim, granule) of parameters already sharded, which keep that layout.
    """
    fixed = fixed or {}
    reads = parameter_reads(gm)
    param_only = parameter_only_nodes(gm, reads)
    canonical = {alias: canon for canon, names in aliases.items() for alias in names}
    module_params = {
        target: [canonical.get(n, n) for n in names]  # a tied module: its alias
        for target, names in _leaf_module_params(gm).items()
    }
    shapes = {name: tuple(p.shape) for name, p in params.items()}
    order = {name: i for i, name in enumerate(shapes)}

    consumers: dict[fx.Node, list[str]] = {}
    closures: dict[fx.Node, list[fx.Node]] = {}
    calls: dict[fx.Node, OpCall] = {}
    for node in gm.graph.nodes:
        if node in param_only:
            continue
        closure = closures[node] = consumer_closure(node, param_only)
        names = {reads[n] for n in closure if n in reads} | set(module_params.get(node.target, []))
        if not names:
            continue
        if node.op == "output":
            raise ValueError(
                f"rtp_compile: the model returns parameter(s) {sorted(names)} (or values computed "
                "from parameters alone) directly; return them from a module call instead."
            )
        consumers[node] = sorted(names, key=order.__getitem__)
        call = match_op(node, gm, reads) if node.op == "call_function" else None
        inside = set(closure)  # the op's reads and what its rule applies to them (w.t(), 1 + w)
        if (
            call is not None
            and set(call.params.values()) == set(names)
            and all(n in reads or (chain_input(n) or n.args[0]) in inside for n in closure)
        ):
            calls[node] = call

    dims = _choose_dims(calls, shapes, fixed)
    layouts = {
        name: ParamLayout(
            name,
            shapes[name],
            p.dtype,
            world_size,
            dims.get(name),
            tuple(aliases.get(name, [name])),
            fixed[name][1] if name in fixed else 1,
        )
        for name, p in params.items()
    }
    plan = Plan(world_size, layouts)
    taken: set[str] = set()
    for node, names in consumers.items():
        call = calls.get(node)
        mode = _mode_for(call, dims, shapes) if call else None
        if mode is not None:
            base = call.params.get("weight") or next(iter(call.params.values()))
            plan.units.append(
                Unit(
                    unique_name(base.rpartition(".")[0] or node.name, taken),
                    node.name,
                    UnitKind.ROTATE,
                    dict(call.params),
                    call,
                    mode,
                    target=target_name(node),
                )
            )
            continue
        if call is not None and fixed.keys() & set(call.params.values()):
            reason = (
                "it cannot shard along the dim its parameter was already sharded on "
                "(rtp_compile.shard, or an earlier compiled graph)"
            )
        elif call is not None:
            reason = "its shard dims conflict with the layout its tied parameter needs elsewhere"
        elif match_op(node, gm, reads) is not None:
            reason = "it reads parameters through ops the rule cannot shard"
        else:
            reason = why_not_sharded(node, gm, reads, closures[node])
        plan.units.append(
            Unit(
                unique_name(f"{node.name}_gather", taken),
                node.name,
                UnitKind.GATHER,
                {f"param{i}": p for i, p in enumerate(names)},
                None,
                None,
                reason,
                target_name(node),
            )
        )
    return plan


def _leaf_module_params(gm: fx.GraphModule) -> dict[str, list[str]]:
    """call_module targets that own parameters (leaf modules not lowered) -> their parameters."""
    out = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            names = [
                f"{node.target}.{n}" for n, _ in gm.get_submodule(node.target).named_parameters()
            ]
            if names:
                out[node.target] = names
    return out


def _choose_dims(calls: dict[fx.Node, OpCall], shapes, fixed: dict[str, tuple]) -> dict[str, int]:
    """One shard dim per parameter that every rotatable use supports, in the first use's order;
    a fixed parameter's own (None: flat)."""
    options: dict[str, list[int]] = {name: [dim] for name, (dim, _) in fixed.items()}
    for call in calls.values():
        modes = call.rule.modes({r: shapes[p] for r, p in call.params.items()}, call.options)
        for role, name in call.params.items():
            supported = [dims[role] for dims in modes.values()]
            if name not in options:
                options[name] = list(dict.fromkeys(supported))
            elif name not in fixed:
                narrowed = [d for d in options[name] if d in supported]
                options[name] = narrowed or options[name]  # conflict: first use wins, others gather
    return {name: dims[0] for name, dims in options.items() if dims and dims[0] is not None}


def _mode_for(call: OpCall, dims: dict[str, int], shapes) -> str | None:
    modes = call.rule.modes({r: shapes[p] for r, p in call.params.items()}, call.options)
    for mode, mode_dims in modes.items():
        if all(dims.get(name) == mode_dims[role] for role, name in call.params.items()):
            return mode
    return None
