"""Functions the checkpoint tests run on every rank of a real job (rtp_compile.launch, gloo)."""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist
from decoders import DECODERS, DecoderConfig, build_decoder, decoder_batch
from jobs import LR, loss_of, param_errors, rel_err
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP
from zoo import ZOO, build

import rtp_compile
from rtp_compile.runtime.groups import resolve_group
from rtp_compile.runtime.job import job_of
from rtp_compile.state import dcp as checkpoint


def draw_batch(name: str) -> torch.Tensor:
    """A batch of zoo or decoder model `name` drawn from the global RNG (so resuming must
    restore it)."""
    if name in DECODERS:
        return torch.randint(0, DecoderConfig.vocab, (2, 11))
    return ZOO[name][1](torch.default_generator)


def program(name: str, seed: int, world_size: int) -> rtp_compile.RTPProgram:
    """Zoo models traced with torch.fx; decoders exported (their rotary tables need sizes)."""
    if name in DECODERS:
        return rtp_compile.transform(
            build_decoder(name, seed), world_size, example_inputs=(decoder_batch(0, 0),)
        )
    return rtp_compile.transform(build(name, seed), world_size)


class DieWhenPickled:
    """A value whose pickling kills the process: a rank dying in the middle of a save."""

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)


def train_with_checkpoints(
    rank: int,
    world_size: int,
    name: str,
    path: str,
    steps: int,
    every: int,
    seed: int,
    die: tuple[str, int] | None = None,
    resume: bool = False,
) -> tuple[dict[int, float], dict]:
    """AdamW steps on zoo model `name`, each rank's batches drawn from its global RNG, a
    checkpoint (with the step, the RNG state and the losses so far as `extra`) every `every`
    steps. `die=("backward", k)`: rank 1 is killed (SIGKILL) half-way through step k's backward;
    `("save", k)`: while saving after step k. `resume`: start from the checkpoint at `path`.
    Returns the losses by step and the full state dict at the end."""
    torch.manual_seed(seed * 100 + rank)
    prog = rtp_compile.transform(build(name, seed), world_size)
    gm = prog.module(rank)
    opt = torch.optim.AdamW(gm.parameters(), lr=LR, weight_decay=0.1)
    start, losses = 0, {}
    if resume:
        extra = checkpoint.load(path, gm, opt)
        assert extra["rank"] == rank  # each rank's own values come back to it
        torch.set_rng_state(extra["rng"])
        start, losses = extra["step"], extra["losses"]
    units = [m for n, m in gm.named_modules() if n.startswith("rtp_units.")]
    for step in range(start, steps):
        hook = None
        if die == ("backward", step) and rank == 1:
            hook = units[len(units) // 2].register_full_backward_pre_hook(
                lambda *args: os.kill(os.getpid(), signal.SIGKILL)
            )
        loss = loss_of(gm(draw_batch(name)), step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses[step] = loss.item()
        if hook is not None:
            hook.remove()
        if (step + 1) % every == 0:
            extra = {
                "step": step + 1,
                "rng": torch.get_rng_state(),
                "losses": dict(losses),
                "rank": rank,
            }
            if die == ("save", step + 1) and rank == 1:
                extra["bomb"] = DieWhenPickled()
            checkpoint.save(path, gm, opt, extra=extra)
    return losses, prog.full_state_dict(gm)


def save_after_steps(
    rank: int,
    world_size: int,
    name: str,
    path: str,
    steps: int,
    seed: int,
    mesh_shape: tuple[int, int] | None = None,
) -> dict:
    """`steps` AdamW steps of zoo model `name` on per-rank batches (on a 2-D (replicas, ring)
    mesh of `mesh_shape`), then a checkpoint; returns what `full_state_and_moments` gives."""
    torch.manual_seed(seed * 100 + rank)
    if mesh_shape is None:
        prog = program(name, seed, world_size)
        gm = prog.module(rank)
    else:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "rtp"))
        prog = program(name, seed, mesh_shape[1])
        gm = prog.module(mesh=mesh)
    opt = torch.optim.AdamW(gm.parameters(), lr=LR, weight_decay=0.1)
    for step in range(steps):
        loss_of(gm(draw_batch(name)), step).backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(path, gm, opt, extra={"step": steps, "rank": rank})
    return full_state_and_moments(prog, gm, opt)


def full_state_and_moments(prog, gm, opt) -> dict:
    """The full state dict, and every parameter's full AdamW moments and step count."""
    moments, ring = {}, resolve_group(job_of(gm).group_name)
    for name, p in gm.named_parameters():
        state, layout = opt.state[p], prog.plan.params[name]
        full = []
        for key in ("exp_avg", "exp_avg_sq"):
            shards = [torch.empty_like(state[key]) for _ in range(prog.world_size)]
            dist.all_gather(shards, state[key], group=ring)
            full.append(layout.unshard(shards))
        moments[name] = (*full, state["step"].item())
    return {"state": prog.full_state_dict(gm), "moments": moments}


def resharded_steps_match_ddp(
    rank: int, world_size: int, name: str, path: str, steps: int, seed: int
) -> dict:
    """Load a checkpoint saved by another world size and take `steps` more AdamW steps; next
    to it, DDP on the unsharded model and optimizer read from `dcp_to_torch_save`'s file (as a
    user without rtp_compile would) takes the same steps. Returns the largest relative errors
    of losses and parameters, and what the file's model entry looked like."""
    torch.manual_seed(seed * 100 + rank)
    prog = rtp_compile.transform(build(name, seed + 1), world_size)  # other values: all loaded
    gm = prog.module(rank)
    opt = torch.optim.AdamW(gm.parameters(), lr=LR, weight_decay=0.1)
    extra = checkpoint.load(path, gm, opt)

    torch_file = f"{path}.pt"
    if rank == 0:
        dcp_to_torch_save(path, torch_file)
    dist.barrier()
    saved = torch.load(torch_file, weights_only=False)
    model = build(name, seed + 2)
    model.load_state_dict(saved["model"], strict=True)
    keys_match = list(saved["model"]) == list(model.state_dict())
    ddp = DDP(model)
    ddp_opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    names = [n for n, _ in model.named_parameters()]
    group = saved["optimizer"]["param_groups"][0]
    ddp_opt.load_state_dict(
        {
            "state": {names.index(n): s for n, s in saved["optimizer"]["state"].items()},
            "param_groups": [{**group, "params": [names.index(n) for n in names]}],
        }
    )

    loss_error = 0.0
    for step in range(extra["step"], extra["step"] + steps):
        x = draw_batch(name)
        losses = []
        for module, optimizer in ((gm, opt), (ddp, ddp_opt)):
            loss = loss_of(module(x), step)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
        loss_error = max(loss_error, rel_err(*losses))
    full, reference = prog.full_state_dict(gm), model.state_dict()
    return {
        "loss": loss_error,
        "param": param_errors(full, reference, full),
        "keys_match": keys_match,
        "extra_rank": extra["rank"],
    }


def load_into_world_size(rank: int, world_size: int, name: str, path: str) -> dict:
    """Load a checkpoint into a program for `world_size` whose own values all differ; returns
    what `full_state_and_moments` gives."""
    prog = program(name, 123, world_size)
    gm = prog.module(rank)
    opt = torch.optim.AdamW(gm.parameters(), lr=LR)
    checkpoint.load(path, gm, opt)
    return full_state_and_moments(prog, gm, opt)


def die_mid_save(rank: int, world_size: int, report_dir: str) -> None:
    """Rank 1 is killed while its part of a save is being written; the others write what they
    raised, and when, to `report_dir`, and re-raise."""
    import pathlib
    import time

    gm = program("gpt", 0, world_size).module(rank)
    opt = torch.optim.AdamW(gm.parameters())
    dist.barrier()
    start = time.monotonic()
    try:
        checkpoint.save(f"{report_dir}/ck", gm, opt, extra=DieWhenPickled() if rank == 1 else None)
    except RuntimeError as err:
        (pathlib.Path(report_dir) / f"rank{rank}.txt").write_text(
            f"{time.monotonic() - start:.2f}\n{err}"
        )
        raise
