"""What fused rotation units change: GPT-style models, fused vs unfused, N = 2 and 4.

Two models with the same computation: TinyGPT, whose packed qkv projection keeps attention
unfused (only the MLPs fuse), and the same model with separate q/k/v projections, whose
attention fuses too (heads through the output projection). Per rank and training step (forward +
backward + AdamW), measured in one run on local gloo processes: ring hops and bytes sent, bytes
written by concatenations (`aten.cat`: the partial outputs a column-split unit joins), and the
median step time. Prints a table, saves a plot.

    python benchmarks/fusion.py [--steps 8] [--out benchmarks/out]
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import rtp_compile
from rtp_compile.apps.models import GPTConfig, TinyGPT, lm_loss
from rtp_compile.core.tables import format_table
from rtp_compile.runtime import ring

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
BATCH = 8


class SeparateQKVAttention(nn.Module):
    """TinyGPT's causal attention with q, k and v as three linears (heads split with int
    sizes, so torch.fx capture sees where they go)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.q, self.k, self.v = (nn.Linear(cfg.n_embd, cfg.n_embd) for _ in range(3))
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (
            f(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
            for f in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


def build(model: str) -> nn.Module:
    torch.manual_seed(0)
    gpt = TinyGPT(CONFIG)
    if model == "separate qkv":
        for block in gpt.blocks:
            block.attn = SeparateQKVAttention(CONFIG)
        gpt.apply(gpt._init_weights)
    return gpt


MODELS = ("packed qkv", "separate qkv")


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


def measure(rank: int, world_size: int, model: str, fuse: bool, steps: int) -> dict:
    prog = rtp_compile.transform(build(model), world_size, fuse=fuse)
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
            counted = {
                "hops": ring.traffic["hops"],
                "ring_bytes": ring.traffic["bytes"],
                "cat_bytes": cat.bytes,
            }
        else:
            start = time.perf_counter()
            lm_loss(gm(idx[:, :-1]), idx[:, 1:]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step >= 2:
                times.append(time.perf_counter() - start)
    units = [u.kind for u in prog.plan.units]
    attention = sum(u.kind == "fused" and u.fusion.attention for u in prog.plan.units)
    return {
        **counted,
        "step_s": statistics.median(times),
        "fused_blocks": units.count("fused"),
        "fused_attention": attention,
        "units": len(units),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/out")
    args = parser.parse_args(argv)
    # the ranks import `measure` from this file as a module (not from __main__)
    here = importlib.import_module(pathlib.Path(__file__).stem)
    rows = []
    for world_size in (2, 4):
        for model in MODELS:
            for fuse in (False, True):
                r = rtp_compile.launch(
                    here.measure, world_size, args=(model, fuse, args.steps), timeout=600
                )[0]
                rows.append({"N": world_size, "model": model, "fuse": fuse, **r})
    table = [
        ("N", "model", "fused", "attention", "units", "ring hops", "ring MB", "cat MB", "step ms")
    ]
    for r in rows:
        table.append(
            (
                r["N"],
                r["model"],
                r["fused_blocks"] if r["fuse"] else "-",
                r["fused_attention"] if r["fuse"] else "-",
                r["units"],
                r["hops"],
                f"{r['ring_bytes'] / 1e6:.2f}",
                f"{r['cat_bytes'] / 1e6:.2f}",
                f"{r['step_s'] * 1e3:.1f}",
            )
        )
    print(format_table(table))
    for n in (2, 4):
        for model in MODELS:
            off, on = [r for r in rows if r["N"] == n and r["model"] == model]
            print(
                f"N={n} {model}: fused/unfused ring hops {on['hops'] / off['hops']:.2f}, "
                f"ring bytes {on['ring_bytes'] / off['ring_bytes']:.2f}, cat bytes "
                f"{on['cat_bytes'] / off['cat_bytes']:.2f}, step time "
                f"{on['step_s'] / off['step_s']:.2f}"
            )
    _plot(rows, pathlib.Path(args.out))


def _plot(rows, out: pathlib.Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    kinds = [(m, f) for m in MODELS for f in (False, True)]
    width = 0.8 / len(kinds)
    for ax, key, label in zip(
        axes,
        ("hops", "cat_bytes", "step_s"),
        ("ring hops / step", "cat bytes / step", "step time (s)"),
    ):
        for i, (model, fuse) in enumerate(kinds):
            values = [r[key] for r in rows if (r["model"], r["fuse"]) == (model, fuse)]
            ax.bar(
                [x + width * i for x in range(2)],
                values,
                width,
                label=f"{model}, {'fused' if fuse else 'unfused'}",
            )
        ax.set_xticks([0.4 - width / 2, 1.4 - width / 2], ["N=2", "N=4"])
        ax.set_title(label)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "fusion.png", dpi=120)
    print(f"plot: {out / 'fusion.png'}")


if __name__ == "__main__":
    main()
