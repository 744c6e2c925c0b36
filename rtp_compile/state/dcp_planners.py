"""A rank's shard of a parameter as torch.distributed.checkpoint (DCP) chunks of the full tensor.

DCP stores a tensor as chunks (boxes: offsets and sizes in the full tensor) and reshards by
reading, for every chunk a rank asks for, the overlapping parts of the chunks saved. A shard of
a `ParamLayout` holds a slot of the full tensor: along its shard dim a box (`offset`, `valid`),
or, for a flat layout, a contiguous range of the flattened tensor, which `flat_range_boxes`
cuts into the few boxes it covers. Padding is never saved and never read: a shard's padding is
zero when loaded, whatever world size saved it.

`ShardChunks` speaks DCP's chunk protocol (`__create_write_items__`, `__create_chunk_list__`,
`__get_tensor_shard__`, the one DTensor implements), and `ShardSavePlanner` /
`ShardLoadPlanner` (DCP's default planners) look its chunks up, so the directory written is a
standard DCP checkpoint whose tensors have the model's full shapes.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from rtp_compile.core.layout import ParamLayout

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in the full tensor


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The boxes that together cover flat indices [start, stop) of a row-major tensor of
    `shape`, in flat order; each box is itself a contiguous flat range."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    row = math.prod(shape[1:])
    if start // row == (stop - 1) // row:  # inside one row: recurse into it
        first = start // row
        return [
            ((first,) + o, (1,) + s)
            for o, s in flat_range_boxes(shape[1:], start - first * row, stop - first * row)
        ]
    boxes: list[Box] = []
    if start % row:  # the partial first row
        boxes += flat_range_boxes(shape, start, (start // row + 1) * row)
        start = (start // row + 1) * row
    whole_end = stop // row * row
    if whole_end > start:  # whole rows
        boxes.append(
            (
                (start // row,) + (0,) * (len(shape) - 1),
                ((whole_end - start) // row,) + tuple(shape[1:]),
            )
        )
    if stop > whole_end:  # the partial last row
        boxes += flat_range_boxes(shape, whole_end, stop)
    return boxes


class ShardChunks:
    """Shard `s` of `layout`, held in `shard` (padded shard shape), as chunks of the full tensor.

    Saving reads the real part of `shard`; loading writes into it (so a load target is a fresh
    zero shard, copied into the parameter only once the whole checkpoint has been read)."""

    def __init__(self, shard: torch.Tensor, layout: ParamLayout, s: int):
        self.shard, self.layout = shard, layout
        self.full_shape = torch.Size(layout.shape)
        slot = layout.slot(s)
        if layout.dim is None:
            flat, taken = shard.reshape(-1), 0
            self.boxes = {}
            for offsets, sizes in flat_range_boxes(
                layout.shape, slot.offset, slot.offset + slot.valid
            ):
                size = math.prod(sizes)  # boxes come in flat order, one after another
                self.boxes[offsets] = (sizes, flat.narrow(0, taken, size).view(sizes))
                taken += size
        elif slot.valid:
            offsets = tuple(slot.offset if d == layout.dim else 0 for d in range(len(layout.shape)))
            view = shard.narrow(layout.dim, 0, slot.valid)
            self.boxes = {offsets: (tuple(view.shape), view)}
        else:  # a shard past the end holds only padding
            self.boxes = {}

    def size(self) -> torch.Size:
        """The full tensor's size (DCP checks it against the saved one before loading)."""
        return self.full_shape

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.shard)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                    properties=properties,
                    size=self.full_shape,
                ),
            )
            for offsets, (sizes, _) in self.boxes.items()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            for offsets, (sizes, _) in self.boxes.items()
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.boxes[tuple(index.offset)][1]


class ShardSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, looking up `ShardChunks` boxes. A box that is its shard's
    whole storage (a shard without padding) is written as it is; any other is written from a
    compact copy, since torch.save of a view writes all of the storage under it."""

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        if isinstance(obj, ShardChunks):
            box = obj.__get_tensor_shard__(index).detach()
            whole = (
                box.is_contiguous()
                and box.storage_offset() == 0
                and box.numel() * box.element_size() == box.untyped_storage().nbytes()
            )
            return box if whole else box.clone()
        return super().lookup_object(index)


class ShardLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading into `ShardChunks` boxes (views of the target)."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        """The default set-up without its first step, which makes real tensors of meta ones
        and drops every value it does not know (a `ShardChunks`); targets here are real."""
        self.original_state_dict = state_dict
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, ShardChunks):
            return obj.__get_tensor_shard__(index)
        return super().lookup_tensor(index)
