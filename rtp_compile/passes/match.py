"""Adapters: a graph node at any capture level -> `OpCall` (rule, input, parameters by role).

One table row per op target, for torch-function graphs (fx, dynamo) and aten graphs
(torch.export) alike; each adapter reads the node's arguments by name and says which is the
activation and which are parameters. A node that reads a parameter but has no adapter (or
whose arguments the rule cannot shard) gets `None`: the plan gathers its parameters instead.

An elementwise op may read its parameter through a chain of ops (`CHAIN_OPS`): dtype casts,
views that add or drop size-1 dims, arithmetic with Python scalars. `parameter_chain` reads
such a chain back to the parameter; the rule then applies it to each shard.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from rtp_compile.core.ir import target_name
from rtp_compile.core.op_rules import RULES, External, OpCall, Step
from rtp_compile.passes.pipeline import InvariantError
from rtp_compile.core.graph_ops import affine

aten = torch.ops.aten


class Unshardable(Exception):
    """An adapter's reason why a node it knows cannot be sharded by its rule."""


def parameter_reads(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """get_attr nodes that read a parameter -> the parameter's name."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    return {n: n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target in params}


def canonical_reads(gm: fx.GraphModule, ctx) -> None:
    """Invariant of capture and of the passes that add parameter reads: every read of a
    parameter uses its canonical name (one node target per parameter, tied ones included)."""
    canonical = ctx.canonical
    aliased = sorted({n.target for n in parameter_reads(gm) if canonical.get(n.target, n.target)
                      != n.target})
    if aliased:
        raise InvariantError(f"parameters read by an alias, not their canonical name: {aliased}")


def _transposed_param(value, reads):
    """(name, transposed) when `value` is a parameter or its 2-D transpose, else (None, False)."""
    if value in reads:
        return reads[value], False
    if isinstance(value, fx.Node) and value.args and value.args[0] in reads:
        is_t = value.target in ("t", aten.t.default, torch.t)
        is_swap = value.target in ("transpose", aten.transpose.int, torch.transpose) and \
            len(value.args) == 3 and {d % 2 for d in value.args[1:]} == {0, 1}
        if is_t or is_swap:
            return reads[value.args[0]], True
    return None, False


CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
CONV_TRANSPOSE_ARGS = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups",
                       "dilation")


def _kwargs(node: fx.Node, gm, names: tuple[str, ...] = ()) -> dict | None:
    """The node's arguments by name; `names` binds positionally where overloads are ambiguous."""
    try:
        bound = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True)
    except RuntimeError:
        bound = None
    if bound is not None:
        return dict(bound.kwargs)
    if names and len(node.args) <= len(names):
        return {**dict(zip(names, node.args)), **node.kwargs}
    return None


def _is_activation(value, reads) -> bool:
    return isinstance(value, fx.Node) and value not in reads


def _roles(**params) -> dict[str, str]:
    return {role: name for role, name in params.items() if name is not None}


def _linear(x, weight, bias, reads, transposed_storage=False):
    """Linear-like op; `transposed_storage`: the op multiplies by the weight as stored [in, out]."""
    wname, transposed = _transposed_param(weight, reads)
    if wname is None or not _is_activation(x, reads):
        return None
    if bias is not None and bias not in reads:
        return None
    return OpCall(RULES["linear"], x, _roles(weight=wname, bias=reads.get(bias)),
                  {"transposed": transposed != transposed_storage})


def _linear_adapter(node, gm, reads):
    k = _kwargs(node, gm)
    return k and _linear(k["input"], k["weight"], k.get("bias"), reads)


def _addmm_adapter(node, gm, reads):
    k = _kwargs(node, gm)
    if not k:
        return None
    if k.get("beta", 1) != 1 or k.get("alpha", 1) != 1:
        raise Unshardable("addmm with beta or alpha other than 1")
    return _linear(k["mat1"], k["mat2"], k["input"], reads, transposed_storage=True)


def _matmul_adapter(node, gm, reads):
    x, w = node.args[:2] if len(node.args) >= 2 else (None, None)
    return _linear(x, w, None, reads, transposed_storage=True)


def _pair(v, n):
    return list(v) if isinstance(v, (list, tuple)) else [v] * n


def _conv(node, gm, reads, transposed, n):
    k = _kwargs(node, gm, CONV_TRANSPOSE_ARGS if transposed else CONV_ARGS)
    if not k:
        return None
    if k.get("groups", 1) != 1:
        raise Unshardable(f"the conv rule shards groups=1 only, this conv has "
                          f"groups={k['groups']}")
    weight, bias, x = k["weight"], k.get("bias"), k["input"]
    if weight not in reads or not _is_activation(x, reads) or (bias is not None and bias not in reads):
        return None
    n = n or len(gm.get_parameter(reads[weight]).shape) - 2
    stride, dilation = _pair(k.get("stride", 1), n), _pair(k.get("dilation", 1), n)
    padding = k.get("padding", 0)
    if isinstance(padding, str):
        ksize = gm.get_parameter(reads[weight]).shape[2:]
        total = [d * (s - 1) for d, s in zip(dilation, ksize)]
        if padding == "valid":
            padding = [0] * n
        elif padding == "same" and all(t % 2 == 0 for t in total):
            padding = [t // 2 for t in total]
        else:
            raise Unshardable(f"padding={padding!r} pads unevenly for this kernel")
    options = {"stride": stride, "padding": _pair(padding, n), "dilation": dilation,
               "transposed": transposed,
               "output_padding": _pair(k.get("output_padding", 0), n)}
    return OpCall(RULES["conv"], x, _roles(weight=reads[weight], bias=reads.get(bias)), options)


def _convolution_adapter(node, gm, reads):
    k = _kwargs(node, gm)
    return k and _conv(node, gm, reads, bool(k["transposed"]), None)


def _conv_adapter(transposed, n):
    return lambda node, gm, reads: _conv(node, gm, reads, transposed, n)


def _embedding(idx, weight, padding_idx, scale_grad_by_freq, reads, gm):
    if weight not in reads or not _is_activation(idx, reads):
        return None
    num = gm.get_parameter(reads[weight]).shape[0]
    options = {"padding_idx": None if padding_idx is None else padding_idx % num,
               "scale_grad_by_freq": bool(scale_grad_by_freq)}
    return OpCall(RULES["embedding"], idx, {"weight": reads[weight]}, options)


def _embedding_adapter(node, gm, reads):
    k = _kwargs(node, gm)
    if not k:
        return None
    if k.get("max_norm") is not None or k.get("sparse"):
        raise Unshardable("embedding with max_norm (renormalises whole rows in place) or "
                          "sparse gradients")
    return _embedding(k["input"], k["weight"], k.get("padding_idx"), k.get("scale_grad_by_freq"),
                      reads, gm)


def _aten_embedding_adapter(node, gm, reads):
    k = _kwargs(node, gm)
    if not k:
        return None
    if k.get("sparse"):
        raise Unshardable("embedding with sparse gradients")
    padding_idx = k.get("padding_idx", -1)
    return _embedding(k["indices"], k["weight"], None if padding_idx == -1 else padding_idx,
                      k.get("scale_grad_by_freq"), reads, gm)


CAST, VIEW, SCALAR = "cast", "view", "scalar"
# ops a parameter may pass through before its elementwise use, by what they do to it: a cast
# changes its dtype, a view adds or drops size-1 dims, a scalar op combines it with numbers
CHAIN_OPS = {
    # fx (tensor methods by name, torch functions) and dynamo
    "to": CAST, "type_as": CAST, "float": CAST, "double": CAST, "half": CAST, "bfloat16": CAST,
    "view": VIEW, "reshape": VIEW, "unsqueeze": VIEW, "squeeze": VIEW, operator.getitem: VIEW,
    torch.reshape: VIEW, torch.unsqueeze: VIEW, torch.squeeze: VIEW,
    operator.add: SCALAR, operator.sub: SCALAR, operator.mul: SCALAR, operator.truediv: SCALAR,
    operator.neg: SCALAR, operator.pow: SCALAR, torch.add: SCALAR, torch.sub: SCALAR,
    torch.mul: SCALAR, torch.div: SCALAR, torch.neg: SCALAR, "add": SCALAR, "sub": SCALAR,
    "mul": SCALAR, "div": SCALAR, "neg": SCALAR, "pow": SCALAR,
    # aten (torch.export)
    aten.to.dtype: CAST, aten._to_copy.default: CAST, aten.type_as.default: CAST,
    aten.view.default: VIEW, aten.reshape.default: VIEW, aten._unsafe_view.default: VIEW,
    aten.unsqueeze.default: VIEW, aten.squeeze.default: VIEW, aten.squeeze.dim: VIEW,
    aten.squeeze.dims: VIEW, aten.slice.Tensor: VIEW, aten.alias.default: VIEW,
    aten.add.Tensor: SCALAR, aten.add.Scalar: SCALAR, aten.sub.Tensor: SCALAR,
    aten.sub.Scalar: SCALAR, aten.rsub.Scalar: SCALAR, aten.mul.Tensor: SCALAR,
    aten.mul.Scalar: SCALAR, aten.div.Tensor: SCALAR, aten.div.Scalar: SCALAR,
    aten.neg.default: SCALAR, aten.pow.Tensor_Scalar: SCALAR,
}
_DTYPE_METHODS = {"float", "double", "half", "bfloat16"}


def _chain_kind(node) -> str | None:
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return None
    return CHAIN_OPS.get(op_key(node.target) if node.op == "call_function" else node.target)


def _is_dtype_read(value) -> bool:
    """`t.dtype` in an fx graph (export has made it a constant)."""
    return isinstance(value, fx.Node) and value.op == "call_function" and \
        value.target is getattr and value.args[1:] == ("dtype",)


def chain_input(node: fx.Node) -> fx.Node | None:
    """The tensor a chain op applies to (the others are numbers, sizes, dtypes or what a
    dtype is read from), or None when `node` is no chain op."""
    kind = _chain_kind(node)
    if kind is None:
        return None
    if kind != SCALAR:
        return node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    tensors = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
    scalars = all(isinstance(a, (int, float, bool)) for a in (*node.args, *node.kwargs.values())
                  if not isinstance(a, fx.Node))
    return tensors[0] if len(tensors) == 1 and scalars else None


def dtype_inputs(node: fx.Node) -> list[fx.Node]:
    """Inputs a cast reads only for their dtype (`x` in `w.type_as(x)`, `x.dtype`)."""
    if _chain_kind(node) != CAST:
        return []
    return [i for i in node.all_input_nodes if i is not node.args[0]]


def _op(node: fx.Node) -> str:
    return f"{node.name} ({target_name(node)})"


def chain_break(closure: list[fx.Node], reads) -> fx.Node | None:
    """The first op of a parameter-only closure that is neither a read nor a chain op."""
    return next((n for n in closure if n not in reads and chain_input(n) is None), None)


def _cast_step(node: fx.Node, externals: list) -> Step:
    """A cast as a step; a dtype only known at run time becomes `w.to(External(i))`."""
    def external(ref):
        if ref not in externals:
            externals.append(ref)
        return Step("to", 0, (External(externals.index(ref)),))

    target, rest = op_key(node.target), node.args[1:]
    if target in _DTYPE_METHODS:
        return Step(target, 0)
    if target in ("type_as", aten.type_as.default):
        return external((rest[0].name, "dtype"))
    if target == "to":
        dtype = node.kwargs.get("dtype", rest[0] if len(rest) == 1 else None)
        if _is_dtype_read(dtype) and len(rest) + len(node.kwargs) == 1:
            return external((dtype.name, None))
        if not isinstance(dtype, torch.dtype) or len(rest) + len(node.kwargs) != 1:
            raise Unshardable(f"{_op(node)} does more to the parameter than cast it to a dtype "
                              "the graph names")
    elif target is aten._to_copy.default:
        if rest or any(v is not None for k, v in node.kwargs.items() if k != "dtype"):
            raise Unshardable(f"{_op(node)} copies the parameter to another layout or device")
    return Step(node.target, 0, tuple(rest), tuple(node.kwargs.items()))


def _on_meta(node: fx.Node, value: torch.Tensor, at: fx.Node) -> torch.Tensor:
    """`node`'s op on a meta tensor standing for its input `at` (static arguments only)."""
    args = fx.node.map_arg(node.args, lambda a: value if a is at else a)
    kwargs = fx.node.map_arg(node.kwargs, lambda a: value if a is at else a)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


def parameter_chain(value, reads, gm, externals: list):
    """(parameter name, steps, the shape the op sees) when `value` is a parameter read or a
    chain of `CHAIN_OPS` from one, else None. Raises Unshardable for a chain whose view does
    more than add or drop size-1 dims. Run-time dtypes are appended to `externals`."""
    chain = []
    while value not in reads:
        at = chain_input(value)
        if at is None:
            return None
        chain.append(value)
        value = at
    name, param = reads[value], gm.get_parameter(reads[value])
    steps, at = [], value
    meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
    big = [n for n in param.shape if n != 1]
    for node in reversed(chain):
        kind = _chain_kind(node)
        if kind == VIEW:
            if _has_node(node.args[1:], node.kwargs):
                raise Unshardable(f"{_op(node)} views the parameter with sizes read at run "
                                  "time")
            if node.target is operator.getitem and not _plain_index(node.args[1]):
                raise Unshardable(f"{_op(node)} indexes the parameter with a list or tensor")
            viewed = _on_meta(node, meta, at)
            if [n for n in viewed.shape if n != 1] != big or viewed.numel() != meta.numel():
                raise Unshardable(f"{_op(node)} makes the parameter {tuple(viewed.shape)} from "
                                  f"{tuple(meta.shape)}; a shard can only gain or lose size-1 "
                                  "dims")
            meta = viewed
        elif kind == CAST:
            steps.append(_cast_step(node, externals))
            if not any(isinstance(a, External) for a in steps[-1].args):
                meta = steps[-1](meta)
            if not meta.dtype.is_floating_point:
                raise Unshardable(f"{_op(node)} casts the parameter to {meta.dtype}")
        else:
            args = list(node.args)
            param_at = args.index(at)
            del args[param_at]
            steps.append(Step(node.target, param_at, tuple(args), tuple(node.kwargs.items())))
            meta = steps[-1](meta)
        at = node
    return name, tuple(steps), tuple(meta.shape)


def _plain_index(index) -> bool:
    """An index of None, ..., ints and slices only (a list or tensor could reorder)."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items)


def _has_node(args, kwargs) -> bool:
    found = []
    fx.node.map_arg((args, kwargs), found.append)
    return bool(found)


def _elementwise(x, operands: dict, dim, reads, gm):
    """An elementwise op of activation `x` and parameters by role (each read, or a chain from
    a read), laid along `dim` as in `affine`."""
    if not _is_activation(x, reads):
        return None
    operands = {role: v for role, v in operands.items() if v is not None}
    if not operands:
        return None
    externals, found = [], {}
    for role, value in operands.items():
        found[role] = parameter_chain(value, reads, gm, externals)
        if found[role] is None:
            return None
    shapes = {tuple(gm.get_parameter(name).shape) for name, _, _ in found.values()}
    seen = {shape for _, _, shape in found.values()}
    if len(shapes) != 1 or len(seen) != 1 or (dim >= 0 and len(next(iter(seen))) != 1):
        return None
    if dim < 0 and all(n == 1 for n in next(iter(shapes))):
        raise Unshardable(f"{', '.join(name for name, _, _ in found.values())} has no dim "
                          "larger than 1: it scales the whole input, so no shard of it lines "
                          "up with a slice of the input")
    options = {"dim": dim}
    chains = {role: steps for role, (_, steps, _) in found.items() if steps}
    if chains:
        options["chains"] = chains
    if seen != shapes:
        options["shape"] = next(iter(seen))
    return OpCall(RULES["elementwise"], x, {role: name for role, (name, _, _) in found.items()},
                  options, externals)


def _affine_adapter(node, gm, reads):
    x, weight, bias, dim = node.args
    return _elementwise(x, {"weight": weight, "bias": bias}, dim, reads, gm)


def _binary_adapter(role):
    def adapter(node, gm, reads):
        if len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
            return None
        a, b = node.args
        return _elementwise(b, {role: a}, -1, reads, gm) or \
            _elementwise(a, {role: b}, -1, reads, gm)
    return adapter


ADAPTERS = {
    # torch-function level (fx after lower_modules, dynamo)
    F.linear: _linear_adapter,
    torch.addmm: _addmm_adapter,
    torch.matmul: _matmul_adapter, operator.matmul: _matmul_adapter, torch.mm: _matmul_adapter,
    F.conv1d: _conv_adapter(False, 1), F.conv2d: _conv_adapter(False, 2),
    F.conv3d: _conv_adapter(False, 3),
    F.conv_transpose1d: _conv_adapter(True, 1), F.conv_transpose2d: _conv_adapter(True, 2),
    F.conv_transpose3d: _conv_adapter(True, 3),
    F.embedding: _embedding_adapter,
    affine: _affine_adapter,
    operator.mul: _binary_adapter("weight"), torch.mul: _binary_adapter("weight"),
    operator.add: _binary_adapter("bias"), torch.add: _binary_adapter("bias"),
    # aten level (torch.export training IR)
    aten.linear.default: _linear_adapter,
    aten.addmm.default: _addmm_adapter,
    aten.mm.default: _matmul_adapter, aten.matmul.default: _matmul_adapter,
    aten.conv1d.default: _conv_adapter(False, 1), aten.conv2d.default: _conv_adapter(False, 2),
    aten.conv3d.default: _conv_adapter(False, 3),
    aten.conv1d.padding: _conv_adapter(False, 1), aten.conv2d.padding: _conv_adapter(False, 2),
    aten.conv3d.padding: _conv_adapter(False, 3),
    aten.conv_transpose1d.default: _conv_adapter(True, 1),
    aten.conv_transpose2d.input: _conv_adapter(True, 2),
    aten.conv_transpose3d.input: _conv_adapter(True, 3),
    aten.convolution.default: _convolution_adapter,
    aten.embedding.default: _aten_embedding_adapter,
    aten.mul.Tensor: _binary_adapter("weight"),
    aten.add.Tensor: _binary_adapter("bias"),
}
if hasattr(torch._C._nn, "linear"):
    ADAPTERS[torch._C._nn.linear] = _linear_adapter


def op_key(target):
    """An aten op called as `torch.ops.aten.x(...)` (the overload packet) as its default
    overload, so one table row serves both spellings."""
    return target.default if isinstance(target, torch._ops.OpOverloadPacket) else target


def _match(node: fx.Node, gm: fx.GraphModule, reads, closure=()) -> tuple[OpCall | None, str]:
    target = target_name(node)
    adapter = ADAPTERS.get(op_key(node.target)) if node.op == "call_function" else None
    if node.op == "call_module":
        kind = type(gm.get_submodule(node.target)).__name__
        return None, (f"{kind} is called as one module (torch.fx keeps torch.nn modules whole); "
                      "pass example_inputs so torch.export captures the ops inside it")
    if adapter is None:
        return None, f"no shard rule for {target}"
    try:
        call = adapter(node, gm, reads)
    except Unshardable as why:
        return None, str(why)
    except (TypeError, ValueError, KeyError, RuntimeError) as err:
        # arguments the adapter does not understand: gathered, never guessed
        return None, f"arguments of {target} its adapter does not understand ({err})"
    if call is None:
        through = chain_break(closure, reads)
        if through is not None:
            return None, (f"{target} reads its parameter through {_op(through)}, which a shard "
                          "cannot go through: only dtype casts, views that add or drop size-1 "
                          "dims and arithmetic with Python scalars apply to each shard")
        return None, f"{target} reads parameters where its rule expects activations (or " \
                     "through ops it cannot see through)"
    call.input = call.input.name  # plans outlive graph rewrites: refer to nodes by name
    return call, ""


def match_op(node: fx.Node, gm: fx.GraphModule, reads: dict[fx.Node, str]) -> OpCall | None:
    """The rule view of `node`, or None when it has no rule that can shard its parameters."""
    return _match(node, gm, reads)[0]


def why_not_sharded(node: fx.Node, gm: fx.GraphModule, reads: dict[fx.Node, str],
                    closure: list[fx.Node] = ()) -> str:
    """Why `match_op` gave None for `node` (which reads the parameter-only nodes `closure`),
    for the report."""
    return _match(node, gm, reads, closure)[1]
