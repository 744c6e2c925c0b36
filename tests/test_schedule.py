"""Communication/compute overlap, read off the emitted graphs (the schedule pass's invariant).

Forward, in every unit of every rank: the hop that brings step k+1's shard is started before
any op of step k's compute, waited on after step k's compute and before step k+1's. Backward
(the schedule the runtime follows): each weight hop is started a step before it is needed, and
at most two weight and two gradient buffers are in flight.
"""

import pytest
import torch
from zoo import build

import rtp_compile
from rtp_compile.core.ir import label_of, unit_of
from rtp_compile.passes.schedule import backward_schedule, forward_schedule


def unit_events(gm):
    """unit -> list of (position in the graph, step, action) of its emitted nodes."""
    events = {}
    for i, node in enumerate(gm.graph.nodes):
        tag = label_of(node)
        if tag is not None and tag.step is not None:
            events.setdefault(tag.unit, []).append((i, tag.step, tag.action))
    return events


@pytest.mark.slow
@pytest.mark.parametrize("bucket_bytes", [0, None])
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("model", ["mlp", "gpt", "conv"])
def test_sends_start_before_the_step_they_overlap_and_wait_before_the_next(
    model, world_size, bucket_bytes
):
    """A unit in a bucket has no hops of its own: its step k + 1 comes after the wait for the
    hop that brought it, in the bucket's first unit."""
    prog = rtp_compile.transform(build(model, 0), world_size, bucket_bytes=bucket_bytes)
    lead_of = {m: members[0] for members in prog.ctx.buckets.values() for m in members}
    for rank in range(world_size):
        events = unit_events(prog.module(rank))
        assert set(events) == {u.name for u in prog.plan.units if u.kind in ("rotate", "fused")}
        for unit, evs in events.items():
            hops = events[lead_of.get(unit, unit)]
            where = lambda evs, step, action: [i for i, s, a in evs if s == step and a == action]
            for k in range(world_size):
                compute_k = where(evs, k, "compute")
                if k + 1 < world_size:
                    (start,), wait = where(hops, k + 1, "start"), min(where(hops, k + 1, "wait"))
                    if compute_k and lead_of.get(unit, unit) == unit:  # all-padding: no compute
                        assert start < min(compute_k), f"{unit} rank {rank}: start {k + 1}"
                        assert wait > max(compute_k), f"{unit} rank {rank}: wait {k + 1}"
                    if lead_of.get(unit, unit) != unit:
                        assert not where(evs, k + 1, "start"), f"{unit}: a hop of its own"
                    later = where(evs, k + 1, "compute")
                    assert not later or wait < min(later), f"{unit} rank {rank}: step {k + 1}"
    if bucket_bytes is None and world_size == 2 and model == "gpt":
        assert prog.ctx.buckets  # the default does bucket this model


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_forward_schedule_keeps_one_hop_in_flight(world_size):
    events = forward_schedule(world_size)
    assert [e.step for e in events if e.action == "compute"] == list(range(world_size))
    in_flight = 0
    for e in events:
        in_flight += {"start": 1, "wait": -1}.get(e.action, 0)
        assert 0 <= in_flight <= 1
    assert in_flight == 0


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_backward_schedule_prefetches_and_bounds_buffers(world_size):
    events = backward_schedule(world_size)
    order = [(e.action, e.step) for e in events]
    n = world_size
    assert [s for a, s in order if a == "weight_grad"] == list(range(n))
    for j in range(n - 1):  # weight for step j fetched before step j-1 computes its gradient
        assert order.index(("fetch_wait", j)) < order.index(("input_grad", j))
        if j > 0:
            assert order.index(("fetch_start", j)) < order.index(("input_grad", j - 1))
    assert ("fetch_start", n - 1) not in order  # the last step uses the rank's own shard
    weights = grads = 0
    for action, step in order:
        weights += {"fetch_start": 1, "fetch_wait": -1}.get(action, 0)
        grads += {"pass": 1, "receive_grad": -1 if step > 0 else 0}.get(action, 0)
        assert weights <= 1 and grads <= 1
    assert sum(a == "pass" for a, _ in order) == n - 1


def test_emitted_code_reads_as_the_schedule():
    prog = rtp_compile.transform(torch.nn.Linear(6, 10), 3)
    code = prog.module(2).code
    for expected in ("ring_shift_start", "ring_wait", "_y0", "_y1", "_y2", "torch.cat"):
        assert expected in code
    assert code.index("_recv1") < code.index("_y0") < code.index("_wait1") < code.index("_y1")


def _position(gm, unit, step, action):
    return [
        i
        for i, n in enumerate(gm.graph.nodes)
        if unit_of(n) == unit and (label_of(n).step, label_of(n).action) == (step, action)
    ]


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_next_units_first_hop_starts_during_the_last_step_of_the_one_before(world_size):
    model = build("mlp", 0)
    units = [
        u.name
        for u in rtp_compile.transform(model, world_size).plan.units
        if u.kind in ("rotate", "fused")
    ]
    assert len(units) >= 2
    for budget, prefetched in ((None, True), (0, False)):
        gm = rtp_compile.transform(model, world_size, max_bytes_in_flight=budget).module(0)
        for current, following in zip(units, units[1:]):
            (start,) = _position(gm, following, 1, "start")
            last = _position(gm, current, world_size - 1, "compute")  # the ops of the step
            assert last and (start < min(last)) == prefetched, (current, following, budget)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_backward_starts_with_the_own_shards_input_grad_while_the_first_fetch_flies(world_size):
    order = [(e.action, e.step) for e in backward_schedule(world_size)]
    own = world_size - 1
    assert order[:2] == [("fetch_start", 0), ("input_grad", own)]
    assert order.index(("input_grad", own)) < order.index(("fetch_wait", 0))
    assert order[-2:] == [("receive_grad", own), ("weight_grad", own)]
