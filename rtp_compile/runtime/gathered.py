"""`GatheredOpRuntime`, the fallback for ops without a rule: ring all-gather of the
parameters, run the op once, free; backward gathers again, recomputes the op, and
ring-reduce-scatters the gradient (its forward and backward are custom ops, as `rotated`'s)."""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
from torch import nn

from rtp_compile.runtime import transaction
from rtp_compile.runtime.collectives import ring_all_gather, ring_reduce_scatter
from rtp_compile.runtime.events import UnitSchedule
from rtp_compile.runtime.precision import Precision
from rtp_compile.runtime.registry import (
    Keyed,
    autograd_in_op,
    decode,
    distinct,
    encode,
    graph_op,
    laid_out_like,
    lookup,
    save_values,
    saved_values,
)


class _GatherGrad(torch.autograd.Function):
    """A gathered op in autograd: forward `rtp::gathered_forward` (gather, run the op), saving
    its inputs and own shards; backward `rtp::gathered_backward`. `single`: the op returns one
    tensor, not a tuple."""

    @staticmethod
    def forward(ctx, key, single, *values):
        ctx.key = key
        save_values(ctx, values)  # inputs and own shards; the gathered tensors are freed
        outputs = gathered_forward(key, *encode(values))
        return outputs[0] if single else tuple(outputs)

    @staticmethod
    def backward(ctx, *douts):
        values = saved_values(ctx)
        needs = ctx.needs_input_grad[2:]
        grads = iter(gathered_backward(ctx.key, list(douts), *encode(values), list(needs)))
        return (None, None, *[next(grads) if need else None for need in needs])


class GatheredOpRuntime(Keyed):
    """Runtime of one gathered op: `body` is a small GraphModule (the op and the parameter-only
    ops feeding it) whose parameters are placeholders filled with the gathered tensors."""

    def __init__(
        self,
        name,
        body,
        param_names,
        layouts,
        rank,
        world_size,
        group_name,
        schedule: UnitSchedule,
        grad_scale,
        reason,
        precision: Precision,
    ):
        super().__init__()
        self.unit_name, self.param_names = name, list(param_names)
        self.body, self.fills = _without_parameters(body, self.param_names)
        self.layouts, self.rank, self.world_size = layouts, rank, world_size
        self.group_name, self.schedule = group_name, schedule
        self.grad_scale, self.reason, self.precision = grad_scale, reason, precision
        self.single = isinstance(self.body.graph.output_node().args[0], fx.Node)
        self.register(name)

    def extra_repr(self) -> str:
        return f"gathered: {self.reason}; rank {self.rank} of {self.world_size}"

    def full_like(self, own) -> list[torch.Tensor]:
        """Empty tensors shaped like the gathered parameters (for fake implementations)."""
        return [
            o.new_empty(lay.shape, dtype=self.precision.compute(lay.dtype))
            for o, lay in zip(own, self.layouts)
        ]

    def forward_op(self, values, full=None) -> list[torch.Tensor]:
        """`rtp::gathered_forward`: the op's outputs on the gathered parameters (`full`: given,
        else gathered)."""
        n_inputs = len(values) - len(self.param_names)
        inputs, own = values[:n_inputs], values[n_inputs:]
        outputs = self.run(inputs, self.gather(own) if full is None else full)
        return distinct([outputs] if self.single else list(outputs), values)

    @transaction.transactional
    def backward_op(self, douts, values, needs) -> list[torch.Tensor]:
        """`rtp::gathered_backward`: gather again, recompute the op, the gradients of the
        values that need one (an input's: zeros where the op does not read it)."""
        n_inputs = len(values) - len(self.param_names)
        inputs, own = values[:n_inputs], values[n_inputs:]
        full = [p.requires_grad_(True) for p in self.gather([p.detach() for p in own])]
        leaves = [
            v.detach().requires_grad_(need) if need else v
            for v, need in zip(inputs, needs[:n_inputs])
        ]
        with torch.enable_grad():
            outputs = self.run(leaves, full)
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        pairs = [
            (o, d)
            for o, d in zip(outputs, douts)
            if isinstance(o, torch.Tensor) and o.requires_grad
        ]
        wanted = [v for v, need in zip(leaves, needs[:n_inputs]) if need] + full
        grads = list(
            torch.autograd.grad(
                [o for o, _ in pairs], wanted, [d for _, d in pairs], allow_unused=True
            )
            if pairs
            else [None] * len(wanted)
        )
        input_grads = [
            torch.zeros_like(v) if g is None else g
            for g, v in zip(grads, wanted[: len(wanted) - len(full)])
        ]
        param_grads = [
            torch.zeros_like(p) if g is None else g for g, p in zip(grads[len(input_grads) :], full)
        ]
        shard_grads = self.reduce_scatter(param_grads)
        return distinct(
            input_grads + [g for g, need in zip(shard_grads, needs[n_inputs:]) if need],
            [*douts, *values],
        )  # an add's dx is its dout

    def gather(self, own):
        return ring_all_gather(
            self.precision.to_compute(own),
            self.layouts,
            self.rank,
            self.world_size,
            self.group_name,
            self.schedule.forward_tag,
            self.unit_name,
        )

    def run(self, inputs, full):
        tensors = {name: t for names, t in zip(self.fills, full) for name in names}
        try:
            return torch.func.functional_call(
                self.body, tensors, tuple(inputs), strict=False, tie_weights=False
            )
        except (RuntimeError, TypeError) as err:
            if self.precision.param_dtype is None:
                raise
            raise RuntimeError(
                f"rtp_compile: gathered op {self.unit_name} (parameters "
                f"{', '.join(lay.name for lay in self.layouts)}) failed with its parameters in "
                f"{self.precision.param_dtype} (mp_policy.param_dtype): {err}. The op may need "
                f"another dtype; FSDP2 would run it in {self.precision.param_dtype} too. Cast "
                f"in the model, or compile without mp_policy.param_dtype."
            ) from err

    def reduce_scatter(self, full_grads):
        return ring_reduce_scatter(
            full_grads,
            self.layouts,
            self.rank,
            self.world_size,
            self.group_name,
            self.schedule.grad_tag,
            self.unit_name,
            self.grad_scale,
            self.precision.reduce(self.layouts[0].dtype),
        )

    def forward(self, *tensors):
        if not torch.is_grad_enabled():
            outputs = gathered_forward(self.rtp_key, *encode(tensors))
            return outputs[0] if self.single else tuple(outputs)
        return _GatherGrad.apply(self.rtp_key, self.single, *tensors)


def _without_parameters(body: nn.Module, param_names: list[str]):
    """A copy of `body` that registers no parameter (its placeholders would otherwise show in
    the rank module's `parameters()`), and for each of `param_names` every name under which the
    body reads that parameter (a tied one: several)."""
    body = copy.deepcopy(body)  # the program's body serves every rank's module
    held = dict(body.named_parameters(remove_duplicate=False))
    names_of: dict[int, list[str]] = {}
    for name, p in held.items():
        names_of.setdefault(id(p), []).append(name)
    fills = [names_of[id(held[n])] if n in held else [n] for n in param_names]
    for name in held:
        owner, _, leaf = name.rpartition(".")
        del body.get_submodule(owner)._parameters[leaf]
    return body, fills


@graph_op("gathered_forward")
def gathered_forward(
    key: str, tensors: list[torch.Tensor], ints: list[int], floats: list[float], kinds: list[int]
) -> list[torch.Tensor]:
    """Graph op: the gathered op registered under `key` on its inputs and own shards."""
    return lookup(key).forward_op(decode(tensors, ints, floats, kinds))


@gathered_forward.op.register_fake
def _(key, tensors, ints, floats, kinds):
    unit, values = lookup(key), decode(tensors, ints, floats, kinds)
    return unit.forward_op(values, unit.full_like(values[len(values) - len(unit.param_names) :]))


@graph_op("gathered_backward")
def gathered_backward(
    key: str,
    douts: list[torch.Tensor],
    tensors: list[torch.Tensor],
    ints: list[int],
    floats: list[float],
    kinds: list[int],
    needs: list[bool],
) -> list[torch.Tensor]:
    """Graph op: the backward of the gathered op registered under `key`: the gradients of
    those of its inputs and own shards that `needs` says."""
    values = decode(tensors, ints, floats, kinds)
    with autograd_in_op():  # it differentiates the op
        grads = lookup(key).backward_op(douts, values, needs)
    return laid_out_like(grads, [v for v, need in zip(values, needs) if need])


@gathered_backward.op.register_fake
def _(key, douts, tensors, ints, floats, kinds, needs):
    values = decode(tensors, ints, floats, kinds)
    return [torch.empty_like(v) for v, need in zip(values, needs) if need]
