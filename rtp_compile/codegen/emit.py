"""Rank-generic program -> the GraphModule of one rank, holding only that rank's shards.

The schedule pass has written every unit's steps and ring hops into the program; codegen fills
in the rank: each `unit_step` becomes the rule's `forward_step` traced for the shard the rank
holds at that step (its offsets as constants, so `print(gm.code)` reads as the schedule),
`unit_combine` the parts concatenated in shard order or summed as the steps go (each added
right after its step), `unit_autograd` the unit's runtime module (handed its backward events),
the hops get the rank's process group. Nodes of a unit keep their label
`core.ir.NodeLabel(unit, step, action)` in `node.meta["rtp"]`.
"""

from __future__ import annotations

import copy
import operator

import torch
import torch.fx as fx
from torch import nn

from rtp_compile.capture.activation_checkpoints import outline_checkpoints
from rtp_compile.core.attributes import install
from rtp_compile.core.graph_ops import add_into
from rtp_compile.core.ir import (
    Action,
    CombineMode,
    NodeLabel,
    Split,
    UnitKind,
    bucket_params,
    gathered_op,
    gathered_small,
    unit_autograd,
    unit_combine,
    unit_step,
)
from rtp_compile.core.op_rules import Combine
from rtp_compile.passes.manager.context import Context
from rtp_compile.passes.schedule import LabellingTracer
from rtp_compile.runtime.bucket import BucketRuntime
from rtp_compile.runtime.events import forward_shard
from rtp_compile.runtime.failure import install_failure_handling
from rtp_compile.runtime.fused import LINEAR, FusedBlockRuntime, head_groups, sub_roles
from rtp_compile.runtime.gathered import GatheredOpRuntime
from rtp_compile.runtime.job import BufferBroadcast, JobCheck
from rtp_compile.runtime.replicas import ReplicaGradReduction
from rtp_compile.runtime.rotated import RotatedOpRuntime
from rtp_compile.runtime.small import SmallParamsGather


class RankEmitter:
    """Builds the GraphModule of one rank from the rank-generic program."""

    def __init__(
        self,
        ctx: Context,
        graph_module: fx.GraphModule,
        rank: int,
        group_name: str,
        device=None,
        broadcast_buffers=True,
        shards: dict[str, torch.Tensor] | None = None,
        attrs: dict[str, torch.Tensor] | None = None,
        replica: int = 0,
        replicas: int = 1,
        replica_group_name: str | None = None,
    ):
        """`shards`: this rank's parameter shards, ready (default: cut from the model's
        parameters); `attrs`: values for buffers / constants of the program (default: copies of
        its own). `replica` of `replicas` in group `replica_group_name`: where the rank's ring
        sits among data-parallel replicas of it (a 2-D mesh's first dim)."""
        self.ctx, self.src, self.plan = ctx, graph_module, ctx.plan
        self.shards, self.attrs = shards or {}, attrs or {}
        self.rank, self.n, self.group_name = rank, ctx.world_size, group_name
        self.replica, self.replicas = replica, replicas
        self.replica_group_name = replica_group_name
        self.device, self.broadcast_buffers = device, broadcast_buffers
        self.units = {u.name: u for u in self.plan.units}
        self.saved: dict[
            str, dict[int, list[fx.Node]]
        ] = {}  # fused unit -> shard -> column outputs
        self.buckets: dict[str, BucketRuntime] = {}
        self.tickets: dict[str, fx.Node] = {}  # bucket -> its forward's ticket
        self.graph = fx.Graph()
        self.graph._codegen = copy.deepcopy(graph_module.graph._codegen)
        self.tracer = LabellingTracer(self.graph)
        self.root: dict = {}

    # -- graph -------------------------------------------------------------------------------
    def emit(self) -> fx.GraphModule:
        env: dict[fx.Node, fx.Node | None] = {}
        checked = False
        lowerings = {
            unit_step: self._step,
            unit_combine: self._combine,
            unit_autograd: self._autograd,
            gathered_op: self._gathered,
            gathered_small: self._small,
            bucket_params: self._bucket,
        }
        for node in self.src.graph.nodes:
            if node.op != "placeholder" and not checked:
                self._emit_job_start()
                checked = True
            lower = lowerings.get(node.target) if node.op == "call_function" else None
            if lower is not None:
                env[node] = lower(node, env)
            else:
                env[node] = self.graph.node_copy(node, lambda a: env[a])
                if node.target is torch.ops.rtp.ring_shift_start.default:
                    env[node].update_arg(1, self.group_name)  # the hop in this rank's group
                self._own_attr(env[node])
        gm = fx.GraphModule(self.root, self.graph, class_name=f"RTPRank{self.rank}")
        for name in self.plan.params:  # parameters no op reads are still this rank's to keep
            if name not in self.root:
                install(gm, name, self._shard(name))
        for name, buffer in self.src.named_buffers():  # unread buffers still belong to the state
            if name not in self.root:
                install(gm, name, self._attr_value(name, buffer))
        for spec in ("_in_spec", "_out_spec"):
            if hasattr(self.src, spec):
                setattr(gm, spec, getattr(self.src, spec))
        outline_checkpoints(gm)  # the model's activation checkpoints, recomputed in backward
        gm.graph.lint()
        install_failure_handling(gm, self._replica_reduction(gm), self.group_name)
        return gm

    def _replica_reduction(self, gm: fx.GraphModule) -> ReplicaGradReduction | None:
        """The all-reduce of the shards' gradients over the data-parallel replicas (mean over
        them too for "mean"), None with one replica."""
        if self.replicas == 1:
            return None
        read = [
            p
            for name, p in gm.named_parameters()
            if p.requires_grad and self.plan.strategy(name) != "unused"
        ]
        scale = 1.0 / self.replicas if self.ctx.options.grad_reduction == "mean" else 1.0
        return ReplicaGradReduction(read, self.replica_group_name, scale)

    def _emit_job_start(self) -> None:
        """Check the job, then (like DDP) take the first rank's buffers."""
        self.root["rtp_job"] = JobCheck(
            self.n, self.rank, self.group_name, self.replica, self.replicas, self.replica_group_name
        )
        self.graph.call_module("rtp_job")
        buffers = [name for name, _ in self.src.named_buffers()]
        if self.broadcast_buffers and buffers and self.n * self.replicas > 1:
            reads = [self.graph.get_attr(name) for name in buffers]
            for read in reads:
                self._own_attr(read)
            groups = (
                (self.group_name,)
                if self.replica_group_name is None
                else (self.group_name, self.replica_group_name)
            )
            self.root["rtp_buffers"] = BufferBroadcast(groups)
            self.graph.call_module("rtp_buffers", tuple(reads))

    def _own_attr(self, node: fx.Node) -> None:
        """Put what a copied get_attr/call_module refers to into this rank's root."""
        if node.op == "get_attr" and node.target not in self.root:
            if node.target in self.plan.params:
                self.root[node.target] = self._shard(node.target)
            else:
                value = operator.attrgetter(node.target)(self.src)
                self.root[node.target] = (
                    self._attr_value(node.target, value)
                    if isinstance(value, torch.Tensor)
                    else value
                )
        elif node.op == "call_module" and node.target not in self.root:
            self.root[node.target] = copy.deepcopy(self.src.get_submodule(node.target))

    def _attr_value(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """This rank's copy of a buffer or constant: the materialised one, else the program's."""
        if name in self.attrs:
            return self.attrs[name]
        return value.detach().clone().to(self.device or value.device)

    def _shard(self, name: str) -> nn.Parameter:
        full = self.ctx.params[name]
        shard = self.shards.get(name)
        if shard is None:
            shard = self.plan.params[name].shard(full.detach(), self.rank)
            if self.device is not None:
                shard = shard.to(self.device)
        return nn.Parameter(shard, requires_grad=full.requires_grad)

    # -- units -------------------------------------------------------------------------------
    def _layouts(self, unit):
        roles = list(unit.params)
        layouts = [self.plan.params[p] for p in unit.params.values()]
        return roles, layouts, {r: lay.shape for r, lay in zip(roles, layouts)}

    def _step(self, node: fx.Node, env) -> fx.Node | None:
        """Step k of a unit, for the shard this rank holds then; None for an all-padding one."""
        name, k, x, *rest = node.args
        unit = self.units[name]
        roles, layouts, shapes = self._layouts(unit)
        s = forward_shard(self.rank, k, self.n)
        proxy = lambda a: fx.Proxy(env[a], self.tracer)  # noqa: E731
        x_p, held = proxy(x), {r: proxy(h) for r, h in zip(roles, rest[: len(roles)])}
        slots = {r: lay.slot(s) for r, lay in zip(roles, layouts)}
        # labels from the arguments, not node.meta (which an fx re-trace of the graph drops)
        self.tracer.label = NodeLabel(name, k, Action.COMPUTE)
        if unit.kind == UnitKind.FUSED:
            out = self._fused_step(
                unit, s, x_p, held, slots, shapes, [env[e] for e in rest[len(roles) :]]
            )
        else:
            options = unit.call.run_options([proxy(e) for e in rest[len(roles) :]])
            out = unit.call.rule.forward_step(unit.mode, options, x_p, held, slots, shapes)
        self.tracer.label = None
        if out is None:
            return None
        out.node._rename(node.name)
        return out.node

    def _fused_step(self, unit, s, x_p, shards, slots, shapes, externals):
        fusion, body = unit.fusion, self.ctx.bodies[unit.name]
        width = slots["tail.weight"].valid
        tail = [sub_roles(d, "tail") for d in (shards, slots, shapes)]
        if width == 0:  # an all-padding shard: only the tail's bias slot, if any
            return (
                LINEAR.row_partial(fusion.tail.call.options, x_p.narrow(-1, 0, 0), *tail)
                if "bias" in tail[0]
                else None
            )
        columns = [
            LINEAR.forward_step(
                Split.COL,
                h.call.options,
                x_p,
                *[sub_roles(d, f"col{i}") for d in (shards, slots, shapes)],
            )
            for i, h in enumerate(fusion.columns)
        ]
        self.saved.setdefault(unit.name, {})[s] = [h.node for h in columns]  # for backward
        # this shard's groups of the cut axis (whole columns), as constants of the step
        tail_layout = self.plan.params[unit.params["tail.weight"]]
        hidden = body(
            *head_groups(slots, tail_layout),
            *columns,
            *[fx.Proxy(e, self.tracer) for e in externals],
        )
        return LINEAR.row_partial(fusion.tail.call.options, hidden, *tail)

    def _combine(self, node: fx.Node, env) -> fx.Node:
        """The steps' parts concatenated in shard order, or summed as the steps go, as the rule
        says."""
        name, parts = node.args
        unit = self.units[name]
        _, _, shapes = self._layouts(unit)
        combine = (
            Combine(CombineMode.SUM)
            if unit.kind == UnitKind.FUSED
            else unit.call.rule.combine(unit.mode, unit.call.options, shapes)
        )
        if combine.how == CombineMode.SUM:
            return self._running_sum(name, parts, env)
        by_shard = {forward_shard(self.rank, p.args[1], self.n): env[p] for p in parts}
        ordered = [by_shard[s] for s in sorted(by_shard) if by_shard[s] is not None]
        self.tracer.label = NodeLabel(name, self.n - 1, Action.COMBINE)
        y = self.tracer.create_node(
            "call_function", torch.cat, (ordered, combine.dim), {}, name=f"{name}_out"
        )
        self.tracer.label = None
        return y

    def _running_sum(self, name: str, parts, env) -> fx.Node:
        """A sum's parts added up in step order, each right after its step: a row split's (and
        a fused block's) every part has the size of the whole output, so adding them at the
        end would keep N output-sized tensors alive at once (the tied head's logits N times)."""
        steps = sorted(parts, key=lambda p: p.args[1])
        computed = [(p.args[1], env[p]) for p in steps if env[p] is not None]
        (_, y), rest = computed[0], computed[1:]
        for k, part in rest:
            self.tracer.label = NodeLabel(name, k, Action.COMBINE)
            with self.graph.inserting_after(part):
                y = self.tracer.create_node(
                    "call_function", add_into, (y, part), {}, name=f"{name}_sum"
                )
        self.tracer.label = None
        return y

    def _autograd(self, node: fx.Node, env) -> fx.Node:
        """The unit's runtime module, called on (result, input, own shards[, externals, saved
        column outputs]): it links the result into autograd and runs the unit's backward."""
        name, *args = node.args
        unit = self.units[name]
        roles, layouts, _ = self._layouts(unit)
        common = (
            self.rank,
            self.n,
            self.group_name,
            self.ctx.schedules[name],
            self.ctx.grad_scale,
            self.ctx.precision,
        )
        if unit.kind == UnitKind.FUSED:
            self.root[f"rtp_units.{name}"] = FusedBlockRuntime(
                name, unit.fusion, roles, layouts, self.ctx.bodies[name], *common
            )
            saved = self.saved.get(name, {})
            keep = [h for s in range(self.n) for h in saved.get(s, [])]
        else:
            self.root[f"rtp_units.{name}"] = RotatedOpRuntime(
                name, unit.call, unit.mode, layouts, *common
            )
            keep = []
        bucket = self.ctx.schedules[name].bucket
        ticket = {}
        if bucket is not None:  # not a submodule: the bucket's runtime is rtp_buckets.<name>
            self.root[f"rtp_units.{name}"].__dict__["bucket"] = self.buckets[bucket]
            ticket = {"ticket": self.tickets[bucket]}
        out = self.graph.call_module(f"rtp_units.{name}", (*[env[a] for a in args], *keep), ticket)
        out.meta.update(node.meta)
        if bucket is None:
            return out
        # a bucket's unit returns its result and the ticket (or links) for the bucket's next
        self.tickets[bucket] = self.graph.call_function(operator.getitem, (out, 1))
        self.tickets[bucket].meta.update(node.meta)
        result = self.graph.call_function(operator.getitem, (out, 0))
        result.meta.update(node.meta)
        return result

    def _gathered(self, node: fx.Node, env) -> fx.Node:
        name, *rest = node.args
        unit = self.units[name]
        n_params = len(unit.params)
        inputs = [env[a] if isinstance(a, fx.Node) else a for a in rest[: len(rest) - n_params]]
        params = [env[a] for a in rest[len(rest) - n_params :]]
        layouts = [self.plan.params[p] for p in unit.params.values()]
        body = self.ctx.bodies[name]
        held = {n for n, _ in body.named_parameters(remove_duplicate=False)}
        # the body names a parameter as it reads it: a tied module called whole, by its alias
        names = [
            next((a for a in self.ctx.aliases.get(p, [p]) if a in held), p)
            for p in unit.params.values()
        ]
        self.root[f"rtp_units.{name}"] = GatheredOpRuntime(
            name,
            body,
            names,
            layouts,
            self.rank,
            self.n,
            self.group_name,
            self.ctx.schedules[name],
            self.ctx.grad_scale,
            unit.reason,
            self.ctx.precision,
        )
        out = self.graph.call_module(f"rtp_units.{name}", (*inputs, *params))
        out.meta.update(node.meta)
        return out

    def _small(self, node: fx.Node, env) -> fx.Node:
        """The small parameters' runtime, called on their own shards: their whole tensors."""
        names = [read.target for read in node.args]
        first = next(u for u in self.plan.units if u.kind == UnitKind.SMALL)
        self.root["rtp_units.small_params"] = SmallParamsGather(
            names,
            [self.plan.params[p] for p in names],
            self.rank,
            self.n,
            self.group_name,
            self.ctx.schedules[first.name],
            self.ctx.grad_scale,
            self.ctx.precision,
        )
        out = self.graph.call_module("rtp_units.small_params", tuple(env[a] for a in node.args))
        out.meta.update(node.meta)
        return out

    def _bucket(self, node: fx.Node, env) -> fx.Node:
        """The bucket's runtime, called on its units' own shards: they pass through it."""
        name, *params = node.args
        members = [self.units[m] for m in self.ctx.buckets[name]]
        layouts = [self.plan.params[p] for u in members for p in u.params.values()]
        runtime = self.buckets[name] = BucketRuntime(
            name,
            [(u.name, len(u.params)) for u in members],
            layouts,
            self.rank,
            self.n,
            self.group_name,
            self.ctx.schedules[members[0].name],
            self.ctx.grad_scale,
            self.ctx.precision,
        )
        self.root[f"rtp_buckets.{name}"] = runtime
        out = self.graph.call_module(f"rtp_buckets.{name}", tuple(env[a] for a in params))
        out.meta.update(node.meta)
        self.tickets[name] = self.graph.call_function(operator.getitem, (out, len(params)))
        self.tickets[name].meta.update(node.meta)
        self.tickets[name]._rename(f"{name}_ticket")
        return out
