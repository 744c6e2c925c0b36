"""What the unsharded model does on one batch, measured, not guessed: the model runs once on
fake tensors (no memory, no compute) with the batch's shapes, and every tensor autograd saves
is counted once, in the order it is saved, next to the moments each parameter is last used
(`cost.model` walks that order for the peak).
"""

from __future__ import annotations

import copy
import operator
import weakref
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from rtp_compile.capture.repeats import CAPTURED, Copies
from rtp_compile.core.retarget_meta import retarget_meta


# -- what the unsharded model does on one batch, on fake tensors --------------------------
@dataclass(frozen=True, slots=True)
class OpWork:
    """What one aten op of the forward does: floating-point operations (torch's flop counter:
    matmuls, convolutions, attention; 0 for the rest), bytes it reads and writes (0 for a view),
    the element size it computes in, and the parameters it reads."""

    flops: float
    bytes: float
    itemsize: int
    reads: tuple[str, ...]


@dataclass
class Profile:
    """The order in which a forward saves activations and uses parameters, and its ops' work."""

    saved: list[int]  # bytes first saved, in order
    uses: dict[str, list[int]]  # parameter -> the points (len(saved) then) it is read at
    output_bytes: int
    ops: list[OpWork] = field(default_factory=list)  # the forward's aten ops, in order

    @property
    def last_use(self) -> dict[str, int]:
        """Where backward produces each parameter's gradient (its last use in forward)."""
        return {name: points[-1] for name, points in self.uses.items()}

    @property
    def activation_bytes(self) -> int:
        return sum(self.saved)


class _ParamUse(TorchDispatchMode):
    """Records, in op order, which parameters each op reads (by storage): ("use", name) events,
    then the op's ("op", (flops, bytes, itemsize)) (its reads: the uses since the last op)."""

    def __init__(self, storages: dict[int, str], events: list):
        super().__init__()
        self.storages, self.events = storages, events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [
            t
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        ]
        for t in tensors:
            name = self.storages.get(t.untyped_storage()._cdata)
            if name is not None:
                self.events.append(("use", name))
        out = func(*args, **(kwargs or {}))
        if func.namespace != "prim":  # metadata queries, no kernel
            self.events.append(("op", _work(func, args, kwargs or {}, out, tensors)))
        return out


def _flops_of(func):
    """torch's flop formula for an op (the CPU flash attention as the fused one), or None."""
    packet = func.overloadpacket
    if packet is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        packet = torch.ops.aten._scaled_dot_product_flash_attention
    return flop_registry.get(packet)


def _work(func, args, kwargs, out, tensors) -> tuple[float, float, int]:
    """(flops, bytes read and written, element size) of one op; a view (every output aliases
    an input) moves no bytes."""
    formula = _flops_of(func)
    flops = float(formula(*args, **kwargs, out_val=out)) if formula else 0.0
    outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    inputs = {t.untyped_storage()._cdata for t in tensors}
    view = all(t.untyped_storage()._cdata in inputs for t in outs)
    moved = 0.0 if view else float(sum(t.nbytes for t in tensors + outs))
    floating = [t for t in tensors if t.is_floating_point()] or outs or tensors
    return flops, moved, floating[0].element_size() if floating else 4


def profile_forward(
    module: torch.nn.Module,
    params: dict[str, torch.Tensor],
    inputs: dict,
    loss_keeps_output: bool = True,
    compute=lambda dtype: dtype,
) -> Profile:
    """Run `module(**inputs)` on fake tensors (the inputs are (shape, dtype) specs) with
    `params` (canonical name -> tensor, meta or real; never read), each in the dtype
    `compute(its dtype)` (mixed precision: what the graph was captured computing in), and
    record what it saves.

    `loss_keeps_output`: count one more tensor the size of the output, as a cross-entropy loss
    saves its log-softmax."""
    events, out_bytes = _events(module, params, inputs, compute)
    return _profile(events, out_bytes, loss_keeps_output)


def profile_copies(
    copies: Copies,
    params: dict[str, torch.Tensor],
    inputs: dict,
    loss_keeps_output: bool = True,
    compute=lambda dtype: dtype,
) -> Profile:
    """`profile_forward` of the graph `copies` describes, run on its prefix only: the copied
    block's events (what it saves, which parameters it reads) are repeated for every copy,
    its own parameters renamed to the copy's. Exact: a copy runs the copied block's ops on
    the same shapes, reading its predecessor as the block reads its own, so it saves tensors
    of the same sizes, and only new ones where the block does (an outside tensor a copy
    saves was saved by the block before it already)."""
    start, end = copies.boundaries()
    module = fx.GraphModule(copies.prefix, copy.deepcopy(copies.prefix.graph))
    nodes = dict(zip(copies.prefix.graph.nodes, module.graph.nodes))
    for node in (nodes[start], nodes[end]):
        with module.graph.inserting_before(node):
            module.graph.call_function(_boundary)
    module.recompile()
    events, out_bytes = _events(module, params, inputs, compute)
    first, last = (i for i, event in enumerate(events) if event is _BOUNDARY)
    block, copied = events[first + 1 : last], f"{copies.path}.{CAPTURED - 1}."
    spliced = events[:first] + block
    for index in range(CAPTURED, copies.count):
        spliced += _renamed(block, copied, f"{copies.path}.{index}.", params)
    return _profile(spliced + events[last + 1 :], out_bytes, loss_keeps_output)


_BOUNDARY = ("boundary", None)
_recording: list[list] = []  # the events of the profile running now


def _boundary() -> None:
    """Marks, in the events of the profile running now, where a block of copies starts or ends."""
    _recording[-1].append(_BOUNDARY)


def _renamed(events: list, old: str, new: str, params: dict) -> list:
    """`events` with every parameter of the block at `old` read as the one of the block at
    `new` (the same path inside it); outside parameters unchanged."""
    out = []
    for kind, value in events:
        if kind == "use" and value.startswith(old):
            value = new + value[len(old) :]
            assert value in params, f"a copied block reads {value}, which the model lacks"
        out.append((kind, value))
    return out


def _events(module, params, inputs, compute) -> tuple[list, int]:
    """What running `module` on fake tensors saves and reads, in order (`profile_forward`):
    ("save", bytes) for each storage first saved, ("use", name) for each parameter read, and
    the output's bytes."""
    if any(p.device.type == "meta" for p in params.values()):
        module = _meta_to_cpu(module)  # so kernels are chosen as on a real device
    events: list = []
    seen: set[int] = set()
    aliases = list(_aliases(module, params))
    held = {name for name, _ in aliases}  # the parameters this module holds
    with FakeTensorMode(allow_non_fake_inputs=True):
        device = "cpu"
        fake = {
            name: torch.empty(
                p.shape, dtype=compute(p.dtype), device=device, requires_grad=p.requires_grad
            )
            for name, p in params.items()
            if name in held
        }
        state = {alias: fake[name] for name, alias in aliases}
        for node in module.graph.nodes:  # buffers and constants, fake and on cpu too
            value = _attr(module, node.target) if node.op == "get_attr" else None
            if isinstance(value, torch.Tensor) and node.target not in state:
                state[node.target] = torch.zeros(value.shape, dtype=value.dtype, device=device)
        storages = {t.untyped_storage()._cdata: name for name, t in fake.items()}
        seen.update(storages)
        args = {
            k: torch.zeros(shape, dtype=dtype, device=device)
            for k, (shape, dtype) in inputs.items()
        }

        def pack(t):
            key = t.untyped_storage()._cdata
            if key not in seen:
                seen.add(key)
                events.append(("save", t.untyped_storage().nbytes()))
            return t

        _recording.append(events)
        try:
            with (
                _ParamUse(storages, events),
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            ):
                out = torch.func.functional_call(module, state, (), args, strict=False)
        finally:
            _recording.pop()
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return events, sum(t.numel() * t.element_size() for t in leaves)


def _profile(events: list, out_bytes: int, loss_keeps_output: bool) -> Profile:
    """The profile of a forward's events (`_events`)."""
    if loss_keeps_output:
        events = [*events, ("save", out_bytes)]
    saved: list[int] = []
    uses: dict[str, list[int]] = {}
    ops: list[OpWork] = []
    reads: list[str] = []
    for kind, value in events:
        if kind == "save":
            saved.append(value)
        elif kind == "op":
            ops.append(OpWork(*value, tuple(dict.fromkeys(reads))))
            reads = []
        else:
            reads.append(value)
            if len(saved) not in uses.setdefault(value, []):
                uses[value].append(len(saved))
    return Profile(saved, uses, out_bytes, ops)


def _meta_to_cpu(module):
    """A copy of a graph captured on the meta device that runs on (fake) cpu tensors (on meta,
    attention would take its unfused path and seem to save its whole score matrix)."""
    on_cpu = fx.GraphModule(module, copy.deepcopy(module.graph))
    retarget_meta(on_cpu, torch.device("cpu"))
    return on_cpu


def _attr(module, target: str):
    try:
        return operator.attrgetter(target)(module)
    except AttributeError:
        return None


def _aliases(module, params):
    """(canonical name, attribute path) for every path under which `module` holds a parameter."""
    by_id = {id(p): name for name, p in params.items()}
    for path, p in module.named_parameters(remove_duplicate=False):
        if id(p) in by_id:
            yield by_id[id(p)], path


# reference -> {batch: Profile}
_profiles: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def profile_of(
    ctx, batch_size: int, seq_len: int | None = None, example_kwargs: dict | None = None
) -> Profile:
    """The profile of the captured model (`ctx.reference`) on such a batch, made once per batch
    shape for all world sizes' programs of one capture."""
    specs = (
        input_specs(ctx.reference, batch_size, seq_len)
        if example_kwargs is None
        else {k: (tuple(v.shape), v.dtype) for k, v in example_kwargs.items()}
    )
    key = tuple(sorted((k, shape, str(dtype)) for k, (shape, dtype) in specs.items()))
    profiles = _profiles.setdefault(ctx.reference, {})
    if key not in profiles:
        if ctx.copies is None:
            profiles[key] = profile_forward(
                ctx.reference, ctx.params, specs, compute=ctx.precision.compute
            )
        else:
            profiles[key] = profile_copies(
                ctx.copies, ctx.params, specs, compute=ctx.precision.compute
            )
    return profiles[key]


# -- the batch a cost is for ------------------------------------------------------------------
def input_specs(reference, batch_size: int, seq_len: int | None) -> dict[str, tuple]:
    """(shape, dtype) of every input of the captured graph for a batch of `batch_size`
    sequences of `seq_len`: dim 0 is the batch; dim 1 of an integer input (token ids, masks)
    is the sequence; other sizes as captured. Inputs of an fx-traced graph carry no shapes:
    an input that indexes an embedding is taken as token ids [batch, seq_len]."""
    specs = {}
    for node in reference.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            shape = [_hint(s) for s in val.shape]
            if shape:
                shape[0] = batch_size
            if len(shape) > 1 and not val.dtype.is_floating_point and seq_len is not None:
                shape[1] = seq_len
            specs[node.name] = (tuple(shape), val.dtype)
        elif _indexes_embedding(node, reference) and seq_len is not None:
            specs[node.name] = ((batch_size, seq_len), torch.long)
        else:
            raise ValueError(
                f"rtp_compile.cost: cannot tell the shape of the model input {node.name!r} "
                "(seq_len not given, or the input does not index an embedding); pass "
                "example_kwargs={name: tensor} with one batch instead."
            )
    return specs


def _hint(size) -> int:
    return size.node.hint if isinstance(size, torch.SymInt) else int(size)


def _indexes_embedding(node, reference) -> bool:
    for user in node.users:
        if user.op == "call_module" and isinstance(
            reference.get_submodule(user.target), torch.nn.Embedding
        ):
            return user.args[0] is node
        if user.target in (F.embedding, torch.ops.aten.embedding.default):
            return user.args[1 if user.target is torch.ops.aten.embedding.default else 0] is node
    return False
