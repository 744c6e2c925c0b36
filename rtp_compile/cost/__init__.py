"""Predicted per-rank memory and traffic of one training step, before anything runs: RTP,
DDP and FSDP2 on the same model and batch (the model itself is `cost.model`, the forward it
measures `cost.profile`).

    prog = rtp_compile.transform(model, world_size=8)
    print(prog.cost(batch_size=1, seq_len=4096))                 # RTP
    print(rtp_compile.cost.fsdp(prog, batch_size=1, seq_len=4096))
    print(rtp_compile.cost.table(prog, batch_size=1, seq_len=4096, world_sizes=(8, 16, 64)))

May import: `runtime` (precision) and `core`.
"""

from __future__ import annotations

import dataclasses

from rtp_compile.core.tables import format_table
from rtp_compile.cost.hardware import load as load_hardware
from rtp_compile.cost.model import Cost, ddp_cost, fsdp_blocks, fsdp_cost, rtp_messages
from rtp_compile.cost.time import ddp_time, fsdp_time, rtp_time

__all__ = ["Cost", "rtp", "rtp_2d", "ddp", "fsdp", "table"]


def rtp(
    prog,
    batch_size: int,
    seq_len: int | None = None,
    optimizer: str = "adamw",
    dtype=None,
    example_kwargs=None,
    hardware=None,
) -> Cost:
    """RTP's cost: the same as `prog.cost(...)`."""
    return prog.cost(batch_size, seq_len, optimizer, dtype, example_kwargs, hardware)


def ddp(
    prog,
    batch_size: int,
    seq_len: int | None = None,
    optimizer: str = "adamw",
    dtype=None,
    example_kwargs=None,
    hardware=None,
) -> Cost:
    """DistributedDataParallel on the same model, ranks and per-rank batch (`hardware`: with
    its predicted step time, as `prog.cost`)."""
    params = prog.ctx.params
    profile = prog.profile(batch_size, seq_len, example_kwargs)
    cost = ddp_cost(params, profile, prog.world_size, optimizer, dtype)
    if hardware is None:
        return cost
    described = load_hardware(hardware)
    time = ddp_time(params, profile, described.rates(prog.world_size), described.name)
    return dataclasses.replace(cost, time=time)


def fsdp(
    prog,
    batch_size: int,
    seq_len: int | None = None,
    optimizer: str = "adamw",
    dtype=None,
    example_kwargs=None,
    hardware=None,
) -> Cost:
    """FSDP2 on the same model, `fully_shard` applied to each block of every nn.ModuleList
    (each transformer layer) and then to the root (`hardware`: with its predicted step time)."""
    params = prog.ctx.params
    profile = prog.profile(batch_size, seq_len, example_kwargs)
    blocks = fsdp_blocks(list(params))
    cost = fsdp_cost(params, profile, prog.world_size, blocks, optimizer, dtype)
    if hardware is None:
        return cost
    described = load_hardware(hardware)
    time = fsdp_time(params, profile, blocks, described.rates(prog.world_size), described.name)
    return dataclasses.replace(cost, time=time)


def table(
    prog,
    batch_size: int,
    seq_len: int | None = None,
    world_sizes=None,
    optimizer: str = "adamw",
    dtype=None,
    example_kwargs=None,
    hardware=None,
) -> str:
    """DDP, FSDP2 and RTP side by side (GiB or MiB per rank), for each world size (default:
    the program's), each with the plan made for it (`prog.for_world_size`). With `hardware`
    (a `cost.hardware` description): each kind's predicted step time and exposed
    communication too, and where N spans more ranks than the description's first level holds
    (a node), RTP on a 2-D mesh: its ring inside the node, replicas across."""
    described = None if hardware is None else load_hardware(hardware)

    def costs(p):
        return [
            f(p, batch_size, seq_len, optimizer, dtype, example_kwargs, described)
            for f in (ddp, fsdp, rtp)
        ]

    peak = costs(prog)[0].peak_bytes
    unit, scale = ("GiB", 2**30) if peak >= 2**30 else ("MiB", 2**20)
    head = (
        "N",
        "kind",
        "params",
        "grads",
        "optimizer",
        "activations",
        "transient",
        "peak",
        "peak/FSDP2",
        "traffic",
    )
    rows = [head + (("step s", "exposed") if described else ())]
    for n in world_sizes or (prog.world_size,):
        at = [_keep_time(c, n) for c in costs(prog.for_world_size(n))]
        kinds = [c.kind for c in at]
        node = described.levels[0].ranks if described else None
        if described and node and n > node and n % node == 0:
            at.append(
                rtp_2d(
                    prog,
                    n,
                    batch_size,
                    seq_len,
                    optimizer,
                    dtype,
                    example_kwargs,
                    hardware=described,
                )
            )
            kinds.append(f"rtp 2-D {n // node}x{node}")
        for kind, c in zip(kinds, at):
            row = (
                str(n),
                kind,
                *[
                    f"{getattr(c, f) / scale:.2f}"
                    for f in (
                        "param_bytes",
                        "grad_bytes",
                        "optimizer_bytes",
                        "activation_bytes",
                        "transient_bytes",
                        "peak_bytes",
                    )
                ],
                f"{c.peak_bytes / at[1].peak_bytes:.2f}",
                f"{c.traffic_bytes / scale:.2f}",
            )
            if described and c.time is not None:
                row += (f"{c.time.step_s:.3g}", f"{c.time.exposed_s / c.time.step_s:.0%}")
            rows.append(row)
    lines = [
        f"{unit} per rank and training step, per-rank batch {batch_size}"
        f"{f'x{seq_len}' if seq_len else ''}, {optimizer}",
        format_table(rows),
    ]
    if described:
        lines += [
            f"time model: {described.assumptions(n)}" for n in world_sizes or (prog.world_size,)
        ]
    return "\n".join(lines)


def _keep_time(cost: Cost, n: int) -> Cost:
    """`cost.at(n)` (its numbers at n) with its step time."""
    return dataclasses.replace(cost.at(n), time=cost.time)


def rtp_2d(
    prog,
    world_size: int,
    batch_size: int,
    seq_len: int | None = None,
    optimizer: str = "adamw",
    dtype=None,
    example_kwargs=None,
    *,
    hardware,
) -> Cost:
    """RTP on a 2-D mesh of `world_size` ranks, as one deploys it across nodes: a ring inside
    each node of `hardware` (its first level's ranks), world_size / node replicas across
    (HSDP's convention, `prog.module(mesh=...)`). Memory: the ring's plan (shards of 1/node);
    time: its step with the replicas' all-reduce of the shards' gradients across the nodes."""
    described = load_hardware(hardware)
    node = described.levels[0].ranks
    if not node or world_size % node or world_size <= node:
        raise ValueError(
            f"rtp_compile.cost.rtp_2d: world_size={world_size} must be a multiple of "
            f"{described.name}'s {node} ranks a node, and more than one node"
        )
    ring = prog.for_world_size(node)
    cost = ring.cost(batch_size, seq_len, optimizer, dtype, example_kwargs)
    profile = ring.profile(batch_size, seq_len, example_kwargs)
    messages = rtp_messages(ring.plan, ring.ctx.buckets, node, dtype, ring.ctx.precision)
    time = rtp_time(
        ring.plan,
        profile,
        messages,
        ring.ctx.buckets,
        described.rates(node),
        described.name,
        replicas=world_size // node,
        across=described.across_nodes(world_size // node, node),
    )
    replicas = world_size // node
    return dataclasses.replace(
        cost,
        world_size=world_size,
        traffic_bytes=int(cost.traffic_bytes + 2 * (replicas - 1) / replicas * cost.grad_bytes),
        time=dataclasses.replace(time, world_size=world_size),
    )
