"""Soak: a few hundred AdamW steps of RTP next to DDP on the same ranks, the schedule's options
on (buckets, prefetch, small parameters gathered: the defaults). Prints, every `--every`
steps, RTP's measured peak (MemTracker) and the ring hops left in flight, and at the end the
largest loss difference and the parameters' relative error against DDP.

    python benchmarks/soak.py [--world-size 2] [--steps 300] [--every 50] [--dtype float64]
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import rtp_compile
from rtp_compile.apps.models import GPTConfig, TinyGPT, lm_loss

BATCH_SIZE = 16  # sequences per rank per step
MULTIPLIER, INCREMENT = 5, 3  # next token = (prev * 5 + 3) % vocab: a permutation of the vocab


def batch_seed(seed: int, rank: int, step: int) -> int:
    """The generator seed of one rank's batch at one step, distinct for every (seed, rank, step)."""
    # seed + rank + step would hand rank 1 at step s the batch of rank 0 at step s + 1.
    return (seed * 1_000_003 + step) * 1_009 + rank


def make_batch(cfg: GPTConfig, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that start at a random token and continue with next = (prev * 5 + 3) % vocab
    (the data the demo trained on before it read Shakespeare; the soak's numbers in the README
    were measured on it). Returns (inputs, targets), both [batch_size, block_size]."""
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(cfg.vocab_size, (batch_size,), generator=gen)]
    for _ in range(cfg.block_size):
        tokens.append((tokens[-1] * MULTIPLIER + INCREMENT) % cfg.vocab_size)
    seq = torch.stack(tokens, dim=1)
    return seq[:, :-1], seq[:, 1:]


def _peak_bytes(module, opt, idx, targets) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(module, opt, idx, targets)
    with tracker:
        lm_loss(module(idx), targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return sum(stats["Total"] for stats in tracker.get_tracker_snapshot("peak").values())


def soak(rank: int, world_size: int, steps: int, every: int, dtype: str) -> dict:
    from rtp_compile.runtime import ring

    torch.manual_seed(0)
    model = TinyGPT().to(getattr(torch, dtype))
    prog = rtp_compile.transform(model, world_size)
    gm, ddp = prog.module(rank), DDP(copy.deepcopy(model))
    opt = torch.optim.AdamW(gm.parameters(), lr=3e-3, weight_decay=0.1)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.1)
    rows, loss_diff = [], 0.0
    progress = range(steps)
    if rank == 0:
        from tqdm import tqdm

        progress = tqdm(progress, desc=f"soak N={world_size}")
    for step in progress:
        idx, targets = make_batch(model.cfg, BATCH_SIZE, batch_seed(1, rank, step))
        if step % every == 0 or step == steps - 1:
            rows.append((step, _peak_bytes(gm, opt, idx, targets), len(ring._pending)))
            loss = ddp_loss = None
        else:
            loss = lm_loss(gm(idx), targets)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        ddp_loss = lm_loss(ddp(idx), targets)
        ddp_loss.backward()
        ddp_opt.step()
        ddp_opt.zero_grad(set_to_none=True)
        if loss is not None:
            loss_diff = max(loss_diff, abs(loss.item() - ddp_loss.item()))
    full, reference = prog.full_state_dict(gm), ddp.module.state_dict()
    param_err = max(
        ((full[k] - reference[k]).norm() / reference[k].norm().clamp_min(1e-12)).item()
        for k, _ in model.named_parameters()
    )
    return {"rows": rows, "loss_diff": loss_diff, "param_err": param_err}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float64"],
        help="float64: what is left of the drift is not rounding",
    )
    args = parser.parse_args(argv)
    results = rtp_compile.launch(
        soak, args.world_size, args=(args.steps, args.every, args.dtype), timeout=3600
    )
    print(f"TinyGPT ({args.dtype}), N={args.world_size}, {args.steps} AdamW steps, RTP next to DDP")
    print("step  " + "  ".join(f"rank {r} peak MB  in flight" for r in range(len(results))))
    for i, (step, *_) in enumerate(results[0]["rows"]):
        cells = [f"{r['rows'][i][1] / 1e6:12.3f}  {r['rows'][i][2]:9d}" for r in results]
        print(f"{step:4d}  " + "  ".join(cells))
    print("max |loss rtp - ddp| per rank: " + ", ".join(f"{r['loss_diff']:.2e}" for r in results))
    print(
        "parameters vs DDP after the last step (max rel. error): "
        + ", ".join(f"{r['param_err']:.2e}" for r in results)
    )


if __name__ == "__main__":
    main()
