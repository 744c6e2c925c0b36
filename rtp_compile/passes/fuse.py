"""Column-split linear(s) -> region -> row-split linear: one rotation unit for the block.

An MLP or SwiGLU block, and attention from its q/k/v projections through to the output
projection, rotate as one unit: step k holds shard k of every linear in it (the first layers
cut along their outputs, the last along its inputs, all on the block's hidden / head axis),
computes the block's slice of the region between them and its contribution to the output, which
is summed. One ring pass carries all the block's shards, and the hidden activation (the heads)
is never concatenated.

Invariant: a block is fused only where that is exact: every op of its region computes a shard's
slice of the cut axis from the inputs' slices (`passes.analysis.cut_axis`: pointwise ops, head-wise
attention, views and transposes that carry the axis, splits beside it, kv heads repeated for
their q heads, sizes and per-head operands rewritten per shard), shards hold whole groups of
that axis (an MLP's hidden units; a kv head with its q heads), nothing outside the block reads
a value of it, no parameter of the block is read anywhere else, and nothing the region reads
from outside carries a gradient from a parameter. Heads are the projections whose data (not
only sizes or dtype) reaches the last layer: rotary tables an earlier block made from its q
sizes do not make that block's projections heads of this one.
Attention blocks that are not fused are listed in `plan.unfused` with the reason.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import operator
from collections.abc import Container

import torch
import torch.fx as fx

from rtp_compile.core.graph_ops import head_slice
from rtp_compile.core.ir import RewriteKind, Split, UnitKind
from rtp_compile.core.subgraph import extract_graph
from rtp_compile.passes.analysis.cut_axis import CutWalk, NotExact, Rewrite, is_attention, op_kind
from rtp_compile.passes.analysis.match import parameter_reads
from rtp_compile.passes.manager.pipeline import graph_pass
from rtp_compile.passes.plan import Plan, Unit, check_plan, unique_name


@dataclasses.dataclass
class Fusion:
    """The block a fused unit runs: its column linears, region and tail."""

    columns: list[Unit]  # column-split linears reading the block's input
    tail: Unit  # the linear reading the region's output, cut on inputs
    region: list[str]  # the ops between them, in graph order
    groups: int  # G: whole groups the cut axis holds (hidden units, kv heads)
    externals: list[str]  # values from outside the block the region reads
    rewrites: dict[str, list[Rewrite]]  # region node -> its sizes / operands cut per shard
    attention: bool  # the region attends (SDPA, softmax, matmul of heads)
    hidden: int  # the tail's input width (what is never concatenated)


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


def _is_column(unit: Unit) -> bool:
    return (
        unit.kind == UnitKind.ROTATE and unit.call.rule.name == "linear" and unit.mode == Split.COL
    )


def _is_metadata_read(node: fx.Node) -> bool:
    """A read of sizes, dtype or device only (x.size(), x.shape, x.dtype, aten.sym_size): it
    carries no gradient and none of the value's data."""
    return op_kind(node) == "size" or (
        node.op == "call_function"
        and node.target is getattr
        and node.args[1:2] in (("shape",), ("dtype",), ("device",))
    )


def _ancestors(node: fx.Node, cut: Container[fx.Node]) -> set[fx.Node]:
    """The nodes `node` reads, transitively, reading on through no node of `cut` (one that is
    read is among them; what it reads is not, unless read otherwise)."""
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        n = todo.pop()
        if n not in cut:
            fresh = [i for i in n.all_input_nodes if i not in seen]
            seen.update(fresh)
            todo += fresh
    return seen


def _descendants(node: fx.Node, cut: Container[fx.Node]) -> set[fx.Node]:
    """The nodes that read `node`, transitively, through no node of `cut` (never among them)."""
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        fresh = [u for u in todo.pop().users if u not in cut and u not in seen]
        seen.update(fresh)
        todo += fresh
    return seen


class BlockFinder:
    """What every block search shares: the graph's units, its metadata reads, which the walks
    stop at (`_ancestors`, `_descendants`), and the parameters' readers."""

    def __init__(self, gm: fx.GraphModule, plan: Plan, max_padding: float):
        self.gm, self.plan, self.max_padding = gm, plan, max_padding
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.units = {self.nodes[u.node]: u for u in plan.units}
        # walks that stop at units end at the nearest ones; walks that stop at metadata reads
        # follow a value's gradient back (ancestors) or what depends on its data (descendants)
        self.metadata_reads = {n for n in gm.graph.nodes if _is_metadata_read(n)}
        self.units_or_metadata = self.units.keys() | self.metadata_reads
        self.weighted = set(self.units) | set(parameter_reads(gm))
        self.readers = collections.Counter(p for u in plan.units for p in set(u.params.values()))
        self.merged: set[fx.Node] = set()  # the nodes of the units fused so far

    def region_of(self, tail: Unit):
        """(columns, region nodes, attention?) between the nearest column-split linears above
        `tail` and its input, or None where no column-split linear feeds it."""
        t_in = self.nodes[tail.call.input]
        # through data only: rotary tables made from an earlier block's q sizes bring no head
        above = (
            {t_in}
            if t_in in self.units
            else _ancestors(t_in, self.units_or_metadata) & self.units.keys()
        )
        columns = sorted((n for n in above if _is_column(self.units[n])), key=self.order.get)
        if not columns:
            return None
        # paths from a column linear to the tail's input that pass no other unit
        stop = self.units.keys()
        below = set().union(*(_descendants(h, stop) for h in columns))
        region = sorted(
            (below & (_ancestors(t_in, stop) | {t_in})) - set(columns),
            key=self.order.get,
        )
        return columns, region, any(is_attention(n) for n in region)

    def _read_only_inside(self, members: set, columns, tail_node) -> None:
        """NotExact naming the first value of the block read outside it, and why that stops the
        block: a value from the column linears' data exists per shard only as its slice."""
        outside = {
            m: min(
                set(m.users) - members - {tail_node},
                key=self.order.get,
                default=None,
            )
            for m in members
        }
        value = min(
            (m for m, r in outside.items() if r is not None), key=self.order.get, default=None
        )
        if value is None:
            return
        reader = outside[value].name
        if any(value is h or value in _descendants(h, self.metadata_reads) for h in columns):
            raise NotExact(
                f"{value.name}, computed from the heads, is also read outside the "
                f"block (by {reader}; k or v kept as a cache, attention weights "
                f"returned): a shard holds only its heads' slice of it"
            )
        raise NotExact(
            f"{value.name} is made from the sizes or dtype of the block's values (not "
            f"their data) and read outside it (by {reader}): at fx level they are not "
            f"known to be its input's; pass example_inputs (torch.export reads them "
            f"from the input)"
        )

    def check(self, tail: Unit, columns, region) -> CutWalk:
        """The cut walk of the block, or NotExact with the first reason it is not exact."""
        t_in, tail_node = self.nodes[tail.call.input], self.nodes[tail.node]
        units = [self.units[h] for h in columns]
        if len({u.call.input for u in units}) != 1:
            raise NotExact(
                "its heads read different inputs (q from one, k/v from another, as "
                "in cross-attention): a fused unit has one input"
            )
        if self.merged.intersection(columns):
            raise NotExact("a head already belongs to another fused block")
        members = set(region) | set(columns)
        self._read_only_inside(members, columns, tail_node)
        params = [p for u in units + [tail] for p in u.params.values()]
        if any(self.readers[p] != 1 for p in params):
            raise NotExact("a parameter of the block is tied or read elsewhere")
        for ext in {i for n in region for i in n.all_input_nodes} - members:
            carriers = (_ancestors(ext, self.metadata_reads) | {ext}) & self.weighted
            if carriers and not _is_metadata_read(ext):
                raise NotExact(
                    f"its operand {ext.name} is computed from parameters (through "
                    f"{min(carriers, key=self.order.get).name}): the fused unit does "
                    f"not carry that gradient out"
                )
        widths = {
            h: self.plan.params[u.params["weight"]].shape[_linear_dims(u)[0]]
            for h, u in zip(columns, units)
        }
        hidden = self.plan.params[tail.params["weight"]].shape[_linear_dims(tail)[1]]
        walk = CutWalk(self.gm, region, widths, t_in, hidden)
        g, n = walk.groups(), self.plan.world_size
        # beyond what cutting the same width element by element pads anyway
        padding = math.ceil(g / n) * (hidden // g) / math.ceil(hidden / n) - 1 if g else 0
        if n > 1 and (g < 2 or padding > self.max_padding):
            raise NotExact(
                f"only {g} whole head group(s) for {n} ranks: shards of whole "
                f"groups would add {padding:.0%} to the block's weights per rank "
                f"(fuse_padding allows {self.max_padding:.0%})"
            )
        return walk


@graph_pass(check=check_plan, plans_only=True)
def fuse_blocks(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Merge, in `ctx.plan`, every exact column-split -> region -> linear block into one fused
    unit; record why each attention block that is not fused is not (the graph is unchanged).
    Attention is cut in whole head groups: a block whose groups N does not divide is fused only
    if that padding adds at most `ctx.options.fuse_padding` to its weights per rank (memory at
    1/N comes first). A block that would cut an already-sharded parameter
    (`Options.fixed_layouts`) otherwise than it is cut is not fused."""
    plan = ctx.plan
    finder = BlockFinder(gm, plan, ctx.options.fuse_padding)
    for tail in [
        u for u in plan.units if u.kind == UnitKind.ROTATE and u.call.rule.name == "linear"
    ]:
        if finder.nodes[tail.node] in finder.merged:
            continue
        found = finder.region_of(tail)
        if found is None:
            continue
        columns, region, attention = found
        try:
            if finder.readers[tail.params["weight"]] != 1:
                raise NotExact("its output projection's weight is tied or read elsewhere")
            walk = finder.check(tail, columns, region)
            externals = sorted(
                {i for n in region for i in n.all_input_nodes} - set(region) - set(columns),
                key=finder.order.get,
            )
            fusion = Fusion(
                [finder.units[h] for h in columns],
                tail,
                [n.name for n in region],
                walk.groups(),
                [e.name for e in externals],
                walk.rewrites,
                attention,
                walk.tail_width,
            )
            _keeps_fixed(_fused_layouts(plan, fusion), ctx.options.fixed)
        except NotExact as why:
            if attention:
                plan.unfused[tail.name] = str(why)
            continue
        _record_fusion(plan, fusion)
        finder.merged.update([*columns, finder.nodes[tail.node]])
    plan.units.sort(key=lambda u: finder.order[finder.nodes[u.node]])
    return gm


def _fused_layouts(plan: Plan, fusion: Fusion) -> dict[str, tuple[int, int]]:
    """(dim, granule) of every parameter of the block fused: the tail's weight cut on its
    inputs, every other layout on its outputs, in whole groups (a granule: one group's width
    in that layer)."""
    g, out = fusion.groups, {}
    for unit, dim in [(h, _linear_dims(h)[0]) for h in fusion.columns] + [
        (fusion.tail, _linear_dims(fusion.tail)[1])
    ]:
        roles = (
            unit.params.items() if unit is not fusion.tail else [("weight", unit.params["weight"])]
        )
        for role, name in roles:
            d = dim if role == "weight" else 0
            out[name] = (d, plan.params[name].shape[d] // g)
    return out


def _keeps_fixed(layouts: dict[str, tuple[int, int]], fixed: dict[str, tuple]) -> None:
    """NotExact where fusing would cut a parameter otherwise than it is already sharded."""
    moved = sorted(n for n, lay in layouts.items() if n in fixed and fixed[n] != lay)
    if moved:
        raise NotExact(
            f"{moved[0]} is already sharded as (dim, granule) {fixed[moved[0]]} "
            f"(rtp_compile.shard or an earlier compiled graph); the block would cut "
            f"it as {layouts[moved[0]]}"
        )


def _record_fusion(plan: Plan, fusion: Fusion) -> None:
    """Replace the block's units by one fused unit, its parameters laid out by
    `_fused_layouts`."""
    for name, (d, granule) in _fused_layouts(plan, fusion).items():
        plan.params[name] = dataclasses.replace(plan.params[name], dim=d, granule=granule)
    params = {
        f"col{i}.{role}": name
        for i, h in enumerate(fusion.columns)
        for role, name in h.params.items()
    }
    params.update({f"tail.{role}": name for role, name in fusion.tail.params.items()})
    for unit in fusion.columns + [fusion.tail]:
        plan.units.remove(unit)
    name = unique_name(_block_name(fusion.columns + [fusion.tail]), plan.names())
    plan.units.append(
        Unit(
            name,
            fusion.tail.node,
            UnitKind.FUSED,
            params,
            fusion.tail.call,
            Split.ROW,
            target="+".join(u.target for u in fusion.columns + [fusion.tail]),
            fusion=fusion,
        )
    )


def _rewritten(graph: fx.Graph, args: list, kwargs: dict, rewrites, first, groups, g: int):
    """args / kwargs of one region node with its per-shard sizes and operands."""

    def per_group(size):
        return size // g

    for r in rewrites:
        where, key, *inner = r.path
        box = args if where == "args" else kwargs
        value = box[key][inner[0]] if inner else box[key]
        if r.kind == RewriteKind.SIZE:
            new = graph.call_function(operator.mul, (groups, per_group(r.size)))
        else:
            start = graph.call_function(operator.mul, (first, per_group(r.size)))
            length = graph.call_function(operator.mul, (groups, per_group(r.size)))
            new = (
                graph.call_function(torch.narrow, (value, r.dim, start, length))
                if r.kind == RewriteKind.SLICE
                else graph.call_function(head_slice, (value, r.dim, start, length, r.size, r.rank))
            )
        if inner:
            seq = list(box[key])
            seq[inner[0]] = new
            box[key] = type(box[key])(seq)
        else:
            box[key] = new


def region_body(nodes: dict[str, fx.Node], fusion: Fusion) -> fx.GraphModule:
    """The block's region as a GraphModule: (first group, groups held, *column outputs,
    *externals) in, the tail's input out; `nodes`: the graph's nodes by name. Run for any
    shard: its sizes on the cut axis are `groups` x a group's width, its per-head operands
    narrowed to the shard's groups."""
    graph = fx.Graph()
    first, groups = graph.placeholder("first_group"), graph.placeholder("groups")

    def per_shard(node, args, kwargs):
        _rewritten(
            graph, args, kwargs, fusion.rewrites.get(node.name, []), first, groups, fusion.groups
        )

    inputs = [(nodes[h.node], f"col{i}") for i, h in enumerate(fusion.columns)] + [
        (nodes[name], name) for name in fusion.externals
    ]
    extract_graph(
        inputs,
        [nodes[name] for name in fusion.region],
        nodes[fusion.tail.call.input],
        graph,
        per_shard,
    )
    return fx.GraphModule(torch.nn.Module(), graph, class_name="FusedRegion")
