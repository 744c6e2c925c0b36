"""The IR's vocabulary, in one place: the words of a plan (unit kinds, how a weight is split,
how step outputs combine, what a cut-axis rewrite does), the events of a schedule, the label
every node of a unit carries (`NodeLabel`, in `node.meta["rtp"]`), the marker calls the passes
write into the rank-generic program (codegen replaces each one for a rank) and the label
capture leaves on a node computed inside an activation checkpoint.

The words are string enums: a member equals, hashes and prints as its value, so tables and
reports read as before and a value read back from a string (a test, a user) compares equal."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch.fx as fx


class Word(str, enum.Enum):
    """A string enum whose members print and format as their value (Python 3.10 and later)."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)


class UnitKind(Word):
    """What a unit of the plan does with its weights each step."""

    ROTATE = "rotate"  # one op whose shards rotate around the ring, one step per shard
    FUSED = "fused"  # a block (MLP, attention) rotated as one unit
    GATHER = "gather"  # an op that cannot compute on a shard: its weights gathered whole
    SMALL = "small"  # tiny elementwise parameters, all gathered in one message per hop


class Split(Word):
    """How a rotated linear-like op cuts its weight: along its outputs or its inputs."""

    COL = "col"  # column parallel: each shard gives some output features (concatenated)
    ROW = "row"  # row parallel: each shard reads some input features (summed)


class CombineMode(Word):
    """How a unit's step outputs form its output."""

    CAT = "cat"  # concatenated along a dim, in shard order
    SUM = "sum"  # summed, in step order


class RewriteKind(Word):
    """What a cut-axis rewrite does to a region node's size or operand."""

    SIZE = "size"  # a full extent becomes the shard's groups x size / G
    SLICE = "slice"  # an operand narrowed to the shard's groups along a dim
    CHECK = "check"  # an operand of unknown shape: sliced or broadcast at run time


class Action(Word):
    """What a node of a unit does (its label's action) or what a schedule event does."""

    START = "start"  # forward: start the hop of the next step's shards
    COMPUTE = "compute"  # forward: one step on the shard held
    WAIT = "wait"  # forward: wait for that hop
    COMBINE = "combine"  # the steps' outputs combined
    DETACH = "detach"  # a unit's own shards and input taken out of autograd
    BUCKET = "bucket"  # a bucket's parameters passed through its runtime
    FETCH_START = "fetch_start"  # backward: start re-fetching the next step's weights
    FETCH_WAIT = "fetch_wait"  # backward: wait for them
    RELEASE = "release"  # backward: free a fetched buffer
    INPUT_GRAD = "input_grad"  # backward: a step's input gradient
    RECEIVE_GRAD = "receive_grad"  # backward: wait for the gradient accumulator
    WEIGHT_GRAD = "weight_grad"  # backward: a step's weight gradients into the accumulator
    PASS = "pass"  # backward: pass the accumulator on
    DONE = "done"  # backward: a fused unit's gradients complete
    # a unit's marker and autograd link are labelled with the unit's kind (`UnitKind`)


@dataclass
class NodeLabel:
    """What a node of the rank-generic program belongs to, in `node.meta["rtp"]`: its unit,
    the step (None: the unit's marker or link) and action; `units`: the small parameters'
    marker lists the units it serves; a hop's message (`tag`, `dtype`, `bytes`), its `bucket`,
    and whether it was moved before the previous unit's last step (`prefetched`)."""

    unit: str
    step: int | None
    action: Action | UnitKind
    units: tuple[str, ...] | None = None
    bucket: str | None = None
    tag: int | None = None
    dtype: object = None
    bytes: int | None = None
    prefetched: bool = False


LABEL_KEY = "rtp"


def target_name(node: fx.Node) -> str:
    """The name of what `node` calls: a method's or module's name as the graph holds it, a
    function's or op overload's `__name__` (e.g. "linear", "linear.default")."""
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", None) or str(target)


def label_of(node: fx.Node) -> NodeLabel | None:
    """The unit label of `node`, None on a node of no unit."""
    return node.meta.get(LABEL_KEY)


def set_label(node: fx.Node, label: NodeLabel) -> None:
    node.meta[LABEL_KEY] = label


def unit_of(node: fx.Node) -> str | None:
    """The unit `node` belongs to, None on a node of no unit."""
    label = label_of(node)
    return None if label is None else label.unit


CHECKPOINT_KEY = "rtp_checkpoint"  # fx `custom` node meta: the activation checkpoint a node is in


def checkpoint_region(node: fx.Node) -> int | None:
    """The activation checkpoint a captured node was computed in (numbered in the order the
    forward entered them), None outside any."""
    return node.meta.get("custom", {}).get(CHECKPOINT_KEY)


def rotated_op(name: str, x, *params):
    """Marker of a rotated op in the rank-generic graph; codegen unrolls it for a rank."""
    raise RuntimeError(
        f"rotation unit {name!r} belongs to the rank-generic program: run the "
        "module of a rank, prog.module(rank), not prog.graph"
    )


def fused_block(name: str, x, *params_then_extras):
    """Marker of a fused block in the rank-generic graph; codegen unrolls it for a rank."""
    raise RuntimeError(
        f"fused block {name!r} belongs to the rank-generic program: run the "
        "module of a rank, prog.module(rank), not prog.graph"
    )


def gathered_op(name: str, *inputs):
    """Marker of a gathered op in the rank-generic graph; codegen calls its GatheredOpRuntime."""
    raise RuntimeError(
        f"gathered op {name!r} belongs to the rank-generic program: run the "
        "module of a rank, prog.module(rank), not prog.graph"
    )


def gathered_small(*params):
    """Marker of the small parameters gathered once per step (all of them, in one message per
    hop); codegen calls the runtime that gathers them and returns them whole."""
    raise RuntimeError(
        "the small parameters belong to the rank-generic program: run the module "
        "of a rank, prog.module(rank), not prog.graph"
    )


def bucket_params(name: str, *own):
    """Marker: bucket `name`'s parameters pass through its runtime before its units read them
    (its backward reduce-scatters the bucket's gradients, `runtime.bucket`)."""
    raise RuntimeError(
        f"bucket {name!r} belongs to the rank-generic program: run prog.module(rank)"
    )


def unit_step(name: str, step: int, x, *held_then_extras):
    """Marker of forward step `step` of unit `name`; codegen traces the step for the shard the
    rank holds then."""
    raise RuntimeError(
        f"unit {name!r} belongs to the rank-generic program: run the module of a "
        "rank, prog.module(rank), not prog.graph"
    )


def unit_combine(name: str, parts):
    """Marker: the steps' partial outputs of unit `name` combined (codegen concatenates them
    in shard order, or sums them in step order right after each step)."""
    raise RuntimeError(f"unit {name!r} belongs to the rank-generic program: run prog.module(rank)")


def unit_autograd(name: str, y, x, *params_then_extras):
    """Marker: unit `name`'s runtime module, which links its combined output `y` into autograd
    (its backward executes the unit's backward events)."""
    raise RuntimeError(f"unit {name!r} belongs to the rank-generic program: run prog.module(rank)")
