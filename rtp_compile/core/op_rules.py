"""What each weight-bearing op computes with one shard of its parameters.

One rule per kind of computation (linear, conv, embedding, elementwise), whatever the capture level
that produced the node (adapters in `passes/analysis/match.py` translate nodes into `OpCall`s).
A rule says which shard dims it supports (its *modes*), how step outputs combine (concatenate the
partial outputs, or sum them), and gives two functions written in plain torch ops:

- `forward_step`: the partial output of one step; codegen traces it into the emitted graph, so the
  per-rank code shows the real ops with the rank's offsets as constants;
- `input_grad` / `weight_grads`: run eagerly by the rotation unit's backward: the step's part of
  the input gradient, added into `dx`, and this rank's gradient of the shard, added in place into
  the travelling accumulator (so no separate gradient buffer is allocated).

Shards arrive padded (`rtp_compile.core.layout`); the steps read only their real part.

An elementwise op may read its parameter through a chain (`w.to(x.dtype)`, `1 + w`,
`w.view(1, 1, -1)`): `OpCall.options` then holds the chain's ops (`ChainOp`) and the shape the
op sees, and the rule applies them to each shard's real part; its gradient goes back through
them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from rtp_compile.core.graph_ops import affine
from rtp_compile.core.ir import CombineMode, Split
from rtp_compile.core.layout import Slot, real_part


@dataclass(frozen=True)
class Combine:
    """How step outputs form the op's output: concatenated along `dim`, or summed."""

    how: CombineMode
    dim: int = -1


@dataclass
class OpCall:
    """A weight-bearing node seen through its rule: the activation, the parameters by role."""

    rule: Rule
    input: Any  # name of the activation node the op consumes
    params: dict[str, str]  # role ("weight", "bias") -> parameter name
    options: dict = field(default_factory=dict)
    # what the parameter chain reads at run time, as (node name, attribute or None): the dtype
    # of `w.to(x.dtype)` or `w.type_as(x)`; the unit's marker carries their values
    run_inputs: list[tuple[str, str | None]] = field(default_factory=list)

    def run_options(self, values) -> dict:
        """`options` with the run-time inputs' values (proxies when traced) under "run_inputs"."""
        return {**self.options, "run_inputs": tuple(values)} if self.run_inputs else self.options


@dataclass(frozen=True)
class RunInput:
    """An argument of a `ChainOp` known only at run time: the call's run-time input `index`."""

    index: int


@dataclass(frozen=True)
class ChainOp:
    """One op between a parameter's read and its elementwise use, as the graph calls it:
    `target` (a function, or a tensor method's name) with the parameter so far inserted into
    `args` at `param_at`; `RunInput`s in `args` / `kwargs` are read at run time."""

    target: Any
    param_at: int
    args: tuple = ()
    kwargs: tuple = ()  # (name, value) pairs

    def __call__(self, w, run_inputs=()):
        value = lambda a: run_inputs[a.index] if isinstance(a, RunInput) else a  # noqa: E731
        args = [value(a) for a in self.args]
        args.insert(self.param_at, w)
        kwargs = {k: value(v) for k, v in self.kwargs}
        if isinstance(self.target, str):
            return getattr(args[0], self.target)(*args[1:], **kwargs)
        return self.target(*args, **kwargs)


class Rule:
    """Base of the op rules: subclasses fill in modes, combine and the two step functions."""

    name = "rule"

    def modes(self, shapes: dict[str, tuple], options: dict) -> dict[str, dict[str, int]]:
        """Mode name -> shard dim of each parameter role, in order of preference."""
        raise NotImplementedError

    def combine(self, mode: str, options: dict, shapes: dict[str, tuple]) -> Combine:
        raise NotImplementedError

    def forward_step(self, mode, options, x, shards, slots, shapes):
        """This step's partial output, or None when the shard is all padding."""
        raise NotImplementedError

    def input_grad(self, mode, options, dy, x, shards, slots, shapes, dx) -> None:
        """Add this step's part of the input gradient into `dx`."""
        raise NotImplementedError

    def weight_grads(self, mode, options, dy, x, shards, slots, shapes, into) -> None:
        """Add this rank's gradient of each shard's real part into `into[role]` (in place)."""
        raise NotImplementedError


def _flat2d(t: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [rows, d] (also for d = 0, an all-padding shard)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


class LinearRule(Rule):
    """y = x Wᵀ + b (W stored [out, in]) or y = x W + b (`transposed`: W stored [in, out])."""

    name = "linear"

    def modes(self, shapes, options):
        out_dim, in_dim = (1, 0) if options.get("transposed") else (0, 1)
        return {Split.COL: {"weight": out_dim, "bias": 0}, Split.ROW: {"weight": in_dim, "bias": 0}}

    def combine(self, mode, options, shapes):
        return Combine(CombineMode.CAT, -1) if mode == Split.COL else Combine(CombineMode.SUM)

    @staticmethod
    def weight_as_out_in(options, shard, dim, slot):
        """The real part of a weight shard, viewed [out, in] whatever its storage."""
        w = real_part(shard, dim, slot)
        return w.t() if options.get("transposed") else w  # always [out, in] from here on

    def forward_step(self, mode, options, x, shards, slots, shapes):
        if mode == Split.COL:
            w = self.weight_as_out_in(
                options, shards["weight"], self.weight_dim(mode, options), slots["weight"]
            )
            b = real_part(shards["bias"], 0, slots["bias"]) if "bias" in shards else None
            return F.linear(x, w, b)
        ws = slots["weight"]
        return self.row_partial(options, x.narrow(-1, ws.offset, ws.valid), shards, slots, shapes)

    def weight_dim(self, mode, options):
        """The stored weight's dim that `mode` cuts."""
        return self.modes({}, options)[mode]["weight"]

    def row_partial(self, options, x_part, shards, slots, shapes):
        """Row split, given the input's slice for this shard: x_s W_sᵀ (+ the bias in its slot)."""
        w = self.weight_as_out_in(
            options, shards["weight"], self.weight_dim(Split.ROW, options), slots["weight"]
        )
        y = F.linear(x_part, w)
        if "bias" in shards:
            y = y + _bias_in_slot(shards["bias"], slots["bias"], shapes["bias"][0])
        return y

    def input_grad(self, mode, options, dy, x, shards, slots, shapes, dx):
        ws = slots["weight"]
        w = self.weight_as_out_in(options, shards["weight"], self.weight_dim(mode, options), ws)
        if mode == Split.COL:
            dx += dy.narrow(-1, ws.offset, ws.valid) @ w
        else:
            dx.narrow(-1, ws.offset, ws.valid).add_(dy @ w)

    def weight_grads(self, mode, options, dy, x, shards, slots, shapes, into):
        ws = slots["weight"]
        if mode == Split.COL:
            self.col_weight_grads(options, dy.narrow(-1, ws.offset, ws.valid), x, into)
        else:
            self.row_weight_grads(options, dy, x.narrow(-1, ws.offset, ws.valid), slots, into)

    @staticmethod
    def col_weight_grads(options, dy_part, x, into):
        """Column split, given the output gradient's slice for this shard."""
        dy2 = _flat2d(dy_part)
        _add_weight_grad(options, into["weight"], dy2, _flat2d(x))
        if "bias" in into:
            into["bias"].add_(dy2.sum(0))

    @staticmethod
    def row_weight_grads(options, dy, x_part, slots, into):
        """Row split, given the input's slice for this shard."""
        dy2 = _flat2d(dy)
        _add_weight_grad(options, into["weight"], dy2, _flat2d(x_part))
        if "bias" in into:
            bs = slots["bias"]
            into["bias"].add_(dy2.narrow(1, bs.offset, bs.valid).sum(0))


def _add_weight_grad(options, gw, dy2, x2) -> None:
    """gw += dy2ᵀ x2 ([out, in]), or its transpose when the weight is stored [in, out]. Written
    into gw itself, never through a transposed view of it: functionalization (AOT autograd)
    replays a view chain's inverse with `view`, which a transposed accumulator cannot take."""
    if options.get("transposed"):
        gw.addmm_(x2.t(), dy2)
    else:
        gw.addmm_(dy2.t(), x2)


def _bias_in_slot(bias_shard, slot: Slot, total: int):
    """A bias shard zero-padded to the full output width, so a summed step adds it once."""
    return F.pad(real_part(bias_shard, 0, slot), (slot.offset, total - slot.offset - slot.valid))


class ConvRule(Rule):
    """torch.convolution with groups=1: out-channel split (concat) or in-channel split (sum)."""

    name = "conv"

    def modes(self, shapes, options):
        out_dim, in_dim = (1, 0) if options["transposed"] else (0, 1)
        return {Split.COL: {"weight": out_dim, "bias": 0}, Split.ROW: {"weight": in_dim, "bias": 0}}

    def combine(self, mode, options, shapes):
        return Combine(CombineMode.CAT, 1) if mode == Split.COL else Combine(CombineMode.SUM)

    @staticmethod
    def _args(o):
        return (o["stride"], o["padding"], o["dilation"], o["transposed"], o["output_padding"], 1)

    def forward_step(self, mode, options, x, shards, slots, shapes):
        wdim = self.modes(shapes, options)[mode]["weight"]
        ws = slots["weight"]
        w = real_part(shards["weight"], wdim, ws)
        if mode == Split.COL:
            if ws.valid == 0:
                return None  # an all-padding shard adds no output channel
            b = real_part(shards["bias"], 0, slots["bias"]) if "bias" in shards else None
            return torch.convolution(x, w, b, *self._args(options))
        y = (
            None
            if ws.valid == 0
            else torch.convolution(x.narrow(1, ws.offset, ws.valid), w, None, *self._args(options))
        )
        if "bias" in shards and slots["bias"].valid:
            bias = _bias_in_slot(shards["bias"], slots["bias"], shapes["bias"][0])
            bias = bias.view([-1] + [1] * len(options["stride"]))
            y = bias if y is None else y + bias
        return y

    def _operands(self, mode, options, dy, x, shards, slots, shapes):
        """(output grad, input, weight) of this step's convolution."""
        wdim = self.modes(shapes, options)[mode]["weight"]
        ws = slots["weight"]
        w = real_part(shards["weight"], wdim, ws)
        if mode == Split.COL:
            return dy.narrow(1, ws.offset, ws.valid), x, w
        return dy, x.narrow(1, ws.offset, ws.valid), w

    def input_grad(self, mode, options, dy, x, shards, slots, shapes, dx):
        if slots["weight"].valid == 0:
            return
        g, inp, w = self._operands(mode, options, dy, x, shards, slots, shapes)
        gx = torch.ops.aten.convolution_backward(
            g, inp, w, None, *self._args(options), [True, False, False]
        )[0]
        ws = slots["weight"]
        (dx if mode == Split.COL else dx.narrow(1, ws.offset, ws.valid)).add_(gx)

    def weight_grads(self, mode, options, dy, x, shards, slots, shapes, into):
        if slots["weight"].valid:
            g, inp, w = self._operands(mode, options, dy, x, shards, slots, shapes)
            gw = torch.ops.aten.convolution_backward(
                g, inp, w, None, *self._args(options), [False, True, False]
            )[1]
            into["weight"].add_(gw)
        if "bias" in into:
            spatial = [d for d in range(dy.dim()) if d != 1]
            bs = slots["bias"]
            into["bias"].add_(dy.narrow(1, bs.offset, bs.valid).sum(spatial))


class EmbeddingRule(Rule):
    """e = W[idx], split along the embedding dim (dim 1 of W)."""

    name = "embedding"

    def modes(self, shapes, options):
        return {Split.COL: {"weight": 1}}

    def combine(self, mode, options, shapes):
        return Combine(CombineMode.CAT, -1)

    def forward_step(self, mode, options, x, shards, slots, shapes):
        return F.embedding(x, real_part(shards["weight"], 1, slots["weight"]))

    def input_grad(self, mode, options, dy, x, shards, slots, shapes, dx):
        pass  # indices have no gradient

    def weight_grads(self, mode, options, dy, x, shards, slots, shapes, into):
        ws = slots["weight"]
        padding_idx = options.get("padding_idx")
        into["weight"].add_(
            torch.ops.aten.embedding_dense_backward(
                dy.narrow(-1, ws.offset, ws.valid),
                x,
                shapes["weight"][0],
                -1 if padding_idx is None else padding_idx,
                options.get("scale_grad_by_freq", False),
            )
        )


class ElementwiseRule(Rule):
    """y = x * weight + bias (either may be absent), split along one dim of the parameters.

    options["dim"]: as in `affine`. Every parameter role shares the same shape. A parameter
    read through a chain: options["shape"], the shape the op sees (the parameter's with size-1
    dims added or dropped), and options["chains"][role], the `ChainOp`s applied after that view.
    """

    name = "elementwise"

    def modes(self, shapes, options):
        shape = next(iter(shapes.values()))
        if options["dim"] >= 0:
            return {"dim0": {role: 0 for role in shapes}}
        return {
            f"dim{d}": {role: d for role in shapes}
            for d in reversed(range(len(shape)))
            if shape[d] > 1
        }

    def combine(self, mode, options, shapes):
        return Combine(CombineMode.CAT, self._mode_dims(mode, options, shapes)[1])

    @staticmethod
    def _seen_dim(options, shape, pdim):
        """The dim of the shape the op sees that parameter dim `pdim` becomes (the view keeps
        the order of the dims larger than 1)."""
        seen = options.get("shape", shape)
        if seen == shape:
            return pdim, seen
        big = [d for d, n in enumerate(seen) if n != 1]
        return big[[d for d, n in enumerate(shape) if n != 1].index(pdim)], seen

    def _mode_dims(self, mode, options, shapes):
        shape = next(iter(shapes.values()))
        pdim = int(mode[3:])
        if options["dim"] >= 0:
            return pdim, options["dim"]
        sdim, seen = self._seen_dim(options, shape, pdim)
        return pdim, sdim - len(seen)

    def _seen(self, role, w, pdim, valid, options, shapes):
        """A shard's real part (`valid` long on `pdim`) as the op uses it: viewed, then through
        its chain."""
        if "shape" in options:
            sdim, seen = self._seen_dim(options, shapes[role], pdim)
            w = w.reshape(seen[:sdim] + (valid,) + seen[sdim + 1 :])
        for step in options.get("chains", {}).get(role, ()):
            w = step(w, options.get("run_inputs", ()))
        return w

    def _params(self, pdim, slot, shards, options, shapes):
        return {
            role: self._seen(
                role, real_part(shards[role], pdim, slot), pdim, slot.valid, options, shapes
            )
            for role in ("weight", "bias")
            if role in shards
        }

    def forward_step(self, mode, options, x, shards, slots, shapes):
        pdim, xdim = self._mode_dims(mode, options, shapes)
        slot = next(iter(slots.values()))
        x_s = x.narrow(xdim, slot.offset, slot.valid)
        params = self._params(pdim, slot, shards, options, shapes)
        return affine(x_s, params.get("weight"), params.get("bias"), options["dim"])

    def _step_operands(self, mode, options, dy, x, slots, shapes):
        pdim, xdim = self._mode_dims(mode, options, shapes)
        slot = next(iter(slots.values()))
        return (
            pdim,
            xdim,
            slot,
            x.narrow(xdim, slot.offset, slot.valid),
            dy.narrow(xdim, slot.offset, slot.valid),
        )

    def input_grad(self, mode, options, dy, x, shards, slots, shapes, dx):
        pdim, xdim, slot, x_s, dy_s = self._step_operands(mode, options, dy, x, slots, shapes)
        weight = self._params(pdim, slot, shards, options, shapes).get("weight")
        dx_s = dy_s if weight is None else affine(dy_s, weight, None, options["dim"])
        dx.narrow(xdim, slot.offset, slot.valid).add_(dx_s.sum_to_size(x_s.shape))

    def weight_grads(self, mode, options, dy, x, shards, slots, shapes, into):
        pdim, xdim, slot, x_s, dy_s = self._step_operands(mode, options, dy, x, slots, shapes)

        def reduced(t, target):  # sum over the dims the parameter is broadcast along
            if options["dim"] >= 0:
                return t.sum([d for d in range(t.dim()) if d != options["dim"]])
            return t.sum_to_size(target.shape)

        for role in into:
            g = dy_s * x_s if role == "weight" else dy_s
            if "shape" not in options and role not in options.get("chains", {}):
                into[role].add_(reduced(g, into[role]))
                continue
            # back through the view and the chain, as autograd takes the unsharded model's
            w = real_part(shards[role], pdim, slot).detach().requires_grad_()
            with torch.enable_grad():
                seen = self._seen(role, w, pdim, slot.valid, options, shapes)
            into[role].add_(torch.autograd.grad(seen, w, reduced(g, seen).to(seen.dtype))[0])


RULES: dict[str, Rule] = {
    r.name: r for r in (LinearRule(), ConvRule(), EmbeddingRule(), ElementwiseRule())
}
