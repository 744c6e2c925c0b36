"""Functions the emitted graphs call, besides torch's own: the split-off affine of a norm, a
BatchNorm module's forward as a function, and the per-shard cut of an operand of unknown shape.

The passes write calls to them into the graph; they run inside every rank's module.
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx
import torch.nn.functional as F


def one_call_when_traced(fn):
    """`fn` called on an fx.Proxy first argument (a rank's graph traced, or an unpickled module
    re-traced) records one call of `fn` in the graph, decided at run time, instead of tracing
    into its body."""

    @functools.wraps(fn)
    def call(first, *args):
        if isinstance(first, fx.Proxy):
            return first.tracer.create_proxy("call_function", call, (first, *args), {})
        return fn(first, *args)

    return call


def affine(x: torch.Tensor, weight, bias, dim: int) -> torch.Tensor:
    """x * weight + bias, the parameters laid along `dim` of x.

    A negative `dim` means the parameters broadcast against x from the right (LayerNorm, RMSNorm,
    layer scale); a non-negative `dim` means 1-D per-channel parameters at that dim (BatchNorm,
    GroupNorm). The norm passes split a norm's affine part into this op so it can be sharded.
    """
    if dim >= 0:
        return affine(x.transpose(dim, -1), weight, bias, -1).transpose(dim, -1)
    y = x if weight is None else x * weight
    return y if bias is None else y + bias


def batch_norm_module(
    x,
    running_mean,
    running_var,
    num_batches_tracked,
    weight,
    bias,
    training: bool,
    momentum,
    eps: float,
    track_running_stats: bool,
):
    """nn.BatchNorm*'s forward as a function of its tensors and flags."""
    factor = 0.0 if momentum is None else momentum
    if training and track_running_stats and num_batches_tracked is not None:
        num_batches_tracked.add_(1)
        factor = 1.0 / float(num_batches_tracked) if momentum is None else momentum
    use_batch_stats = training or (running_mean is None and running_var is None)
    keep_stats = not training or track_running_stats
    return F.batch_norm(
        x,
        running_mean if keep_stats else None,
        running_var if keep_stats else None,
        weight,
        bias,
        use_batch_stats,
        factor,
        eps,
    )


@one_call_when_traced
def head_slice(t, dim: int, start: int, length: int, full: int, rank):
    """An operand of unknown shape (fx level) against a value cut on `dim`: broadcast when it
    has no extent there, this shard's part when it has the full extent, else an error."""
    if not isinstance(t, torch.Tensor) or t.dim() < -dim or t.shape[dim] == 1:
        if isinstance(t, torch.Tensor) and rank is not None and t.dim() > rank:
            raise RuntimeError(
                f"rtp_compile: an operand of a fused block has {t.dim()} dims, "
                f"more than the {rank} the block was planned for"
            )
        return t
    if t.shape[dim] != full:
        raise RuntimeError(
            f"rtp_compile: an operand of a fused block has extent {t.shape[dim]} "
            f"on the head axis (dim {dim}), neither 1 nor {full}"
        )
    return t.narrow(dim, start, length)


@one_call_when_traced
def add_into(total: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """total + part, written into `total` when nothing else can see it: no other tensor shares
    its storage, it takes no gradient, and the sum keeps its shape and dtype (a unit's running
    sum of its step outputs, computed outside autograd); else a new tensor. Bitwise the same
    either way. In a compiled graph a new tensor: the compiler plans the memory itself."""
    if (
        not torch.compiler.is_compiling()
        and not total.requires_grad
        and total.shape == torch.broadcast_shapes(total.shape, part.shape)
        and total.dtype == torch.result_type(total, part)
        and torch._C._storage_Use_Count(total.untyped_storage()._cdata) <= 2
    ):
        return total.add_(part)
    return total + part


@one_call_when_traced
def expect_dtype(x, dtype: torch.dtype, unit: str, what: str):
    """`x`, the input of a unit whose ops (linear, conv) need it in their weights' dtype,
    checked to be in `dtype`, the dtype mixed precision computes the unit in; else a clear
    error naming the unit (`what`: its op and parameters)."""
    if x.dtype != dtype:
        raise TypeError(
            f"rtp_compile: unit {unit} ({what}) computes in {dtype} (mp_policy.param_dtype) "
            f"but its input is {x.dtype}: the model computes that input in {x.dtype} (an "
            f"upcast, a {x.dtype} buffer, or a model input left uncast by "
            f"cast_forward_inputs=False), and a linear or conv needs its input in its weights' "
            f"dtype, as under FSDP2. Cast the input to {dtype} in the model, or compile without "
            f"mp_policy.param_dtype."
        )
    return x


@one_call_when_traced
def cast_floating(value, dtype: torch.dtype):
    """`value` with every floating-point tensor in it cast to `dtype` (FSDP2's cast of a
    module's inputs and outputs under its MixedPrecisionPolicy); other values as they are."""
    return torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, value
    )
