"""Reading a full state dict (a mapping, a `torch.save` file or `.safetensors` files; what
`module(..., checkpoint=...)` takes) one tensor (or one rank's shard) at a time.

Loading (`module(rank, device=d, checkpoint=path)`, `load_full_state_dict(gm, path)`):
a `torch.save`d state_dict (opened with `torch.load(mmap=True, weights_only=True)`), a
`.safetensors` file, or a directory of them (a sharded transformers checkpoint). Every key and
shape is checked before anything is read; then one parameter at a time only this rank's part is
read (safetensors: `get_slice`, so only those bytes; torch files: a view of the memory-mapped
tensor), padded into the shard and cast to the model's dtype. A tied parameter is read under the
first of its names the checkpoint has. Persistent buffers come from the checkpoint;
non-persistent ones (rotary `inv_freq`, ...) are recomputed by their module's initialisers
(`rtp_compile.state.materialize`).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from rtp_compile.core.layout import ParamLayout


class FullStateSource:
    """A full state_dict to read from one tensor (or one shard) at a time."""

    description = "the state_dict"

    def keys(self) -> set[str]:
        raise NotImplementedError

    def shape(self, key: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def read_real_part(self, key: str, layout: ParamLayout, s: int) -> torch.Tensor:
        """The part of tensor `key` that shard `s` of `layout` holds (no padding)."""
        return layout.real_part_of(self.read(key), s)

    def read_shard(self, key: str, layout: ParamLayout, s: int) -> torch.Tensor:
        """Shard `s` of tensor `key`, zero-padded to `layout.shard_shape`, in its stored dtype."""
        part = self.read_real_part(key, layout, s)
        return layout.padded(part.reshape(-1) if layout.dim is None else part)

    def close(self) -> None:
        pass


class DictSource(FullStateSource):
    """An in-memory (or memory-mapped, from torch.load(mmap=True)) state_dict."""

    def __init__(self, state_dict: Mapping, description: str = "the state_dict"):
        self.sd, self.description = state_dict, description

    def keys(self):
        return set(self.sd.keys())

    def shape(self, key):
        return tuple(self.sd[key].shape)

    def read(self, key):
        return self.sd[key].detach()


class SafetensorsSource(FullStateSource):
    """One or more .safetensors files (a sharded checkpoint: every file of a directory); reads
    only the slices asked for."""

    def __init__(self, files: list[Path], description: str):
        try:
            from safetensors import safe_open
        except ImportError as err:
            raise ImportError(
                "rtp_compile: reading a .safetensors checkpoint needs the "
                "`safetensors` package (pip install safetensors)"
            ) from err
        self.description = description
        self.stack = contextlib.ExitStack()
        self.where: dict[str, object] = {}
        for f in files:
            handle = self.stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            for key in handle.keys():
                self.where.setdefault(key, handle)

    def keys(self):
        return set(self.where)

    def shape(self, key):
        return tuple(self.where[key].get_slice(key).get_shape())

    def read(self, key):
        return self.where[key].get_tensor(key)

    def read_real_part(self, key, layout, s):
        shape = self.shape(key)
        if not shape:
            return self.read(key)
        piece = self.where[key].get_slice(key)
        slot = layout.slot(s)
        if layout.dim is not None:
            index = (slice(None),) * layout.dim + (slice(slot.offset, slot.offset + slot.valid),)
            return piece[index]
        row = max(1, math.prod(shape[1:]))
        first, last = slot.offset // row, -(-(slot.offset + slot.valid) // row)  # whole rows
        rows = piece[first : max(last, first)]
        return rows.reshape(-1).narrow(0, slot.offset - first * row, slot.valid)

    def close(self):
        self.stack.close()


def open_full_state(checkpoint) -> FullStateSource:
    """A state_dict mapping, a torch.save'd state_dict file, a .safetensors file, or a directory
    of .safetensors files, as a FullStateSource."""
    if isinstance(checkpoint, Mapping):
        return DictSource(checkpoint)
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(
            f"rtp_compile: a checkpoint is a state_dict or a path (torch.save file, "
            f".safetensors file or a directory of them), got "
            f"{type(checkpoint).__name__}"
        )
    path = Path(checkpoint)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"rtp_compile: checkpoint directory {path} has no .safetensors files"
            )
        return SafetensorsSource(files, f"the checkpoint {path}")
    if not path.exists():
        raise FileNotFoundError(f"rtp_compile: checkpoint {path} does not exist")
    if path.suffix == ".safetensors":
        return SafetensorsSource([path], f"the checkpoint {path}")
    try:
        sd = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception as err:
        raise ValueError(
            f"rtp_compile: could not open checkpoint {path} with torch.load(mmap="
            f"True, weights_only=True): {type(err).__name__}: {err}. Save it with "
            f"torch.save(model.state_dict(), path) or as .safetensors."
        ) from err
    if not isinstance(sd, Mapping) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(
            f"rtp_compile: checkpoint {path} does not hold a state_dict (a mapping "
            f"of names to tensors) but a {type(sd).__name__}"
        )
    return DictSource(sd, f"the checkpoint {path}")


def full_state_keys(
    source: FullStateSource,
    layouts: dict[str, ParamLayout],
    buffers: dict[str, tuple[int, ...]],
    what: str,
) -> dict[str, str]:
    """Check, before anything is read or written, that `source` has every parameter (under any
    of its tied names) and buffer with the model's shape; returns the key to read for each.
    KeyError names the missing ones, ValueError the mis-shaped ones."""
    keys = source.keys()
    found, missing, wrong = {}, [], []
    for name, layout in layouts.items():
        key = next((a for a in (layout.aliases or (name,)) if a in keys), None)
        if key is None:
            names = "/".join(layout.aliases) if len(layout.aliases) > 1 else name
            missing.append(f"parameter {names}")
            continue
        found[name] = key
        if source.shape(key) != tuple(layout.shape):
            wrong.append(
                f"parameter {name} has shape {source.shape(key)} in {source.description},"
                f" the model has {tuple(layout.shape)}"
            )
    for name, shape in buffers.items():
        if name not in keys:
            missing.append(f"buffer {name}")
            continue
        found[name] = name
        if source.shape(name) != tuple(shape):
            wrong.append(
                f"buffer {name} has shape {source.shape(name)} in {source.description}, "
                f"the model has {tuple(shape)}"
            )
    if missing:
        raise KeyError(
            f"rtp_compile: {what}: {source.description} is missing "
            f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}; nothing was "
            f"loaded"
        )
    if wrong:
        raise ValueError(
            f"rtp_compile: {what}: {'; '.join(wrong[:8])}"
            f"{' ...' if len(wrong) > 8 else ''}; nothing was loaded"
        )
    return found
