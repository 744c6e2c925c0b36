"""Real tensors for a model built on the meta device: one module, or one checkpoint tensor, at a time.

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

Checkpoint loading (`module(rank, device=d, checkpoint=path)`, `load_full_state_dict(gm, path)`):
a `torch.save`d state_dict (opened with `torch.load(mmap=True, weights_only=True)`), a
`.safetensors` file, or a directory of them (a sharded transformers checkpoint). Every key and
shape is checked before anything is read; then one parameter at a time only this rank's part is
read (safetensors: `get_slice`, so only those bytes; torch files: a view of the memory-mapped
tensor), padded into the shard and cast to the model's dtype. A tied parameter is read under the
first of its names the checkpoint has. Persistent buffers come from the checkpoint;
non-persistent ones (rotary `inv_freq`, ...) are recomputed by their module's initialisers as
above.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import math
import operator
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx as fx
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from rtp_compile.layout import ParamLayout


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
            found.append((f"{type(owner).__name__}._init_weights({kind})",
                          lambda fn=fn: fn(module)))
            break
    return found


def init_module(root: nn.Module, name: str, params: list[str], buffers: list[str],
                device, seed: int) -> dict[str, torch.Tensor]:
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
                    torch.zeros(p.shape, dtype=p.dtype, device=device), p.requires_grad)
            elif p.device.type != "meta":  # someone else's (a tied alias), or not to be touched
                module._parameters[leaf] = nn.Parameter(torch.empty_like(p, device="meta"),
                                                        p.requires_grad)
        for leaf, b in saved_b.items():
            if b is None:
                continue
            if leaf in buffers:
                fresh[leaf] = module._buffers[leaf] = torch.zeros(b.shape, dtype=b.dtype,
                                                                  device=device)
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
                        f"{tuple(before.shape)}")
                now = now.detach().to(device, before.dtype)
            elif before.numel() and before.untyped_storage().data_ptr() not in watch.written \
                    and before.untyped_storage().data_ptr() == storage[leaf]:  # `.data = ...`
                kind = "parameter" if leaf in params else "buffer"
                tried = ", ".join(d for d, _ in steps) or "none found"
                raise RuntimeError(
                    f"rtp_compile: {kind} {name + '.' if name else ''}{leaf} of "
                    f"{type(module).__name__} is a meta tensor (no value) and no initialiser of "
                    f"its module wrote it (tried: {tried}). Give {type(module).__name__} a "
                    f"reset_parameters() that fills it, or handle it in the model's "
                    f"_init_weights(module), or load the values from a checkpoint: "
                    f"prog.module(rank, device=..., checkpoint=path).")
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
    for kind, items in (("p", model.named_parameters(remove_duplicate=False)),
                        ("b", model.named_buffers(remove_duplicate=False))):
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


# -- checkpoints -----------------------------------------------------------------------------

class CheckpointSource:
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


class DictSource(CheckpointSource):
    """An in-memory (or memory-mapped, from torch.load(mmap=True)) state_dict."""

    def __init__(self, state_dict: Mapping, description: str = "the state_dict"):
        self.sd, self.description = state_dict, description

    def keys(self):
        return set(self.sd.keys())

    def shape(self, key):
        return tuple(self.sd[key].shape)

    def read(self, key):
        return self.sd[key].detach()


class SafetensorsSource(CheckpointSource):
    """One or more .safetensors files (a sharded checkpoint: every file of a directory); reads
    only the slices asked for."""

    def __init__(self, files: list[Path], description: str):
        try:
            from safetensors import safe_open
        except ImportError as err:
            raise ImportError("rtp_compile: reading a .safetensors checkpoint needs the "
                              "`safetensors` package (pip install safetensors)") from err
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
        rows = piece[first:max(last, first)]
        return rows.reshape(-1).narrow(0, slot.offset - first * row, slot.valid)

    def close(self):
        self.stack.close()


def open_checkpoint(checkpoint) -> CheckpointSource:
    """A state_dict mapping, a torch.save'd state_dict file, a .safetensors file, or a directory
    of .safetensors files, as a CheckpointSource."""
    if isinstance(checkpoint, Mapping):
        return DictSource(checkpoint)
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"rtp_compile: a checkpoint is a state_dict or a path (torch.save file, "
                        f".safetensors file or a directory of them), got "
                        f"{type(checkpoint).__name__}")
    path = Path(checkpoint)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"rtp_compile: checkpoint directory {path} has no "
                                    f".safetensors files")
        return SafetensorsSource(files, f"the checkpoint {path}")
    if not path.exists():
        raise FileNotFoundError(f"rtp_compile: checkpoint {path} does not exist")
    if path.suffix == ".safetensors":
        return SafetensorsSource([path], f"the checkpoint {path}")
    try:
        sd = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception as err:
        raise ValueError(f"rtp_compile: could not open checkpoint {path} with torch.load(mmap="
                         f"True, weights_only=True): {type(err).__name__}: {err}. Save it with "
                         f"torch.save(model.state_dict(), path) or as .safetensors.") from err
    if not isinstance(sd, Mapping) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"rtp_compile: checkpoint {path} does not hold a state_dict (a mapping "
                         f"of names to tensors) but a {type(sd).__name__}")
    return DictSource(sd, f"the checkpoint {path}")


def checkpoint_keys(source: CheckpointSource, layouts: dict[str, ParamLayout],
                    buffers: dict[str, tuple[int, ...]], what: str) -> dict[str, str]:
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
            wrong.append(f"parameter {name} has shape {source.shape(key)} in {source.description},"
                         f" the model has {tuple(layout.shape)}")
    for name, shape in buffers.items():
        if name not in keys:
            missing.append(f"buffer {name}")
            continue
        found[name] = name
        if source.shape(name) != tuple(shape):
            wrong.append(f"buffer {name} has shape {source.shape(name)} in {source.description}, "
                         f"the model has {tuple(shape)}")
    if missing:
        raise KeyError(f"rtp_compile: {what}: {source.description} is missing "
                       f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}; nothing was "
                       f"loaded")
    if wrong:
        raise ValueError(f"rtp_compile: {what}: {'; '.join(wrong[:8])}"
                         f"{' ...' if len(wrong) > 8 else ''}; nothing was loaded")
    return found


# -- one rank's tensors ----------------------------------------------------------------------

@dataclass
class RankTensors:
    """What `prog.module(rank)` installs: the rank's parameter shards, and the buffers and
    constants that had to be materialised (the rest are copied from the program as they are);
    `device`: where a program captured on the meta device now runs (see `retarget_meta`)."""
    shards: dict[str, torch.Tensor]
    attrs: dict[str, torch.Tensor] = field(default_factory=dict)
    device: torch.device | None = None


def _on_target(value, device: torch.device, is_device_arg: bool = False):
    if isinstance(value, torch.device) and value.type == "meta":
        return device
    if is_device_arg and value == "meta":
        return device
    return value


def retarget_meta(gm: fx.GraphModule, device: torch.device) -> None:
    """A graph captured from a meta model names the meta device where it creates or checks
    tensors (`arange(..., device=meta)`, export's `_assert_tensor_metadata`, `.to(meta)`): point
    those at `device`, in `gm` and in the graph modules it calls (replaced by retargeted copies,
    as the program shares them between ranks)."""
    def rewrite(graph: fx.Graph) -> bool:
        changed = False
        for node in graph.nodes:
            args = fx.node.map_aggregate(node.args, lambda a: _on_target(a, device))
            kwargs = {k: fx.node.map_aggregate(v, lambda a, k=k: _on_target(a, device,
                                                                            k == "device"))
                      for k, v in node.kwargs.items()}
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs, changed = args, kwargs, True
        return changed

    if rewrite(gm.graph):
        gm.recompile()
    for name, sub in list(gm.named_modules()):
        if sub is gm or not isinstance(sub, fx.GraphModule):
            continue
        graph = copy.deepcopy(sub.graph)
        if rewrite(graph):
            parent, _, leaf = name.rpartition(".")
            setattr(gm.get_submodule(parent), leaf, fx.GraphModule(sub, graph))


def _tensor_attrs(src: fx.GraphModule, params) -> dict[str, torch.Tensor]:
    """The program's non-parameter tensors: its buffers and the tensors get_attr nodes read."""
    out = {name: b for name, b in src.named_buffers()}
    for node in src.graph.nodes:
        if node.op == "get_attr" and node.target not in params and node.target not in out:
            value = operator.attrgetter(node.target)(src)
            if isinstance(value, torch.Tensor):
                out[node.target] = value
    return out


def _meta_leftovers(src: fx.GraphModule, bodies, params) -> list[str]:
    """Meta tensors a rank module would copy without any way to give them a value: inside
    called submodules and gathered-op bodies."""
    found = []
    for node in src.graph.nodes:
        if node.op == "call_module":
            sub = src.get_submodule(node.target)
            found += [f"{node.target}.{n}" for n, t in sub.state_dict(keep_vars=True).items()
                      if isinstance(t, torch.Tensor) and t.is_meta]
    for unit, body in bodies.items():
        params_of_body = {n for n, _ in body.named_parameters()}
        for name, t in _tensor_attrs(body, params_of_body).items():
            if t.is_meta:
                found.append(f"{name} (in the body of unit {unit})")
    return found


def rank_tensors(ctx, src: fx.GraphModule, rank: int, device, seed: int,
                 checkpoint) -> RankTensors:
    """This rank's parameter shards, and the buffers / constants that need a value (meta ones,
    or checkpointed ones), for `prog.module(rank, device=device, seed=seed,
    checkpoint=checkpoint)` of the program `src` compiled in `ctx`."""
    _check_seed(seed)
    plan, model = ctx.plan, ctx.model
    target = torch.device(device) if device is not None else None
    attrs_in = _tensor_attrs(src, plan.params)
    any_meta = any(p.is_meta for p in ctx.params.values()) or \
        any(t.is_meta for t in attrs_in.values())
    materialising = any_meta and target is not None and target.type != "meta"
    if checkpoint is not None and any_meta and not materialising:
        raise ValueError("rtp_compile: loading a checkpoint into a meta-device model needs a real "
                         "device: prog.module(rank, device='cuda' or 'cpu', checkpoint=path)")
    source = open_checkpoint(checkpoint) if checkpoint is not None else None
    try:
        persistent = set(ctx.state_keys)
        loaded = {n: tuple(t.shape) for n, t in attrs_in.items() if n in persistent} \
            if source is not None else {}
        keys = checkpoint_keys(source, plan.params, loaded, f"prog.module({rank}, checkpoint=...)") \
            if source is not None else {}
        wanted: dict[str, str] = {}  # canonical name of a meta tensor to initialise -> its name
        if materialising:
            _check_materialisable(ctx, src, attrs_in, keys)
            wanted.update({n: n for n, p in ctx.params.items()
                           if n not in keys and p.is_meta})
            wanted.update({_canonical_buffer(model, n): n for n, t in attrs_in.items()
                           if n not in keys and t.is_meta})
        shards: dict[str, torch.Tensor] = {}
        attrs: dict[str, torch.Tensor] = {}
        for mod, (params, buffers) in _owned(model).items() if wanted else ():
            prefix = f"{mod}." if mod else ""
            if not any(prefix + leaf in wanted for leaf in params + buffers):
                continue
            module = model.get_submodule(mod)
            # all of the module's meta tensors, as materialize_full makes them (one RNG stream),
            # but its parameters stay meta when a checkpoint gives them
            params = [p for p in params if module._parameters[p].is_meta and source is None]
            buffers = [b for b in buffers if module._buffers[b].is_meta]
            values = init_module(model, mod, params, buffers, target, seed)
            for leaf in params:
                if prefix + leaf in plan.params:
                    shards[prefix + leaf] = plan.params[prefix + leaf].shard(values[leaf], rank)
            for leaf in buffers:
                if prefix + leaf in wanted:
                    attrs[wanted[prefix + leaf]] = values[leaf]
            del values  # the module's full tensors go before the next module's are made
        for name, layout in plan.params.items():
            if name in shards:
                continue
            if name in keys:
                shard = source.read_shard(keys[name], layout, rank)
                shards[name] = shard.to(target or ctx.params[name].device, layout.dtype)
            else:
                shard = layout.shard(ctx.params[name].detach(), rank)
                shards[name] = shard.to(target) if target is not None else shard
        for name in loaded:
            value = attrs_in[name]
            attrs[name] = source.read(keys[name]).to(target or value.device, value.dtype)
        return RankTensors(shards, attrs, target if materialising else None)
    finally:
        if source is not None:
            source.close()


def _check_materialisable(ctx, src, attrs_in, keys) -> None:
    """Every meta tensor of the program can get a value: a parameter, a module's buffer, or in
    the checkpoint; constants and tensors inside called modules cannot."""
    model = ctx.model
    if model is None:
        raise ValueError("rtp_compile: this program does not know the model it was captured from, "
                         "so it cannot initialise its meta tensors; load a checkpoint instead")
    bad = [n for n, t in attrs_in.items() if t.is_meta and n not in keys and
           not _is_buffer_of(model, n)]
    bad += _meta_leftovers(src, ctx.bodies, ctx.plan.params)
    if bad:
        raise ValueError(
            f"rtp_compile: {', '.join(bad[:8])} {'is a meta tensor' if len(bad) == 1 else 'are meta tensors'} "
            f"of the program that no initialiser or checkpoint can give a value (neither a "
            f"parameter nor a module's buffer). Register it as a buffer of its module, filled by "
            f"the module's reset_parameters(), or build the model on a real device.")


def _is_buffer_of(model: nn.Module, name: str) -> bool:
    mod, _, leaf = name.rpartition(".")
    try:
        return leaf in model.get_submodule(mod)._buffers
    except AttributeError:
        return False


def _canonical_buffer(model: nn.Module, name: str) -> str:
    """The first name of the buffer called `name` (tied buffers are initialised by their first
    module)."""
    target = model.get_buffer(name)
    return next(n for n, b in model.named_buffers(remove_duplicate=False) if b is target)
