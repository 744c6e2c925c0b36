"""One rank's memory against N: a training step of TinyGPT, run as rank 0 of a fake process group.

The same model and per-rank batch at N = 1, 2, 4, 8, in one process: communication is a no-op
(`torch.distributed` "fake" backend; received buffers hold garbage, which is fine for memory),
so what is measured is what one rank of an N-rank job allocates. Each step (forward, backward,
AdamW, after a warm-up step that creates AdamW's state) runs under MemTracker; printed per N:
the plain model's peak, RTP's peak and the ratio, RTP's peak in forward and in backward (the
root module's), and the model state (parameters + gradients + AdamW) after the step. The
parameters, gradients and AdamW state fall as 1/N and the activations are the plain model's, so
the peak should fall with N.

    python benchmarks/rank_memory.py [--vocab 8192 --layers 4 --width 256 --batch 4 --seq 256]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import _ModState
from torch.testing._internal.distributed.fake_pg import FakeStore

import rtp_compile
from rtp_compile.apps.bench_memory import tracked_step
from rtp_compile.apps.models import GPTConfig, TinyGPT
from rtp_compile.core.tables import format_table


def measure(model: torch.nn.Module, cfg: GPTConfig, batch: int) -> dict:
    """Peak bytes of one AdamW step (overall, forward, backward) and the state after it."""
    peak, state, tracker = tracked_step(model, cfg.vocab_size, cfg.block_size, batch, seed=0)
    snaps = tracker.memory_tracking[model].snapshots

    def phase(state):
        return max(s["Total"] for snap in snaps.get(state, []) for s in snap.values())

    return {
        "peak": peak["Total"],
        "fw": phase(_ModState.PEAK_FW),
        "bw": phase(_ModState.PEAK_BW),
        "state": state,
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--bucket-bytes", type=int, default=None)
    parser.add_argument("--disable", nargs="*", default=[])
    args = parser.parse_args(argv)
    cfg = GPTConfig(
        vocab_size=args.vocab,
        block_size=args.seq,
        n_layer=args.layers,
        n_head=args.heads,
        n_embd=args.width,
    )
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    plain = measure(TinyGPT(cfg), cfg, args.batch)
    options = {"disable": args.disable}
    if args.bucket_bytes is not None:
        options["bucket_bytes"] = args.bucket_bytes
    rows = []
    for n in args.world_sizes:
        prog = rtp_compile.transform(model, n, **options)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
        try:
            rows.append({"N": n, **measure(prog.module(0), cfg, args.batch)})
        finally:
            dist.destroy_process_group()
    mib = 2**20
    print(
        f"TinyGPT vocab {args.vocab}, {args.layers} x {args.width}, per-rank batch "
        f"{args.batch} x {args.seq}, fp32, AdamW; rank 0 under a fake process group; MiB "
        f"(MemTracker); options {options}"
    )
    table = [
        (
            "N",
            "plain peak",
            "RTP peak",
            "RTP / plain",
            "RTP fw peak",
            "RTP bw peak",
            "RTP state",
            "plain state",
        )
    ]
    for r in rows:
        table.append(
            (
                r["N"],
                f"{plain['peak'] / mib:.1f}",
                f"{r['peak'] / mib:.1f}",
                f"{r['peak'] / plain['peak']:.2f}",
                f"{r['fw'] / mib:.1f}",
                f"{r['bw'] / mib:.1f}",
                f"{r['state'] / mib:.1f}",
                f"{plain['state'] / mib:.1f}",
            )
        )
    print(format_table(table))
    return rows


if __name__ == "__main__":
    main()
