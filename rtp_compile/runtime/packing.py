"""A hop's message: a list of tensors packed into one flat buffer and unpacked as views of it
(`flat_layout`, `pack`, `unpack`), the buffers drawn from a pool this process keeps.
"""

from __future__ import annotations

import functools
import math

import torch


def flat_layout(specs):
    """Where each (shape, dtype) sits in one flat message: (flat dtype, total length, offsets).
    One dtype: a flat tensor of it. Mixed dtypes: bytes, each tensor 16-byte aligned."""
    key = tuple((tuple(shape), dtype) for shape, dtype in specs)
    if torch.compiler.is_compiling():  # traced once: no cache (dynamo would warn of it)
        return _flat_layout.__wrapped__(key)
    try:
        return _flat_layout(key)
    except TypeError:  # a symbolic size is not hashable
        return _flat_layout.__wrapped__(key)


@functools.lru_cache(maxsize=4096)
def _flat_layout(specs: tuple[tuple[tuple[int, ...], torch.dtype], ...]):
    """`flat_layout`, computed once per distinct message (a program has a few dozen)."""
    dtypes = {dtype for _, dtype in specs}
    if len(dtypes) == 1:
        sizes = [math.prod(shape) for shape, _ in specs]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        return dtypes.pop(), sum(sizes), offsets
    offsets, end = [], 0
    for shape, dtype in specs:
        end = -(-end // 16) * 16
        offsets.append(end)
        end += math.prod(shape) * dtype.itemsize
    return torch.uint8, end, offsets


def unpack(flat: torch.Tensor, specs) -> list[torch.Tensor]:
    """Views of a flat message shaped and typed like `specs` [(shape, dtype)] (`flat` may be an
    fx Proxy: everything but the tensor ops is computed from `specs`); `flat` holds exactly the
    message (as `flat_layout` sizes it)."""
    flat_dtype, total, offsets = flat_layout(specs)
    if all(dtype == flat_dtype for _, dtype in specs):  # one split: k + 1 ops, not 2k
        parts = flat.split_with_sizes([math.prod(shape) for shape, _ in specs])
        return [parts[i].view(shape) for i, (shape, _) in enumerate(specs)]  # a Proxy indexes
    views = []
    for (shape, dtype), offset in zip(specs, offsets):
        if flat_dtype == dtype:
            views.append(flat.narrow(0, offset, math.prod(shape)).view(shape))
        else:
            nbytes = math.prod(shape) * dtype.itemsize
            views.append(flat.narrow(0, offset, nbytes).view(dtype).view(shape))
    return views


def specs_of(tensors: list[torch.Tensor]) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [(tuple(t.shape), t.dtype) for t in tensors]


class BufferPool:
    """Flat weight messages reused across the hops of a unit instead of one allocation per hop.

    A buffer is handed out again only when nothing but the pool refers to its storage (no view
    of it alive, no hop still sending it): each hop receives into the buffer the hop before
    last arrived in, so a unit's N - 1 hops use two buffers. A unit lets the pool go after its
    last hop, so no idle buffer waits through the last step's compute or between units (a
    pool kept across units would hold two of the largest unit's messages through the whole
    pass: +3% peak on the memory benchmark at N=2; the device's caching allocator reuses
    memory across units without that). A request no free buffer matches drops the free ones."""

    def __init__(self):
        self.buffers: list[torch.Tensor] = []

    @staticmethod
    def _unused(buffer: torch.Tensor) -> bool:
        storage = buffer.untyped_storage()  # this wrapper and `buffer` hold the only references
        return torch._C._storage_Use_Count(storage._cdata) <= 2

    def take(self, numel: int, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
        """A flat `dtype` tensor of `numel` elements on `like`'s device (contents undefined)."""
        free = [b for b in self.buffers if self._unused(b)]
        match = [b for b in free if (b.numel(), b.dtype, b.device) == (numel, dtype, like.device)]
        if not match:
            self.buffers = [b for b in self.buffers if not any(b is f for f in free)]
            match = [torch.empty(numel, dtype=dtype, device=like.device)]
            self.buffers.append(match[0])
        return match[0].view(-1)  # a view: while it lives, the storage counts as in use

    def release(self) -> None:
        self.buffers = []


pool = BufferPool()


def pack(tensors: list[torch.Tensor], pooled: bool = False) -> torch.Tensor:
    """One flat message holding `tensors`: no copy when they already lie in one buffer the way
    `unpack` lays them out (what arrived by the ring is passed on as it is); else a copy, into
    a buffer of the pool if `pooled`."""
    specs = specs_of(tensors)
    dtype, total, offsets = flat_layout(specs)
    item = dtype.itemsize
    storage, start = tensors[0].untyped_storage(), tensors[0].data_ptr()
    in_place = (
        (start - storage.data_ptr()) % item == 0
        and start - storage.data_ptr() + total * item <= storage.nbytes()
        and all(
            t.is_contiguous()
            and t.untyped_storage().data_ptr() == storage.data_ptr()
            and t.data_ptr() == start + offset * item
            for t, offset in zip(tensors, offsets)
        )
    )
    if in_place:
        # torch's stubs require set_'s stride once an offset and size are given; it is optional
        return (
            tensors[0]
            .new_empty(0, dtype=dtype)
            .set_(  # type: ignore[call-overload]
                storage,
                (start - storage.data_ptr()) // item,
                (total,),
            )
        )
    flat = (
        pool.take(total, dtype, tensors[0]) if pooled else tensors[0].new_empty(total, dtype=dtype)
    )
    for view, t in zip(unpack(flat, specs), tensors):
        view.copy_(t)
    return flat
