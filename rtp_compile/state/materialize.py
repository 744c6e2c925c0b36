"""Real tensors for a model built on the meta device: one module, or one checkpoint tensor, at a
time.

`transform` captures and plans a model built under `torch.device("meta")` without allocating
anything. `RTPProgram.module(rank, device=...)` then materialises only that rank's shards, in one
of two ways; `materialize_full(model, seed)` gives the unsharded twin the first way computes.

Initialisation (`module(rank, device=d, seed=s)`, `materialize_full(model, s, d)`), exactly:

* Modules are visited in `model.named_modules()` order. A module is materialised on its own: only
  its direct parameters and buffers (`recurse=False`) that it owns and that are meta tensors. A
  tied tensor is owned by the module of its first name (its name in `state_dict` order), and is
  initialised only there.
* Its owned tensors are allocated zero-filled on `d` (dtype and `requires_grad` of the meta
  tensor); every other direct tensor of the module stays a meta tensor, so the initialisers see
  every shape but their writes to tensors the module does not own go nowhere.
* Under `torch.no_grad()`, with the RNG of `d`'s device type seeded with
  `init_seed(s, module_name)` (sha256 of `"{s}:{module_name}"`, 63 bits; the global RNG state is
  restored afterwards), the module's initialisers run, in this order:
  1. its own `reset_parameters()` (`_reset_parameters()` for `nn.MultiheadAttention`), if any:
     what the module's constructor ran when the model was built eagerly;
  2. `owner._init_weights(module)` of the nearest module (itself or an ancestor) that defines an
     `_init_weights` taking a module: a transformers model's (the nearest `PreTrainedModel`, the
     one transformers' `initialize_weights` dispatches to; this includes recomputing rotary
     `inv_freq` buffers) or a custom model's (nanoGPT style, e.g. `TinyGPT._init_weights`).
* Every owned tensor must have been written by one of them (checked by watching the ops'
  in-place writes, `.data` writes included, or the attribute being replaced); one that was not
  has no value and is an error naming it. Writes an initialiser makes to other modules' tensors
  (e.g. `nn.MultiheadAttention._reset_parameters` zeroing `out_proj.bias`) are not applied: each
  tensor gets what its own module's initialisers give it.
* A rank then keeps `layout.shard(full, rank)` of each parameter and frees the module's full
  tensors before the next module: a rank's transient peak is one module's own parameters, never
  the model. Buffers are kept whole, as every rank holds them.

The values are therefore a function of (seed, module name, module code, device type) only: the
same for every rank and every world size, and equal to `materialize_full(model, seed, d)`. They
follow the same distributions as eager initialisation but are not the same numbers: eager init
draws every module from one RNG stream in construction order (and transformers then
re-initialises), here each module draws from its own seeded stream. CPU and CUDA RNGs differ, so
materialise the reference on the same device type.

Checkpoint loading, the other way: `rtp_compile.state.full_state`; what a rank installs:
`rtp_compile.state.rank_tensors`.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


def init_seed(seed: int, module_name: str) -> int:
    """The seed module `module_name` is initialised with: 63 bits of sha256("{seed}:{name}")."""
    digest = hashlib.sha256(f"{seed}:{module_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@contextlib.contextmanager
def _seeded(device: torch.device, seed: int):
    """The RNG of `device`'s type seeded with `seed`; the previous state restored afterwards."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        with torch.random.fork_rng(devices=[index], device_type="cuda"), torch.cuda.device(index):
            torch.default_generator.manual_seed(seed)
            torch.cuda.manual_seed(seed)
            yield
    else:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            yield


class _WriteWatch(TorchDispatchMode):
    """Records the storages every op writes (in-place, out=, copy_), `.data` writes included."""

    def __init__(self):
        super().__init__()
        self.written: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            info = arg.alias_info
            if info is None or not info.is_write:
                continue
            value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
            for t in torch.utils._pytree.tree_leaves(value):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    self.written.add(t.untyped_storage().data_ptr())
        return func(*args, **kwargs)


def _takes_module(fn) -> bool:
    try:
        inspect.signature(fn).bind(nn.Module())
        return True
    except (TypeError, ValueError):
        return False


def initialisers(root: nn.Module, name: str) -> list[tuple[str, object]]:
    """What initialises module `name` of `root`, in order, each as (description, call)."""
    module = root.get_submodule(name)
    kind = type(module).__name__
    found = []
    for attr in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, attr, None)
        if callable(fn):
            found.append((f"{kind}.{attr}()", fn))
            break
    parts = name.split(".") if name else []
    for depth in range(len(parts), -1, -1):  # the module itself, then its ancestors
        owner = root.get_submodule(".".join(parts[:depth]))
        fn = getattr(owner, "_init_weights", None)
        if callable(fn) and _takes_module(fn):
            found.append(
                (f"{type(owner).__name__}._init_weights({kind})", lambda fn=fn: fn(module))
            )
            break
    return found


def init_module(
    root: nn.Module, name: str, params: list[str], buffers: list[str], device, seed: int
) -> dict[str, torch.Tensor]:
    """Materialise the direct parameters `params` and buffers `buffers` of module `name` of `root`
    on `device` by its initialisers (see the module docstring); returns them by leaf name.

    The module is left as it was (its tensors are swapped in only while the initialisers run)."""
    device = torch.device(device)
    module = root.get_submodule(name)
    where = name or type(root).__name__
    saved_p, saved_b = dict(module._parameters), dict(module._buffers)
    fresh: dict[str, torch.Tensor] = {}
    try:
        for leaf, p in saved_p.items():
            if p is None:
                continue
            if leaf in params:
                fresh[leaf] = module._parameters[leaf] = nn.Parameter(
                    torch.zeros(p.shape, dtype=p.dtype, device=device), p.requires_grad
                )
            elif p.device.type != "meta":  # someone else's (a tied alias), or not to be touched
                module._parameters[leaf] = nn.Parameter(
                    torch.empty_like(p, device="meta"), p.requires_grad
                )
        for leaf, b in saved_b.items():
            if b is None:
                continue
            if leaf in buffers:
                fresh[leaf] = module._buffers[leaf] = torch.zeros(
                    b.shape, dtype=b.dtype, device=device
                )
            elif b.device.type != "meta":
                module._buffers[leaf] = torch.empty_like(b, device="meta")
        steps = initialisers(root, name)
        storage = {leaf: t.untyped_storage().data_ptr() for leaf, t in fresh.items()}
        watch = _WriteWatch()
        with torch.no_grad(), _seeded(device, init_seed(seed, name)), watch:
            for _, step in steps:
                step()
        out = {}
        for leaf, before in fresh.items():
            table = module._parameters if leaf in params else module._buffers
            now = table.get(leaf)
            if now is None or now is not before:  # the initialiser replaced the attribute
                if now is None or tuple(now.shape) != tuple(before.shape):
                    raise RuntimeError(
                        f"rtp_compile: the initialisers of {where} replaced {leaf} with "
                        f"{'None' if now is None else tuple(now.shape)}, expected shape "
                        f"{tuple(before.shape)}"
                    )
                now = now.detach().to(device, before.dtype)
            elif (
                before.numel()
                and before.untyped_storage().data_ptr() not in watch.written
                and before.untyped_storage().data_ptr() == storage[leaf]
            ):  # `.data = ...`
                kind = "parameter" if leaf in params else "buffer"
                tried = ", ".join(d for d, _ in steps) or "none found"
                raise RuntimeError(
                    f"rtp_compile: {kind} {name + '.' if name else ''}{leaf} of "
                    f"{type(module).__name__} is a meta tensor (no value) and no initialiser of "
                    f"its module wrote it (tried: {tried}). Give {type(module).__name__} a "
                    f"reset_parameters() that fills it, or handle it in the model's "
                    f"_init_weights(module), or load the values from a checkpoint: "
                    f"prog.module(rank, device=..., checkpoint=path)."
                )
            out[leaf] = now.detach()
        return out
    finally:
        module._parameters.clear()
        module._parameters.update(saved_p)
        module._buffers.clear()
        module._buffers.update(saved_b)


def _owned(model: nn.Module) -> dict[str, tuple[list[str], list[str]]]:
    """Module name -> (parameter leaves, buffer leaves) it owns: a tensor under several names
    belongs to the module of its first name. Modules in `named_modules()` order."""
    owner: dict[int, tuple[str, str]] = {}
    for kind, items in (
        ("p", model.named_parameters(remove_duplicate=False)),
        ("b", model.named_buffers(remove_duplicate=False)),
    ):
        for full, t in items:
            mod, _, leaf = full.rpartition(".")
            owner.setdefault((kind, id(t)), (mod, leaf))
    out: dict[str, tuple[list[str], list[str]]] = {n: ([], []) for n, _ in model.named_modules()}
    for (kind, _), (mod, leaf) in owner.items():
        out.setdefault(mod, ([], []))[0 if kind == "p" else 1].append(leaf)
    return {n: v for n, v in out.items() if v[0] or v[1]}


def materialize_full(model: nn.Module, seed: int = 0, device="cpu") -> nn.Module:
    """The unsharded model, materialised on `device` by the procedure every rank's
    `prog.module(rank, device, seed=seed)` follows (see the module docstring): a copy of `model`
    whose meta parameters and buffers are real, tied parameters still tied. `model` is unchanged.
    Tensors that are not yet meta keep their values; plain tensor attributes (neither parameter
    nor buffer) are not touched.

    `full_state_dict` of any world size's program equals this model's `state_dict()`."""
    _check_seed(seed)
    device = torch.device(device)
    twin = copy.deepcopy(model)
    new: dict[int, torch.Tensor] = {}
    for name, (params, buffers) in _owned(twin).items():
        module = twin.get_submodule(name)
        params = [p for p in params if module._parameters[p].is_meta]
        buffers = [b for b in buffers if module._buffers[b].is_meta]
        if not params and not buffers:
            continue
        values = init_module(twin, name, params, buffers, device, seed)
        for leaf in params:
            old = module._parameters[leaf]
            new[id(old)] = nn.Parameter(values[leaf], old.requires_grad)
        for leaf in buffers:
            new[id(module._buffers[leaf])] = values[leaf]
    for module in twin.modules():  # every name of a tied tensor gets the one new tensor
        for table in (module._parameters, module._buffers):
            for leaf, t in table.items():
                if t is not None and id(t) in new:
                    table[leaf] = new[id(t)]
    return twin


def _check_seed(seed) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"rtp_compile: seed must be an int, got {seed!r}")
