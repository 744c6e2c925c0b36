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

from rtp_compile.codegen import job_of
from rtp_compile.layout import real_part
from rtp_compile.program import program_of
from rtp_compile.runtime import ring


def clip_grad_norm_(gm: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """Clip the gradients of a rank module's shards in place by the norm of the *full*
    gradients, over all ranks of its group; return that total norm (a tensor, as torch's).

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
        raise ValueError(f"rtp_compile.clip_grad_norm_: norm_type must be > 0 or inf, got "
                         f"{norm_type}")
    job, layouts = job_of(gm), program_of(gm).plan.params
    params = [p for p in gm.parameters() if p.grad is not None]
    local = torch.nn.utils.get_total_norm(
        [part for name, p in gm.named_parameters() if p.grad is not None
         if (part := _real_grad(p.grad, layouts[name], job.rank)).numel()],
        norm_type, foreach=foreach)
    if job.world_size > 1:
        norms = [torch.empty_like(local) for _ in range(job.world_size)]
        ring.all_gather(norms, local, job.group_name)
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    else:
        total = local
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"rtp_compile.clip_grad_norm_: the total norm of order {norm_type} of the gradients "
            "over all ranks is non-finite, so it cannot be clipped. To disable this error and "
            "scale the gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=foreach)
    return total


def _real_grad(grad: torch.Tensor, layout, rank: int) -> torch.Tensor:
    """The gradient of the real (unpadded) part of this rank's shard."""
    flat = layout.dim is None
    return real_part(grad.reshape(-1) if flat else grad, layout.dim or 0, layout.slot(rank))
