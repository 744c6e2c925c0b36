"""RTP inside a node, data parallel across nodes: FSDP2's HSDP convention on a 2-D DeviceMesh.

    # two nodes of 8 GPUs (run on each; HOST is the first node's address)
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        examples/hsdp.py
    # one machine, CPU: 2 replicas of a 2-rank ring
    torchrun --standalone --nproc-per-node=4 examples/hsdp.py --rtp 2

torchrun numbers the ranks node by node, so the mesh's last dim (the ring, `--rtp`, default the
processes per node) stays inside a node where links are fast, and its first dim (the replicas)
spans the nodes; each rank trains on its own batch and the gradients equal DDP's over all ranks.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import rtp_compile
from rtp_compile.apps.models import TinyGPT, lm_loss
from rtp_compile.runtime.job import job_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rtp",
        type=int,
        default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        help="ranks per ring (the mesh's last dim; default: processes per node)",
    )
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    replicas, rest = divmod(dist.get_world_size(), args.rtp)
    if rest:
        raise SystemExit(f"--rtp {args.rtp} does not divide the {dist.get_world_size()} ranks")
    mesh = init_device_mesh(device.type, (replicas, args.rtp), mesh_dim_names=("dp", "rtp"))

    torch.manual_seed(0)  # the same model on every rank
    prog = rtp_compile.transform(TinyGPT(), world_size=args.rtp)
    gm = prog.module(mesh=mesh, device=device)  # this rank's shards; rank from the mesh
    opt = torch.optim.AdamW(gm.parameters(), lr=3e-3)
    job = job_of(gm)
    print(
        f"rank {dist.get_rank()}: ring rank {job.rank} of {job.world_size}, replica "
        f"{job.replica} of {job.replicas}",
        flush=True,
    )

    batches = torch.Generator().manual_seed(dist.get_rank())  # each rank its own batch
    for step in range(args.steps):
        idx = torch.randint(0, 96, (8, 33), generator=batches).to(device)
        loss = lm_loss(gm(idx[:, :-1]), idx[:, 1:])
        loss.backward()  # ring, then all-reduce over replicas
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f} (rank 0's batch)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
