"""Gradient clipping by the global norm over every rank's shards: what
`torch.nn.utils.clip_grad_norm_` computes on DDP's full gradients.

A rank module holds 1/N of each parameter, so `torch.nn.utils.clip_grad_norm_(gm.parameters())`
sees only this rank's shards and returns (and clips by) a *local* norm, different on every rank.
`clip_grad_norm_(gm, max_norm)` takes each rank's norm over the real (unpadded) part of its
shards' gradients, gathers the N norms and combines them the way torch combines per-parameter
norms, so every rank gets the same total and scales its shards by the same factor.
"""

from __future__ import annotations

import torch
from torch import nn

from rtp_compile.core.layout import real_part
from rtp_compile.runtime import groups
from rtp_compile.runtime.job import JobCheck, job_of
from rtp_compile.state import shard_registry
from rtp_compile.state.program_state import state_of


def clip_grad_norm_(
    gm: nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients of a rank module's shards in place by the norm of the *full*
    gradients, over all ranks of its group; return that total norm (a tensor, as torch's).
    `gm` may also be a model trained through the compile backend (`backend="rtp"`, after its
    first call) or sharded by `rtp_compile.shard`: its shards are clipped the same way.

    Collective: every rank of the module's group calls it, at the same point. Equals
    `torch.nn.utils.clip_grad_norm_(ddp_model.parameters(), max_norm, norm_type)` on the
    unsharded gradients (float64: to rounding); padding entries of the shards are not counted.
    On a 2-D mesh the norm is the module's ring's: its replicas hold equal gradients once
    backward has all-reduced them.

    Do not call `torch.nn.utils.clip_grad_norm_(gm.parameters(), ...)` on a rank module: it
    computes a local norm over this rank's shards only, different on every rank::

        loss.backward()
        total_norm = rtp_compile.clip_grad_norm_(gm, max_norm=1.0)   # global, like DDP's
        optimizer.step()

    `norm_type`: p > 0 or `inf` (0 and negative p, which count or reward zeros, are refused).
    `error_if_nonfinite`: raise if the total norm is nan or inf, on every rank alike (the total
    is the same everywhere), before any gradient is changed. `foreach`: as torch's.
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(
            f"rtp_compile.clip_grad_norm_: norm_type must be > 0 or inf, got {norm_type}"
        )
    if isinstance(getattr(gm, "rtp_job", None), JobCheck):
        job, layouts = job_of(gm), state_of(gm).layouts
        params = [p for p in gm.parameters() if p.grad is not None]
        parts = [
            _real_grad(p.grad, layouts[name], job.rank)
            for name, p in gm.named_parameters()
            if p.grad is not None
        ]
        world_size, group_name = job.world_size, job.group_name
    else:
        params, parts, world_size, group_name = _model_shard_grads(gm)
    local = torch.nn.utils.get_total_norm(
        [part for part in parts if part.numel()], norm_type, foreach=foreach
    )
    if world_size > 1:
        norms = [torch.empty_like(local) for _ in range(world_size)]
        groups.all_gather(norms, local, group_name)
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    else:
        total = local
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"rtp_compile.clip_grad_norm_: the total norm of order {norm_type} of the gradients "
            "over all ranks is non-finite, so it cannot be clipped. To disable this error and "
            "scale the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=foreach)
    return total


def _model_shard_grads(model: nn.Module):
    """(shards with a gradient, the real part of each gradient, world size, group name) of a
    model that trains through the compile backend or was sharded by `rtp_compile.shard`."""
    entries = {
        id(e.shard): e for p in model.parameters() if (e := shard_registry.entry_of(p)) is not None
    }
    stray = [
        n
        for n, p in model.named_parameters()
        if shard_registry.entry_of(p) is None and p.grad is not None
    ]
    if stray or not entries:
        raise ValueError(
            f"rtp_compile.clip_grad_norm_: expected a rank module (prog.module(rank)), a model "
            f"compiled with backend='rtp' after its first call, or one sharded by "
            f"rtp_compile.shard; {type(model).__name__} has "
            + (
                f"unsharded parameters with gradients ({', '.join(stray[:4])})"
                if stray
                else "no sharded parameter"
            )
        )
    groups = {(e.layout.world_size, e.group_name) for e in entries.values()}
    if len(groups) > 1:
        raise ValueError(
            f"rtp_compile.clip_grad_norm_: the model's shards live on several "
            f"rings {sorted(groups)}; clip each ring's parameters separately"
        )
    with_grad = [e for e in entries.values() if e.shard.grad is not None]
    ((world_size, group_name),) = groups
    return [e.shard for e in with_grad], [e.real_grad() for e in with_grad], world_size, group_name


def _real_grad(grad: torch.Tensor, layout, rank: int) -> torch.Tensor:
    """The gradient of the real (unpadded) part of this rank's shard."""
    flat = layout.dim is None
    return real_part(grad.reshape(-1) if flat else grad, layout.dim or 0, layout.slot(rank))
