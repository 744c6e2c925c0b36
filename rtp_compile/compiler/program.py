"""RTPProgram: the plan, the rank-generic program, and what each rank needs from them."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from rtp_compile.capture.trace import capture
from rtp_compile.codegen.emit import RankEmitter
from rtp_compile.compiler.auto_buckets import chooser
from rtp_compile.compiler.mesh import place_in
from rtp_compile.compiler.report import report
from rtp_compile.core.retarget_meta import retarget_meta
from rtp_compile.cost.hardware import load as load_hardware
from rtp_compile.cost.model import rtp_cost, rtp_messages
from rtp_compile.cost.profile import profile_of
from rtp_compile.cost.time import rtp_time
from rtp_compile.passes import plan_graph, write_steps
from rtp_compile.passes.manager.context import Context, Options
from rtp_compile.passes.plan import Plan
from rtp_compile.state.program_state import ProgramState, bind_state
from rtp_compile.state.rank_tensors import rank_tensors

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class RTPProgram:
    """One model compiled for `world_size` ranks: `module(rank)` emits a rank's GraphModule.

    `ctx` is the compilation (`passes.manager.context.Context`: capture, options, plan, unit
    bodies and schedules, pass log); `graph_module` the rank-generic program the passes made.
    The plan, the report and the cost read only the planned graph (units as markers); the
    steps of every unit (O(units x N) nodes: 3 M for a 405B model at N = 512) are written
    the first time `graph_module` is asked for, by a rank module, a drawing or the pass log."""

    def __init__(self, ctx: Context, planned: fx.GraphModule):
        self.ctx = ctx
        self._planned = planned  # rank-generic, units still markers: `plan_graph`'s result

    @classmethod
    def compile(cls, ctx: Context, gm: fx.GraphModule | None = None) -> RTPProgram:
        """Plan `ctx` on `gm` (default: a fresh copy of the captured graph), rewriting it, and
        make the program; its steps are written when first needed (`graph_module`), or at
        once with `debug=True`, whose log promises every pass as it compiles."""
        prog = cls(ctx, plan_graph(gm if gm is not None else ctx.fresh_graph(), ctx))
        if ctx.options.debug:
            prog.graph_module  # noqa: B018 (writes the steps now)
        return prog

    @functools.cached_property
    def graph_module(self) -> fx.GraphModule:
        """The rank-generic program: units as their steps and hops (`passes.write_steps` run
        on the planned graph, once)."""
        return write_steps(self._planned, self.ctx)

    def __reduce__(self):
        """A program travels (pickle, `launch`) as what made it: the model, the world size, the
        example inputs and the options; unpickling compiles it again, the same way, where it
        lands (a captured graph need not pickle: torch.export's guard module does not)."""
        ctx = self.ctx
        return compile_program, (ctx.model, ctx.world_size, *ctx.examples, ctx.options)

    @property
    def plan(self) -> Plan:
        return self.ctx.plan

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def pass_log(self):
        """What each pass changed (`passes.manager.pipeline.PassRecord`); `debug=True` keeps
        code diffs. Every pass: the steps are written first if they were not yet."""
        self.graph_module  # noqa: B018 (writes the steps, the last passes' records)
        return self.ctx.pass_log

    @functools.cached_property
    def state(self) -> ProgramState:
        """What this program's rank modules keep of it (`program_state`): the layouts, the
        buffer names and a meta skeleton of the model, never its tensors."""
        return ProgramState(
            self.world_size, self.plan.params, self.ctx.buffer_names, self.ctx.model
        )

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    def module(
        self,
        rank: int | None = None,
        group: dist.ProcessGroup | None = None,
        device=None,
        broadcast_buffers: bool = True,
        *,
        mesh: DeviceMesh | None = None,
        seed: int = 0,
        checkpoint=None,
    ) -> fx.GraphModule:
        """The GraphModule of `rank` (rank within `group`, default the whole job), or of this
        process's place in `mesh`.

        Its parameters are this rank's shards only, under the model's parameter names. Buffers
        are whole on every rank; as with DDP's default, each forward first takes the group's
        first rank's buffers (`broadcast_buffers=False`: each rank keeps its own).

        `mesh`: a `DeviceMesh` instead of `rank` and `group`, FSDP2's HSDP convention. Its last
        dim (size `world_size`) is the ring: the rank is this process's place in it. A 2-D
        mesh's first dim holds data-parallel replicas, each with its own batches: after each
        backward they all-reduce the shards' gradients, overlapped with backward, so every rank
        holds DDP's gradient over all ranks of the mesh (mean by default, `grad_reduction`);
        a backward that fails leaves `.grad` as it was (`runtime.replicas`). Buffers come from
        the mesh's first rank. `runtime.job.job_of(gm)` tells the module's `replica` of `replicas`:
        replicas hold the same shards, so one of them (`replica == 0`) is enough to save them.

        `device`: where the shards and buffers live (default: where the model's are). For a model
        built on the meta device, `device=...` materialises only this rank's shards there: each
        module's own parameters are made by its initialisers, seeded from (`seed`, the module's
        name), cut to this rank's shard and freed, one module at a time, so the values are the
        same for every world size and equal `rtp_compile.materialize_full(model, seed, device)`
        (exact semantics: `rtp_compile.state.materialize`). `checkpoint`: instead read the
        parameters and persistent buffers from a full state_dict (a `torch.save` file,
        memory-mapped, a `.safetensors` file or a directory of them, or a mapping), only this
        rank's part of each, one parameter at a time; every key and shape is checked first.
        """
        replicas = {}
        if mesh is not None:
            if rank is not None or group is not None:
                raise ValueError(
                    "rtp_compile: pass either mesh=... or rank (and group), not both: "
                    "with a mesh the rank is this process's place in its last dim"
                )
            rank, group, replicas = place_in(mesh, self.world_size)
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"rtp_compile: rank must be an int in [0, {self.world_size}), got {rank!r}"
            )
        group_name = "" if group is None or group == dist.group.WORLD else group.group_name
        tensors = rank_tensors(self.ctx, self.graph_module, rank, device, seed, checkpoint)
        gm = RankEmitter(
            self.ctx,
            self.graph_module,
            rank,
            group_name,
            device,
            broadcast_buffers,
            shards=tensors.shards,
            attrs=tensors.attrs,
            **replicas,
        ).emit()
        if tensors.device is not None:  # a meta model's graph, now on a real device
            retarget_meta(gm, tensors.device)
        bind_state(gm, self.state)
        return gm

    def draw(self, rank: int, path):
        """Draw `rank`'s module as its forward schedule to `path` (.svg, .png or .pdf): each
        unit's steps coloured by unit (or bucket), each ring hop from its send to its wait,
        gathered ops marked (`rtp_compile.inspect.draw`; needs matplotlib). Returns the path."""
        from rtp_compile.inspect.draw import draw  # matplotlib is imported only to draw

        return draw(self, rank, path)

    def report(self) -> str:
        """Every weight-bearing op: rotated (rule, mode, dims) or gathered (why), bytes per rank."""
        return report(self.ctx)

    def __repr__(self) -> str:
        return f"{self.report()}\n\n{self.plan}"

    def for_world_size(self, world_size: int) -> RTPProgram:
        """The same model compiled for another number of ranks, without capturing it again
        (the plan can differ: padding decides which attention blocks fuse)."""
        if world_size == self.world_size:
            return self
        return RTPProgram.compile(self.ctx.for_world_size(world_size))

    def cost(
        self,
        batch_size: int,
        seq_len: int | None = None,
        optimizer: str = "adamw",
        dtype: torch.dtype | None = None,
        example_kwargs: dict | None = None,
        hardware=None,
    ):
        """Predicted per-rank bytes of one training step on a per-rank batch (`rtp_compile.cost`):
        a `Cost` with param/grad/optimizer/transient/activation/peak/traffic bytes and their
        sympy expressions in N and A. `dtype`: the parameters' dtype if not theirs.
        `hardware` (a `cost.hardware` name, JSON path or description): also the predicted
        step time, `.step_time` (seconds; `.time` its parts)."""
        profile = self.profile(batch_size, seq_len, example_kwargs)
        cost = rtp_cost(
            self.plan,
            profile,
            optimizer,
            dtype,
            tuple(self.ctx.buckets.values()),
            self.ctx.precision,
        )
        if hardware is None:
            return cost
        described = load_hardware(hardware)
        messages = rtp_messages(
            self.plan, self.ctx.buckets, self.world_size, dtype, self.ctx.precision
        )
        time = rtp_time(
            self.plan,
            profile,
            messages,
            self.ctx.buckets,
            described.rates(self.world_size),
            described.name,
        )
        return dataclasses.replace(cost, time=time)

    def profile(
        self, batch_size: int, seq_len: int | None = None, example_kwargs: dict | None = None
    ):
        """What the unsharded model saves for backward on such a batch, on fake tensors."""
        return profile_of(self.ctx, batch_size, seq_len, example_kwargs)

    # -- full state (what a rank module keeps of the program: `program_state`) ----------
    def full_state_dict(self, gm: nn.Module) -> dict[str, torch.Tensor]:
        """Collective: the model's state_dict (its keys, through its own state-dict hooks; full
        shapes, padding removed)."""
        return self.state.full_state_dict(gm)

    def full_tensor(self, gm: nn.Module, key: str) -> torch.Tensor:
        """Collective for a parameter: the full tensor of native key `key` (a parameter under
        any of its names, all ranks' shards gathered, padding removed; or a buffer, this rank's
        copy)."""
        return self.state.full_tensor(gm, key)

    def load_full_state_dict(self, gm: nn.Module, state_dict) -> None:
        """Take a full state_dict into the shards of `gm`: a mapping (as from full_state_dict or
        the unsharded model), or a path to one (`torch.save` file, read memory-mapped; a
        `.safetensors` file or a directory of them), read one parameter at a time, only this
        rank's part. Every key and shape is checked before anything is written; a tied
        parameter may be stored under any of its names. The keys are the model's own: a model
        whose modules rename them with state-dict hooks has them taken back by its load
        pre-hooks (`rtp_compile.state.model_state`; the checkpoint is then read whole)."""
        self.state.load_full_state_dict(gm, state_dict)


def compile_program(
    model: nn.Module, world_size: int, example_inputs, example_kwargs, options: Options
) -> RTPProgram:
    """Capture `model` and run the pass pipeline: `transform` once its options are checked, and
    what an unpickled program runs again (`RTPProgram.__reduce__`)."""
    policy = options.mp_policy
    captured = capture(
        model,
        example_inputs,
        example_kwargs,
        compute_dtype=None if policy is None else policy.param_dtype,
        cast_inputs=policy is None or policy.cast_forward_inputs,
    )
    ctx = Context.of(captured, world_size, options)
    if options.bucket_bytes == "auto":
        ctx.bucket_chooser = chooser(options.hardware)
    return RTPProgram.compile(ctx, captured.gm)
