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

from rtp_compile.core.tables import format_table
from rtp_compile.cost.model import Cost, ddp_cost, fsdp_blocks, fsdp_cost

__all__ = ["Cost", "rtp", "ddp", "fsdp", "table"]


def rtp(
    prog,
    batch_size: int,
    seq_len: int | None = None,
    optimizer: str = "adamw",
    dtype=None,
    example_kwargs=None,
) -> Cost:
    """RTP's cost: the same as `prog.cost(...)`."""
    return prog.cost(batch_size, seq_len, optimizer, dtype, example_kwargs)


def ddp(
    prog,
    batch_size: int,
    seq_len: int | None = None,
    optimizer: str = "adamw",
    dtype=None,
    example_kwargs=None,
) -> Cost:
    """DistributedDataParallel on the same model, ranks and per-rank batch."""
    params = prog.ctx.params
    return ddp_cost(
        params, prog.profile(batch_size, seq_len, example_kwargs), prog.world_size, optimizer, dtype
    )


def fsdp(
    prog,
    batch_size: int,
    seq_len: int | None = None,
    optimizer: str = "adamw",
    dtype=None,
    example_kwargs=None,
) -> Cost:
    """FSDP2 on the same model, `fully_shard` applied to each block of every nn.ModuleList
    (each transformer layer) and then to the root."""
    params = prog.ctx.params
    return fsdp_cost(
        params,
        prog.profile(batch_size, seq_len, example_kwargs),
        prog.world_size,
        fsdp_blocks(list(params)),
        optimizer,
        dtype,
    )


def table(
    prog,
    batch_size: int,
    seq_len: int | None = None,
    world_sizes=None,
    optimizer: str = "adamw",
    dtype=None,
    example_kwargs=None,
) -> str:
    """DDP, FSDP2 and RTP side by side (GiB or MiB per rank), for each world size (default:
    the program's), each with the plan made for it (`prog.for_world_size`)."""

    def costs(p):
        return [
            f(p, batch_size, seq_len, optimizer, dtype, example_kwargs) for f in (ddp, fsdp, rtp)
        ]

    peak = costs(prog)[0].peak_bytes
    unit, scale = ("GiB", 2**30) if peak >= 2**30 else ("MiB", 2**20)
    rows = [
        (
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
    ]
    for n in world_sizes or (prog.world_size,):
        at = [c.at(n) for c in costs(prog.for_world_size(n))]
        for c in at:
            rows.append(
                (
                    str(n),
                    c.kind,
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
            )
    return (
        f"{unit} per rank and training step, per-rank batch {batch_size}"
        f"{f'x{seq_len}' if seq_len else ''}, {optimizer}\n{format_table(rows)}"
    )
