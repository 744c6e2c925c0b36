"""What fused rotation units change: one GPT-style model, fused vs unfused, N = 2 and 4.

Per rank and training step (forward + backward + AdamW), measured in one run on local gloo
processes: ring hops and bytes sent, bytes written by concatenations (`aten.cat`: the partial
outputs a column-split unit joins), and the median step time. Prints a table, saves a plot.

    python benchmarks/fusion.py [--steps 8] [--out benchmarks/out]
"""
from __future__ import annotations

import argparse
import importlib
import pathlib
import statistics
import time

import torch

import rtp_compile
from rtp_compile.models import GPTConfig, TinyGPT, lm_loss
from rtp_compile.runtime import ring

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
BATCH = 8


class CatBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the bytes every aten.cat writes."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.cat.default:
            self.bytes += out.numel() * out.element_size()
        return out


def measure(rank: int, world_size: int, fuse: bool, steps: int) -> dict:
    torch.manual_seed(0)
    prog = rtp_compile.transform(TinyGPT(CONFIG), world_size, fuse=fuse)
    gm = prog.module(rank)
    opt = torch.optim.AdamW(gm.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    times, counted = [], {}
    for step in range(steps + 2):  # two warm-up steps
        idx = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size + 1), generator=gen)
        torch.distributed.barrier()
        if step == steps + 1:  # the last step also counts traffic and concatenations
            ring.traffic.update(hops=0, bytes=0)
            with CatBytes() as cat:
                lm_loss(gm(idx[:, :-1]), idx[:, 1:]).backward()
            counted = {"hops": ring.traffic["hops"], "ring_bytes": ring.traffic["bytes"],
                       "cat_bytes": cat.bytes}
        else:
            start = time.perf_counter()
            lm_loss(gm(idx[:, :-1]), idx[:, 1:]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step >= 2:
                times.append(time.perf_counter() - start)
    units = [u.kind for u in prog.plan.units]
    return {**counted, "step_s": statistics.median(times),
            "fused_blocks": units.count("fused"), "units": len(units)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/out")
    args = parser.parse_args(argv)
    # the ranks import `measure` from this file as a module (not from __main__)
    here = importlib.import_module(pathlib.Path(__file__).stem)
    rows = []
    for world_size in (2, 4):
        for fuse in (False, True):
            r = rtp_compile.launch(here.measure, world_size, args=(fuse, args.steps),
                                   timeout=600)[0]
            rows.append({"N": world_size, "fuse": fuse, **r})
    header = ("N", "fused", "units", "ring hops", "ring MB", "cat MB", "step ms")
    print("  ".join(f"{h:>9}" for h in header))
    for r in rows:
        print("  ".join(f"{v:>9}" for v in (
            r["N"], r["fused_blocks"] if r["fuse"] else "-", r["units"], r["hops"],
            f"{r['ring_bytes'] / 1e6:.2f}", f"{r['cat_bytes'] / 1e6:.2f}",
            f"{r['step_s'] * 1e3:.1f}")))
    for n in (2, 4):
        off, on = [r for r in rows if r["N"] == n]
        print(f"N={n}: fused/unfused ring hops {on['hops'] / off['hops']:.2f}, ring bytes "
              f"{on['ring_bytes'] / off['ring_bytes']:.2f}, cat bytes "
              f"{on['cat_bytes'] / off['cat_bytes']:.2f}, step time "
              f"{on['step_s'] / off['step_s']:.2f}")
    _plot(rows, pathlib.Path(args.out))


def _plot(rows, out: pathlib.Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2))
    for ax, key, label in zip(axes, ("hops", "cat_bytes", "step_s"),
                              ("ring hops / step", "cat bytes / step", "step time (s)")):
        for i, fuse in enumerate((False, True)):
            values = [r[key] for r in rows if r["fuse"] == fuse]
            ax.bar([x + 0.4 * i for x in range(2)], values, 0.4,
                   label="fused" if fuse else "unfused")
        ax.set_xticks([0.2, 1.2], ["N=2", "N=4"])
        ax.set_title(label)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "fusion.png", dpi=120)
    print(f"plot: {out / 'fusion.png'}")


if __name__ == "__main__":
    main()
