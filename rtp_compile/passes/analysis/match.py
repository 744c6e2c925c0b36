"""Adapters: a graph node at any capture level -> `OpCall` (rule, input, parameters by role).

One table row per op target, for torch-function graphs (fx, dynamo) and aten graphs
(torch.export) alike; each adapter reads the node's arguments by name and says which is the
activation and which are parameters. A node that reads a parameter but has no adapter, or
whose arguments the rule cannot shard (the adapter raises `Unshardable` saying why), gets
`None`: the plan gathers its parameters instead. Any other exception an adapter raises is a
bug and propagates, naming the node.

An elementwise op may read its parameter through a chain of ops (`passes.chains`).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from rtp_compile.core.graph_ops import affine
from rtp_compile.core.ir import target_name
from rtp_compile.core.op_rules import RULES, OpCall
from rtp_compile.passes.analysis.chains import (
    Unshardable,
    chain_break,
    describe,
    op_key,
    parameter_chain,
)
from rtp_compile.passes.manager.pipeline import InvariantError

aten = torch.ops.aten


def parameter_reads(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """get_attr nodes that read a parameter -> the parameter's name."""
    params = dict(gm.named_parameters(remove_duplicate=False))
    return {n: n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target in params}


def canonical_reads(gm: fx.GraphModule, ctx) -> None:
    """Invariant of capture and of the passes that add parameter reads: every read of a
    parameter uses its canonical name (one node target per parameter, tied ones included)."""
    canonical = ctx.canonical
    aliased = sorted(
        {n.target for n in parameter_reads(gm) if canonical.get(n.target, n.target) != n.target}
    )
    if aliased:
        raise InvariantError(f"parameters read by an alias, not their canonical name: {aliased}")


def _transposed_param(value, reads):
    """(name, transposed) when `value` is a parameter or its 2-D transpose, else (None, False)."""
    if value in reads:
        return reads[value], False
    if isinstance(value, fx.Node) and value.args and value.args[0] in reads:
        is_t = value.target in ("t", aten.t.default, torch.t)
        is_swap = (
            value.target in ("transpose", aten.transpose.int, torch.transpose)
            and len(value.args) == 3
            and {d % 2 for d in value.args[1:]} == {0, 1}
        )
        if is_t or is_swap:
            return reads[value.args[0]], True
    return None, False


CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
CONV_TRANSPOSE_ARGS = (
    "input",
    "weight",
    "bias",
    "stride",
    "padding",
    "output_padding",
    "groups",
    "dilation",
)


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
    return OpCall(
        RULES["linear"],
        x,
        _roles(weight=wname, bias=reads.get(bias)),
        {"transposed": transposed != transposed_storage},
    )


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
        raise Unshardable(f"the conv rule shards groups=1 only, this conv has groups={k['groups']}")
    weight, bias, x = k["weight"], k.get("bias"), k["input"]
    if (
        weight not in reads
        or not _is_activation(x, reads)
        or (bias is not None and bias not in reads)
    ):
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
    options = {
        "stride": stride,
        "padding": _pair(padding, n),
        "dilation": dilation,
        "transposed": transposed,
        "output_padding": _pair(k.get("output_padding", 0), n),
    }
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
    options = {
        "padding_idx": None if padding_idx is None else padding_idx % num,
        "scale_grad_by_freq": bool(scale_grad_by_freq),
    }
    return OpCall(RULES["embedding"], idx, {"weight": reads[weight]}, options)


def _embedding_adapter(node, gm, reads):
    k = _kwargs(node, gm)
    if not k:
        return None
    if k.get("max_norm") is not None or k.get("sparse"):
        raise Unshardable(
            "embedding with max_norm (renormalises whole rows in place) or sparse gradients"
        )
    return _embedding(
        k["input"], k["weight"], k.get("padding_idx"), k.get("scale_grad_by_freq"), reads, gm
    )


def _aten_embedding_adapter(node, gm, reads):
    k = _kwargs(node, gm)
    if not k:
        return None
    if k.get("sparse"):
        raise Unshardable("embedding with sparse gradients")
    padding_idx = k.get("padding_idx", -1)
    return _embedding(
        k["indices"],
        k["weight"],
        None if padding_idx == -1 else padding_idx,
        k.get("scale_grad_by_freq"),
        reads,
        gm,
    )


def _elementwise(x, operands: dict, dim, reads, gm):
    """An elementwise op of activation `x` and parameters by role (each read, or a chain from
    a read), laid along `dim` as in `affine`."""
    if not _is_activation(x, reads):
        return None
    operands = {role: v for role, v in operands.items() if v is not None}
    if not operands:
        return None
    run_inputs, found = [], {}
    for role, value in operands.items():
        found[role] = parameter_chain(value, reads, gm, run_inputs)
        if found[role] is None:
            return None
    shapes = {tuple(gm.get_parameter(name).shape) for name, _, _ in found.values()}
    seen = {shape for _, _, shape in found.values()}
    if len(shapes) != 1 or len(seen) != 1 or (dim >= 0 and len(next(iter(seen))) != 1):
        return None
    if dim < 0 and all(n == 1 for n in next(iter(shapes))):
        raise Unshardable(
            f"{', '.join(name for name, _, _ in found.values())} has no dim "
            "larger than 1: it scales the whole input, so no shard of it lines "
            "up with a slice of the input"
        )
    options = {"dim": dim}
    chains = {role: steps for role, (_, steps, _) in found.items() if steps}
    if chains:
        options["chains"] = chains
    if seen != shapes:
        options["shape"] = next(iter(seen))
    return OpCall(
        RULES["elementwise"],
        x,
        {role: name for role, (name, _, _) in found.items()},
        options,
        run_inputs,
    )


def _affine_adapter(node, gm, reads):
    x, weight, bias, dim = node.args
    return _elementwise(x, {"weight": weight, "bias": bias}, dim, reads, gm)


def _binary_adapter(role):
    def adapter(node, gm, reads):
        if len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
            return None
        a, b = node.args
        return _elementwise(b, {role: a}, -1, reads, gm) or _elementwise(
            a, {role: b}, -1, reads, gm
        )

    return adapter


ADAPTERS = {
    # torch-function level (fx after lower_modules, dynamo)
    F.linear: _linear_adapter,
    torch.addmm: _addmm_adapter,
    torch.matmul: _matmul_adapter,
    operator.matmul: _matmul_adapter,
    torch.mm: _matmul_adapter,
    F.conv1d: _conv_adapter(False, 1),
    F.conv2d: _conv_adapter(False, 2),
    F.conv3d: _conv_adapter(False, 3),
    F.conv_transpose1d: _conv_adapter(True, 1),
    F.conv_transpose2d: _conv_adapter(True, 2),
    F.conv_transpose3d: _conv_adapter(True, 3),
    F.embedding: _embedding_adapter,
    affine: _affine_adapter,
    operator.mul: _binary_adapter("weight"),
    torch.mul: _binary_adapter("weight"),
    operator.add: _binary_adapter("bias"),
    torch.add: _binary_adapter("bias"),
    # aten level (torch.export training IR)
    aten.linear.default: _linear_adapter,
    aten.addmm.default: _addmm_adapter,
    aten.mm.default: _matmul_adapter,
    aten.matmul.default: _matmul_adapter,
    aten.conv1d.default: _conv_adapter(False, 1),
    aten.conv2d.default: _conv_adapter(False, 2),
    aten.conv3d.default: _conv_adapter(False, 3),
    aten.conv1d.padding: _conv_adapter(False, 1),
    aten.conv2d.padding: _conv_adapter(False, 2),
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


def _match(node: fx.Node, gm: fx.GraphModule, reads, closure=()) -> tuple[OpCall | None, str]:
    target = target_name(node)
    adapter = ADAPTERS.get(op_key(node.target)) if node.op == "call_function" else None
    if node.op == "call_module":
        kind = type(gm.get_submodule(node.target)).__name__
        return None, (
            f"{kind} is called as one module (torch.fx keeps torch.nn modules whole); "
            "pass example_inputs so torch.export captures the ops inside it"
        )
    if adapter is None:
        return None, f"no shard rule for {target}"
    try:
        call = adapter(node, gm, reads)
    except Unshardable as why:
        return None, str(why)
    except Exception as err:  # a bug of the adapter, not a planning decision: never gathered
        raise RuntimeError(
            f"rtp_compile: the shard-rule adapter of {target} failed on node "
            f"{describe(node)}: {type(err).__name__}: {err}. This is a bug in "
            "rtp_compile; please report it with the model"
        ) from err
    if call is None:
        through = chain_break(closure, reads)
        if through is not None:
            return None, (
                f"{target} reads its parameter through {describe(through)}, which a shard "
                "cannot go through: only dtype casts, views that add or drop size-1 "
                "dims and arithmetic with Python scalars apply to each shard"
            )
        return (
            None,
            f"{target} reads parameters where its rule expects activations (or "
            "through ops it cannot see through)",
        )
    call.input = call.input.name  # plans outlive graph rewrites: refer to nodes by name
    return call, ""


def match_op(node: fx.Node, gm: fx.GraphModule, reads: dict[fx.Node, str]) -> OpCall | None:
    """The rule view of `node`, or None when it has no rule that can shard its parameters."""
    return _match(node, gm, reads)[0]


def why_not_sharded(
    node: fx.Node, gm: fx.GraphModule, reads: dict[fx.Node, str], closure: list[fx.Node] = ()
) -> str:
    """Why `match_op` gave None for `node` (which reads the parameter-only nodes `closure`),
    for the report."""
    return _match(node, gm, reads, closure)[1]
