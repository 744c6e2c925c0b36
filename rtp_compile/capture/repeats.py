"""Repeated blocks: a model whose `nn.ModuleList` holds alike blocks (a transformer's layers) is
exported with its first `CAPTURED` blocks only, and the graph of the last captured block is
copied for the others, as compilers of repeated layers do: capture then costs the same at any
depth, and the graph is the one a whole export would give, node for node (up to node names).

Blocks are alike when they are distinct modules of the same classes, with parameters and
buffers of the same names, shapes, dtypes (and values, where they have any) and the same
plain attributes, except attributes that differ from block to block (a layer index): while
the prefix is captured those hold a stand-in that raises on any use, so code that reads one
(`if self.layer_idx == 0`) fails that capture and the model is exported whole. The captured
blocks must then be copies of each other in the graph: each block's nodes in one run, the
second block reading the first exactly as the third reads the second, nothing between them,
no activation checkpoint inside. Anything else: `None`, and the caller exports the model whole.

Invariant: the graph returned computes what the model does (each copied block reads its own
parameters and its predecessor's outputs, the model's tail the last block's).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from rtp_compile.core.attributes import install
from rtp_compile.core.ir import CHECKPOINT_KEY

CAPTURED = 3  # blocks exported: the first, and two that must be copies of each other
MIN_BLOCKS = CAPTURED + 1  # fewer: nothing to gain, the model is exported whole
_MODULE_FIELDS = {"_parameters", "_buffers", "_modules"}


@dataclass
class Repeat:
    """A `nn.ModuleList` of alike blocks: its path, its blocks, their differing attributes."""

    path: str
    blocks: list[nn.Module]
    varying: set[tuple[str, str]]  # (submodule path in a block, attribute name)


@dataclass
class Copies:
    """What `replicate` made of a graph: `prefix` is the graph before the copies (its first
    `CAPTURED` blocks, then the tail), and the whole graph is `prefix` with block
    `CAPTURED - 1` copied, op for op, for blocks `CAPTURED .. count - 1` of the list at
    `path`, each copy reading its own block's parameters (`path.k.*`) and the copy before."""

    prefix: fx.GraphModule
    path: str
    count: int

    def boundaries(self) -> tuple[fx.Node, fx.Node]:
        """In `prefix`: the first node computed in the block that is copied, and the first
        node after it (the tail's)."""
        blocks = _cut(self.prefix, self.path)
        assert blocks is not None and blocks.tail, "a prefix whose blocks are not one run"
        return blocks.nodes[-1][0], blocks.tail[0]


class AttributeRead(RuntimeError):
    """The forward used an attribute that differs between blocks: they cannot be copied."""


def _refuse(*args, **kwargs):
    raise AttributeRead("a block attribute that differs between blocks was used")


class _Unread:
    """Stands for an attribute that differs between blocks while the prefix is captured: any
    use of it (comparison, arithmetic, truth, hashing, formatting, indexing) raises."""

    for _name in (
        "__eq__ __ne__ __lt__ __le__ __gt__ __ge__ __hash__ __bool__ __index__ __int__ "
        "__float__ __add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __mod__ __rmod__ "
        "__floordiv__ __truediv__ __pow__ __neg__ __str__ __repr__ __format__ __len__ "
        "__iter__ __getitem__ __contains__ __call__ __getattr__"
    ).split():
        locals()[_name] = _refuse
    del _name


def _state(block: nn.Module) -> tuple[dict, dict]:
    """A block's shape (classes, parameter and buffer specs) and its plain attributes, each
    keyed by (submodule path, name)."""
    shape, attrs = {}, {}
    for sub_path, sub in block.named_modules(remove_duplicate=False):
        shape[(sub_path, "")] = type(sub)
        for name, p in sub._parameters.items():
            spec = None if p is None else (tuple(p.shape), p.dtype, p.requires_grad)
            shape[(sub_path, name)] = ("parameter", spec)
        for name, b in sub._buffers.items():
            shape[(sub_path, name)] = ("buffer", None if b is None else (tuple(b.shape), b.dtype))
        for name, value in vars(sub).items():
            if name not in _MODULE_FIELDS:
                attrs[(sub_path, name)] = value
    return shape, attrs


def _same(a, b, depth: int = 3) -> bool:
    """Whether two attribute values are the same: equal, or (containers, modules and plain
    objects `depth` levels down) made of the same parts; tensors only if the same object."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    if depth and isinstance(a, nn.Module):
        (shape_a, attrs_a), (shape_b, attrs_b) = _state(a), _state(b)
        return shape_a == shape_b and _same(attrs_a, attrs_b, depth - 1)
    if depth and isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], depth - 1) for k in a)
    if depth and isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, depth - 1) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # a value that does not compare: taken as different
        return False


def _same_buffers(blocks: list[nn.Module]) -> bool:
    """Whether every block's buffers hold the first block's values (meta ones hold none)."""
    first = dict(blocks[0].named_buffers())
    for block in blocks[1:]:
        for name, b in block.named_buffers():
            a = first[name]
            if not (a.is_meta or b.is_meta) and not torch.equal(a, b):
                return False
    return True


def alike_blocks(path: str, blocks: list[nn.Module], outside: set[int]) -> Repeat | None:
    """`blocks` as a `Repeat` if they are alike (module docstring); `outside`: ids of the
    model's parameters that are not in `blocks`, which no block may share."""
    if len({id(b) for b in blocks}) < len(blocks):
        return None
    seen: set[int] = set()
    for block in blocks:
        ids = {id(p) for p in block.parameters()}
        if ids & (seen | outside):
            return None  # a parameter shared between blocks, or with the rest of the model
        seen |= ids
    states = [_state(b) for b in blocks]
    shape, attrs = states[0]
    if any(s != shape or a.keys() != attrs.keys() for s, a in states[1:]):
        return None
    varying = {k for k in attrs if any(not _same(attrs[k], a[k]) for _, a in states[1:])}
    if any(k[1].startswith("_") for k in varying) or not _same_buffers(blocks):
        return None  # hooks, or module machinery, that differ: not ours to judge
    return Repeat(path, list(blocks), varying)


def find_repeat(model: nn.Module) -> Repeat | None:
    """The longest `nn.ModuleList` of the model whose blocks are alike, if any."""
    lists = [
        (path, m)
        for path, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and path and len(m) >= MIN_BLOCKS
    ]
    for path, blocks in sorted(lists, key=lambda item: -len(item[1])):
        inside = {id(p) for p in blocks.parameters()}
        outside = {id(p) for p in model.parameters()} - inside
        repeat = alike_blocks(path, list(blocks), outside)
        if repeat is not None:
            return repeat
    return None


@contextlib.contextmanager
def prefix_of(model: nn.Module, repeat: Repeat):
    """Meanwhile the model's list holds its first `CAPTURED` blocks, whose differing
    attributes hold stand-ins (`_Unread`)."""
    parent_path, _, name = repeat.path.rpartition(".")
    parent = model.get_submodule(parent_path)
    whole = getattr(parent, name)
    saved = []
    for block in repeat.blocks[:CAPTURED]:
        for sub_path, attr in repeat.varying:
            sub = block.get_submodule(sub_path)
            saved.append((sub, attr, vars(sub)[attr]))
            vars(sub)[attr] = _Unread()
    setattr(parent, name, nn.ModuleList(repeat.blocks[:CAPTURED]))
    try:
        yield
    finally:
        setattr(parent, name, whole)
        for sub, attr, value in saved:
            vars(sub)[attr] = value


def _block_of(node: fx.Node, path: str) -> int | None:
    """The block (index in the list at `path`) a node computes in or reads from, if any."""
    if node.op == "get_attr":
        names = [node.target]
    else:
        names = [p for p, _ in node.meta.get("nn_module_stack", {}).values()]
    for name in names:
        if name.startswith(path + "."):
            head = name[len(path) + 1 :].split(".")[0]
            if head.isdigit():
                return int(head)
    return None


@dataclass
class _Blocks:
    """The captured graph cut into the blocks' nodes (graph order) and their get_attrs."""

    nodes: list[list[fx.Node]]
    attrs: list[list[fx.Node]]
    tail: list[fx.Node]  # the nodes after the last block


def _cut(gm: fx.GraphModule, path: str) -> _Blocks | None:
    """The blocks' runs of nodes, or None if a block's nodes are not one run in order, with
    nothing else between the blocks, or lie in an activation checkpoint."""
    nodes: list[list[fx.Node]] = [[] for _ in range(CAPTURED)]
    attrs: list[list[fx.Node]] = [[] for _ in range(CAPTURED)]
    order, tail = [], []
    for node in gm.graph.nodes:
        block = _block_of(node, path)
        if block is None:
            if order:
                tail.append(node)
            continue
        if block >= CAPTURED or node.meta.get("custom", {}).get(CHECKPOINT_KEY) is not None:
            return None
        if node.op == "get_attr":
            attrs[block].append(node)
            continue
        if tail or (order and order[-1] > block):
            return None  # a block's nodes not in one run, or something between blocks
        if not order or order[-1] != block:
            order.append(block)
        nodes[block].append(node)
    if order != list(range(CAPTURED)):
        return None
    return _Blocks(nodes, attrs, tail)


def _relative(target: str, path: str) -> str:
    """A get_attr target inside a block, without the block's own path."""
    return target[len(path) + 1 :].split(".", 1)[1]


def _form(blocks: _Blocks, b: int, path: str) -> list | None:
    """What block `b` computes, without names: per node its op, target and arguments, each
    argument a position in the block, a position in the block before, a parameter path
    relative to the block, or a node outside the blocks. None if it reads other blocks."""
    here = {n: i for i, n in enumerate(blocks.nodes[b])}
    before = {n: i for i, n in enumerate(blocks.nodes[b - 1])} if b else {}
    attrs = {n: _relative(n.target, path) for n in blocks.attrs[b]}
    others = {n for nodes in blocks.nodes for n in nodes} - here.keys() - before.keys()
    refs = []

    def ref(arg):
        if arg in here:
            return ("here", here[arg])
        if arg in before:
            return ("before", before[arg])
        if arg in attrs:
            return ("attr", attrs[arg])
        if arg in others or (arg.op == "get_attr" and _block_of(arg, path) is not None):
            raise LookupError
        return ("outside", arg)

    try:
        for node in blocks.nodes[b]:
            args = fx.node.map_arg((node.args, node.kwargs), ref)
            refs.append((node.op, node.target, args))
    except LookupError:
        return None
    return refs


def _renamed(meta: dict, old: str, new: str, stacks: dict) -> dict:
    """A copied node's meta: the module paths of its block `old` now those of block `new`.
    `stacks`: the module stacks renamed so far for this copy, by content; its nodes of one
    stack share its renamed dict (as a graph's copy shares its nodes' meta values)."""
    meta = dict(meta)
    if "nn_module_stack" in meta:
        stack = tuple(meta["nn_module_stack"].items())
        if stack not in stacks:
            stacks[stack] = {
                key.replace(old, new, 1): (
                    p.replace(old, new, 1) if p == old or p.startswith(old + ".") else p,
                    kind,
                )
                for key, (p, kind) in stack
            }
        meta["nn_module_stack"] = stacks[stack]
    return meta


def _tensor(block: nn.Module, relative: str) -> torch.Tensor:
    """The parameter or buffer at `relative` inside `block`."""
    owner_path, _, name = relative.rpartition(".")
    owner = block.get_submodule(owner_path)
    return owner._parameters.get(name, owner._buffers.get(name))


def replicate(gm: fx.GraphModule, repeat: Repeat) -> bool:
    """Copy the last captured block of `gm` for every further block of `repeat`, in place:
    each copy reads its own block's parameters and buffers and the copy before; the tail
    reads the last copy. False (and `gm` untouched) if the captured blocks are not copies of
    each other (module docstring)."""
    path = repeat.path
    blocks = _cut(gm, path)
    if blocks is None or not blocks.tail:
        return False
    last = _form(blocks, CAPTURED - 1, path)
    if last is None or last != _form(blocks, CAPTURED - 2, path):
        return False
    template, before, graph = blocks.nodes[-1], blocks.nodes[-2], gm.graph
    tail = set(blocks.tail)
    earlier = {n for nodes in blocks.nodes[:-1] for n in nodes}
    if any(u in tail for n in earlier for u in n.users):
        return False  # the tail reads an earlier block: copies would not know which
    attr_of = {n: _relative(n.target, path) for n in blocks.attrs[-1]}
    anchor = blocks.attrs[-1][-1] if blocks.attrs[-1] else None
    made = template
    for index in range(CAPTURED, len(repeat.blocks)):
        prefix = f"{path}.{index}"
        env = dict(zip(before, made))  # what the template read of its block before
        if anchor is not None:
            with graph.inserting_after(anchor):  # the copy's parameters, in captured order
                for node in reversed(blocks.attrs[-1]):
                    target = f"{prefix}.{attr_of[node]}"
                    install(gm, target, _tensor(repeat.blocks[index], attr_of[node]))
                    env[node] = graph.get_attr(target)
                    env[node].meta = dict(node.meta)
            anchor = env[blocks.attrs[-1][-1]]
        stacks: dict = {}
        with graph.inserting_before(blocks.tail[0]):
            for node in template:
                env[node] = graph.node_copy(node, lambda a: env.get(a, a))
                env[node].meta = _renamed(node.meta, f"{path}.{CAPTURED - 1}", prefix, stacks)
        made = [env[n] for n in template]
    for node, copy in zip(template, made):
        node.replace_all_uses_with(copy, delete_user_cb=lambda user: user in tail)
    graph.lint()
    gm.recompile()
    return True
