"""What one compilation knows, handed to every pass: `Context`, with the user's `Options`.

A pass reads what earlier passes left here (the plan, the unit bodies, the schedules) and adds
its own; nothing else travels between passes, and the program keeps the context it was made
with, so every later step (codegen, cost, state dicts) reads the same record.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from rtp_compile.core.checks import check_world_size
from rtp_compile.core.lazy_graph import lazy_graph_module
from rtp_compile.runtime.precision import Precision

if TYPE_CHECKING:
    from rtp_compile.passes.manager.pipeline import PassRecord
    from rtp_compile.passes.plan import Plan
    from rtp_compile.runtime.events import UnitSchedule


@dataclass(frozen=True)
class Options:
    """How to compile, as `rtp_compile.transform` takes it.

    `grad_reduction`: "mean" (like DDP) or "sum" over the ranks' batches. `fuse_padding`: the
    share whole-head-group cutting may add to a fused attention block's weights per rank.
    `small_param_bytes`: elementwise units (norm affines, layer scales) whose parameters hold at
    most this many bytes are gathered once per step together instead of rotated (0: none).
    `max_bytes_in_flight`: the ring messages a rank may hold at once in forward; the schedule
    starts a unit's first hop during the previous unit's last step where both fit (None: two
    of the largest unit's messages, what one unit alone holds; 0: never).
    `bucket_bytes`: consecutive rotated and fused units share one ring message per step while
    their weights (full size) fit this many bytes; a bucket is held gathered through its
    forward and its backward, like an FSDP2 block (0: none; "auto": the size the context's
    `bucket_chooser` picks).
    `disable`: names of passes to skip (`rtp_compile.passes.PIPELINE`). `debug`: log every
    pass's graph diff at INFO through `logging.getLogger("rtp_compile")` and keep the code
    before and after each pass in `prog.pass_log`. `mp_policy`: FSDP2's
    `MixedPrecisionPolicy` (compute and rotation in `param_dtype`, gradients reduced in
    `reduce_dtype`, the shards themselves stay in the model's dtype; `runtime.precision`).
    `fixed_layouts`: (parameter name, shard dim or None for flat, granule) of parameters already
    sharded, which the plan keeps (`rtp_compile.shard`, the compile backend's earlier graphs)."""

    grad_reduction: str = "mean"
    fuse_padding: float = 0.02
    small_param_bytes: int = 65536
    max_bytes_in_flight: int | None = None
    bucket_bytes: int | str | None = None
    disable: tuple[str, ...] = ()
    debug: bool = False
    mp_policy: MixedPrecisionPolicy | None = None
    fixed_layouts: tuple[tuple[str, int | None, int], ...] = ()
    hardware: object = None  # bucket_bytes="auto": the `cost.hardware` description it plans for

    def __post_init__(self):
        if self.grad_reduction not in ("mean", "sum"):
            raise ValueError(
                f"rtp_compile.transform: grad_reduction must be 'mean' or 'sum', "
                f"got {self.grad_reduction!r}"
            )
        if (
            isinstance(self.fuse_padding, bool)
            or not isinstance(self.fuse_padding, (int, float))
            or self.fuse_padding < 0
        ):
            raise ValueError(
                f"rtp_compile.transform: fuse_padding must be a share >= 0 (0.02 = "
                f"2%), got {self.fuse_padding!r}"
            )
        if (
            isinstance(self.small_param_bytes, bool)
            or not isinstance(self.small_param_bytes, int)
            or self.small_param_bytes < 0
        ):
            raise ValueError(
                f"rtp_compile.transform: small_param_bytes must be an int >= 0, "
                f"got {self.small_param_bytes!r}"
            )
        if self.bucket_bytes not in (None, "auto") and (
            isinstance(self.bucket_bytes, bool)
            or not isinstance(self.bucket_bytes, int)
            or self.bucket_bytes < 0
        ):
            raise ValueError(
                f'rtp_compile.transform: bucket_bytes must be None, "auto" or an int '
                f">= 0, got {self.bucket_bytes!r}"
            )
        if self.max_bytes_in_flight is not None and (
            isinstance(self.max_bytes_in_flight, bool)
            or not isinstance(self.max_bytes_in_flight, int)
            or self.max_bytes_in_flight < 0
        ):
            raise ValueError(
                f"rtp_compile.transform: max_bytes_in_flight must be None or an int "
                f">= 0, got {self.max_bytes_in_flight!r}"
            )
        if self.mp_policy is not None:
            _check_policy(self.mp_policy)
        object.__setattr__(self, "disable", tuple(self.disable))
        object.__setattr__(self, "fixed_layouts", tuple(self.fixed_layouts))

    @property
    def fixed(self) -> dict[str, tuple[int | None, int]]:
        """Parameter name -> (dim, granule) the plan must keep."""
        return {name: (dim, granule) for name, dim, granule in self.fixed_layouts}


def _check_policy(policy) -> None:
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(
            f"rtp_compile.transform: mp_policy must be a "
            f"torch.distributed.fsdp.MixedPrecisionPolicy, got {policy!r}"
        )
    for field_name in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(policy, field_name)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(
                f"rtp_compile.transform: mp_policy.{field_name} must be None or "
                f"a floating-point torch.dtype, got {dtype!r}"
            )


@dataclass
class Context:
    """One model compiled for `world_size` ranks: what capture found and what the passes made.

    Capture: `level` ("function": torch.fx, "aten": torch.export), `params` (canonical name ->
    the model's parameter), `aliases` (canonical name -> every name of it, tied weights),
    `native_keys` (its parameters, under every name, and persistent buffers, as its modules
    name them, in state_dict order: `rtp_compile.state.model_state`), `model` (what was
    captured, for meta init),
    `examples` (the example inputs and kwargs it was captured with, or None), `copies` (the
    reference is a prefix whose last block was copied for the others: `capture.repeats`) and
    `reference` (the captured graph, never rewritten: the cost model profiles it and every
    world size's program starts from it). Passes: `plan` (plan_sharding, fuse_blocks),
    `bodies` (rotate: the graph a fused or gathered unit runs), `schedules` (schedule: each
    unit's message tags and backward events), `buckets` (bucket_units: name -> the units that
    share its messages; with `bucket_bytes="auto"`, `bucket_chooser(ctx, group)` picks the
    size, given `group(budget)` -> the buckets of that size, and `bucket_choice` records what
    it compared), `pass_log` (the runner: what each pass changed).
    Later passes add their fields here (device mesh, dtypes, buckets)."""

    world_size: int
    options: Options
    level: str
    params: dict[str, torch.Tensor]
    aliases: dict[str, list[str]]
    native_keys: list[str]
    reference: fx.GraphModule
    model: nn.Module | None = field(default=None, repr=False)
    examples: tuple = field(default=(None, None), repr=False)
    copies: object | None = field(default=None, repr=False)  # a capture.repeats.Copies
    plan: Plan | None = None
    bodies: dict[str, fx.GraphModule] = field(default_factory=dict, repr=False)
    schedules: dict[str, UnitSchedule] = field(default_factory=dict, repr=False)
    buckets: dict[str, tuple[str, ...]] = field(default_factory=dict)
    pass_log: list[PassRecord] = field(default_factory=list, repr=False)
    bucket_chooser: Callable | None = field(default=None, repr=False)
    bucket_choice: object | None = None

    @classmethod
    def of(cls, captured, world_size: int, options: Options) -> Context:
        """The context of a fresh capture (`rtp_compile.capture.trace.Captured`)."""
        reference = lazy_graph_module(captured.gm, copy.deepcopy(captured.gm.graph))
        return cls(
            check_world_size(world_size, "rtp_compile.transform"),
            options,
            captured.level,
            captured.params,
            captured.aliases,
            captured.native_keys,
            reference,
            captured.model,
            captured.examples,
            captured.copies,
        )

    def for_world_size(self, world_size: int) -> Context:
        """The same capture and options, for another number of ranks, before any pass."""
        return replace(
            self,
            world_size=check_world_size(world_size, "for_world_size"),
            plan=None,
            bodies={},
            schedules={},
            buckets={},
            pass_log=[],
            bucket_choice=None,
        )

    def fresh_graph(self) -> fx.GraphModule:
        """A copy of the captured graph for the passes to rewrite (parameters shared)."""
        return lazy_graph_module(self.reference, copy.deepcopy(self.reference.graph))

    @property
    def canonical(self) -> dict[str, str]:
        """Every name of a parameter -> its canonical (first) name."""
        return {alias: canon for canon, names in self.aliases.items() for alias in names}

    @property
    def buffer_names(self) -> list[str]:
        """The persistent buffers by native name, in state_dict order."""
        aliases = self.canonical
        return [n for n in self.native_keys if n not in aliases]

    @property
    def precision(self) -> Precision:
        """The dtypes the program computes, rotates and reduces in (`Options.mp_policy`)."""
        return Precision.of(self.options.mp_policy)

    @property
    def grad_scale(self) -> float:
        """Each rank's gradient contribution is multiplied by this: 1/N for "mean"."""
        return 1.0 / self.world_size if self.options.grad_reduction == "mean" else 1.0
