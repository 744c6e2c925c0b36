"""Where a graph module holds the model's tensors: a parameter or buffer registered at its
dotted path, the parent modules made as needed."""

from __future__ import annotations

import torch
from torch import nn


def install(root: nn.Module, target: str, value: torch.Tensor) -> None:
    """Register `value` at `target` in `root` (a parameter if it is one, else a buffer),
    creating empty parent modules along the path."""
    *path, leaf = target.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if isinstance(value, nn.Parameter):
        module.register_parameter(leaf, value)
    else:
        module.register_buffer(leaf, value)
