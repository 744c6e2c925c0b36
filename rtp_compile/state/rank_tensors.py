"""One rank's tensors: what `prog.module(rank, device=..., seed=..., checkpoint=...)` installs
(its parameter shards, and the buffers and constants that need a value), made by the meta-device
initialisation of `rtp_compile.state.materialize` or read by `rtp_compile.state.full_state`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from rtp_compile.state.full_state import full_state_keys
from rtp_compile.state.materialize import _check_seed, _owned, init_module
from rtp_compile.state.model_state import open_model_full_state


@dataclass
class RankTensors:
    """What `prog.module(rank)` installs: the rank's parameter shards, and the buffers and
    constants that had to be materialised (the rest are copied from the program as they are);
    `device`: where a program captured on the meta device now runs (see `core.retarget_meta`)."""

    shards: dict[str, torch.Tensor]
    attrs: dict[str, torch.Tensor] = field(default_factory=dict)
    device: torch.device | None = None


def _tensor_attrs(src: fx.GraphModule, params) -> dict[str, torch.Tensor]:
    """The program's non-parameter tensors: its buffers and the tensors get_attr nodes read."""
    out = {name: b for name, b in src.named_buffers()}
    for node in src.graph.nodes:
        if node.op == "get_attr" and node.target not in params and node.target not in out:
            value = operator.attrgetter(node.target)(src)
            if isinstance(value, torch.Tensor):
                out[node.target] = value
    return out


def _meta_leftovers(src: fx.GraphModule, bodies, params) -> list[str]:
    """Meta tensors a rank module would copy without any way to give them a value: inside
    called submodules and gathered-op bodies."""
    found = []
    for node in src.graph.nodes:
        if node.op == "call_module":
            sub = src.get_submodule(node.target)
            found += [
                f"{node.target}.{n}"
                for n, t in sub.state_dict(keep_vars=True).items()
                if isinstance(t, torch.Tensor) and t.is_meta
            ]
    for unit, body in bodies.items():
        params_of_body = {n for n, _ in body.named_parameters()}
        for name, t in _tensor_attrs(body, params_of_body).items():
            if t.is_meta:
                found.append(f"{name} (in the body of unit {unit})")
    return found


def rank_tensors(ctx, src: fx.GraphModule, rank: int, device, seed: int, checkpoint) -> RankTensors:
    """This rank's parameter shards, and the buffers / constants that need a value (meta ones,
    or checkpointed ones), for `prog.module(rank, device=device, seed=seed,
    checkpoint=checkpoint)` of the program `src` compiled in `ctx`."""
    _check_seed(seed)
    plan, model = ctx.plan, ctx.model
    target = torch.device(device) if device is not None else None
    attrs_in = _tensor_attrs(src, plan.params)
    any_meta = any(p.is_meta for p in ctx.params.values()) or any(
        t.is_meta for t in attrs_in.values()
    )
    materialising = any_meta and target is not None and target.type != "meta"
    if checkpoint is not None and any_meta and not materialising:
        raise ValueError(
            "rtp_compile: loading a checkpoint into a meta-device model needs a real "
            "device: prog.module(rank, device='cuda' or 'cpu', checkpoint=path)"
        )
    source = (
        open_model_full_state(checkpoint, model, f"prog.module({rank}, checkpoint=...)")
        if checkpoint is not None
        else None
    )
    try:
        persistent = set(ctx.native_keys)
        loaded = (
            {n: tuple(t.shape) for n, t in attrs_in.items() if n in persistent}
            if source is not None
            else {}
        )
        keys = (
            full_state_keys(source, plan.params, loaded, f"prog.module({rank}, checkpoint=...)")
            if source is not None
            else {}
        )
        wanted: dict[str, str] = {}  # canonical name of a meta tensor to initialise -> its name
        if materialising:
            _check_materialisable(ctx, src, attrs_in, keys)
            wanted.update({n: n for n, p in ctx.params.items() if n not in keys and p.is_meta})
            wanted.update(
                {
                    _canonical_buffer(model, n): n
                    for n, t in attrs_in.items()
                    if n not in keys and t.is_meta
                }
            )
        shards: dict[str, torch.Tensor] = {}
        attrs: dict[str, torch.Tensor] = {}
        for mod, (params, buffers) in _owned(model).items() if wanted else ():
            prefix = f"{mod}." if mod else ""
            if not any(prefix + leaf in wanted for leaf in params + buffers):
                continue
            module = model.get_submodule(mod)
            # all of the module's meta tensors, as materialize_full makes them (one RNG stream),
            # but its parameters stay meta when a checkpoint gives them
            params = [p for p in params if module._parameters[p].is_meta and source is None]
            buffers = [b for b in buffers if module._buffers[b].is_meta]
            values = init_module(model, mod, params, buffers, target, seed)
            for leaf in params:
                if prefix + leaf in plan.params:
                    shards[prefix + leaf] = plan.params[prefix + leaf].shard(values[leaf], rank)
            for leaf in buffers:
                if prefix + leaf in wanted:
                    attrs[wanted[prefix + leaf]] = values[leaf]
            del values  # the module's full tensors go before the next module's are made
        for name, layout in plan.params.items():
            if name in shards:
                continue
            if name in keys:
                shard = source.read_shard(keys[name], layout, rank)
                shards[name] = shard.to(target or ctx.params[name].device, layout.dtype)
            else:
                shard = layout.shard(ctx.params[name].detach(), rank)
                shards[name] = shard.to(target) if target is not None else shard
        for name in loaded:
            value = attrs_in[name]
            attrs[name] = source.read(keys[name]).to(target or value.device, value.dtype)
        return RankTensors(shards, attrs, target if materialising else None)
    finally:
        if source is not None:
            source.close()


def _check_materialisable(ctx, src, attrs_in, keys) -> None:
    """Every meta tensor of the program can get a value: a parameter, a module's buffer, or in
    the checkpoint; constants and tensors inside called modules cannot."""
    model = ctx.model
    if model is None:
        raise ValueError(
            "rtp_compile: this program does not know the model it was captured from, "
            "so it cannot initialise its meta tensors; load a checkpoint instead"
        )
    bad = [
        n
        for n, t in attrs_in.items()
        if t.is_meta and n not in keys and not _is_buffer_of(model, n)
    ]
    bad += _meta_leftovers(src, ctx.bodies, ctx.plan.params)
    if bad:
        raise ValueError(
            f"rtp_compile: {', '.join(bad[:8])} "
            f"{'is a meta tensor' if len(bad) == 1 else 'are meta tensors'} "
            f"of the program that no initialiser or checkpoint can give a value (neither a "
            f"parameter nor a module's buffer). Register it as a buffer of its module, filled by "
            f"the module's reset_parameters(), or build the model on a real device."
        )


def _is_buffer_of(model: nn.Module, name: str) -> bool:
    mod, _, leaf = name.rpartition(".")
    try:
        return leaf in model.get_submodule(mod)._buffers
    except AttributeError:
        return False


def _canonical_buffer(model: nn.Module, name: str) -> str:
    """The first name of the buffer called `name` (tied buffers are initialised by their first
    module)."""
    target = model.get_buffer(name)
    return next(n for n, b in model.named_buffers(remove_duplicate=False) if b is target)
