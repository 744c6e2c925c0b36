"""retarget_meta: a graph captured from a meta-device model, pointed at a real device.

A graph rewrite applied per device, not a pipeline pass (it is not in `PIPELINE`): codegen's
output for a rank that materialises on a real device (`prog.module(rank, device=...)`), and the
cost profiler's copy of the captured graph (on fake cpu tensors) are retargeted with it.

Invariant: afterwards no node of the graph, nor of the graph modules it calls, names the meta
device.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx


def _on_target(value, device: torch.device, is_device_arg: bool = False):
    if isinstance(value, torch.device) and value.type == "meta":
        return device
    if is_device_arg and value == "meta":
        return device
    return value


def _retarget(device: torch.device, key: str):
    """What `map_aggregate` applies to keyword argument `key`'s values."""
    return lambda a: _on_target(a, device, key == "device")


def retarget_meta(gm: fx.GraphModule, device: torch.device) -> None:
    """A graph captured from a meta model names the meta device where it creates or checks
    tensors (`arange(..., device=meta)`, `.to(meta)`): point
    those at `device`, in `gm` and in the graph modules it calls (replaced by retargeted copies,
    as the program shares them between ranks)."""

    def rewrite(graph: fx.Graph) -> bool:
        changed = False
        for node in graph.nodes:
            args = fx.node.map_aggregate(node.args, lambda a: _on_target(a, device))
            kwargs = {
                k: fx.node.map_aggregate(v, _retarget(device, k)) for k, v in node.kwargs.items()
            }
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs, changed = args, kwargs, True
        return changed

    if rewrite(gm.graph):
        gm.recompile()
    for name, sub in list(gm.named_modules()):
        if sub is gm or not isinstance(sub, fx.GraphModule):
            continue
        graph = copy.deepcopy(sub.graph)
        if rewrite(graph):
            parent, _, leaf = name.rpartition(".")
            setattr(gm.get_submodule(parent), leaf, fx.GraphModule(sub, graph))
