"""The model's own state_dict, through its own hooks.

Inside rtp_compile a model's tensors go by their *native* names: where its modules keep them
(every name of a tied parameter, persistent buffers). Its `state_dict()` may speak other keys:
modules can rename, split or merge entries with state-dict hooks (a packed `wqkv` saved as
`wq`/`wk`/`wv`) and take them back with load pre-hooks. Full state dicts and checkpoints speak
the model's keys, so they go through those hooks, run by torch itself on a *skeleton*: a copy of
the model whose tensors are empty meta tensors, into which the full tensors are put (no copy).
Models without such hooks skip the skeleton: their keys are their native names.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import nn

from rtp_compile.core.state_keys import native_state_keys
from rtp_compile.state.full_state import DictSource, FullStateSource, open_full_state

_HOOK_TABLES = (
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def has_state_dict_hooks(model: nn.Module) -> bool:
    """Whether any module changes what state_dict gives or load_state_dict takes by a hook."""
    return any(getattr(m, table, None) for m in model.modules() for table in _HOOK_TABLES)


def skeleton(model: nn.Module, full_shape=None) -> nn.Module:
    """A copy of `model` whose parameters and buffers are meta tensors (no data is copied), of
    `full_shape(tensor)` where given (a model holding shards: the shapes its state_dict has
    in full)."""
    memo = {}
    for _, t in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        shape = t.shape if full_shape is None else full_shape(t)
        empty = torch.empty(shape, dtype=t.dtype, device="meta")
        memo[id(t)] = nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
    return copy.deepcopy(model, memo)


def to_model_state_dict(
    model: nn.Module, native: Mapping[str, torch.Tensor], what: str, full_shape=None
) -> dict[str, torch.Tensor]:
    """`native` (every native key of `model`, full tensors) as `model.state_dict()` gives it
    (`full_shape`: as `skeleton` takes it)."""
    keys = native_state_keys(model)
    if not has_state_dict_hooks(model):
        return {k: native[k] for k in keys}
    shell = _skeleton_holding(model, {k: native[k] for k in keys}, full_shape)
    try:
        return dict(shell.state_dict())
    except Exception as err:
        raise RuntimeError(
            f"rtp_compile: {what}: the model's state_dict hooks failed on the full "
            f"tensors ({type(err).__name__}: {err}); they must work on tensors "
            f"passed in the state_dict, as torch.save(model.state_dict()) needs"
        ) from err


def to_native(
    model: nn.Module, state_dict: Mapping[str, torch.Tensor], what: str, full_shape=None
) -> dict[str, torch.Tensor]:
    """A state_dict in `model`'s keys as native names, through the model's own load_state_dict
    (its load pre-hooks, strict key and shape checks) on a skeleton (`full_shape`: as
    `skeleton` takes it): nothing of the model or of any shard is touched. KeyError /
    ValueError say what does not map; nothing is loaded then."""
    shell = skeleton(model, full_shape)
    try:
        shell.load_state_dict(dict(state_dict), strict=True, assign=True)
    except RuntimeError as err:
        message = str(err).replace("\n\t", " ").strip()
        kind = ValueError if "size mismatch" in message else KeyError
        raise kind(
            f"rtp_compile: {what}: the model's own load_state_dict (with its load hooks) "
            f"does not take this state_dict: {message}; nothing was loaded"
        ) from err
    tensors = dict(shell.named_parameters(remove_duplicate=False))
    tensors.update(shell.named_buffers(remove_duplicate=False))
    return {k: tensors[k].detach() for k in native_state_keys(model)}


def open_model_full_state(checkpoint, model: nn.Module, what: str) -> FullStateSource:
    """`full_state.open_full_state`, speaking native names: a model with state-dict hooks
    has its checkpoint read whole and translated by `to_native` (the hooks need whole tensors)."""
    source = open_full_state(checkpoint)
    if model is None or not has_state_dict_hooks(model):
        return source
    try:
        tensors = (
            source.sd
            if isinstance(source, DictSource)
            else {key: source.read(key) for key in source.keys()}
        )
        return DictSource(to_native(model, tensors, what), source.description)
    finally:
        source.close()


def state_dict_sources(model: nn.Module) -> dict[str, str | None]:
    """Every key of `model.state_dict()`, in its order, with the native key whose tensor it
    passes on unchanged (its own name, or another where a hook renames it), or None where the
    model's state-dict hooks compute it (a packed `wqkv` saved as `wq`/`wk`/`wv`): found by
    running `state_dict(keep_vars=True)` on a skeleton and following each tensor's identity."""
    keys = native_state_keys(model)
    if not has_state_dict_hooks(model):
        return {k: k for k in keys}
    shell = skeleton(model)
    native = {}
    for key in keys:
        table, leaf = _table_of(shell, key)
        native.setdefault(id(table[leaf]), key)
    return {k: native.get(id(v)) for k, v in shell.state_dict(keep_vars=True).items()}


def hooked_native_keys(model: nn.Module) -> list[str]:
    """The native keys held by modules with state-dict hooks, or by their descendants: what a
    hook that computes keys may read."""
    roots = [
        name
        for name, m in model.named_modules()
        if any(getattr(m, table, None) for table in _HOOK_TABLES)
    ]
    return [
        k
        for k in native_state_keys(model)
        if any(not root or k.startswith(root + ".") for root in roots)
    ]


def computed_state(
    model: nn.Module,
    native: Mapping[str, torch.Tensor],
    sources: Mapping[str, str | None],
    what: str,
) -> dict[str, torch.Tensor]:
    """The keys of `model.state_dict()` its hooks compute (None in `sources`, what
    `state_dict_sources` gives), from the full tensors of `native` (at least
    `hooked_native_keys`); the other tensors stay meta."""
    wanted = [k for k, source in sources.items() if source is None]
    state = _skeleton_holding(model, native).state_dict()
    out = {k: state[k] for k in wanted}
    stray = [k for k, v in out.items() if v.is_meta]
    if stray:
        raise RuntimeError(
            f"rtp_compile: {what}: the model's state-dict hooks compute "
            f"{', '.join(stray)} from tensors outside the module that has the hook"
        )
    return out


def _table_of(module: nn.Module, key: str) -> tuple[dict, str]:
    """The table (`_parameters` or `_buffers`) of the submodule that keeps native key `key`,
    and its name there."""
    module_name, _, leaf = key.rpartition(".")
    owner = module.get_submodule(module_name)
    return (owner._parameters if leaf in owner._parameters else owner._buffers), leaf


def _skeleton_holding(
    model: nn.Module, native: Mapping[str, torch.Tensor], full_shape=None
) -> nn.Module:
    """A skeleton of `model` whose tensors under the native keys of `native` are those (no
    copy; state_dict reads these tables, and plain tensors are fine there); the rest meta."""
    shell = skeleton(model, full_shape)
    for key, tensor in native.items():
        table, leaf = _table_of(shell, key)
        table[leaf] = tensor
    return shell
