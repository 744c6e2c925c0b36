"""Per-rank peak memory of one AdamW step with and without activation checkpointing, DDP and RTP.

TinyGPT's blocks each run under `torch.utils.checkpoint.checkpoint(block, x,
use_reentrant=False)` (or plainly), on the same per-rank batch, N = 2 and 4 local gloo
processes; rank 0's step is measured with MemTracker after a warm-up step
(`rtp_compile.apps.bench_memory.tracked_step`). RTP keeps each checkpoint as a recomputed region of
the rank's program, so its peak falls as DDP's does.

    python benchmarks/checkpointing.py
"""

from __future__ import annotations

import torch
from torch import nn

from rtp_compile import launch, transform
from rtp_compile.apps.bench_memory import tracked_step
from rtp_compile.apps.models import GPTConfig, TinyGPT
from rtp_compile.core.tables import format_table

CONFIG = GPTConfig(vocab_size=1024, block_size=128, n_layer=4, n_head=4, n_embd=128)
BATCH = 8
WORLD_SIZES = (2, 4)


class Checkpointed(nn.Module):
    """A block run under non-reentrant activation checkpointing."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def model(checkpointed: bool) -> TinyGPT:
    torch.manual_seed(0)
    gpt = TinyGPT(CONFIG)
    if checkpointed:
        gpt.blocks = nn.ModuleList(Checkpointed(b) for b in gpt.blocks)
    return gpt


def measure(rank: int, world_size: int) -> dict:
    """Rank's peak bytes (MemTracker's categories at the step's peak), per kind."""
    out = {}
    for checkpointed in (False, True):
        for kind in ("DDP", "RTP"):
            m = model(checkpointed)
            m = (
                torch.nn.parallel.DistributedDataParallel(m)
                if kind == "DDP"
                else transform(m, world_size).module(rank)
            )
            peak, _, _ = tracked_step(m, CONFIG.vocab_size, CONFIG.block_size, BATCH, rank)
            out[(kind, checkpointed)] = peak
    return out


def main() -> list[tuple]:
    print(
        f"TinyGPT {CONFIG.n_layer} x {CONFIG.n_embd}, vocab {CONFIG.vocab_size}, per-rank "
        f"batch {BATCH} x {CONFIG.block_size}; MB at the step's peak, rank 0, MemTracker"
    )
    rows = [
        (
            "N",
            "kind",
            "checkpointed",
            "params",
            "grads",
            "optimizer",
            "activations",
            "temporaries",
            "peak",
            "peak / unchecked",
        )
    ]
    for world_size in WORLD_SIZES:
        peaks = launch(measure, world_size, timeout=900)[0]
        for (kind, checkpointed), peak in peaks.items():
            rows.append(
                (
                    world_size,
                    kind,
                    "yes" if checkpointed else "no",
                    *[
                        f"{peak.get(c, 0) / 1e6:.2f}"
                        for c in ("PARAM", "GRAD", "OPT", "ACT", "TEMP", "Total")
                    ],
                    f"{peak['Total'] / peaks[(kind, False)]['Total']:.2f}",
                )
            )
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
