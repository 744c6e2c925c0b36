"""Mixed precision as FSDP2's `MixedPrecisionPolicy` defines it, resolved per parameter dtype.

Shards stay in the model's dtype (their stored dtype, what the optimizer steps); a floating
shard computes and rotates in `param_dtype`, its gradient accumulators travel and sum in
`reduce_dtype` (default: the compute dtype), and the finished gradient lands in `.grad` in the
stored dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    """The dtypes a program computes and reduces in; both None: the parameters' own."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    @classmethod
    def of(cls, policy) -> Precision:
        """From a `torch.distributed.fsdp.MixedPrecisionPolicy` (or None)."""
        if policy is None:
            return cls()
        return cls(policy.param_dtype, policy.reduce_dtype)

    def compute(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a shard of `dtype` computes and rotates in."""
        return self.param_dtype if self.param_dtype and dtype.is_floating_point else dtype

    def reduce(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the gradient of a shard of `dtype` is summed over the ranks in."""
        if not dtype.is_floating_point:
            return dtype
        return self.reduce_dtype or self.param_dtype or dtype

    def to_compute(self, shards: list[torch.Tensor]) -> list[torch.Tensor]:
        """The shards cast to their compute dtype (the same tensors where it is theirs)."""
        return [s.to(self.compute(s.dtype)) for s in shards]
