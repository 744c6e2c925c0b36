"""The order of communication and compute inside a rotation unit, rank-generic.

Forward, step k holds shard (rank - k) mod N: the hop that brings step k+1's shard is started
before step k computes and waited on right before step k+1, so at most two shards of the unit
(held + incoming) exist besides the rank's own. Backward runs the steps in reverse (step j holds
shard (rank + 1 + j) mod N), re-fetching weights counter-clockwise, while a gradient accumulator
travels with each shard and arrives complete at its owner after the last step.

Invariant (checked by tests on the emitted graph): every start precedes the compute it overlaps,
every wait comes after that compute and before the first use of what it receives.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Event:
    action: str   # forward: start | compute | wait; backward: see backward_schedule
    step: int


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


def backward_schedule(world_size: int) -> list[Event]:
    """Reverse steps j = 0..N-1 (forward step N-1-j).

    fetch_start(j)/fetch_wait(j): the weight shard for step j arrives from rank+1 (the last step
    uses the rank's own shard, so it fetches nothing); input_grad(j): this step's part of dx,
    computed while the accumulator hop is in flight; receive_grad(j): wait for that shard's
    accumulator from rank+1 (step 0 starts one at zero); weight_grad(j): add this rank's
    gradient into it in place; pass(j): send it on to rank-1 (the last step keeps it: owner).
    In flight at most: weight held + incoming, accumulator outgoing + incoming.
    """
    n = world_size
    events = [Event("fetch_start", 0)] if n > 1 else []
    for j in range(n):
        if j < n - 1:
            events.append(Event("fetch_wait", j))
        if j + 1 < n - 1:
            events.append(Event("fetch_start", j + 1))
        events += [Event("input_grad", j), Event("receive_grad", j), Event("weight_grad", j)]
        if j < n - 1:
            events.append(Event("pass", j))
    return events


def forward_shard(rank: int, step: int, world_size: int) -> int:
    """The shard a rank holds at forward step `step`."""
    return (rank - step) % world_size


def backward_shard(rank: int, step: int, world_size: int) -> int:
    """The shard a rank holds at backward step `step`."""
    return (rank + 1 + step) % world_size
