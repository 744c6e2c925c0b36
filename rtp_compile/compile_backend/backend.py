"""`torch.compile(model, backend=rtp_compile.backend(world_size=N))` (or `backend="rtp"`): each
graph dynamo captures is transformed and run as this rank's RTP program.

Per graph: lift it (`dynamo_graph.lift`), run `rtp_compile.transform` on it with the layouts of
parameters already sharded fixed (so a parameter met in two graphs, a tied weight, keeps one
layout), emit this rank's module, and hand it to the rank compiler (`rank_compiler`: by
default "inductor" compiles the rank module whole, ring hops included, as
`torch.compile(prog.module(rank), fullgraph=True)` does; "aot_eager" likewise without
inductor's kernels; "eager" runs the module as emitted) at its first call, outside dynamo's
compile of the user's frame (which marks the fx code generated during it as code to skip).
The callable returned binds, at every call, the shards of the parameters passed *then* (by
identity: dynamo guards check only metadata, so one graph serves every identical layer) and
the user's own buffers; after the first call the full parameters' storage is released
(`shard_registry`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from rtp_compile.codegen.emit import RankEmitter
from rtp_compile.compile_backend.dynamo_graph import Lifted, lift
from rtp_compile.compiler.program import RTPProgram
from rtp_compile.compiler.transform import transform
from rtp_compile.core.layout import ParamLayout
from rtp_compile.runtime.unshard import is_unshard
from rtp_compile.state import shard_registry as registry


def _compiled_by(compiler: str):
    """A rank compiler that compiles the emitted rank module whole with torch.compile's
    `compiler` backend (its ring ops are functional custom ops: `runtime.ring`)."""

    def compile_rank(gm: fx.GraphModule, example_inputs):
        return torch.compile(gm, backend=compiler, fullgraph=True)

    return compile_rank


RANK_COMPILERS = {
    "eager": lambda gm, example_inputs: gm,
    "aot_eager": _compiled_by("aot_eager"),
    "inductor": _compiled_by("inductor"),
}


class RTPBackend:
    """A dynamo backend: `(graph module, example inputs) -> callable` (see module doc).

    `world_size`: ranks of the ring (default: the size of `group`, the job's when None);
    `rank_compiler`: "inductor", "aot_eager", "eager" or a callable `(rank GraphModule,
    example inputs) -> callable` that runs the emitted rank module (called at the program's
    first call, with its inputs); `transform_opts`: `rtp_compile.transform`'s options.
    `programs` keeps each graph's program (in compile order), for inspection."""

    def __init__(
        self,
        world_size: int | None = None,
        group: dist.ProcessGroup | None = None,
        rank_compiler="inductor",
        **transform_opts,
    ):
        if "fixed_layouts" in transform_opts:
            raise TypeError("rtp_compile.backend: fixed_layouts is the backend's to set")
        self.world_size, self.group = world_size, group
        self.rank_compiler = (
            RANK_COMPILERS[rank_compiler] if isinstance(rank_compiler, str) else rank_compiler
        )
        self.transform_opts = transform_opts
        self.programs: list[RTPProgram] = []
        registry.install_optimizer_hook()

    def __call__(self, gm: fx.GraphModule, example_inputs):
        world_size = self.world_size or dist.get_world_size(self.group)
        rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        group_name = (
            "" if self.group is None or self.group == dist.group.WORLD else self.group.group_name
        )
        lifted = lift(_unshards_removed(gm), example_inputs, _full_shape)
        fixed = [
            (name, e.layout.dim, e.layout.granule)
            for name, i in lifted.params.items()
            if (e := registry.entry_of(example_inputs[i])) is not None
        ]
        self._check_precision(lifted, example_inputs)
        user = tuple(example_inputs[i] for i in lifted.inputs)
        with torch._guards.tracing(None):  # export must not reuse dynamo's fake mode
            prog = transform(
                lifted.gm,
                world_size,
                example_inputs=user,
                fixed_layouts=fixed,
                **self.transform_opts,
            )
        self.programs.append(prog)
        # the rank module holds placeholders: every call binds the shards of the parameters
        # and the buffers it is passed (a graph dynamo keeps cached keeps no shard alive, and
        # no copy of a buffer)
        shards = {
            name: _placeholder(lay.shard_shape, lay.dtype, prog.ctx.params[name].device)
            for name, lay in prog.plan.params.items()
        }
        buffers = {
            name: _placeholder(b.shape, b.dtype, b.device)
            for name, i in lifted.buffers.items()
            for b in [example_inputs[i]]
        }
        rank_gm = RankEmitter(
            prog.ctx, prog.graph_module, rank, group_name, shards=shards, attrs=buffers
        ).emit()
        return BoundRankProgram(
            self.rank_compiler, rank_gm, lifted, prog.plan.params, rank, group_name
        )

    def _check_precision(self, lifted: Lifted, example_inputs) -> None:
        """Mixed precision needs a graph that dynamo traced computing in `param_dtype`: of a
        model sharded with the same policy (`rtp_compile.shard(model, mp_policy=...)`), whose
        weights read in it. A graph of full parameters computes in their dtype, and the dtypes
        the model's code derives from them are constants in it."""
        policy = self.transform_opts.get("mp_policy")
        wanted = None if policy is None else policy.param_dtype
        computes = wanted or "each parameter's own dtype (no mp_policy)"
        for name, i in lifted.params.items():
            entry = registry.entry_of(example_inputs[i])
            read_in = None if entry is None else entry.compute_dtype
            if example_inputs[i].is_floating_point() and read_in != wanted:
                raise RuntimeError(
                    f"rtp_compile backend: parameter {name} is read in "
                    f"{read_in or example_inputs[i].dtype}, but the backend's mp_policy "
                    f"computes in {computes}. Dynamo traces a model "
                    "in the dtype its weights are read in, so shard it first with the backend's "
                    "policy: model = rtp_compile.shard(model, mp_policy=policy), then "
                    "torch.compile(model, backend=rtp_compile.backend(mp_policy=policy)), as "
                    "FSDP2 takes fully_shard(model, mp_policy=...) before torch.compile."
                )


def backend(
    world_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    rank_compiler="inductor",
    **transform_opts,
) -> RTPBackend:
    """A torch.compile backend that runs each captured graph as this rank's RTP program:
    `torch.compile(model, backend=rtp_compile.backend(world_size=N))` on every rank of a job.
    `world_size` defaults to the size of `group` (the whole job when None). `transform_opts`
    are `rtp_compile.transform`'s (fuse, bucket_bytes, mp_policy, ...). `rank_compiler`: how
    the emitted rank module runs: compiled whole by "inductor" (the default) or "aot_eager",
    run as emitted by "eager", or a callable `(gm, example_inputs) -> callable`.

    The model's own parameters are released after the first call: train through an optimizer
    built on `model.parameters()` (it steps the shards), read the full state with
    `rtp_compile.full_state_dict(model)`, clip with `rtp_compile.clip_grad_norm_(model, ...)`;
    or call `rtp_compile.shard(model, N)` before compiling, so the model holds its shards."""
    return RTPBackend(world_size, group, rank_compiler, **transform_opts)


def _placeholder(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor of `shape` holding one element: what the rank module keeps where every call
    binds the real tensor."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def _full_shape(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The full shape of a parameter input (a shard's: its parameter's), None for others."""
    entry = registry.sharded(tensor)
    if entry is not None:
        return entry.layout.shape
    return tuple(tensor.shape) if isinstance(tensor, nn.Parameter) else None


def _unshards_removed(gm: fx.GraphModule) -> fx.GraphModule:
    """`rtp_compile.shard`'s model reads each weight as `unshard(shard)`: the program reads the
    shard itself (a placeholder that `lift` knows by identity, with its full shape)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and is_unshard(node.target):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


def _shard_for(
    param: torch.Tensor, layout: ParamLayout, rank: int, group_name: str
) -> registry.Sharded:
    """The shard `param` is trained as: its registered one (which must be cut as `layout`),
    else cut now from the full parameter and registered."""
    entry = registry.entry_of(param)
    if entry is None:
        if registry.is_released(param):
            raise RuntimeError("rtp_compile backend: a released parameter has no shard")
        shard = nn.Parameter(layout.shard(param.detach(), rank), requires_grad=param.requires_grad)
        entry = registry.Sharded(layout, shard, rank, group_name)
        registry.register_full(param, entry)
    elif not entry.keeps(layout):
        raise RuntimeError(
            f"rtp_compile backend: parameter {layout.name} (shape {layout.shape}) is already "
            f"sharded along dim {entry.layout.dim} (granule {entry.layout.granule}), but this "
            f"compiled graph, which serves another module of the same shapes, cuts it along dim "
            f"{layout.dim} (granule {layout.granule}). Shard the model first "
            f"(rtp_compile.shard(model, world_size)) so every graph sees fixed layouts."
        )
    return entry


class BoundRankProgram:
    """What the backend returns for one graph: runs the rank module with the shards of the
    parameters it is called with, and the user's buffers, bound for the call.

    The rank compiler gets the module at the first call, not when the backend emits it: while
    dynamo compiles the user's frame it marks the code of every GraphModule generated then as
    code to skip (`fx_forward_from_src_skip_result`), so a `torch.compile` of the module as
    emitted would not trace its forward but compile each runtime module it calls as a frame of
    its own, one per unit (guarded on the unit's key: past the recompile limit, fullgraph fails).
    The first call runs outside that compile: the code is generated again there."""

    def __init__(
        self,
        compiler,
        rank_gm: fx.GraphModule,
        lifted: Lifted,
        layouts: dict[str, ParamLayout],
        rank: int,
        group_name: str,
    ):
        self.compiler, self.run, self.rank_gm = compiler, None, rank_gm
        self.params, self.buffers, self.inputs = lifted.params, lifted.buffers, lifted.inputs
        self.layouts, self.rank, self.group_name = layouts, rank, group_name

    def _compiled(self, inputs: list) -> None:
        for module in self.rank_gm.modules():  # the root and its bodies (fused, checkpointed)
            if isinstance(module, fx.GraphModule):
                module.recompile()
        self.run, self.compiler = self.compiler(self.rank_gm, inputs), None

    def __call__(self, *args):
        bound, full = {}, []
        for name, i in self.params.items():
            entry = _shard_for(args[i], self.layouts[name], self.rank, self.group_name)
            bound[name] = entry.shard
            if entry.shard is not args[i]:
                full.append(args[i])
        bound.update({name: args[i] for name, i in self.buffers.items()})
        inputs = [args[i] for i in self.inputs]
        with _bound(self.rank_gm, bound):
            if self.run is None:
                self._compiled(inputs)
            out = self.run(*inputs)
        for param in full:
            registry.release(param)
        return out


@contextlib.contextmanager
def _bound(module: nn.Module, tensors: dict[str, torch.Tensor]):
    """`module`'s parameters and buffers named in `tensors` replaced by those for the block."""
    tables = []
    graphs = [m for m in module.modules() if isinstance(m, fx.GraphModule)]
    for name, tensor in tensors.items():
        owner_name, _, leaf = name.rpartition(".")
        for graph in graphs:  # the module's, and the bodies that read it (a checkpoint's)
            try:
                owner = graph.get_submodule(owner_name)
            except AttributeError:
                continue
            table = owner._parameters if leaf in owner._parameters else owner._buffers
            if leaf in table:
                tables.append((table, leaf, table[leaf]))
                table[leaf] = tensor
    try:
        yield
    finally:
        for table, leaf, old in tables:
            table[leaf] = old


def rtp_backend(gm: fx.GraphModule, example_inputs):
    """`backend="rtp"`: the backend with default options, the world of the job's group."""
    return RTPBackend()(gm, example_inputs)


def register_rtp_backend() -> None:
    """Register `backend="rtp"` with dynamo, unless it is registered already or dynamo found
    it as the `torch_dynamo_backends` entry point (it then registers it on first use, and
    would refuse a duplicate)."""
    from importlib.metadata import EntryPoint

    from torch._dynamo.backends import registry as dynamo_backends

    if "rtp" in dynamo_backends._COMPILER_FNS or isinstance(
        dynamo_backends._BACKENDS.get("rtp"), EntryPoint
    ):
        return
    dynamo_backends.register_backend(rtp_backend, name="rtp")
