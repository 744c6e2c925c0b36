"""What a rank module keeps of the program that emitted it: enough to gather, load, checkpoint
and clip its shards, and nothing of the user's model but its structure.

A user writes `gm = transform(model, N).module(rank); del model` and expects the full model to
be freed: that is what RTP exists for. So a rank module is tied (weakly) to a `ProgramState`,
not to its `RTPProgram` (which holds the captured graph and, through it, the model's full
tensors): the parameter layouts, the buffer names and a *skeleton* of the model (its modules
and state-dict hooks over empty meta tensors, `model_state.skeleton`), which is all the
model's own state_dict hooks need.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

from rtp_compile.core.layout import ParamLayout
from rtp_compile.runtime.job import job_of
from rtp_compile.state.full_state import full_state_keys
from rtp_compile.state.model_state import (
    open_model_full_state,
    skeleton,
    state_dict_sources,
    to_model_state_dict,
)
from rtp_compile.state.shard_registry import gather_full


class ProgramState:
    """The state a program's rank modules share: `layouts` (parameter name -> `ParamLayout`),
    `buffer_names` (persistent buffers, native names) and `model`, a meta skeleton of the
    model. Holds no tensor of the model and no graph."""

    def __init__(
        self,
        world_size: int,
        layouts: dict[str, ParamLayout],
        buffer_names: list[str],
        model: nn.Module | None,
    ):
        self.world_size, self.layouts, self.buffer_names = world_size, layouts, buffer_names
        self.model = None if model is None else skeleton(model)
        self._aliases = {a: n for n, lay in layouts.items() for a in lay.aliases or (n,)}

    def alias_of(self, key: str) -> str | None:
        """The parameter (as the plan and rank modules name it) that native state key `key`
        names, under any of its tied names; None for a buffer."""
        return self._aliases.get(key)

    @functools.cached_property
    def state_dict_sources(self) -> dict[str, str | None]:
        """`model_state.state_dict_sources` of the model: each of its state_dict keys with the
        native key it passes on, or None where its hooks compute it."""
        return state_dict_sources(self.model)

    def full_state_dict(self, gm: nn.Module) -> dict[str, torch.Tensor]:
        """Collective: the model's state_dict (its keys, through its own state-dict hooks; full
        shapes, padding removed)."""
        full = {}
        for name, layout in self.layouts.items():
            tensor = self.full_tensor(gm, name)
            for alias in layout.aliases:
                full[alias] = tensor
        for name in self.buffer_names:
            full[name] = self.full_tensor(gm, name)
        return to_model_state_dict(self.model, full, "full_state_dict")

    def full_tensor(self, gm: nn.Module, key: str) -> torch.Tensor:
        """Collective for a parameter: the full tensor of native key `key` (a parameter under
        any of its names, all ranks' shards gathered, padding removed; or a buffer, this rank's
        copy)."""
        name = self.alias_of(key)
        if name is None:
            return gm.get_buffer(key).detach().clone()
        return gather_full(gm.get_parameter(name), self.layouts[name], job_of(gm).group_name)

    def load_full_state_dict(self, gm: nn.Module, state_dict) -> None:
        """Take a full state_dict (a mapping, or a path: `RTPProgram.load_full_state_dict`) into
        the shards of `gm`; every key and shape checked before anything is written."""
        rank = job_of(gm).rank
        source = open_model_full_state(state_dict, self.model, "load_full_state_dict")
        try:
            buffers = {n: tuple(gm.get_buffer(n).shape) for n in self.buffer_names}
            keys = full_state_keys(source, self.layouts, buffers, "load_full_state_dict")
            with torch.no_grad():
                for name, layout in self.layouts.items():
                    param = gm.get_parameter(name)
                    param.copy_(
                        source.read_shard(keys[name], layout, rank).to(param.device, param.dtype)
                    )
                for name in self.buffer_names:
                    gm.get_buffer(name).copy_(source.read(keys[name]))
        finally:
            source.close()


_states: weakref.WeakKeyDictionary[nn.Module, ProgramState] = weakref.WeakKeyDictionary()


def bind_state(gm: nn.Module, state: ProgramState) -> None:
    """Tie rank module `gm` to the state of the program that emitted it (weakly: the state
    lives as long as one of its modules)."""
    _states[gm] = state


def state_of(gm: nn.Module) -> ProgramState:
    """The `ProgramState` of rank module `gm` (`RTPProgram.module`)."""
    try:
        return _states[gm]
    except (KeyError, TypeError):
        raise ValueError(
            f"rtp_compile: expected a rank module made by prog.module(rank), got a "
            f"{type(gm).__name__}"
        ) from None
