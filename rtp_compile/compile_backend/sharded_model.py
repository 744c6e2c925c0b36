"""A model whose parameters are this rank's shards, in place, under their own names (SimpleFSDP's
pattern): `rtp_compile.shard(model, N)`, then an optimizer on `model.parameters()` and
`torch.compile(model, backend="rtp")`. And the full state of a model that trains through the
compile backend, either way (`full_state_dict`, `load_full_state_dict`).

`shard` plans the whole model once (tied parameters get one layout), replaces every parameter by
its shard and gives each module that holds one a subclass whose attribute of that name reads
`rtp::unshard(shard)`: the full weight (an all-gather when run eagerly; for the compile backend
a node it turns back into a read of the shard, which its program rotates). So the model holds
no full parameter at any time, `model.parameters()` are the shards, the layouts are fixed for
every graph dynamo captures, and state_dict keys stay the model's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from rtp_compile.compiler.transform import transform
from rtp_compile.core.state_keys import native_state_keys
from rtp_compile.runtime.unshard import unshard
from rtp_compile.state import shard_registry as registry
from rtp_compile.state.model_state import to_model_state_dict, to_native


def shard(
    model: nn.Module,
    world_size: int | None = None,
    example_inputs=None,
    *,
    example_kwargs=None,
    group: dist.ProcessGroup | None = None,
    grad_reduction: str = "mean",
    **transform_opts,
) -> nn.Module:
    """Shard `model` in place for the ring of `group` (the whole job when None; `world_size`
    defaults to its size) and return it. Collective-free: every rank cuts its own shards from
    its own (identical) full parameters, which are then dropped.

    The plan comes from `rtp_compile.transform(model, world_size, example_inputs, ...)` on the
    whole model (so it needs what transform needs to capture it). Afterwards build the optimizer
    on `model.parameters()` (the shards) and compile with `backend="rtp"` (or
    `rtp_compile.backend(...)` with the same options); run uncompiled, each weight is
    all-gathered when read. State: `rtp_compile.full_state_dict(model)`.

    `mp_policy` (a transform option): the shards stay in the model's dtype and every weight is
    read in `param_dtype`, as FSDP2's `fully_shard(model, mp_policy=...)` has the model compute,
    so dynamo traces the model computing in it: mixed precision through the compile backend
    takes the model sharded this way, with the backend given the same policy."""
    if any(registry.sharded(p) is not None for p in model.parameters()):
        raise ValueError(f"rtp_compile.shard: {type(model).__name__} is already sharded")
    world_size = world_size or dist.get_world_size(group)
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    group_name = "" if group is None or group == dist.group.WORLD else group.group_name
    prog = transform(
        model,
        world_size,
        example_inputs,
        example_kwargs=example_kwargs,
        grad_reduction=grad_reduction,
        **transform_opts,
    )
    compute_dtype = prog.ctx.precision.param_dtype
    scale = 1.0 / world_size if grad_reduction == "mean" else 1.0
    canonical = prog.ctx.canonical
    shards: dict[int, registry.Sharded] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        entry = shards.get(id(p))
        if entry is None:
            layout = prog.plan.params[canonical[name]]
            piece = nn.Parameter(layout.shard(p.detach(), rank), requires_grad=p.requires_grad)
            entry = shards[id(p)] = registry.Sharded(
                layout, piece, rank, group_name, compute_dtype if p.is_floating_point() else None
            )
            registry.register_shard(entry)
        owner_name, _, leaf = name.rpartition(".")
        _read_through_unshard(model.get_submodule(owner_name), leaf, entry, scale)
    return model


def _read_through_unshard(
    module: nn.Module, leaf: str, entry: registry.Sharded, scale: float
) -> None:
    """Put `entry.shard` in `module._parameters[leaf]` and make `module.<leaf>` read its full
    weight through `rtp::unshard` (a property of a subclass made for this module)."""
    module._parameters[leaf] = entry.shard
    cls = type(module)
    if not getattr(cls, "_rtp_sharded", False):
        cls = type(cls.__name__, (cls,), {"_rtp_sharded": True, "__module__": cls.__module__})
        module.__class__ = cls
    layout = entry.layout
    shape, dim = list(layout.shape), -1 if layout.dim is None else layout.dim

    def full(self, _leaf=leaf):
        weight = unshard(self._parameters[_leaf], shape, dim, entry.group_name, scale)
        return weight if entry.compute_dtype is None else weight.to(entry.compute_dtype)

    setattr(cls, leaf, property(full))


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective over the ring: the model's state_dict with full tensors (its keys, through its
    state-dict hooks; padding removed), for a model compiled with the rtp backend (after its
    first call) or sharded by `rtp_compile.shard`."""
    full, seen = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            entry = registry.entry_of(p)
            seen[id(p)] = entry.gather() if entry is not None else p.detach().clone()
        full[name] = seen[id(p)]
    full.update((n, b.detach().clone()) for n, b in model.named_buffers(remove_duplicate=False))
    return to_model_state_dict(
        model, {k: full[k] for k in native_state_keys(model)}, "full_state_dict", _full_shape
    )


def _full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape `tensor` has in the model's full state: a shard's parameter's, else its own."""
    entry = registry.sharded(tensor)
    return entry.layout.shape if entry is not None else tuple(tensor.shape)


def load_full_state_dict(model: nn.Module, state_dict) -> None:
    """Take a full state_dict (the model's keys; as `full_state_dict` or the unsharded model
    gives it) into the shards of `model` (and its buffers and any parameter not sharded). Keys
    and shapes are checked first (through the model's own load_state_dict on a skeleton);
    nothing is written when they do not fit."""
    native = to_native(model, state_dict, "load_full_state_dict", _full_shape)
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=False):
            entry = registry.entry_of(p)
            if entry is None:
                p.copy_(native[name])
            else:
                entry.shard.copy_(entry.layout.shard(native[name], entry.rank))
        for name, b in model.named_buffers():
            if name in native:
                b.copy_(native[name])
