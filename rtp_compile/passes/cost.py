"""Per-rank memory and traffic of one training step, as sympy expressions in N (ranks) and A
(the activations the model keeps for one batch): RTP from its plan, DDP and FSDP2 from the
same model, so they can be compared before anything runs.

Model state is exact: a parameter cut into N padded shards holds ceiling(extent/N) slices, its
gradient the same, AdamW two more (its `step` counters are scalars). Activations are measured,
not guessed: the model runs once on fake tensors (no memory, no compute) with the batch's
shapes, and every tensor autograd saves is counted once, in the order it is saved, next to the
moments each parameter is last used. The peak walks that order: forward end (all activations),
backward (activations of the ops not yet differentiated + gradients already produced), the
optimizer step (gradients + its temporaries), each with the transient buffers of that phase.

Invariant: `param_bytes`, `grad_bytes`, `optimizer_bytes` and `traffic_bytes` equal what the
emitted programs allocate and send (tests measure them); the peak is a model (tests hold it
within 10% of MemTracker's).
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import sympy
import torch
from torch.utils._python_dispatch import TorchDispatchMode

N, A = sympy.symbols("N A", positive=True, integer=True)
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1, "adagrad": 1}
_POWERS_OF_TWO = [2 ** k for k in range(11)]


@dataclass
class Cost:
    """Per-rank bytes of one training step (`expressions`: the same as sympy in N and A)."""
    kind: str
    world_size: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    transient_bytes: int
    activation_bytes: int
    peak_bytes: int
    traffic_bytes: int
    expressions: dict[str, sympy.Expr] = field(default_factory=dict, repr=False)

    FIELDS = ("param_bytes", "grad_bytes", "optimizer_bytes", "transient_bytes",
              "activation_bytes", "peak_bytes", "traffic_bytes")

    def at(self, world_size: int) -> "Cost":
        """These expressions evaluated for another number of ranks: the same plan with
        shards of that size (`prog.for_world_size(n).cost(...)` plans for n itself)."""
        return _evaluate(self.kind, world_size, self.expressions, self.activation_bytes)

    def __str__(self) -> str:
        rows = [(f.removesuffix("_bytes"), f"{getattr(self, f) / 2 ** 20:,.2f}",
                 str(self.expressions.get(f, ""))) for f in self.FIELDS]
        width = [max(len(r[i]) for r in rows) for i in range(2)]
        head = f"{self.kind} cost per rank, N={self.world_size} (MiB; A = activation bytes)"
        return "\n".join([head] + [f"  {a.ljust(width[0])}  {b.rjust(width[1])}   {c}"
                                   for a, b, c in rows])


# -- what the unsharded model does on one batch, on fake tensors --------------------------
@dataclass
class Profile:
    """The order in which a forward saves activations and uses parameters."""
    saved: list[int]                   # bytes first saved, in order
    uses: dict[str, list[int]]         # parameter -> the points (len(saved) then) it is read at
    output_bytes: int

    @property
    def last_use(self) -> dict[str, int]:
        """Where backward produces each parameter's gradient (its last use in forward)."""
        return {name: points[-1] for name, points in self.uses.items()}

    @property
    def activation_bytes(self) -> int:
        return sum(self.saved)


class _ParamUse(TorchDispatchMode):
    """Records, in op order, which parameters each op reads (by storage)."""

    def __init__(self, storages: dict[int, str], events: list):
        super().__init__()
        self.storages, self.events = storages, events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                name = self.storages.get(t.untyped_storage()._cdata)
                if name is not None:
                    self.events.append(("use", name))
        return func(*args, **(kwargs or {}))


def profile_forward(module: torch.nn.Module, params: dict[str, torch.Tensor], inputs: dict,
                    loss_keeps_output: bool = True) -> Profile:
    """Run `module(**inputs)` on fake tensors (the inputs are (shape, dtype) specs) with
    `params` (canonical name -> tensor, meta or real; never read) and record what it saves.

    `loss_keeps_output`: count one more tensor the size of the output, as a cross-entropy loss
    saves its log-softmax."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if any(p.device.type == "meta" for p in params.values()):
        module = _meta_to_cpu(module)  # so kernels are chosen as on a real device
    events: list = []
    seen: set[int] = set()
    with FakeTensorMode(allow_non_fake_inputs=True):
        device = "cpu"
        fake = {name: torch.empty(p.shape, dtype=p.dtype, device=device,
                                  requires_grad=p.requires_grad) for name, p in params.items()}
        state = {alias: fake[name] for name, alias in _aliases(module, params)}
        for node in module.graph.nodes:  # buffers and constants, fake and on cpu too
            value = _attr(module, node.target) if node.op == "get_attr" else None
            if isinstance(value, torch.Tensor) and node.target not in state:
                state[node.target] = torch.zeros(value.shape, dtype=value.dtype, device=device)
        storages = {t.untyped_storage()._cdata: name for name, t in fake.items()}
        seen.update(storages)
        args = {k: torch.zeros(shape, dtype=dtype, device=device)
                for k, (shape, dtype) in inputs.items()}

        def pack(t):
            key = t.untyped_storage()._cdata
            if key not in seen:
                seen.add(key)
                events.append(("save", t.untyped_storage().nbytes()))
            return t

        with _ParamUse(storages, events), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = torch.func.functional_call(module, state, (), args, strict=False)
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    out_bytes = sum(t.numel() * t.element_size() for t in leaves)
    if loss_keeps_output:
        events.append(("save", out_bytes))
    saved, uses = [], {}
    for kind, value in events:
        if kind == "save":
            saved.append(value)
        elif len(saved) not in uses.setdefault(value, []):
            uses[value].append(len(saved))
    return Profile(saved, uses, out_bytes)


def _meta_to_cpu(module):
    """A copy of a graph captured on the meta device that runs on (fake) cpu tensors (on meta,
    attention would take its unfused path and seem to save its whole score matrix)."""
    import copy
    import torch.fx as fx
    from rtp_compile.materialize import retarget_meta

    on_cpu = fx.GraphModule(module, copy.deepcopy(module.graph))
    retarget_meta(on_cpu, torch.device("cpu"))
    return on_cpu


def _attr(module, target: str):
    import operator
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


# -- the three kinds of parallelism ----------------------------------------------------------
def _bytes(dtype: torch.dtype) -> int:
    return dtype.itemsize


def shard_expr(extent: int, rest: int, element: int, granule: int = 1) -> sympy.Expr:
    """Bytes of one padded shard: ceiling(extent / (N granule)) granules of `rest` elements."""
    return sympy.ceiling(sympy.Integer(extent) / (N * granule)) * granule * rest * element


def _layout_expr(layout, element: int) -> sympy.Expr:
    extent = layout.extent
    rest = math.prod(layout.shape) // max(extent, 1) if layout.dim is not None else 1
    return shard_expr(extent, rest, element, getattr(layout, "granule", 1))


def _optimizer_states(optimizer: str) -> int:
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"rtp_compile.cost: optimizer must be one of {sorted(OPTIMIZER_STATES)}, "
                         f"got {optimizer!r}")
    return OPTIMIZER_STATES[optimizer]


def _curve(profile: Profile, grad_of: dict[str, sympy.Expr], buffers_at: dict[int, sympy.Expr],
           backward: bool) -> sympy.Expr:
    """Max over the points of a forward (activations saved so far) or backward (activations not
    yet freed + gradients already produced), plus the buffers the op at that point has in flight.

    Candidates are the points that are maximal for some N in 1, 2, 4, ..., 1024 (a large model
    has thousands of points; only these can be the maximum in that range)."""
    cumulative = [0]
    for b in profile.saved:
        cumulative.append(cumulative[-1] + b)
    produced_at: dict[int, list[str]] = {}
    for name, point in profile.last_use.items():
        produced_at.setdefault(point, []).append(name)
    extra, grads = {}, sympy.Integer(0)
    for i in range(len(profile.saved), -1, -1):  # backward walks the forward order in reverse
        if backward:
            for name in produced_at.get(i, []):
                grads += grad_of.get(name, 0)
        extra[i] = grads + buffers_at.get(i, 0)
    numeric = {e: [float(e.subs(N, n)) for n in _POWERS_OF_TWO] for e in set(extra.values())}
    keep = {max(extra, key=lambda i: cumulative[i] + numeric[extra[i]][k])
            for k in range(len(_POWERS_OF_TWO))}
    scale = A / max(profile.activation_bytes, 1)  # activations enter as a share of A
    curve = [cumulative[i] * scale + extra[i] for i in sorted(keep)]
    return sympy.Max(*curve) if len(curve) > 1 else curve[0]


def _buffers_at(profile: Profile, units: list[tuple[list[str], sympy.Expr]]) -> dict:
    """Point -> the largest buffers of a unit whose parameters are read there."""
    at: dict[int, list] = {}
    for names, buffers in units:
        for point in {p for n in names for p in profile.uses.get(n, [])}:
            at.setdefault(point, []).append(buffers)
    return {p: sympy.Max(*b) if len(b) > 1 else b[0] for p, b in at.items()}


def _evaluate(kind, world_size, exprs, activation_bytes) -> Cost:
    values = {f: int(sympy.ceiling(e.subs({N: world_size, A: activation_bytes})))
              if isinstance(e, sympy.Expr) else int(e) for f, e in exprs.items()}
    return Cost(kind, world_size, **values, expressions=exprs)


def _state(param_exprs: dict[str, sympy.Expr], n_params: int, optimizer: str):
    params = sympy.Add(*param_exprs.values())
    states = _optimizer_states(optimizer)
    steps = 4 * n_params if states else 0  # AdamW/Adam/Adagrad keep a float32 step per tensor
    return params, params, states * params + steps


def rtp_cost(plan, profile: Profile, optimizer: str = "adamw", dtype=None) -> Cost:
    """RTP: every parameter, gradient and optimizer state is a 1/N shard. A rotated unit has
    its flat messages in flight (2 forward: held + incoming; 4 backward: weights and gradient
    accumulators, held + incoming); a gathered op its full tensors. Every unit sends
    3 (N - 1) messages a step (forward, backward weights, gradient accumulators)."""
    element = {n: _bytes(dtype or lay.dtype) for n, lay in plan.params.items()}
    shard = {n: _layout_expr(lay, element[n]) for n, lay in plan.params.items()}
    params, grads, opt = _state(shard, len(plan.params), optimizer)
    ring = sympy.Min(N - 1, 1)  # one rank has no ring: nothing in flight
    forward_units, backward_units, traffic = [], [], sympy.Integer(0)
    for unit in plan.units:
        names = list(unit.params.values())
        message = sympy.Add(*[shard[n] for n in names])
        if len({dtype or plan.params[n].dtype for n in names}) > 1:  # aligned byte message
            message += 16 * len(names)
        traffic += 3 * (N - 1) * message
        if unit.kind == "gather":
            full = sum(math.prod(plan.params[n].shape) * element[n] for n in names)
            forward_units.append((names, full + 2 * ring * message))
            backward_units.append((names, 2 * full + 2 * ring * message))  # weights + grads
        else:
            forward_units.append((names, 2 * ring * message))
            backward_units.append((names, 4 * ring * message))
    transient = sympy.Max(*[b for _, b in backward_units]) if backward_units else sympy.Integer(0)
    largest_shard = sympy.Max(*shard.values()) if shard else sympy.Integer(0)
    exprs = {"param_bytes": params, "grad_bytes": grads, "optimizer_bytes": opt,
             "transient_bytes": transient, "activation_bytes": A, "traffic_bytes": traffic}
    forward = _curve(profile, shard, _buffers_at(profile, forward_units), backward=False)
    backward = _curve(profile, shard, _buffers_at(profile, backward_units), backward=True) \
        + profile.output_bytes  # the output's gradient
    step = grads + 2 * largest_shard  # single-tensor AdamW: two shard-sized temporaries
    exprs["peak_bytes"] = params + opt + sympy.Max(forward, backward, step)
    return _evaluate("rtp", plan.world_size, exprs, profile.activation_bytes)


def ddp_cost(params: dict[str, torch.Tensor], profile: Profile, world_size: int,
             optimizer: str = "adamw", dtype=None) -> Cost:
    """DDP: full replicas of parameters, gradients and optimizer state, plus its gradient
    buckets (a second copy of the gradients, kept for the life of the module); a ring
    all-reduce of the gradients each step."""
    full = {n: sympy.Integer(p.numel() * _bytes(dtype or p.dtype)) for n, p in params.items()}
    p_bytes, grads, opt = _state(full, len(params), optimizer)
    buckets = grads
    exprs = {"param_bytes": p_bytes, "grad_bytes": grads, "optimizer_bytes": opt,
             "transient_bytes": buckets, "activation_bytes": A,
             "traffic_bytes": 2 * (N - 1) / N * grads}
    backward = _curve(profile, full, {}, backward=True) + profile.output_bytes
    step = grads + 2 * sympy.Max(*full.values())
    exprs["peak_bytes"] = p_bytes + opt + buckets + sympy.Max(A, backward, step)
    return _evaluate("ddp", world_size, exprs, profile.activation_bytes)


def fsdp_cost(params: dict[str, torch.Tensor], profile: Profile, world_size: int,
              blocks: list[list[str]], optimizer: str = "adamw", dtype=None) -> Cost:
    """FSDP2 (`fully_shard` per block, then the root): 1/N of every parameter, gradient and
    optimizer state (each cut evenly on dim 0); a block's parameters all-gathered while the
    next one's are prefetched, in backward also its unsharded gradients before the
    reduce-scatter. Traffic: all-gather forward and backward, reduce-scatter."""
    element = {n: _bytes(dtype or p.dtype) for n, p in params.items()}
    shard = {n: sympy.ceiling(sympy.Integer(p.shape[0] if p.dim() else 1) / N)
             * (p.numel() // max(p.shape[0], 1) if p.dim() else 1) * element[n]
             for n, p in params.items()}
    p_bytes, grads, opt = _state(shard, len(params), optimizer)
    ring = sympy.Min(N - 1, 1)
    forward_units, backward_units = [], []
    sizes = [sympy.Integer(sum(params[n].numel() * element[n] for n in names)) for names in blocks]
    root = ring * sum((size for names, size in zip(blocks, sizes) if names is blocks[-1]),
                      sympy.Integer(0))  # the root stays unsharded from forward to backward
    for names, full in zip(blocks[:-1], sizes):
        forward_units.append((names, root + 2 * ring * full))   # this block + the prefetched one
        backward_units.append((names, root + 3 * ring * full))  # + its unsharded gradients
    forward_units.append((blocks[-1], root))
    backward_units.append((blocks[-1], 2 * root))
    total = sympy.Integer(sum(p.numel() * element[n] for n, p in params.items()))
    exprs = {"param_bytes": p_bytes, "grad_bytes": grads, "optimizer_bytes": opt,
             "transient_bytes": sympy.Max(*[b for _, b in backward_units]),
             "activation_bytes": A, "traffic_bytes": 3 * (N - 1) / N * total}
    forward = _curve(profile, shard, _buffers_at(profile, forward_units), backward=False)
    backward = _curve(profile, shard, _buffers_at(profile, backward_units), backward=True) \
        + profile.output_bytes
    step = grads + 2 * sympy.Max(*shard.values())
    exprs["peak_bytes"] = p_bytes + opt + sympy.Max(forward, backward, step)
    return _evaluate("fsdp2", world_size, exprs, profile.activation_bytes)


def fsdp_blocks(names: list[str]) -> list[list[str]]:
    """How `fully_shard` per block groups parameters: each element of a ModuleList (a path
    component that is a number) is a block; everything else belongs to the root, listed last."""
    blocks: dict[str, list[str]] = {"": []}
    for name in names:
        parts = name.split(".")
        index = next((i for i, p in enumerate(parts) if p.isdigit()), None)
        key = ".".join(parts[:index + 1]) if index is not None else ""
        blocks.setdefault(key, []).append(name)
    root = blocks.pop("")
    return list(blocks.values()) + [root]


_profiles: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # reference -> {batch: Profile}


def profile_of(ctx, batch_size: int, seq_len: int | None = None,
               example_kwargs: dict | None = None) -> Profile:
    """The profile of the captured model (`ctx.reference`) on such a batch, made once per batch
    shape for all world sizes' programs of one capture."""
    specs = input_specs(ctx.reference, batch_size, seq_len) if example_kwargs is None else \
        {k: (tuple(v.shape), v.dtype) for k, v in example_kwargs.items()}
    key = tuple(sorted((k, shape, str(dtype)) for k, (shape, dtype) in specs.items()))
    profiles = _profiles.setdefault(ctx.reference, {})
    if key not in profiles:
        profiles[key] = profile_forward(ctx.reference, ctx.params, specs)
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
                "example_kwargs={name: tensor} with one batch instead.")
    return specs


def _hint(size) -> int:
    return size.node.hint if isinstance(size, torch.SymInt) else int(size)


def _indexes_embedding(node, reference) -> bool:
    import torch.nn.functional as F
    for user in node.users:
        if user.op == "call_module" and isinstance(reference.get_submodule(user.target),
                                                   torch.nn.Embedding):
            return user.args[0] is node
        if user.target in (F.embedding, torch.ops.aten.embedding.default):
            return user.args[1 if user.target is torch.ops.aten.embedding.default else 0] is node
    return False
