"""Which parameters of this process are sharded, and the shard each is trained as: the
process-global record the compile backend (`rtp_compile.backend`) and `rtp_compile.shard` keep.

Keyed by identity (`id`), weakly: an entry goes when its parameter is collected
(`weakref.finalize`), since dynamo's cache keeps compiled callables (and so nothing here) alive
until `torch._dynamo.reset()`. A *full* parameter (the user's, handed to a compiled graph) maps to
its shard; after the first call its storage is released (`resize_(0)`: same shape and strides,
so dynamo's guards hold) and it must never be read again. Reading one would crash the process,
so `repr`, `deepcopy` and pickling a released parameter, and `state_dict()` /
`load_state_dict()` of a module holding one, raise an error saying what to use instead; an
optimizer built on the full parameters steps their shards (`swap_released_for_shards`).
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from rtp_compile.core.layout import ParamLayout, real_part
from rtp_compile.runtime import groups


def gather_full(shard: torch.Tensor, layout: ParamLayout, group_name: str) -> torch.Tensor:
    """Collective over the ring of `group_name`: the full tensor of which `shard` is this
    rank's part as `layout` cuts it, padding removed."""
    shard = shard.detach().contiguous()
    if layout.world_size == 1:
        return layout.unshard([shard.clone()])
    shards = [torch.empty_like(shard) for _ in range(layout.world_size)]
    groups.all_gather(shards, shard, group_name)
    return layout.unshard(shards)


@dataclass
class Sharded:
    """A parameter laid out for the ring: this rank's `shard` (the Parameter an optimizer
    steps), its `layout`, the ring (`rank` in group `group_name`), and `compute_dtype`, the
    dtype the model reads its weight in (mixed precision's `param_dtype`; None: its own)."""

    layout: ParamLayout
    shard: nn.Parameter
    rank: int
    group_name: str
    compute_dtype: torch.dtype | None = None

    def keeps(self, layout: ParamLayout) -> bool:
        """Whether `layout` cuts the parameter as this one does (names may differ per graph)."""
        mine = self.layout
        return (mine.shape, mine.dtype, mine.world_size, mine.dim, mine.granule) == (
            layout.shape,
            layout.dtype,
            layout.world_size,
            layout.dim,
            layout.granule,
        )

    def gather(self) -> torch.Tensor:
        """Collective over the ring: the full tensor, padding removed."""
        return gather_full(self.shard, self.layout, self.group_name)

    def real_grad(self) -> torch.Tensor | None:
        """The gradient of the real (unpadded) part of this rank's shard, or None."""
        grad = self.shard.grad
        if grad is None:
            return None
        flat = self.layout.dim is None
        return real_part(
            grad.reshape(-1) if flat else grad, self.layout.dim or 0, self.layout.slot(self.rank)
        )


_of_full: dict[int, Sharded] = {}  # id(full parameter) -> its shard, while the full one lives
# id(shard parameter) -> its entry, while something else holds the entry (a full parameter's
# row above, or the module `rtp_compile.shard` made read it)
_of_shard: weakref.WeakValueDictionary[int, Sharded] = weakref.WeakValueDictionary()
_released: set[int] = set()  # ids of full parameters whose storage is gone


def _forget(key: int) -> None:
    _of_full.pop(key, None)
    _released.discard(key)


def register_full(full: torch.Tensor, entry: Sharded) -> None:
    """`full` (a user's parameter) is trained as `entry.shard` from now on."""
    _of_full[id(full)] = entry
    register_shard(entry)
    weakref.finalize(full, _forget, id(full))


def register_shard(entry: Sharded) -> None:
    """`entry.shard` is a shard (what `sharded(shard)` finds, while the entry is held)."""
    _of_shard.setdefault(id(entry.shard), entry)


def sharded(shard: torch.Tensor) -> Sharded | None:
    """The entry of a shard parameter, if `shard` is one."""
    return _of_shard.get(id(shard))


def entry_of(param: torch.Tensor) -> Sharded | None:
    """The entry of a parameter that is either a full one with a shard or a shard."""
    return _of_full.get(id(param)) or _of_shard.get(id(param))


def is_released(param: torch.Tensor) -> bool:
    return id(param) in _released


def release(full: torch.Tensor) -> None:
    """Free the storage of a full parameter whose shard now trains (its shape and strides
    stay, so the guards of compiled graphs still hold); make reading it a clear error."""
    if id(full) in _released:
        return
    _guard_parameters()
    for module, _ in _owners(full):
        _guard_module(module)
    full.grad = None
    full.untyped_storage().resize_(0)
    _released.add(id(full))


def released_error(what: str) -> RuntimeError:
    return RuntimeError(
        f"rtp_compile: {what} reads a full parameter that a model compiled with "
        f"backend='rtp' no longer holds: after its first call each rank keeps only its shards. "
        f"Use rtp_compile.full_state_dict(model) (collective) for the full tensors, "
        f"rtp_compile.load_full_state_dict(model, sd) to load them, or shard the model first "
        f"(rtp_compile.shard(model, world_size)) so it holds only shards and stays usable."
    )


def _owners(param: torch.Tensor) -> list[tuple[nn.Module, str]]:
    """(module, name) of every module holding `param` in its `_parameters` (found once, when
    it is released: the compiled graph knows the parameter, not the modules)."""
    found = []
    tables = [t for t in gc.get_referrers(param) if isinstance(t, dict)]
    for attrs in (a for t in tables for a in gc.get_referrers(t) if isinstance(a, dict)):
        table = attrs.get("_parameters")
        if not any(table is t for t in tables):
            continue
        for module in gc.get_referrers(attrs):  # the module whose __dict__ that is
            if isinstance(module, nn.Module) and module.__dict__ is attrs:
                found += [(module, name) for name, p in table.items() if p is param]
    return found


def _guard_module(module: nn.Module) -> None:
    """`state_dict()` and `load_state_dict()` of a module holding a released parameter raise
    (copying into or reading out of a storage of 0 bytes would crash the process)."""
    if getattr(module, "_rtp_guarded", False):
        return
    module._rtp_guarded = True

    def on_save(module, state_dict, prefix, local_metadata):
        if any(is_released(p) for p in module._parameters.values() if p is not None):
            raise released_error(f"state_dict() of {type(module).__name__} at '{prefix}'")

    def on_load(module, state_dict, prefix, *args):
        if any(is_released(p) for p in module._parameters.values() if p is not None):
            raise released_error(f"load_state_dict() of {type(module).__name__} at '{prefix}'")

    module._register_state_dict_hook(on_save)
    module._register_load_state_dict_pre_hook(on_load, with_module=True)


_parameter_guard_installed = False


def _guard_parameters() -> None:
    """`repr`, `deepcopy` and pickling of a released parameter raise instead of crashing (once
    per process, on nn.Parameter; other parameters are untouched)."""
    global _parameter_guard_installed
    if _parameter_guard_installed:
        return
    _parameter_guard_installed = True
    for method, what in (
        ("__repr__", "repr()"),
        ("__deepcopy__", "copy.deepcopy()"),
        ("__reduce_ex__", "pickling"),
    ):
        original = getattr(nn.Parameter, method)

        def guarded(self, *args, _original=original, _what=what):
            if id(self) in _released:
                raise released_error(f"{_what} of a parameter")
            return _original(self, *args)

        guarded.__name__, guarded.__doc__ = method, original.__doc__
        setattr(nn.Parameter, method, guarded)


def swap_released_for_shards(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Optimizer step pre-hook (global): each full parameter a compiled graph trains as a shard
    is replaced in `param_groups` by that shard, so an optimizer built before compiling steps
    the shards. An optimizer that already holds state for a full parameter (it stepped it
    before) is refused: that state has the full shape and no shard to go with. So is one whose
    parameters are partly sharded while another has a gradient of its own: that parameter
    ran outside every compiled graph (dynamo ran its frame eagerly), with a gradient of this
    rank's batch only."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(id(p) in _of_full for p in params):
        eager = [
            p
            for p in params
            if p.grad is not None and id(p) not in _of_full and id(p) not in _of_shard
        ]
        if eager:
            raise RuntimeError(
                f"rtp_compile: {len(eager)} parameter(s) of shape(s) "
                f"{[tuple(p.shape) for p in eager[:4]]} got a gradient outside the graphs "
                f"compiled with backend='rtp' (dynamo ran their code eagerly, e.g. a frame it "
                f"skipped after a graph break in a loop), so they hold this rank's gradient "
                f"alone. Shard the model first (rtp_compile.shard(model, world_size)): its "
                f"weights are then gathered wherever they run."
            )
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            entry = _of_full.get(id(p))
            if entry is None:
                continue
            if optimizer.state.get(p):
                raise RuntimeError(
                    f"rtp_compile: {type(optimizer).__name__} holds state for a full parameter of "
                    f"shape {tuple(p.shape)} that a compiled model now trains as a shard; build "
                    f"the optimizer before the first step on the model's parameters and do not "
                    f"step it before compiling (or use rtp_compile.shard first)"
                )
            params[i] = entry.shard


_hook_installed = False


def install_optimizer_hook() -> None:
    """Register `swap_released_for_shards` as a global optimizer step pre-hook, once."""
    global _hook_installed
    if not _hook_installed:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(swap_released_for_shards)
        _hook_installed = True
