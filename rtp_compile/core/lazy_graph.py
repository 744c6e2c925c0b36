"""Graph modules whose Python code is generated when it is first needed, not at every change:
the compiler's own graphs (capture's, the reference, the one the passes rewrite, the planned
program) change many times and are rarely run, and generating a whole model's code costs
about 2 ms a layer (0.25 s for a 126-layer Llama) each time. A rank's module is an ordinary
`fx.GraphModule`, made by codegen.

Invariant: a lazy module runs, and shows as its `code`, what its graph says at that moment
(torch.fx's `_LazyGraphModule`: `recompile()` only marks the code stale)."""

from __future__ import annotations

import torch.fx as fx
from torch import nn
from torch.fx._lazy_graph_module import _LazyGraphModule

_SPECS = ("_in_spec", "_out_spec")  # torch.export's pytree specs of the inputs and outputs


def lazy_graph_module(root: nn.Module, graph: fx.Graph, class_name: str = "GraphModule"):
    """`fx.GraphModule(root, graph, class_name)`, its code generated when first run or read."""
    return _LazyGraphModule(root, graph, class_name)


def as_lazy(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` as a lazy graph module: the same graph (taken over, not copied), the attributes it
    reads and torch.export's input and output specs."""
    if isinstance(gm, _LazyGraphModule):
        return gm
    lazy = lazy_graph_module(gm, gm.graph, type(gm).__name__)
    for spec in _SPECS:
        if hasattr(gm, spec):
            setattr(lazy, spec, getattr(gm, spec))
    return lazy
