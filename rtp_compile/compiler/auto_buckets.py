"""`bucket_bytes="auto"`: the bucket size the time model (`cost.time`) predicts fastest for the
batch the model was captured with, among sizes whose buckets hold at most the memory budget.

The budget is `max_bytes_in_flight` where given, else the default rule's bound (what the
largest unit holds gathered), so "auto" never holds more than the default does. The sizes
compared: none (0), the default bound times 2^k (k = -4 ... 6) within the budget, and the
budget itself; each size's buckets are the bucket pass's own grouping (`group_units`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rtp_compile.core.ir import UnitKind
from rtp_compile.core.tables import format_table
from rtp_compile.cost.hardware import load as load_hardware
from rtp_compile.cost.model import rtp_messages
from rtp_compile.cost.profile import profile_of
from rtp_compile.cost.time import rtp_time
from rtp_compile.passes.bucket import bucket_message_bytes


@dataclass(frozen=True)
class BucketChoice:
    """What "auto" compared (`candidates`: bucket_bytes, buckets, predicted step seconds) and
    chose, on which hardware, under which budget (bytes a bucket may hold gathered)."""

    chosen: int
    hardware: str
    budget: int
    candidates: tuple[tuple[int, int, float], ...]

    def __str__(self) -> str:
        rows = [("bucket_bytes", "buckets", "predicted step ms", "")]
        rows += [
            (f"{size:,}", str(count), f"{step * 1e3:.2f}", "chosen" if size == self.chosen else "")
            for size, count, step in self.candidates
        ]
        return (
            f'bucket_bytes="auto" on {self.hardware}, budget {self.budget:,} bytes gathered\n'
            + format_table(rows)
        )


def default_hardware() -> str:
    """The description "auto" plans for without one: a GPU cluster's where CUDA is, else this
    machine's as calibrated (`rtp-compile calibrate` writes a fresh one)."""
    return "h100-nvlink" if torch.cuda.is_available() else "this-cpu"


def chooser(hardware=None):
    """The `Context.bucket_chooser` for `hardware` (a `cost.hardware` description)."""

    def choose(ctx, group) -> BucketChoice:
        described = load_hardware(hardware or default_hardware())
        rates = described.rates(ctx.world_size)
        profile = profile_of(ctx, _captured_batch(ctx))
        units = [u for u in ctx.plan.units if u.kind in (UnitKind.ROTATE, UnitKind.FUSED)]
        default = ctx.world_size * max(
            (bucket_message_bytes(ctx.plan, [u]) for u in units), default=0
        )
        limit = ctx.options.max_bytes_in_flight
        budget = default if limit is None else limit
        sizes = sorted(
            {0, budget}
            | {int(default * 2.0**k) for k in range(-4, 7) if default * 2.0**k <= budget}
        )
        candidates = []
        for size in sizes:
            buckets = group(size)
            messages = rtp_messages(ctx.plan, buckets, ctx.world_size, None, ctx.precision)
            step = rtp_time(ctx.plan, profile, messages, buckets, rates, described.name).step_s
            candidates.append((size, len(buckets), step))
        chosen = min(candidates, key=lambda c: (c[2], c[0]))[0]
        return BucketChoice(chosen, described.name, budget, tuple(candidates))

    return choose


def _captured_batch(ctx) -> int:
    """The batch size of the example the model was captured with (dim 0 of its first input)."""
    for node in ctx.reference.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dim():
                return int(val.shape[0])
    raise ValueError(
        'rtp_compile.transform: bucket_bytes="auto" plans for the batch the model is '
        "captured with; pass example_inputs= (or example_kwargs=) with one batch"
    )
