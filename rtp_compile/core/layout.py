"""How a parameter is cut: N equal, zero-padded shards along one dim (or flat); shard s lives on
rank s. Shared by the plan that chooses layouts, the runtime that rotates shards, and the
readers that cut checkpoints.

`Slot(offset, valid, length)` locates shard s inside the full parameter along its shard dim:
the shard tensor is always `length` long there, only its first `valid` entries are real.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Slot:
    """Where shard s sits in the full parameter along the shard dim (`length`: padded size)."""

    offset: int
    valid: int
    length: int


def real_part(t: torch.Tensor, dim: int, slot: Slot) -> torch.Tensor:
    """The real (unpadded) entries of a padded shard."""
    return t if slot.valid == slot.length else t.narrow(dim, 0, slot.valid)


@dataclass(frozen=True)
class ParamLayout:
    """How one parameter is cut into N equal (padded) shards; shard s lives on rank s."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    world_size: int
    dim: int | None  # None: the flattened parameter is cut
    aliases: tuple[str, ...] = ()
    granule: int = 1  # shards hold whole granules (an attention head group)

    def __post_init__(self):
        if self.dim is not None and self.extent % self.granule:
            raise ValueError(
                f"{self.name}: extent {self.extent} is not a multiple of its granule {self.granule}"
            )

    @property
    def extent(self) -> int:
        return math.prod(self.shape) if self.dim is None else self.shape[self.dim]

    @functools.cached_property  # fixed per layout, read on every hop
    def shard_len(self) -> int:
        """ceil(granules / N) whole granules: with granule 1, ceil(extent / N)."""
        return max(1, math.ceil(self.extent // self.granule / self.world_size) * self.granule)

    @property
    def shard_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return (self.shard_len,)
        return self.shape[: self.dim] + (self.shard_len,) + self.shape[self.dim + 1 :]

    @property
    def shard_bytes(self) -> int:
        return math.prod(self.shard_shape) * self.dtype.itemsize

    def slot(self, s: int) -> Slot:
        offset = min(s * self.shard_len, self.extent)  # a shard past the end: empty, at the end
        return Slot(offset, min(self.shard_len, self.extent - offset), self.shard_len)

    def real_part_of(self, full: torch.Tensor, s: int) -> torch.Tensor:
        """The part of the full tensor that shard s holds (a view, without padding)."""
        src = full.reshape(-1) if self.dim is None else full
        slot = self.slot(s)
        return src.narrow(self.dim or 0, slot.offset, slot.valid)

    def padded(self, part: torch.Tensor) -> torch.Tensor:
        """A shard from its real part (as `real_part_of` gives it): zero-padded to
        `shard_shape`, a new tensor in `part`'s dtype and device."""
        out = torch.zeros(self.shard_shape, dtype=part.dtype, device=part.device)
        out.narrow(self.dim or 0, 0, part.shape[self.dim or 0]).copy_(part)
        return out

    def shard(self, full: torch.Tensor, s: int) -> torch.Tensor:
        """Shard s of the full tensor, zero-padded to `shard_shape` (a new tensor)."""
        return self.padded(self.real_part_of(full, s))

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from all N shards (padding dropped)."""
        dim = 0 if self.dim is None else self.dim
        full = torch.cat(list(shards), dim).narrow(dim, 0, self.extent)
        return full.reshape(self.shape) if self.dim is None else full
