"""Where a fused block's cut runs: the hidden (or head) axis of every value of its region.

A fused block's first layers are cut along their outputs: a shard holds g consecutive *groups*
of that axis (one hidden unit of an MLP; one kv head with its q heads in attention). This pass
follows the cut through the region's ops, one rule per kind of op (a table, `RULES`), and finds
for every value the dim the cut lies on and the full extent there.

Invariant: every op it accepts computes, from a shard's slice of its inputs' cut axes, exactly
that slice of its output. Sizes the region names on the cut axis (view, reshape, expand) and
operands from outside the region with an extent on it (a mask or bias per head) are rewritten
per shard (`Rewrite`); everything else runs unchanged. What it cannot prove raises `NotExact`
with the reason, and the block stays unfused.

At aten level (torch.export) every value's shape is known; at fx level only what the view sizes
say (their literal ints; a size read from a tensor is a symbol), so a split of the heads must
name its sizes as ints there, and operands of unknown shape are checked per shard at run time.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F

from rtp_compile.core.ir import RewriteKind, target_name

aten = torch.ops.aten


class NotExact(Exception):
    """The region cannot run shard-wise exactly; the message says why."""


@dataclass(frozen=True)
class Cut:
    """A value cut on `dim` (negative: from the last dim), of full extent `size` there."""

    dim: int
    size: int
    shape: tuple | None = None  # the full shape (sympy sizes) where known


@dataclass(frozen=True)
class Rewrite:
    """A size or operand of a region node that depends on the shard.

    `path`: ("args", i[, j]) or ("kwargs", name[, j]); `kind`: "size" (the full extent `size`
    becomes the shard's groups x size/G), "slice" (narrow the operand's `dim` to the shard's
    groups), "check" (an operand of unknown shape: sliced or broadcast, decided at run time)."""

    path: tuple
    kind: RewriteKind
    size: int
    dim: int = 0
    rank: int | None = None  # check: the most dims the operand may have


POINTWISE = {
    F.gelu,
    F.relu,
    F.silu,
    torch.tanh,
    torch.sigmoid,
    torch.relu,
    torch.erf,
    torch.exp,
    torch.rsqrt,
    torch.neg,
    operator.mul,
    operator.add,
    operator.sub,
    operator.truediv,
    operator.neg,
    operator.pow,
    torch.mul,
    torch.add,
    torch.sub,
    torch.div,
    torch.pow,
    aten.gelu,
    aten.relu,
    aten.silu,
    aten.tanh,
    aten.sigmoid,
    aten.erf,
    aten.exp,
    aten.neg,
    aten.mul,
    aten.add,
    aten.sub,
    aten.div,
    aten.pow,
    aten.rsqrt,
    aten.cos,
    aten.sin,
}
POINTWISE_METHODS = {"mul", "add", "sub", "div", "neg", "pow", "tanh", "sigmoid", "exp", "relu"}
SAME_SHAPE = {aten.contiguous, aten.clone, aten.alias, aten.to, aten._to_copy, aten.type_as}
SAME_SHAPE_METHODS = {"contiguous", "clone", "to", "float", "double", "half", "bfloat16", "type_as"}
OPS = {
    "view": {aten.view, aten.reshape, aten._unsafe_view, torch.reshape, "view", "reshape"},
    "transpose": {aten.transpose, torch.transpose, "transpose"},
    "permute": {aten.permute, torch.permute, "permute"},
    "unsqueeze": {aten.unsqueeze, torch.unsqueeze, "unsqueeze"},
    "expand": {aten.expand, "expand"},
    "slice": {aten.slice},
    "cat": {aten.cat, torch.cat},
    "stack": {aten.stack, torch.stack},
    "softmax": {
        aten._softmax,
        aten.softmax,
        aten._safe_softmax,
        F.softmax,
        torch.softmax,
        "softmax",
    },
    "matmul": {aten.matmul, torch.matmul, operator.matmul},
    "sdpa": {aten.scaled_dot_product_attention, F.scaled_dot_product_attention},
    "dropout": {aten.dropout, F.dropout},
    "masked_fill": {aten.masked_fill, "masked_fill"},
    "unflatten": {aten.unflatten, torch.unflatten, "unflatten"},
    "flatten": {aten.flatten, torch.flatten, "flatten"},
    "select": {aten.select, torch.select, "select"},
    "squeeze": {aten.squeeze, torch.squeeze, "squeeze"},
    "size": {aten.sym_size, "size"},
    "split": {
        aten.split,
        aten.split_with_sizes,
        aten.chunk,
        aten.unbind,
        torch.split,
        torch.chunk,
        torch.unbind,
        "split",
        "chunk",
        "unbind",
    },
    "getitem": {operator.getitem},
    "repeat_interleave": {aten.repeat_interleave, torch.repeat_interleave, "repeat_interleave"},
    "view_as_complex": {aten.view_as_complex, torch.view_as_complex},
    "view_as_real": {aten.view_as_real, torch.view_as_real},
}
ATTENTION = OPS["sdpa"] | OPS["softmax"] | OPS["matmul"]


def op_kind(node: fx.Node) -> str | None:
    """The rule a node falls under, by what it calls at any capture level."""
    if node.op not in ("call_function", "call_method"):
        return None
    target = node.target
    key = target if node.op == "call_method" else getattr(target, "overloadpacket", target)
    for kind, targets in OPS.items():
        if key in targets:
            return kind
    if key in POINTWISE or (node.op == "call_method" and key in POINTWISE_METHODS):
        return "pointwise"
    if key in SAME_SHAPE or (node.op == "call_method" and key in SAME_SHAPE_METHODS):
        return "same_shape"
    return None


def is_attention(node: fx.Node) -> bool:
    return op_kind(node) in ("sdpa", "softmax", "matmul")


# -- shapes ------------------------------------------------------------------------------------
def _sym(v):
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return sympy.Integer(v)
    if isinstance(v, torch.SymInt):
        return sympy.sympify(v.node.expr)
    if isinstance(v, fx.Node):  # a size read at fx level: a symbol of its own
        return sympy.Symbol(v.name, positive=True, integer=True)
    return None


def meta_shape(node) -> tuple | None:
    """The node's shape as sympy sizes, from export's metadata (None at fx level)."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(_sym(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


def _known_shape(node, gm: fx.GraphModule) -> tuple | None:
    shape = meta_shape(node)
    if shape is None and isinstance(node, fx.Node) and node.op == "get_attr":
        value = operator.attrgetter(node.target)(gm)
        if isinstance(value, torch.Tensor):
            shape = tuple(sympy.Integer(s) for s in value.shape)
    return shape


def _same(a, b) -> bool:
    return a is not None and b is not None and sympy.expand(a - b) == 0


def _prod(sizes):
    return None if any(s is None for s in sizes) else sympy.Mul(*sizes)


def _resized(shape: tuple | None, dim: int, size) -> tuple | None:
    """`shape` with its dim `dim` (negative) of `size` (sympy); None where unknown."""
    if shape is None or size is None:
        return None
    return shape[: len(shape) + dim] + (size,) + shape[len(shape) + dim + 1 :]


def _own_size(node: fx.Node, dim: int, rank: int):
    """A size of its own for dim `dim` of `node`'s value (a symbol, as at fx level)."""
    return sympy.Symbol(f"{node.name}_{rank + dim}", positive=True, integer=True)


def _neg(dim: int, rank: int | None, what: str) -> int:
    if dim < 0:
        return dim
    if rank is None:
        raise NotExact(f"{what}: a positive dim on a value whose rank is unknown at fx level")
    return dim - rank


# -- the walk ----------------------------------------------------------------------------------
class CutWalk:
    """Propagates cuts through `region` (in graph order) from the heads' outputs."""

    def __init__(
        self,
        gm,
        region: list[fx.Node],
        heads: dict[fx.Node, int],
        tail_input: fx.Node,
        tail_width: int,
    ):
        self.gm, self.tail_input, self.tail_width = gm, tail_input, tail_width
        self.members = set(region)
        self.state: dict[fx.Node, Cut | None] = {
            h: Cut(-1, width, meta_shape(h)) for h, width in heads.items()
        }
        self.rewrites: dict[str, list[Rewrite]] = {}
        for node in region:
            self.state[node] = self._rule(node)
        out = self.state.get(tail_input)
        if not (isinstance(out, Cut) and out.dim == -1 and out.size == tail_width):
            raise NotExact(
                f"the cut does not reach {tail_input.name}'s last dim, which the last layer reads"
            )

    def groups(self) -> int:
        """G: the finest grouping every cut extent is a whole multiple of."""
        return math.gcd(*[c.size for c in self.state.values() if isinstance(c, Cut)])

    # one region input: Cut, None (shard-invariant) or "outside"
    def _of(self, value):
        return self.state[value] if value in self.state else "outside"

    def _cut_arg(self, node, value) -> Cut:
        cut = self._of(value)
        if not isinstance(cut, Cut):
            raise NotExact(f"{node.name} ({node.target}) needs its input cut on the head axis")
        return cut

    def _rewrite(self, node, rewrite: Rewrite):
        self.rewrites.setdefault(node.name, []).append(rewrite)

    def _operand(self, node, path, value, cut: Cut):
        """An operand broadcast against a cut value: fine with no extent on the cut dim,
        sliced per shard with the full extent, checked at run time when its shape is unknown."""
        if not isinstance(value, fx.Node):
            return
        mine = self._of(value)
        if isinstance(mine, Cut):
            if (mine.dim, mine.size) != (cut.dim, cut.size):
                raise NotExact(f"{node.name} combines values cut on different axes")
            return
        val = value.meta.get("val")
        if val is not None and not isinstance(val, torch.Tensor):
            return  # a number (a scale from a size): nothing to cut
        shape = _known_shape(value, self.gm)
        if shape is None:
            rank = len(cut.shape) if cut.shape else None
            self._rewrite(node, Rewrite(path, RewriteKind.CHECK, cut.size, cut.dim, rank))
        elif len(shape) < -cut.dim or shape[cut.dim] == 1:
            return
        elif _same(shape[cut.dim], sympy.Integer(cut.size)):
            self._rewrite(node, Rewrite(path, RewriteKind.SLICE, cut.size, cut.dim))
        else:
            raise NotExact(
                f"{node.name}'s operand {value.name} has extent {shape[cut.dim]} on "
                f"the head axis of extent {cut.size}"
            )

    def _rule(self, node: fx.Node):
        inputs = [self._of(i) for i in node.all_input_nodes]
        if not any(isinstance(c, Cut) for c in inputs):
            return None  # depends on the shard nowhere (a size of an uncut dim, a constant)
        kind = op_kind(node)
        if kind is None:
            raise NotExact(
                f"{node.name} ({target_name(node)}) has "
                f"no rule for running on a slice of the head / hidden axis"
            )
        cut = getattr(self, f"_{kind}")(node)
        meta = meta_shape(node)
        if cut is not None and meta is not None:
            if len(meta) < -cut.dim or not _same(meta[cut.dim], sympy.Integer(cut.size)):
                raise NotExact(f"{node.name}: the cut extent {cut.size} disagrees with its shape")
            cut = Cut(cut.dim, cut.size, meta)
        return cut

    # -- rules: each returns the node's Cut (or None) or raises NotExact ----------------------
    def _pointwise(self, node):
        """Elementwise with broadcasting: operands are cut alike or have no extent on the cut.
        At fx level the output keeps the cut value's rank (checked at run time) and its other
        sizes become unknown where an operand of unknown shape may broadcast them."""
        cut = next(c for c in map(self._of, node.all_input_nodes) if isinstance(c, Cut))
        for i, a in enumerate(node.args):
            self._operand(node, ("args", i), a, cut)
        for k, a in node.kwargs.items():
            self._operand(node, ("kwargs", k), a, cut)
        shape = cut.shape
        operands = [
            _known_shape(a, self.gm)
            for a in node.all_input_nodes
            if not isinstance(self._of(a), Cut)
        ]
        if shape and any(o is not None and len(o) > len(shape) for o in operands):
            shape = None
        if shape and any(r.kind == RewriteKind.CHECK for r in self.rewrites.get(node.name, ())):
            shape = tuple(
                s
                if d == len(shape) + cut.dim
                else sympy.Symbol(f"{node.name}_{d}", positive=True, integer=True)
                for d, s in enumerate(shape)
            )
        return Cut(cut.dim, cut.size, shape)

    def _same_shape(self, node):
        """A copy or cast of its first argument; a second tensor (type_as, to(other)) gives
        only its dtype and device, so it may be cut or not (`cos.type_as(q)`: no cut)."""
        cut = self._of(node.args[0])
        return cut if isinstance(cut, Cut) else None

    def _dropout(self, node):
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        if p != 0:
            raise NotExact(
                f"{node.name}: dropout p={p} (backward recomputes the region, "
                f"which would draw a different mask)"
            )
        return self._cut_arg(node, node.args[0])

    def _sizes_arg(self, node):
        """(sizes, path of entry j) of a view / reshape / expand, at any capture level."""
        if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)):
            return list(node.args[1]), lambda j: ("args", 1, j)
        return list(node.args[1:]), lambda j: ("args", 1 + j)

    def _view(self, node):
        cut = self._cut_arg(node, node.args[0])
        sizes, path = self._sizes_arg(node)
        out = meta_shape(node) or tuple(None if s == -1 else _sym(s) for s in sizes)
        return self._regroup(node, cut, out, sizes, path)

    def _unflatten(self, node):
        """unflatten(x, dim, sizes): a view of the cut dim into `sizes`, or a dim beside it."""
        cut = self._cut_arg(node, node.args[0])
        rank = len(cut.shape) if cut.shape else None
        dim, sizes = _neg(node.args[1], rank, node.name), list(node.args[2])
        if dim != cut.dim:
            return Cut(cut.dim - (len(sizes) - 1) if dim > cut.dim else cut.dim, cut.size)
        known = [s for s in sizes if s != -1]
        if -1 in sizes and all(isinstance(s, int) for s in known):  # the cut dim's size is known
            sizes = [cut.size // math.prod(known) if s == -1 else s for s in sizes]
        lead = (
            cut.shape[: len(cut.shape) + dim]
            if cut.shape
            else (sympy.Symbol(f"{node.name}_lead", positive=True, integer=True),)
        )
        out = meta_shape(node) or lead + tuple(None if s == -1 else _sym(s) for s in sizes) + (
            cut.shape[len(cut.shape) + dim + 1 :] if cut.shape else ()
        )
        lead = len(out) - len(sizes) - (-dim - 1)
        new = self._regroup(
            node,
            cut,
            out,
            [None] * lead + sizes + [None] * (-dim - 1),
            lambda j: ("args", 2, j - lead),
        )
        return new if cut.shape else Cut(new.dim, new.size)  # the rank stays unknown

    def _flatten(self, node):
        """flatten(x, start, end): the cut must open the merged range (a shard stays one
        contiguous block of it) and the sizes after it in the range must be known."""
        cut = self._cut_arg(node, node.args[0])
        rank = len(cut.shape) if cut.shape else None
        start = _neg(node.args[1] if len(node.args) > 1 else 0, rank, node.name)
        end = _neg(node.args[2] if len(node.args) > 2 else -1, rank, node.name)
        if not start <= cut.dim <= end:
            return Cut(cut.dim + (end - start) if cut.dim < start else cut.dim, cut.size)
        if cut.dim != start or (end > start and not cut.shape):
            raise NotExact(f"{node.name} flattens the head axis into the dims before it")
        inner = (
            _prod(cut.shape[len(cut.shape) + start + 1 : len(cut.shape) + end + 1])
            if end > start
            else sympy.Integer(1)
        )
        if not inner.is_Integer:
            raise NotExact(f"{node.name}: the sizes it flattens into the heads are unknown")
        return Cut(end, cut.size * int(inner))

    def _squeeze(self, node):
        """squeeze(x, dim) of a size-1 dim beside the cut (export's shapes say which)."""
        cut = self._cut_arg(node, node.args[0])
        meta = meta_shape(node)
        dims = node.args[1] if len(node.args) > 1 else None
        if not (cut.shape and meta and isinstance(dims, int)):
            raise NotExact(f"{node.name}: squeeze needs its dim and export's shapes")
        dim = _neg(dims, len(cut.shape), node.name)
        if dim == cut.dim:
            raise NotExact(f"{node.name} squeezes the head axis")
        removed = len(meta) < len(cut.shape)
        return Cut(cut.dim + 1 if removed and dim > cut.dim else cut.dim, cut.size)

    def _select(self, node):
        cut = self._cut_arg(node, node.args[0])
        dim = _neg(node.args[1], len(cut.shape) if cut.shape else None, node.name)
        if dim == cut.dim:
            _packed(node)
        return Cut(cut.dim + 1 if dim > cut.dim else cut.dim, cut.size)

    def _regroup(self, node, cut: Cut, out: tuple, sizes: list, path) -> Cut:
        """A view of the cut value as `out` (sympy sizes, None where unknown; `sizes`: the
        node's own size arguments, entry i at `path(i)`): the cut goes to the outermost dim j
        where out[j:] holds exactly the cut dim and the dims after it."""
        if cut.dim == -1:
            trail = ()
        elif cut.shape is None:
            raise NotExact(f"{node.name}: the sizes after the cut are unknown")
        else:
            trail = cut.shape[len(cut.shape) + cut.dim + 1 :]
        target = _prod((sympy.Integer(cut.size), *trail))
        if node is self.tail_input:  # the last layer reads its last dim
            out = out[:-1] + (sympy.Integer(self.tail_width),)
        found = None
        for j in range(-1, -len(out) - 1, -1):
            if out[j] is not None and out[j].is_Integer and _same(_prod(out[j:]), target):
                found = j  # the outermost match: size-1 dims after it stay whole
        if found is None:
            raise NotExact(
                f"{node.name}: its sizes {list(sizes)} do not show where the head "
                f"axis goes (at fx level they must be ints; pass example_inputs to "
                f"capture with shapes)"
            )
        entry = sizes[len(sizes) + found]
        if entry is None:
            raise NotExact(f"{node.name} moves the head axis out of the sizes it names")
        if entry != -1:
            self._rewrite(
                node, Rewrite(path(len(sizes) + found), RewriteKind.SIZE, int(out[found]))
            )
        lead = len(out) + found  # a -1 before the cut is a leading size of its own
        shape = tuple(
            sympy.Symbol(f"{node.name}_{d}", positive=True, integer=True)
            if s is None and d < lead
            else s
            for d, s in enumerate(out)
        )
        return Cut(found, int(out[found]), shape if None not in shape else None)

    def _expand(self, node):
        cut = self._cut_arg(node, node.args[0])
        sizes, path = self._sizes_arg(node)
        entry = sizes[len(sizes) + cut.dim]
        if entry != -1:
            if isinstance(entry, int) and entry != cut.size:
                raise NotExact(f"{node.name} expands the head axis")
            self._rewrite(node, Rewrite(path(len(sizes) + cut.dim), RewriteKind.SIZE, cut.size))
        return Cut(cut.dim, cut.size)

    def _transpose(self, node):
        cut = self._cut_arg(node, node.args[0])
        rank = len(cut.shape) if cut.shape else None
        a, b = (_neg(d, rank, node.name) for d in node.args[1:3])
        dim = b if cut.dim == a else a if cut.dim == b else cut.dim
        shape = None
        if cut.shape:
            shape = list(cut.shape)
            shape[a], shape[b] = shape[b], shape[a]
        return Cut(dim, cut.size, tuple(shape) if shape else None)

    def _permute(self, node):
        cut = self._cut_arg(node, node.args[0])
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else node.args[1:]
        rank = len(dims)
        order = [_neg(d, rank, node.name) for d in dims]
        return Cut(
            order.index(cut.dim) - rank,
            cut.size,
            tuple(cut.shape[d] for d in order) if cut.shape else None,
        )

    def _view_as_complex(self, node):
        """Pairs of the last dim as complex numbers (torchtitan's rotary): the pairs stay beside
        the cut, which keeps its place counted from the dims before them."""
        cut = self._cut_arg(node, node.args[0])
        if cut.dim == -1:
            raise NotExact(f"{node.name} reads the head axis as (real, imaginary) pairs")
        return Cut(cut.dim + 1, cut.size, cut.shape[:-1] if cut.shape else None)

    def _view_as_real(self, node):
        cut = self._cut_arg(node, node.args[0])
        return Cut(cut.dim - 1, cut.size, cut.shape + (sympy.Integer(2),) if cut.shape else None)

    def _unsqueeze(self, node):
        cut = self._cut_arg(node, node.args[0])
        rank = len(cut.shape) if cut.shape else None
        d = node.args[1]
        d = d - (rank + 1) if d >= 0 and rank is not None else d
        if d >= 0:
            raise NotExact(f"{node.name}: a positive dim on a value whose rank is unknown")
        return Cut(cut.dim if d < cut.dim else cut.dim - 1, cut.size)

    def _slice(self, node):
        cut = self._cut_arg(node, node.args[0])
        rank = len(cut.shape) if cut.shape else None
        dim, start, end, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1 :])[:4]
        if _neg(dim, rank, node.name) == cut.dim and not (
            start in (0, None)
            and (end is None or (isinstance(end, int) and end >= cut.size))
            and step in (1, None)
        ):
            raise NotExact(f"{node.name} slices the head axis")
        return Cut(cut.dim, cut.size)

    def _repeat_interleave(self, node):
        """Each head repeated r times in place (GQA's kv heads for their q heads): a shard's
        whole groups, repeated, are the same groups of the repeated axis."""
        cut = self._cut_arg(node, node.args[0])
        names = ("repeats", "dim", "output_size")
        args = dict(zip(names, node.args[1:])) | {
            k: v for k, v in node.kwargs.items() if k in names
        }
        repeats, dim = args.get("repeats"), args.get("dim")
        if not isinstance(repeats, int) or dim is None:
            raise NotExact(f"{node.name}: repeat_interleave with tensor repeats or without a dim")
        dim = _neg(dim, len(cut.shape) if cut.shape else None, node.name)
        shape = _resized(cut.shape, dim, cut.shape[dim] * repeats) if cut.shape else None
        if dim != cut.dim:
            return Cut(cut.dim, cut.size, shape)
        if args.get("output_size") is not None:
            path = ("args", 3) if len(node.args) > 3 else ("kwargs", "output_size")
            self._rewrite(node, Rewrite(path, RewriteKind.SIZE, cut.size * repeats))
        return Cut(cut.dim, cut.size * repeats, shape)

    def _cut_alike(self, node) -> tuple[list[Cut], int]:
        """(cuts, dim) of cat / stack: every tensor cut alike, or NotExact."""
        cuts = [self._of(t) for t in node.args[0]]
        cut = cuts[0]
        if not all(isinstance(c, Cut) and (c.dim, c.size) == (cut.dim, cut.size) for c in cuts):
            raise NotExact(f"{node.name} joins values not cut alike")
        return cuts, node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)

    def _stack(self, node):
        """Values cut alike stacked on a new dim (torchtune's rotary pairs), beside the cut."""
        cuts, dim = self._cut_alike(node)
        cut = cuts[0]
        rank = len(cut.shape) if cut.shape else None
        dim = _neg(dim, None if rank is None else rank + 1, node.name)
        shape = None
        if cut.shape:
            at = rank + 1 + dim
            shape = cut.shape[:at] + (sympy.Integer(len(cuts)),) + cut.shape[at:]
        return Cut(cut.dim if dim < cut.dim else cut.dim - 1, cut.size, shape)

    def _cat(self, node):
        cuts, dim = self._cut_alike(node)
        cut = cuts[0]
        dim = _neg(dim, len(cut.shape) if cut.shape else None, node.name)
        if dim == cut.dim:
            raise NotExact(f"{node.name} concatenates along the head axis")
        if not all(c.shape and len(c.shape) == len(cut.shape) for c in cuts):
            return Cut(cut.dim, cut.size)
        return Cut(cut.dim, cut.size, _resized(cut.shape, dim, sum(c.shape[dim] for c in cuts)))

    @staticmethod
    def _dim_is_cut(node, cut) -> bool:
        """Whether the op's `dim` (second argument or keyword; none: all dims) is the cut axis."""
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        return dim is None or _neg(dim, len(cut.shape) if cut.shape else None, node.name) == cut.dim

    def _softmax(self, node):
        cut = self._cut_arg(node, node.args[0])
        if self._dim_is_cut(node, cut):
            raise NotExact(f"{node.name}: softmax over the head / hidden axis mixes the shards")
        return cut

    def _matmul(self, node):
        a, b = (self._of(x) for x in node.args[:2])
        if not (
            isinstance(a, Cut) and isinstance(b, Cut) and a.dim == b.dim <= -3 and a.size == b.size
        ):
            raise NotExact(f"{node.name}: a matmul must batch over the head axis of both sides")
        both = a.shape and b.shape and len(a.shape) == len(b.shape)
        return Cut(a.dim, a.size, a.shape[:-1] + b.shape[-1:] if both else None)

    def _sdpa(self, node):
        names = ("query", "key", "value", "attn_mask", "dropout_p")
        args = dict(zip(names, node.args)) | {k: v for k, v in node.kwargs.items() if k in names}
        q, k, v = (self._cut_arg(node, args[n]) for n in names[:3])
        if not q.dim == k.dim == v.dim == -3:
            raise NotExact(f"{node.name}: q, k and v must be cut on their head axis")
        if args.get("dropout_p", 0.0) != 0:
            raise NotExact(f"{node.name}: attention dropout (backward recomputes it)")
        if args.get("attn_mask") is not None:
            path = ("args", 3) if len(node.args) > 3 else ("kwargs", "attn_mask")
            self._operand(node, path, args["attn_mask"], q)
        return Cut(-3, q.size, q.shape[:-1] + v.shape[-1:] if q.shape and v.shape else None)

    def _masked_fill(self, node):
        cut = self._cut_arg(node, node.args[0])
        self._operand(node, ("args", 1), node.args[1], cut)
        return cut

    def _size(self, node):
        if self._dim_is_cut(node, self._cut_arg(node, node.args[0])):
            raise NotExact(f"{node.name} reads the extent of the head / hidden axis")
        return None

    def _split(self, node):
        """split / chunk / unbind beside the cut (rotary's halves of each head): every piece
        keeps the cut (a piece of unbind loses the dim it was taken on). The node's value is
        the pieces; its Cut is each piece's, read by `_getitem`."""
        cut = self._cut_arg(node, node.args[0])
        at = 1 if _unbinds(node) else 2
        dim = node.args[at] if len(node.args) > at else node.kwargs.get("dim", 0)
        dim = _neg(dim, len(cut.shape) if cut.shape else None, node.name)
        if dim == cut.dim:
            _packed(node)
        shape = cut.shape
        if _unbinds(node):
            return Cut(
                cut.dim + 1 if dim > cut.dim else cut.dim,
                cut.size,
                shape[: len(shape) + dim] + shape[len(shape) + dim + 1 :] if shape else None,
            )
        return Cut(
            cut.dim,
            cut.size,
            _resized(shape, dim, _own_size(node, dim, len(shape))) if shape else None,
        )

    def _getitem(self, node):
        """One piece of a split beside the cut: the cut of every piece."""
        source, index = node.args
        if op_kind(source) != "split" or not isinstance(index, int):
            raise NotExact(f"{node.name} indexes a value cut on the head axis")
        return self._cut_arg(node, source)


def _unbinds(node: fx.Node) -> bool:
    """unbind: its pieces lose the dim they are taken on (split, chunk: they keep it)."""
    return node.op != "call_module" and target_name(node).split(".")[0] == "unbind"


def _packed(node: fx.Node):
    """A split / select of the head axis itself: what unpacks q, k, v from one weight."""
    raise NotExact(
        f"{node.name} splits one packed projection (q, k, v in one weight): a "
        f"shard of it would not hold matching q, k and v heads"
    )
