"""Per-rank memory of one AdamW training step: DDP, FSDP2 and RTP side by side, measured.

The same GPT-style model (weights larger than the activations of the per-rank batch), the same
per-rank batch, N = 2 and 4 local gloo processes. Each rank measures a full step (forward,
backward, AdamW) after a warm-up step with torch.distributed._tools.mem_tracker.MemTracker:
parameters, gradients, optimizer state, activations, temporaries and the peak. Prints a table
with ratios, saves a bar plot.

    python benchmarks/memory.py [--out benchmarks/out]      (also: rtp-compile bench --memory)
"""
from __future__ import annotations

import argparse
import importlib
import pathlib

import torch

import rtp_compile
from rtp_compile.models import GPTConfig, TinyGPT, lm_loss

CONFIG = GPTConfig(vocab_size=1024, block_size=32, n_layer=4, n_head=4, n_embd=256)
BATCH = 2
CATEGORIES = ("PARAM", "GRAD", "OPT", "ACT", "TEMP")


def _wrap(kind: str, rank: int, world_size: int):
    """A fresh model (same seed on every rank) prepared as `kind` for this rank."""
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return rtp_compile.transform(model, world_size).module(rank)


def measure(rank: int, world_size: int) -> dict:
    """Peak snapshot (bytes by category and total) of one step, per kind of parallelism."""
    from torch.distributed._tools.mem_tracker import MemTracker
    results = {}
    for kind in ("ddp", "fsdp2", "rtp"):
        model = _wrap(kind, rank, world_size)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(rank)

        def step():
            idx = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1),
                                generator=gen)
            lm_loss(model(idx[:, :-1]), idx[:, 1:]).backward()
            opt.step()
            opt.zero_grad()

        step()  # warm-up: AdamW allocates its state
        tracker = MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            step()
        (peak,) = tracker.get_tracker_snapshot("peak").values()
        results[kind] = {str(k).rsplit(".", 1)[-1]: v for k, v in peak.items()}
        del model, opt, tracker
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/out")
    args = parser.parse_args(argv)
    # the ranks import `measure` from this file as a module (not from __main__)
    here = importlib.import_module(pathlib.Path(__file__).stem)
    n_params = sum(p.numel() for p in TinyGPT(CONFIG).parameters())
    print(f"TinyGPT {n_params:,} parameters (fp32 {n_params * 4 / 1e6:.1f} MB), per-rank batch "
          f"{BATCH}x{CONFIG.block_size}; MB per rank at the step's peak (rank 0)")
    rows = []
    for world_size in (2, 4):
        r = rtp_compile.launch(here.measure, world_size, timeout=600)[0]
        for kind, snap in r.items():
            rows.append({"N": world_size, "kind": kind, **snap})
    header = ("N", "kind", *CATEGORIES, "peak", "peak/FSDP2")
    print("  ".join(f"{h:>10}" for h in header))
    for row in rows:
        fsdp = next(r for r in rows if r["N"] == row["N"] and r["kind"] == "fsdp2")["Total"]
        print("  ".join(f"{v:>10}" for v in (
            row["N"], row["kind"], *[f"{row.get(c, 0) / 1e6:.2f}" for c in CATEGORIES],
            f"{row['Total'] / 1e6:.2f}", f"{row['Total'] / fsdp:.2f}")))
    _plot(rows, pathlib.Path(args.out))


def _plot(rows, out: pathlib.Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['kind']}\nN={r['N']}" for r in rows]
    bottom = [0.0] * len(rows)
    for category in CATEGORIES:
        values = [r.get(category, 0) / 1e6 for r in rows]
        ax.bar(labels, values, bottom=bottom, label=category)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("MB per rank at peak")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=120)
    print(f"plot: {out / 'memory.png'}")


if __name__ == "__main__":
    main()
