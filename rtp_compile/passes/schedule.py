"""The order of communication and compute of every unit, written into the rank-generic graph.

The last pass before codegen, and rank-independent. Each rotated or fused unit marker becomes
its forward steps: the unit's input and own shards detached, then for k = 0 .. N-1 the hop that
brings step k+1's shard started (`torch.ops.rtp.ring_shift_start`, with its message tag), step k
computed (`unit_step`: codegen traces the rule's step for the shard the rank holds), the hop
waited on (`ring_wait`, which returns what arrived: nothing reads it before), the pooled
buffers released after the last one (`ring_release`), the views of what arrived taken; then
`unit_combine` (codegen concatenates the parts in shard order or sums them as the steps go) and
`unit_autograd` (the unit's runtime module, which links the result into autograd). Each
unit's backward is a list of events with their tags, in `ctx.schedules`
(`runtime.events.UnitSchedule`): the runtime executes it as given.

Forward, step k holds shard (rank - k) mod N; at most two shards of a unit (held + incoming)
exist besides the rank's own. Backward runs the steps in reverse (step j holds shard
(rank + 1 + j) mod N), re-fetching weights counter-clockwise, while a gradient accumulator
travels with each shard and arrives complete at its owner after the last step.

Invariant (checked on the graph after the pass): every start precedes the compute
it overlaps, every wait comes after that compute and before the step that uses what it
receives; every unit has its schedule; parameters are read only by the nodes of units.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from rtp_compile.core.graph_ops import expect_dtype
from rtp_compile.core.ir import (
    LABEL_KEY,
    Action,
    NodeLabel,
    UnitKind,
    bucket_params,
    checkpoint_region,
    fused_block,
    label_of,
    rotated_op,
    set_label,
    unit_autograd,
    unit_combine,
    unit_step,
)
from rtp_compile.passes.manager.pipeline import InvariantError, graph_pass
from rtp_compile.passes.rotate import parameters_read_only_by_units
from rtp_compile.runtime import packing, ring  # noqa: F401 (ring registers torch.ops.rtp.*)
from rtp_compile.runtime.events import Event, UnitSchedule


def forward_schedule(world_size: int) -> list[Event]:
    """start(k+1), compute(k), wait(k+1) for every step: one hop in flight while computing."""
    events = []
    for k in range(world_size):
        if k + 1 < world_size:
            events.append(Event(Action.START, k + 1))
        events.append(Event(Action.COMPUTE, k))
        if k + 1 < world_size:
            events.append(Event(Action.WAIT, k + 1))
    return events


def backward_schedule(
    world_size: int, fetch_tag: int | None = None, grad_tag: int | None = None
) -> list[Event]:
    """Reverse steps j = 0..N-1 (forward step N-1-j).

    fetch_start(j)/fetch_wait(j): the weight shard for step j arrives from rank+1 (the last step
    uses the rank's own shard, so it fetches nothing); release: after the last weight hop the
    pooled weight buffers go; input_grad(j): this step's part of dx; receive_grad(j): wait for
    that shard's accumulator from rank+1 (step 0 starts one at zero); weight_grad(j): add this
    rank's gradient into it in place; pass(j): send it on to rank-1 (the last step keeps it:
    owner). The own shard's part of dx comes first, while the first weight hop is in flight, so
    a unit's backward does not start by waiting; its weight gradient waits for its accumulator,
    last. In flight at most: weight held + incoming, accumulator outgoing + incoming.
    """
    n = world_size
    own = n - 1
    events = (
        [Event(Action.FETCH_START, 0, fetch_tag), Event(Action.INPUT_GRAD, own)] if n > 1 else []
    )
    for j in range(n - 1):
        events.append(Event(Action.FETCH_WAIT, j))
        if j == n - 2:
            events.append(Event(Action.RELEASE, j))
        if j + 1 < n - 1:
            events.append(Event(Action.FETCH_START, j + 1, fetch_tag))
        events += [
            Event(Action.INPUT_GRAD, j),
            Event(Action.RECEIVE_GRAD, j),
            Event(Action.WEIGHT_GRAD, j),
            Event(Action.PASS, j, grad_tag),
        ]
    if n == 1:
        events.append(Event(Action.INPUT_GRAD, own))
    return events + [Event(Action.RECEIVE_GRAD, own), Event(Action.WEIGHT_GRAD, own)]


def bucket_backward_schedule(world_size: int, fetch_tag: int | None = None) -> list[Event]:
    """The backward of a unit in a bucket: its own shard's step first (dx part and gradient)
    while the bucket's first weight hop flies, then steps j = 0..N-2 on the fetched weights
    (fetch_start / fetch_wait drive the bucket's hops: the first unit to run does them, the
    others find them done); each step's gradient goes into the bucket's rows, which the bucket
    reduce-scatters after its last unit (`done`)."""
    n, own = world_size, world_size - 1
    events = [
        Event(Action.FETCH_START, 0, fetch_tag),
        Event(Action.INPUT_GRAD, own),
        Event(Action.WEIGHT_GRAD, own),
    ]
    for j in range(n - 1):
        events.append(Event(Action.FETCH_WAIT, j))
        if j + 1 < n - 1:
            events.append(Event(Action.FETCH_START, j + 1, fetch_tag))
        events += [Event(Action.INPUT_GRAD, j), Event(Action.WEIGHT_GRAD, j)]
    return events + [Event(Action.DONE, own)]


class LabellingTracer(fx.proxy.GraphAppendingTracer):
    """Appends to a graph and labels every node it creates with the current unit step."""

    def __init__(self, graph):
        super().__init__(graph)
        self.label = None

    def create_node(self, *args, **kwargs):
        node = super().create_node(*args, **kwargs)
        if self.label is not None:
            set_label(node, replace(self.label))
        return node


def _message(specs, tag: int) -> dict:
    """What a hop sends: its tag, the flat message's dtype and bytes (for inspection)."""
    dtype, total, _ = packing.flat_layout(specs)
    return {"tag": tag, "dtype": dtype, "bytes": total * dtype.itemsize}


@dataclass
class Expanded:
    """Where a unit's (or bucket's) forward steps lie: its first hop (the own shards' reads and
    detaches and the start), its last step, and the bytes of its message."""

    first_hop: list[fx.Node]
    last_step: fx.Node
    message_bytes: int
    region: int | None  # the model's activation checkpoint it is in (core.ir.checkpoint_region)


@dataclass
class _Member:
    """One unit of what `_expand` writes: its marker's arguments, split. Its input and
    extras are read from the marker when used: an earlier unit of its bucket, finished
    first, may have replaced the node that computes them."""

    marker: fx.Node
    unit: object
    params: list
    stored: list  # the shards' stored dtypes (the model's)
    specs: list  # (shape, dtype) of the shards as they rotate: in their compute dtype

    @classmethod
    def of(cls, marker, unit, plan, precision):
        layouts = [plan.params[p] for p in unit.params.values()]
        return cls(
            marker,
            unit,
            list(marker.args[2 : 2 + len(unit.params)]),
            [lay.dtype for lay in layouts],
            [(lay.shard_shape, precision.compute(lay.dtype)) for lay in layouts],
        )

    @property
    def x(self) -> fx.Node:
        return self.marker.args[1]

    @property
    def extras(self) -> list:
        """What the marker carries after its weights: a rotated op's run-time inputs, a fused
        block's externals."""
        return list(self.marker.args[2 + len(self.unit.params) :])

    def label(self, r: str, k: int) -> str:
        return f"{self.unit.name}_{r.replace('.', '_')}{k}"


def _finish(graph, tracer, member: _Member, x_in, parts: list[fx.Node]) -> None:
    """After a unit's steps `parts`: their combine and the autograd link, in place of the
    unit's marker (call inside `graph.inserting_before(member.marker)`)."""
    create, name = tracer.create_node, member.unit.name
    tracer.label = NodeLabel(name, len(parts) - 1, Action.COMBINE)
    y = create("call_function", unit_combine, (name, parts), {}, name=f"{name}_out")
    tracer.label = NodeLabel(name, None, member.unit.kind)
    link = create(
        "call_function",
        unit_autograd,
        (name, y, member.x, *member.params, *member.extras),
        {},
        name=name,
    )
    for node in (*parts, y, link):
        node.meta["is_wrapped"] = True  # fx records a marker as a call when re-tracing (pickle)
    link.meta.update({k: v for k, v in member.marker.meta.items() if k != LABEL_KEY})
    member.marker.replace_all_uses_with(link)
    graph.erase_node(member.marker)


def _step(tracer, member: _Member, k: int, x_in, held: list[fx.Node]) -> fx.Node:
    name = member.unit.name
    tracer.label = NodeLabel(name, k, Action.COMPUTE)
    return tracer.create_node(
        "call_function",
        unit_step,
        (name, k, x_in, *held, *member.extras),
        {},
        name=f"{name}_y{k}",
    )


def _own_shard(
    create, param: fx.Node, stored: torch.dtype, compute: torch.dtype, name: str
) -> list[fx.Node]:
    """The rank's own shard as its unit's step 0 reads and its first hop sends it: detached,
    and cast once to its compute dtype (mixed precision: the ring carries that dtype). The
    nodes made, the shard last."""
    if stored == compute:
        return [create("call_method", "detach", (param,), {}, name=name)]
    shard = create("call_method", "detach", (param,), {}, name=f"{name}_stored")
    return [shard, create("call_method", "to", (shard, compute), {}, name=name)]


def _unit_input(create, member: _Member) -> fx.Node:
    """The unit's input, detached; under mixed precision, for an op that needs its input in
    its weights' dtype (linear, conv, a fused block's linears), checked to be in it."""
    unit, name = member.unit, f"{member.unit.name}_in"
    op = "fused block" if unit.kind == UnitKind.FUSED else unit.call.rule.name
    (_, compute), stored = member.specs[0], member.stored[0]
    if op not in ("fused block", "linear", "conv") or compute == stored:
        return create("call_method", "detach", (member.x,), {}, name=name)
    x = create("call_method", "detach", (member.x,), {}, name=f"{name}_unchecked")
    what = f"{op} of {', '.join(unit.params.values())}"
    return create("call_function", expect_dtype, (x, compute, unit.name, what), {}, name=name)


def _expand(
    graph: fx.Graph, members: list[_Member], n: int, tag: int, bucket: str | None = None
) -> Expanded:
    """The forward steps of one unit, or of a bucket's units, before their markers (which they
    replace). A bucket's parameters first pass through `bucket_params`; its first unit's steps
    carry the hops of every unit's shards, the later units compute from what arrived."""
    tracer = LabellingTracer(graph)
    create = tracer.create_node
    lead, hop = members[0], bucket or members[0].unit.name
    specs = [s for m in members for s in m.specs]
    message = _message(specs, tag)
    with graph.inserting_before(lead.marker):
        first = [p for m in members for p in m.params]
        if bucket is not None:
            tracer.label = NodeLabel(lead.unit.name, 0, Action.BUCKET, bucket=bucket)
            through = create(
                "call_function", bucket_params, (bucket, *first), {}, name=f"{bucket}_params"
            )
            through.meta["is_wrapped"] = True  # a call when fx re-traces it (pickle)
            for read in first:  # the later units' parameter reads move up to it
                through.prepend(read)
            first.append(through)
            index = iter(range(len(specs)))
            for m in members:
                m.params = [
                    create(
                        "call_function",
                        operator.getitem,
                        (through, next(index)),
                        {},
                        name=m.label(r, "_param"),
                    )
                    for r in m.unit.params
                ]
                first += m.params
        arrived: dict[int, dict[str, list[fx.Node]]] = {0: {}}
        for m in members:
            tracer.label = NodeLabel(m.unit.name, 0, Action.DETACH)
            own = [
                _own_shard(create, p, stored, compute, m.label(r, 0))
                for p, r, stored, (_, compute) in zip(m.params, m.unit.params, m.stored, m.specs)
            ]
            arrived[0][m.unit.name] = [nodes[-1] for nodes in own]
            first += [node for nodes in own for node in nodes]
        held = [d for m in members for d in arrived[0][m.unit.name]]
        tracer.label = NodeLabel(lead.unit.name, 0, Action.DETACH)
        x_in = _unit_input(create, lead)
        parts = []
        for event in forward_schedule(n):  # the lead unit: start(k+1), compute(k), wait(k+1)
            k = event.step
            tracer.label = NodeLabel(lead.unit.name, k, event.action)
            if event.action == Action.START:
                tracer.label = replace(tracer.label, bucket=bucket, **message)
                received = create(
                    "call_function",
                    torch.ops.rtp.ring_shift_start.default,
                    (held, "", 1, tag, f"{hop} step {k}"),
                    {},
                    name=f"{hop}_recv{k}",
                )
                if k == 1:
                    first.append(received)
            elif event.action == Action.WAIT:  # what arrived is read only through the wait
                arrival = create(
                    "call_function",
                    torch.ops.rtp.ring_wait.default,
                    (received, held),
                    {},
                    name=f"{hop}_wait{k}",
                )
                if k == n - 1:  # the last hop: no buffer waits idle through compute
                    create(
                        "call_function",
                        torch.ops.rtp.ring_release.default,
                        (arrival,),
                        {},
                        name=f"{hop}_release",
                    )
                held = [v.node for v in packing.unpack(fx.Proxy(arrival, tracer), specs)]
                arrived[k], at = {}, 0
                for m in members:
                    arrived[k][m.unit.name] = held[at : at + len(m.specs)]
                    for view, r in zip(arrived[k][m.unit.name], m.unit.params):
                        view._rename(m.label(r, k))
                    at += len(m.specs)
            else:
                parts.append(_step(tracer, lead, k, x_in, arrived[k][lead.unit.name]))
        _finish(graph, tracer, lead, x_in, parts)
    for m in members[1:]:  # compute from what arrived during the lead unit's steps
        with graph.inserting_before(m.marker):
            tracer.label = NodeLabel(m.unit.name, 0, Action.DETACH)
            m_in = _unit_input(create, m)
            parts = [_step(tracer, m, k, m_in, arrived[k][m.unit.name]) for k in range(n)]
            _finish(graph, tracer, m, m_in, parts)
    return Expanded(first, parts[-1], message["bytes"], checkpoint_region(lead.marker))


def prefetch(current: Expanded, following: Expanded, budget: int) -> None:
    """Start the following unit's first hop before the current unit's last step computes (its
    own shards are at hand from the start), where the two messages then in flight (the
    current unit's last one, the following unit's first) fit in `budget` bytes, and both are
    in the same activation checkpoint (or in none): a recomputed region starts no hop that
    runs past it and waits on none it did not start."""
    if (
        current.message_bytes + following.message_bytes > budget
        or current.region != following.region
    ):
        return
    for node in following.first_hop:
        current.last_step.prepend(node)
        if node.op == "call_function":
            label_of(node).prefetched = True


def _check(gm: fx.GraphModule, ctx) -> None:
    parameters_read_only_by_units(gm)
    steps: dict[str, dict[tuple[int, str], int]] = {}
    for i, node in enumerate(gm.graph.nodes):
        if node.target in (rotated_op, fused_block):
            raise InvariantError(f"unit {node.args[0]} was not scheduled")
        label = label_of(node)
        if label is not None and label.step is not None:
            steps.setdefault(label.unit, {}).setdefault((label.step, label.action), i)
    n = ctx.world_size
    lead_of = {m: members[0] for members in ctx.buckets.values() for m in members}
    for u in ctx.plan.units:
        if u.name not in ctx.schedules:
            raise InvariantError(f"unit {u.name} has no schedule")
        if u.kind in (UnitKind.GATHER, UnitKind.SMALL):
            continue
        at, hops = steps.get(u.name, {}), steps.get(lead_of.get(u.name, u.name), {})
        follower = lead_of.get(u.name, u.name) != u.name  # computes from its bucket's hops
        for k in range(n - 1):
            start, compute = hops.get((k + 1, Action.START)), at.get((k, Action.COMPUTE))
            wait, following = hops.get((k + 1, Action.WAIT)), at.get((k + 1, Action.COMPUTE))
            if follower:
                ok = (
                    None not in (wait, following)
                    and wait < following
                    and (k + 1, Action.START) not in at
                )
            else:
                ok = (
                    None not in (start, compute, wait, following)
                    and start < compute < wait < following
                )
            if not ok:
                raise InvariantError(
                    f"unit {u.name}: hop {k + 1} is not started before step "
                    f"{k} computes and waited on before step {k + 1}"
                )


@graph_pass(check=_check, required=True)
def schedule(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Write every unit's (and bucket's) forward steps and hops into the graph, its tags and
    backward events into `ctx.schedules`."""
    n, plan = ctx.world_size, ctx.plan
    markers = {
        node.args[0]: node for node in gm.graph.nodes if node.target in (rotated_op, fused_block)
    }
    tags = {
        u.name: dict(forward_tag=3 * i, fetch_tag=3 * i + 1, grad_tag=3 * i + 2)
        for i, u in enumerate(plan.units)
    }
    for unit in plan.units:
        if unit.kind in (UnitKind.GATHER, UnitKind.SMALL):  # they run their own ring all-gather
            ctx.schedules[unit.name] = UnitSchedule(**tags[unit.name])
    bucket_of = {members[0]: (name, members) for name, members in ctx.buckets.items()}
    in_bucket = {m for members in ctx.buckets.values() for m in members}
    units = {u.name: u for u in plan.units}
    expanded = []
    for name in [node.args[0] for node in markers.values()]:  # graph order
        if name in in_bucket and name not in bucket_of:
            continue  # written with its bucket's first unit
        bucket, members = bucket_of.get(name, (None, (name,)))
        lead = tags[members[0]]
        expanded.append(
            _expand(
                gm.graph,
                [_Member.of(markers[m], units[m], plan, ctx.precision) for m in members],
                n,
                lead["forward_tag"],
                bucket,
            )
        )
        for m in members:
            backward = (
                bucket_backward_schedule(n, lead["fetch_tag"])
                if bucket
                else backward_schedule(n, lead["fetch_tag"], lead["grad_tag"])
            )
            ctx.schedules[m] = UnitSchedule(
                **(lead if bucket else tags[m]), backward=tuple(backward), bucket=bucket
            )
    if n > 1 and expanded:
        budget = ctx.options.max_bytes_in_flight
        if budget is None:  # what one unit alone holds: two of the largest messages
            budget = 2 * max(e.message_bytes for e in expanded)
        for current, following in zip(expanded, expanded[1:]):
            prefetch(current, following, budget)
    gm.graph.lint()
    gm.recompile()
    return gm
