"""Run under torchrun: the emitted module of each rank in an ordinary torchrun job."""

import copy
import os
import sys

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(__file__))
from jobs import gathered_grads, grad_errors, loss_of, rel_err  # noqa: E402
from zoo import batch, build  # noqa: E402

import rtp_compile  # noqa: E402

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, world_size, seed = dist.get_rank(), dist.get_world_size(), int(sys.argv[1])
    out_dir = sys.argv[2]
    model = build("gpt", seed)
    prog = rtp_compile.transform(model, world_size)
    gm = prog.module(rank)
    x = batch("gpt", seed, rank, 0)
    out = gm(x)
    loss_of(out, seed).backward()
    ddp = DDP(copy.deepcopy(model))
    loss_of(ddp(x), seed).backward()
    grad = grad_errors(
        gathered_grads(prog, gm), {n: ddp.module.get_parameter(n).grad for n in prog.plan.params}
    )
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:  # ranks share one stdout
        f.write(f"{rel_err(out, model(x))} {grad}")
    dist.destroy_process_group()
