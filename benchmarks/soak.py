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
from rtp_compile.demo import BATCH_SIZE, batch_seed, make_batch
from rtp_compile.models import TinyGPT, lm_loss


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
    param_err = max(((full[k] - reference[k]).norm() / reference[k].norm().clamp_min(1e-12)).item()
                    for k, _ in model.named_parameters())
    return {"rows": rows, "loss_diff": loss_diff, "param_err": param_err}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                        help="float64: what is left of the drift is not rounding")
    args = parser.parse_args(argv)
    results = rtp_compile.launch(soak, args.world_size, args=(args.steps, args.every, args.dtype),
                                 timeout=3600)
    print(f"TinyGPT ({args.dtype}), N={args.world_size}, {args.steps} AdamW steps, RTP next to "
          "DDP")
    print("step  " + "  ".join(f"rank {r} peak MB  in flight" for r in range(len(results))))
    for i, (step, *_) in enumerate(results[0]["rows"]):
        cells = [f"{r['rows'][i][1] / 1e6:12.3f}  {r['rows'][i][2]:9d}" for r in results]
        print(f"{step:4d}  " + "  ".join(cells))
    print("max |loss rtp - ddp| per rank: " +
          ", ".join(f"{r['loss_diff']:.2e}" for r in results))
    print("parameters vs DDP after the last step (max rel. error): " +
          ", ".join(f"{r['param_err']:.2e}" for r in results))


if __name__ == "__main__":
    main()
