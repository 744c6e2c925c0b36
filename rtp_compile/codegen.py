"""Plan + rank-generic graph -> the GraphModule of one rank, holding only that rank's shards.

Each `rotation_unit` marker is unrolled into the rank's N steps, in the order of
`passes.schedule.forward_schedule`: ring hop started, step computed with the shard in hand,
hop waited on, next step. Step computations are the rule's `forward_step` traced into the
graph with this rank's offsets as constants, so `print(gm.code)` reads as the schedule.
Every emitted node of a unit carries `node.meta["rtp"] = {"unit", "step", "action"}`.
"""
from __future__ import annotations

import copy
import operator

import torch
import torch.fx as fx
from torch import nn

from rtp_compile.runtime import ring  # noqa: F401  (registers torch.ops.rtp.*)
from rtp_compile.runtime.ring import BufferBroadcast, JobCheck, unpack
from rtp_compile.op_rules import Combine
from rtp_compile.passes.plan import Plan
from rtp_compile.passes.rotate import fused_unit, gathered_op, rotation_unit
from rtp_compile.runtime.fused import LINEAR, FusedUnit, head_groups, sub_roles
from rtp_compile.runtime.units import GatherUnit, RotationUnit
from rtp_compile.passes.schedule import forward_schedule, forward_shard

_TAGS_PER_UNIT = 4  # forward hop, backward weight hop, gradient hop, spare


class _TaggingTracer(fx.proxy.GraphAppendingTracer):
    """Appends to the rank graph and stamps every node it creates with the current unit step."""

    def __init__(self, graph):
        super().__init__(graph)
        self.tag = None

    def create_node(self, *args, **kwargs):
        node = super().create_node(*args, **kwargs)
        if self.tag is not None:
            node.meta["rtp"] = dict(self.tag)
        return node


def _install(root: nn.Module, target: str, value: torch.Tensor) -> None:
    """Register a parameter or buffer at a dotted path, creating empty parent modules."""
    *path, leaf = target.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if isinstance(value, nn.Parameter):
        module.register_parameter(leaf, value)
    else:
        module.register_buffer(leaf, value)


def job_of(gm: nn.Module) -> JobCheck:
    """The world size, rank and group name an emitted module was built for."""
    job = getattr(gm, "rtp_job", None)
    if not isinstance(job, JobCheck):
        raise ValueError("rtp_compile: this module was not emitted by RTPProgram.module(rank)")
    return job


class RankEmitter:
    """Builds the GraphModule of one rank from the shared program."""

    def __init__(self, program_gm: fx.GraphModule, plan: Plan, bodies, params, rank: int,
                 group_name: str, grad_scale: float, device=None, broadcast_buffers=True,
                 shards: dict[str, torch.Tensor] | None = None,
                 attrs: dict[str, torch.Tensor] | None = None):
        """`shards`: this rank's parameter shards, ready (default: cut from `params`);
        `attrs`: values for buffers / constants of the program (default: copies of its own)."""
        self.src, self.plan, self.bodies, self.params = program_gm, plan, bodies, params
        self.shards, self.attrs = shards or {}, attrs or {}
        self.rank, self.n, self.group_name = rank, plan.world_size, group_name
        self.grad_scale, self.device = grad_scale, device
        self.broadcast_buffers = broadcast_buffers
        self.units = {u.name: u for u in plan.units}
        self.tags = {u.name: i * _TAGS_PER_UNIT for i, u in enumerate(plan.units)}
        self.graph = fx.Graph()
        self.graph._codegen = copy.deepcopy(program_gm.graph._codegen)
        self.tracer = _TaggingTracer(self.graph)
        self.root: dict = {}

    # -- graph -------------------------------------------------------------------------------
    def emit(self) -> fx.GraphModule:
        env: dict[fx.Node, fx.Node] = {}
        checked = False
        for node in self.src.graph.nodes:
            if node.op != "placeholder" and not checked:
                self._emit_job_start()
                checked = True
            if node.op == "call_function" and node.target is rotation_unit:
                env[node] = self._rotation(node, env)
            elif node.op == "call_function" and node.target is fused_unit:
                env[node] = self._fused(node, env)
            elif node.op == "call_function" and node.target is gathered_op:
                env[node] = self._gathered(node, env)
            else:
                env[node] = self.graph.node_copy(node, lambda a: env[a])
                self._own_attr(env[node])
        gm = fx.GraphModule(self.root, self.graph, class_name=f"RTPRank{self.rank}")
        for name in self.plan.params:  # parameters no op reads are still this rank's to keep
            if name not in self.root:
                _install(gm, name, self._shard(name))
        for name, buffer in self.src.named_buffers():  # unread buffers still belong to the state
            if name not in self.root:
                _install(gm, name, self._attr_value(name, buffer))
        for spec in ("_in_spec", "_out_spec"):
            if hasattr(self.src, spec):
                setattr(gm, spec, getattr(self.src, spec))
        gm.graph.lint()
        return gm

    def _emit_job_start(self) -> None:
        """Check the job, then (like DDP) take the first rank's buffers."""
        self.root["rtp_job"] = JobCheck(self.n, self.rank, self.group_name)
        self.graph.call_module("rtp_job")
        buffers = [name for name, _ in self.src.named_buffers()]
        if self.broadcast_buffers and buffers and self.n > 1:
            reads = [self.graph.get_attr(name) for name in buffers]
            for read in reads:
                self._own_attr(read)
            self.root["rtp_buffers"] = BufferBroadcast(self.group_name)
            self.graph.call_module("rtp_buffers", tuple(reads))

    def _own_attr(self, node: fx.Node) -> None:
        """Put what a copied get_attr/call_module refers to into this rank's root."""
        if node.op == "get_attr" and node.target not in self.root:
            if node.target in self.plan.params:
                self.root[node.target] = self._shard(node.target)
            else:
                value = operator.attrgetter(node.target)(self.src)
                self.root[node.target] = self._attr_value(node.target, value) \
                    if isinstance(value, torch.Tensor) else value
        elif node.op == "call_module" and node.target not in self.root:
            self.root[node.target] = copy.deepcopy(self.src.get_submodule(node.target))

    def _attr_value(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """This rank's copy of a buffer or constant: the materialised one, else the program's."""
        if name in self.attrs:
            return self.attrs[name]
        return value.detach().clone().to(self.device or value.device)

    def _shard(self, name: str) -> nn.Parameter:
        full = self.params[name]
        shard = self.shards.get(name)
        if shard is None:
            shard = self.plan.params[name].shard(full.detach(), self.rank)
            if self.device is not None:
                shard = shard.to(self.device)
        return nn.Parameter(shard, requires_grad=full.requires_grad)

    # -- units -------------------------------------------------------------------------------
    def _unrolled_steps(self, name, x_node, params, roles, layouts, compute):
        """Detach, then the forward schedule of unit `name`: ring hops started and waited,
        `compute(step, shard, x, shards)` for each step (proxies in, a proxy or None out).
        Returns the combined-by-sum-or-cat parts by shard."""
        tag = self.tags[name]
        # the steps compute on detached tensors; the unit module after them wires up autograd
        self.tracer.tag = {"unit": name, "step": 0, "action": "detach"}
        x_d = self.tracer.create_node("call_method", "detach", (x_node,), {}, name=f"{name}_in")
        own = [self.tracer.create_node("call_method", "detach", (p,), {}, name=f"{name}_{r}0")
               for p, r in zip(params, roles)]
        proxy = lambda n: fx.Proxy(n, self.tracer)
        specs = [(lay.shard_shape, lay.dtype) for lay in layouts]
        held, received, outputs = own, None, {}
        for event in forward_schedule(self.n):
            k = event.step
            self.tracer.tag = {"unit": name, "step": k, "action": event.action}
            if event.action == "start":
                received = self.tracer.create_node(
                    "call_function", torch.ops.rtp.ring_shift_start.default,
                    (held, self.group_name, 1, tag, f"{name} step {k}"), {},
                    name=f"{name}_recv{k}")
            elif event.action == "wait":
                self.tracer.create_node("call_function", torch.ops.rtp.ring_wait.default,
                                        (received,), {}, name=f"{name}_wait{k}")
                if k == self.n - 1:  # the unit's last hop: no buffer waits idle through compute
                    self.tracer.create_node("call_function", torch.ops.rtp.ring_release.default,
                                            (), {}, name=f"{name}_release")
                views = unpack(proxy(received), specs)
                for view, r in zip(views, roles):
                    view.node._rename(f"{name}_{r.replace('.', '_')}{k}")
                held = [view.node for view in views]
            else:
                s = forward_shard(self.rank, k, self.n)
                out = compute(k, s, proxy(x_d), {r: proxy(h) for r, h in zip(roles, held)})
                if out is not None:
                    outputs[s] = out.node
                    out.node._rename(f"{name}_y{k}")
        self.tracer.tag = {"unit": name, "step": self.n - 1, "action": "combine"}
        return [outputs[s] for s in range(self.n) if s in outputs]

    def _combine(self, name, parts, combine) -> fx.Node:
        if combine.how == "cat":
            y = self.tracer.create_node("call_function", torch.cat, (parts, combine.dim), {},
                                        name=f"{name}_out")
        else:
            y = parts[0]
            for part in parts[1:]:
                y = self.tracer.create_node("call_function", operator.add, (y, part), {},
                                            name=f"{name}_sum")
        self.tracer.tag = None
        return y

    def _layouts(self, unit):
        roles = list(unit.params)
        layouts = [self.plan.params[p] for p in unit.params.values()]
        return roles, layouts, {r: lay.shape for r, lay in zip(roles, layouts)}

    def _rotation(self, node: fx.Node, env) -> fx.Node:
        name, x, *param_args = node.args
        unit = self.units[name]
        x_node, params = env[x], [env[a] for a in param_args]
        roles, layouts, shapes = self._layouts(unit)
        rule, mode, options = unit.call.rule, unit.mode, unit.call.options

        def compute(k, s, x_p, shards):
            slots = {r: lay.slot(s) for r, lay in zip(roles, layouts)}
            return rule.forward_step(mode, options, x_p, shards, slots, shapes)

        parts = self._unrolled_steps(name, x_node, params, roles, layouts, compute)
        y = self._combine(name, parts, rule.combine(mode, options, shapes))
        self.root[f"rtp_units.{name}"] = RotationUnit(
            name, unit.call, mode, layouts, self.rank, self.n, self.group_name, self.tags[name],
            self.grad_scale)
        out = self.graph.call_module(f"rtp_units.{name}", (y, x_node, *params))
        out.meta.update(node.meta)
        return out

    def _fused(self, node: fx.Node, env) -> fx.Node:
        name, x, *rest = node.args
        unit = self.units[name]
        fusion, body = unit.fusion, self.bodies[name]
        x_node = env[x]
        params = [env[a] for a in rest[:len(unit.params)]]
        externals = [env[a] for a in rest[len(unit.params):]]
        roles, layouts, shapes = self._layouts(unit)
        saved: dict[int, list[fx.Node]] = {}  # per shard: the heads' outputs, for backward
        tail_layout = self.plan.params[unit.params["tail.weight"]]

        def compute(k, s, x_p, shards):
            slots = {r: lay.slot(s) for r, lay in zip(roles, layouts)}
            width = slots["tail.weight"].valid
            tail = [sub_roles(d, "tail") for d in (shards, slots, shapes)]
            if width == 0:  # an all-padding shard: only the tail's bias slot, if any
                return LINEAR.row_partial(fusion.tail.call.options,
                                          x_p.narrow(-1, 0, 0), *tail) if "bias" in tail[0] \
                    else None
            heads = [LINEAR.forward_step("col", h.call.options, x_p,
                                         *[sub_roles(d, f"head{i}") for d in (shards, slots, shapes)])
                     for i, h in enumerate(fusion.heads)]
            saved[s] = [h.node for h in heads]
            # this shard's groups of the cut axis (whole heads), as constants of the step
            hidden = body(*head_groups(slots, tail_layout), *heads,
                          *[fx.Proxy(e, self.tracer) for e in externals])
            return LINEAR.row_partial(fusion.tail.call.options, hidden, *tail)

        parts = self._unrolled_steps(name, x_node, params, roles, layouts, compute)
        y = self._combine(name, parts, Combine("sum"))
        self.root[f"rtp_units.{name}"] = FusedUnit(
            name, fusion, roles, layouts, body, self.rank, self.n, self.group_name,
            self.tags[name], self.grad_scale)
        keep = [n for s in range(self.n) for n in saved.get(s, [])]
        out = self.graph.call_module(f"rtp_units.{name}", (y, x_node, *params, *externals, *keep))
        out.meta.update(node.meta)
        return out

    def _gathered(self, node: fx.Node, env) -> fx.Node:
        name, *rest = node.args
        unit = self.units[name]
        n_params = len(unit.params)
        inputs = [env[a] if isinstance(a, fx.Node) else a for a in rest[:len(rest) - n_params]]
        params = [env[a] for a in rest[len(rest) - n_params:]]
        layouts = [self.plan.params[p] for p in unit.params.values()]
        self.root[f"rtp_units.{name}"] = GatherUnit(
            name, self.bodies[name], list(unit.params.values()), layouts, self.rank, self.n,
            self.group_name, self.tags[name], self.grad_scale, unit.reason)
        out = self.graph.call_module(f"rtp_units.{name}", (*inputs, *params))
        out.meta.update(node.meta)
        out.meta["rtp"] = {"unit": name, "step": None, "action": "gather"}
        return out
