"""The names a model's tensors go by inside rtp_compile (its *native* keys)."""

from __future__ import annotations

from torch import nn


def native_state_keys(model: nn.Module) -> list[str]:
    """Every parameter (under each of its names) and persistent buffer, in state_dict order
    (each module's parameters, then its buffers, then its children's), as the modules name them."""
    keys = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        keys += [dot + n for n, p in module._parameters.items() if p is not None]
        keys += [
            dot + n
            for n, b in module._buffers.items()
            if b is not None and n not in module._non_persistent_buffers_set
        ]
    return keys
