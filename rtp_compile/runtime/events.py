"""What the schedule pass hands the runtime: per unit, the tags of its message streams and the
ordered events of its backward; and which shard a rank holds at a step.

Forward, step k on rank r holds shard (r - k) mod N (clockwise: received from r - 1). Backward,
step j holds shard (r + 1 + j) mod N (counter-clockwise: received from r + 1), so the gradient
accumulator of a shard, passed on to r - 1 after each step, arrives complete at its owner.
"""

from __future__ import annotations

from dataclasses import dataclass

from rtp_compile.core.ir import Action


@dataclass(frozen=True)
class Event:
    """One thing a unit does at step `step`; `tag`: the message tag of a hop it starts."""

    action: Action
    step: int
    tag: int | None = None


@dataclass(frozen=True)
class UnitSchedule:
    """The schedule of one unit: the tags of its three message streams (forward weights or
    gathers, backward weight fetches, gradient accumulators), and its backward events in the
    order the runtime executes them (`passes.schedule.backward_schedule`); `bucket`: the name
    of the unit's bucket (its tags are then the bucket's), if it is in one."""

    forward_tag: int
    fetch_tag: int
    grad_tag: int
    backward: tuple[Event, ...] = ()
    bucket: str | None = None


def forward_shard(rank: int, step: int, world_size: int) -> int:
    """The shard a rank holds at forward step `step`."""
    return (rank - step) % world_size


def backward_shard(rank: int, step: int, world_size: int) -> int:
    """The shard a rank holds at backward step `step`."""
    return (rank + 1 + step) % world_size
