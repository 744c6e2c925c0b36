"""Parameter chains: the ops an elementwise op's parameter may pass through before its use
(`CHAIN_OPS`: dtype casts, views that add or drop size-1 dims, arithmetic with Python scalars),
read back to the parameter (`parameter_chain`) as the steps the rule then applies to each
shard; and where a chain breaks (`chain_break`), the reason a node is gathered instead.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from rtp_compile.core.ir import target_name
from rtp_compile.core.op_rules import ChainOp, RunInput

aten = torch.ops.aten


class Unshardable(Exception):
    """An adapter's reason why a node it knows cannot be sharded by its rule."""


def describe(node: fx.Node) -> str:
    """A node as reasons name it: its name and what it calls."""
    return f"{node.name} ({target_name(node)})"


def op_key(target):
    """An aten op called as `torch.ops.aten.x(...)` (the overload packet) as its default
    overload, so one table row serves both spellings."""
    return target.default if isinstance(target, torch._ops.OpOverloadPacket) else target


CAST, VIEW, SCALAR = "cast", "view", "scalar"
# ops a parameter may pass through before its elementwise use, by what they do to it: a cast
# changes its dtype, a view adds or drops size-1 dims, a scalar op combines it with numbers
CHAIN_OPS = {
    # fx (tensor methods by name, torch functions) and dynamo
    "to": CAST,
    "type_as": CAST,
    "float": CAST,
    "double": CAST,
    "half": CAST,
    "bfloat16": CAST,
    "view": VIEW,
    "reshape": VIEW,
    "unsqueeze": VIEW,
    "squeeze": VIEW,
    operator.getitem: VIEW,
    torch.reshape: VIEW,
    torch.unsqueeze: VIEW,
    torch.squeeze: VIEW,
    operator.add: SCALAR,
    operator.sub: SCALAR,
    operator.mul: SCALAR,
    operator.truediv: SCALAR,
    operator.neg: SCALAR,
    operator.pow: SCALAR,
    torch.add: SCALAR,
    torch.sub: SCALAR,
    torch.mul: SCALAR,
    torch.div: SCALAR,
    torch.neg: SCALAR,
    "add": SCALAR,
    "sub": SCALAR,
    "mul": SCALAR,
    "div": SCALAR,
    "neg": SCALAR,
    "pow": SCALAR,
    # aten (torch.export)
    aten.to.dtype: CAST,
    aten._to_copy.default: CAST,
    aten.type_as.default: CAST,
    aten.view.default: VIEW,
    aten.reshape.default: VIEW,
    aten._unsafe_view.default: VIEW,
    aten.unsqueeze.default: VIEW,
    aten.squeeze.default: VIEW,
    aten.squeeze.dim: VIEW,
    aten.squeeze.dims: VIEW,
    aten.slice.Tensor: VIEW,
    aten.alias.default: VIEW,
    aten.add.Tensor: SCALAR,
    aten.add.Scalar: SCALAR,
    aten.sub.Tensor: SCALAR,
    aten.sub.Scalar: SCALAR,
    aten.rsub.Scalar: SCALAR,
    aten.mul.Tensor: SCALAR,
    aten.mul.Scalar: SCALAR,
    aten.div.Tensor: SCALAR,
    aten.div.Scalar: SCALAR,
    aten.neg.default: SCALAR,
    aten.pow.Tensor_Scalar: SCALAR,
}


_DTYPE_METHODS = {"float", "double", "half", "bfloat16"}


def _chain_kind(node) -> str | None:
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return None
    return CHAIN_OPS.get(op_key(node.target) if node.op == "call_function" else node.target)


def _is_dtype_read(value) -> bool:
    """`t.dtype` in an fx graph (export has made it a constant)."""
    return (
        isinstance(value, fx.Node)
        and value.op == "call_function"
        and value.target is getattr
        and value.args[1:] == ("dtype",)
    )


def chain_input(node: fx.Node) -> fx.Node | None:
    """The tensor a chain op applies to (the others are numbers, sizes, dtypes or what a
    dtype is read from), or None when `node` is no chain op."""
    kind = _chain_kind(node)
    if kind is None:
        return None
    if kind != SCALAR:
        return node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    tensors = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
    scalars = all(
        isinstance(a, (int, float, bool))
        for a in (*node.args, *node.kwargs.values())
        if not isinstance(a, fx.Node)
    )
    return tensors[0] if len(tensors) == 1 and scalars else None


def dtype_inputs(node: fx.Node) -> list[fx.Node]:
    """Inputs a cast reads only for their dtype (`x` in `w.type_as(x)`, `x.dtype`)."""
    if _chain_kind(node) != CAST:
        return []
    return [i for i in node.all_input_nodes if i is not node.args[0]]


def chain_break(closure: list[fx.Node], reads) -> fx.Node | None:
    """The first op of a parameter-only closure that is neither a read nor a chain op."""
    return next((n for n in closure if n not in reads and chain_input(n) is None), None)


def _cast_step(node: fx.Node, run_inputs: list) -> ChainOp:
    """A cast as a step; a dtype only known at run time becomes `w.to(RunInput(i))`."""

    def external(ref):
        if ref not in run_inputs:
            run_inputs.append(ref)
        return ChainOp("to", 0, (RunInput(run_inputs.index(ref)),))

    target, rest = op_key(node.target), node.args[1:]
    if target in _DTYPE_METHODS:
        return ChainOp(target, 0)
    if target in ("type_as", aten.type_as.default):
        return external((rest[0].name, "dtype"))
    if target == "to":
        dtype = node.kwargs.get("dtype", rest[0] if len(rest) == 1 else None)
        if _is_dtype_read(dtype) and len(rest) + len(node.kwargs) == 1:
            return external((dtype.name, None))
        if not isinstance(dtype, torch.dtype) or len(rest) + len(node.kwargs) != 1:
            raise Unshardable(
                f"{describe(node)} does more to the parameter than cast it to a dtype "
                "the graph names"
            )
    elif target is aten._to_copy.default:
        if rest or any(v is not None for k, v in node.kwargs.items() if k != "dtype"):
            raise Unshardable(f"{describe(node)} copies the parameter to another layout or device")
    return ChainOp(node.target, 0, tuple(rest), tuple(node.kwargs.items()))


def _on_meta(node: fx.Node, value: torch.Tensor, at: fx.Node) -> torch.Tensor:
    """`node`'s op on a meta tensor standing for its input `at` (static arguments only)."""
    args = fx.node.map_arg(node.args, lambda a: value if a is at else a)
    kwargs = fx.node.map_arg(node.kwargs, lambda a: value if a is at else a)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


def parameter_chain(value, reads, gm, run_inputs: list):
    """(parameter name, steps, the shape the op sees) when `value` is a parameter read or a
    chain of `CHAIN_OPS` from one, else None. Raises Unshardable for a chain whose view does
    more than add or drop size-1 dims. Run-time dtypes are appended to `run_inputs`."""
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
                raise Unshardable(
                    f"{describe(node)} views the parameter with sizes read at run time"
                )
            if node.target is operator.getitem and not _plain_index(node.args[1]):
                raise Unshardable(f"{describe(node)} indexes the parameter with a list or tensor")
            viewed = _on_meta(node, meta, at)
            if [n for n in viewed.shape if n != 1] != big or viewed.numel() != meta.numel():
                raise Unshardable(
                    f"{describe(node)} makes the parameter {tuple(viewed.shape)} from "
                    f"{tuple(meta.shape)}; a shard can only gain or lose size-1 "
                    "dims"
                )
            meta = viewed
        elif kind == CAST:
            steps.append(_cast_step(node, run_inputs))
            if not any(isinstance(a, RunInput) for a in steps[-1].args):
                meta = steps[-1](meta)
            if not meta.dtype.is_floating_point:
                raise Unshardable(f"{describe(node)} casts the parameter to {meta.dtype}")
        else:
            args = list(node.args)
            param_at = args.index(at)
            del args[param_at]
            steps.append(ChainOp(node.target, param_at, tuple(args), tuple(node.kwargs.items())))
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
