"""The order of communication and compute of every unit, written into the rank-generic graph.

The last pass before codegen, and rank-independent. Each rotated or fused unit marker becomes
its forward steps: the unit's input and own shards detached, then for k = 0 .. N-1 the hop that
brings step k+1's shard started (`torch.ops.rtp.ring_shift_start`, with its message tag), step k
computed (`unit_step`: codegen traces the rule's step for the shard the rank holds), the hop
waited on (`ring_wait`), the pooled buffers released after the last one (`ring_release`), the
views of what arrived taken; then `unit_combine` (codegen orders the parts by shard) and
`unit_autograd` (the unit's runtime module, which links the result into autograd). Each unit's
backward is a list of events with their tags, in `ctx.schedules` (`runtime.events.UnitSchedule`):
the runtime executes it as given.

Forward, step k holds shard (rank - k) mod N; at most two shards of a unit (held + incoming)
exist besides the rank's own. Backward runs the steps in reverse (step j holds shard
(rank + 1 + j) mod N), re-fetching weights counter-clockwise, while a gradient accumulator
travels with each shard and arrives complete at its owner after the last step.

Invariant (DESIGN.md 3, checked on the graph after the pass): every start precedes the compute
it overlaps, every wait comes after that compute and before the step that uses what it
receives; every unit has its schedule; parameters are read only by the nodes of units.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from rtp_compile.passes.pipeline import InvariantError, graph_pass
from rtp_compile.passes.rotate import fused_block, parameters_read_only_by_units, rotated_op
from rtp_compile.runtime import ring  # also registers torch.ops.rtp.*
from rtp_compile.runtime.events import Event, UnitSchedule


def forward_schedule(world_size: int) -> list[Event]:
    """start(k+1), compute(k), wait(k+1) for every step: one hop in flight while computing."""
    events = []
    for k in range(world_size):
        if k + 1 < world_size:
            events.append(Event("start", k + 1))
        events.append(Event("compute", k))
        if k + 1 < world_size:
            events.append(Event("wait", k + 1))
    return events


def backward_schedule(world_size: int, fetch_tag: int | None = None,
                      grad_tag: int | None = None) -> list[Event]:
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
    events = [Event("fetch_start", 0, fetch_tag), Event("input_grad", own)] if n > 1 else []
    for j in range(n - 1):
        events.append(Event("fetch_wait", j))
        if j == n - 2:
            events.append(Event("release", j))
        if j + 1 < n - 1:
            events.append(Event("fetch_start", j + 1, fetch_tag))
        events += [Event("input_grad", j), Event("receive_grad", j), Event("weight_grad", j),
                   Event("pass", j, grad_tag)]
    if n == 1:
        events.append(Event("input_grad", own))
    return events + [Event("receive_grad", own), Event("weight_grad", own)]


def unit_step(name: str, step: int, x, *held_then_externals):
    """Marker of forward step `step` of unit `name`; codegen traces the step for the shard the
    rank holds then."""
    raise RuntimeError(f"unit {name!r} belongs to the rank-generic program: run the module of a "
                       "rank, prog.module(rank), not prog.graph")


def unit_combine(name: str, parts):
    """Marker: the steps' partial outputs of unit `name` combined (codegen orders them by
    shard)."""
    raise RuntimeError(f"unit {name!r} belongs to the rank-generic program: run prog.module(rank)")


def unit_autograd(name: str, y, x, *params_then_externals):
    """Marker: unit `name`'s runtime module, which links its combined output `y` into autograd
    (its backward executes the unit's backward events)."""
    raise RuntimeError(f"unit {name!r} belongs to the rank-generic program: run prog.module(rank)")


class LabellingTracer(fx.proxy.GraphAppendingTracer):
    """Appends to a graph and labels every node it creates with the current unit step."""

    def __init__(self, graph):
        super().__init__(graph)
        self.label = None

    def create_node(self, *args, **kwargs):
        node = super().create_node(*args, **kwargs)
        if self.label is not None:
            node.meta["rtp"] = dict(self.label)
        return node


def _message(specs, tag: int) -> dict:
    """What a hop sends: its tag, the flat message's dtype and bytes (for inspection)."""
    dtype, total, _ = ring.flat_layout(specs)
    return {"tag": tag, "dtype": dtype, "bytes": total * dtype.itemsize}


@dataclass
class Expanded:
    """Where a unit's forward steps lie: its first hop (the own shards' reads and detaches and
    the start), its last step, and the bytes of its message."""
    first_hop: list[fx.Node]
    last_step: fx.Node
    message_bytes: int


def _expand(graph: fx.Graph, marker: fx.Node, unit, layouts, n: int, tag: int) -> Expanded:
    """Unit `unit`'s forward steps before `marker`, which they replace."""
    name, x, *rest = marker.args
    params, externals = rest[:len(unit.params)], rest[len(unit.params):]
    roles = list(unit.params)
    specs = [(lay.shard_shape, lay.dtype) for lay in layouts]
    tracer = LabellingTracer(graph)
    create = tracer.create_node
    with graph.inserting_before(marker):
        tracer.label = {"unit": name, "step": 0, "action": "detach"}
        x_in = create("call_method", "detach", (x,), {}, name=f"{name}_in")
        held = [create("call_method", "detach", (p,), {}, name=f"{name}_{r.replace('.', '_')}0")
                for p, r in zip(params, roles)]
        received, parts = None, []
        for event in forward_schedule(n):
            k = event.step
            tracer.label = {"unit": name, "step": k, "action": event.action}
            if event.action == "start":
                tracer.label.update(_message(specs, tag))
                received = create("call_function", torch.ops.rtp.ring_shift_start.default,
                                  (held, "", 1, tag, f"{name} step {k}"), {},
                                  name=f"{name}_recv{k}")
                if k == 1:
                    received_first = received
            elif event.action == "wait":
                create("call_function", torch.ops.rtp.ring_wait.default, (received,), {},
                       name=f"{name}_wait{k}")
                if k == n - 1:  # the unit's last hop: no buffer waits idle through compute
                    create("call_function", torch.ops.rtp.ring_release.default, (), {},
                           name=f"{name}_release")
                views = ring.unpack(fx.Proxy(received, tracer), specs)
                for view, r in zip(views, roles):
                    view.node._rename(f"{name}_{r.replace('.', '_')}{k}")
                held = [view.node for view in views]
            else:
                parts.append(create("call_function", unit_step, (name, k, x_in, *held,
                                                                 *externals), {},
                                    name=f"{name}_y{k}"))
        tracer.label = {"unit": name, "step": n - 1, "action": "combine"}
        y = create("call_function", unit_combine, (name, parts), {}, name=f"{name}_out")
        tracer.label = {"unit": name, "step": None, "action": unit.kind}
        link = create("call_function", unit_autograd, (name, y, x, *params, *externals), {},
                      name=name)
    for node in (*parts, y, link):
        node.meta["is_wrapped"] = True  # fx records a marker as a call when re-tracing (pickle)
    link.meta.update({k: v for k, v in marker.meta.items() if k != "rtp"})
    marker.replace_all_uses_with(link)
    graph.erase_node(marker)
    own = [d for d in link.graph.nodes if d.meta.get("rtp", {}).get("unit") == name
           and d.meta["rtp"]["action"] == "detach" and d.args[0] in params]
    first = [*params, *own, *([received_first] if n > 1 else [])]
    return Expanded(first, parts[-1], _message(specs, tag)["bytes"])


def prefetch(current: Expanded, following: Expanded, budget: int) -> None:
    """Start the following unit's first hop before the current unit's last step computes (its
    own shards are at hand from the start), where the two messages then in flight (the
    current unit's last one, the following unit's first) fit in `budget` bytes."""
    if current.message_bytes + following.message_bytes > budget:
        return
    for node in following.first_hop:
        current.last_step.prepend(node)
        if node.op == "call_function":
            node.meta["rtp"]["prefetched"] = True


def _check(gm: fx.GraphModule, ctx) -> None:
    parameters_read_only_by_units(gm)
    steps: dict[str, dict[tuple[int, str], int]] = {}
    for i, node in enumerate(gm.graph.nodes):
        if node.target in (rotated_op, fused_block):
            raise InvariantError(f"unit {node.args[0]} was not scheduled")
        label = node.meta.get("rtp")
        if label and label["step"] is not None:
            steps.setdefault(label["unit"], {}).setdefault((label["step"], label["action"]), i)
    n = ctx.world_size
    for u in ctx.plan.units:
        if u.name not in ctx.schedules:
            raise InvariantError(f"unit {u.name} has no schedule")
        if u.kind in ("gather", "small"):
            continue
        at = steps.get(u.name, {})
        for k in range(n - 1):
            start, compute = at.get((k + 1, "start")), at.get((k, "compute"))
            wait, following = at.get((k + 1, "wait")), at.get((k + 1, "compute"))
            if None in (start, compute, wait, following) or \
                    not start < compute < wait < following:
                raise InvariantError(f"unit {u.name}: hop {k + 1} is not started before step "
                                     f"{k} computes and waited on before step {k + 1}")


@graph_pass(check=_check, required=True)
def schedule(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Write every unit's forward steps and hops into the graph, its tags and backward events
    into `ctx.schedules`."""
    n, plan = ctx.world_size, ctx.plan
    markers = {node.args[0]: node for node in gm.graph.nodes
               if node.target in (rotated_op, fused_block)}
    expanded = []
    for i, unit in enumerate(plan.units):
        tags = dict(forward_tag=3 * i, fetch_tag=3 * i + 1, grad_tag=3 * i + 2)
        if unit.kind in ("gather", "small"):  # they run their own ring all-gather
            ctx.schedules[unit.name] = UnitSchedule(**tags)
            continue
        layouts = [plan.params[p] for p in unit.params.values()]
        expanded.append(_expand(gm.graph, markers[unit.name], unit, layouts, n,
                                tags["forward_tag"]))
        ctx.schedules[unit.name] = UnitSchedule(
            **tags, backward=tuple(backward_schedule(n, tags["fetch_tag"], tags["grad_tag"])))
    if n > 1 and expanded:
        budget = ctx.options.max_bytes_in_flight
        if budget is None:  # what one unit alone holds: two of the largest messages
            budget = 2 * max(e.message_bytes for e in expanded)
        for current, following in zip(expanded, expanded[1:]):
            prefetch(current, following, budget)
    gm.graph.lint()
    gm.recompile()
    return gm
