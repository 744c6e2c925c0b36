"""An activation checkpoint of the model, kept in a rank's program: the nodes the model ran
inside `torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False)`, outlined into a body
that runs under torch's non-reentrant checkpoint.

Forward saves none of the body's activations, only its inputs; the first backward that needs one
re-runs the whole body (early stop off: every ring hop the body starts is also waited on, on
every rank alike), so its rotation units fetch their weight shards again by rotation. The
units' autograd nodes are the forward's: the recomputation only refills what they saved (the
activations and the rank's own shards), never a received shard.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn


class CheckpointedRegion(nn.Module):
    """Runs `body` (a GraphModule of the region's nodes) under non-reentrant activation
    checkpointing when gradients are on, plainly otherwise."""

    def __init__(self, body: fx.GraphModule, region: int):
        super().__init__()
        self.body, self.region = body, region

    def extra_repr(self) -> str:
        return f"activation checkpoint {self.region} of the model, recomputed in backward"

    def forward(self, *inputs):
        if not torch.is_grad_enabled():
            return self.body(*inputs)
        return torch.utils.checkpoint.checkpoint(
            self.body, *inputs, use_reentrant=False, early_stop=False
        )
