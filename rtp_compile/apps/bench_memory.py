"""Per-rank memory of one AdamW training step: DDP, FSDP2 and RTP side by side, measured, next
to what the cost model (`rtp_compile.cost`) predicted.

The same GPT-style model (weights larger than the activations of the per-rank batch), the same
per-rank batch, N = 2 and 4 local gloo processes. Each rank measures a full step (forward,
backward, AdamW) after a warm-up step with torch.distributed._tools.mem_tracker.MemTracker:
parameters, gradients, optimizer state, activations, temporaries and the peak; and the model
state (parameters + gradients + optimizer) once the step is done. Prints a table with ratios
and RTP's targets, saves a bar plot.

    rtp-compile bench --memory [--out benchmarks/out]      (also: python benchmarks/memory.py)
"""

from __future__ import annotations

import argparse
import pathlib

import torch

import rtp_compile.cost as cost
from rtp_compile.apps.bench_speed import prepare
from rtp_compile.apps.models import GPTConfig, TinyGPT, lm_loss
from rtp_compile.compiler.transform import transform
from rtp_compile.core.tables import format_table
from rtp_compile.runtime.launch import launch

CONFIG = GPTConfig(vocab_size=1024, block_size=32, n_layer=4, n_head=4, n_embd=256)
BATCH = 2
WORLD_SIZES = (2, 4)
CATEGORIES = ("PARAM", "GRAD", "OPT", "ACT", "TEMP")
KINDS = ("ddp", "fsdp2", "rtp")


def tracked_step(model, vocab_size: int, block_size: int, batch: int, seed: int):
    """One AdamW step of a language model on random tokens, after a warm-up step (AdamW makes
    its state), under MemTracker: (bytes by category at the peak, the model state after the step
    (parameters + gradients + optimizer), the tracker)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)

    def step():
        idx = torch.randint(0, vocab_size, (batch, block_size + 1), generator=gen)
        lm_loss(model(idx[:, :-1]), idx[:, 1:]).backward()
        opt.step()

    step()
    opt.zero_grad()
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
        (after,) = tracker.get_tracker_snapshot().values()
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    opt.zero_grad()
    state = sum(
        v for k, v in after.items() if str(k).rsplit(".", 1)[-1] in ("PARAM", "GRAD", "OPT")
    )
    return {str(k).rsplit(".", 1)[-1]: v for k, v in peak.items()}, state, tracker


def measure(rank: int, world_size: int) -> dict:
    """Per kind: bytes by category at the step's peak, and the model state after the step."""
    results = {}
    for kind in KINDS:
        model = prepare(kind, rank, world_size, CONFIG, torch.device("cpu"))
        peak, state, _ = tracked_step(model, CONFIG.vocab_size, CONFIG.block_size, BATCH, rank)
        results[kind] = {**peak, "state": state}
        del model
    return results


def predict(world_size: int) -> dict:
    """The cost model's numbers for the same model, batch and world size."""
    prog = transform(TinyGPT(CONFIG), world_size)
    costs = {"ddp": cost.ddp, "fsdp2": cost.fsdp, "rtp": cost.rtp}
    out = {kind: f(prog, BATCH, CONFIG.block_size) for kind, f in costs.items()}
    out["activations"] = prog.profile(BATCH, CONFIG.block_size).activation_bytes
    return out


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/out")
    args = parser.parse_args(argv)
    full = sum(p.numel() * p.element_size() for p in TinyGPT(CONFIG).parameters())
    print(
        f"TinyGPT {full // 4:,} parameters (fp32 {full / 1e6:.2f} MB), per-rank batch "
        f"{BATCH}x{CONFIG.block_size}; MB per rank at the step's peak (rank 0), measured with "
        "MemTracker; 'predicted' from rtp_compile.cost"
    )
    rows, targets = [], []
    for world_size in WORLD_SIZES:
        measured = launch(measure, world_size, timeout=600)
        predicted = predict(world_size)
        for kind in KINDS:
            rows.append(
                {
                    "N": world_size,
                    "kind": kind,
                    **measured[0][kind],
                    "predicted": predicted[kind].peak_bytes,
                }
            )
        rtp = [m["rtp"] for m in measured]
        single_state = measured[0]["ddp"]["state"]  # DDP holds the single-device state
        bound = single_state / world_size + predicted["activations"]
        targets.append(
            {
                "N": world_size,
                "params / (full/N)": max(r["PARAM"] for r in rtp) / (full / world_size),
                "peak / (state/N + activations)": max(r["Total"] for r in rtp) / bound,
                "memory-scaling efficiency": min(
                    single_state / world_size / r["state"] for r in rtp
                ),
            }
        )
    table = [("N", "kind", *CATEGORIES, "peak", "predicted", "peak/FSDP2")]
    for row in rows:
        fsdp = next(r for r in rows if r["N"] == row["N"] and r["kind"] == "fsdp2")["Total"]
        table.append(
            (
                row["N"],
                row["kind"],
                *[f"{row.get(c, 0) / 1e6:.2f}" for c in CATEGORIES],
                f"{row['Total'] / 1e6:.2f}",
                f"{row['predicted'] / 1e6:.2f}",
                f"{row['Total'] / fsdp:.2f}",
            )
        )
    print(format_table(table))
    print("\nRTP's targets (worst rank): params <= 1.02, peak <= 1.05, efficiency >= 0.97")
    for t in targets:
        print("  " + ", ".join(f"{k} {v:.3f}" if k != "N" else f"N={v}" for k, v in t.items()))
    _plot(rows, pathlib.Path(args.out))
    return targets


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
    ax.scatter(
        labels,
        [r["predicted"] / 1e6 for r in rows],
        marker="_",
        s=400,
        color="black",
        label="predicted peak",
        zorder=3,
    )
    ax.set_ylabel("MB per rank at peak")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=120)
    print(f"plot: {out / 'memory.png'}")


if __name__ == "__main__":
    main()
