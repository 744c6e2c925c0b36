"""A graph dynamo hands a compile backend -> a module `rtp_compile.transform` can capture.

Dynamo (torch 2.13, `inline_inbuilt_nn_modules`) passes the model's parameters and buffers as
placeholders among the user's inputs, in first-use order, with the real tensors as examples;
SymInt placeholders carry the sizes of a dynamic graph. `lift` turns every parameter placeholder
into a `get_attr` of a stand-in parameter (the full shape and dtype, zero bytes: the user's own
may already be released), every buffer placeholder into a `get_attr` of the user's buffer, and
every SymInt into `x.size(d)` of a tensor input whose size it is; the user's tensors stay inputs.
Names come from dynamo's sources (`L['self']._modules['fc1']._parameters['weight']` ->
`fc1.weight`), made unique; which tensor is which goes by identity, never by name (after a
graph break one graph serves every identical layer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn


@dataclass
class Lifted:
    """The lifted graph and where each placeholder of dynamo's graph went.

    `params`: name -> index of the placeholder holding that parameter (one name per tensor:
    a tied parameter passed twice reads one); `buffers`: name -> index; `inputs`: indices of the
    user's tensors, in the lifted module's argument order; `standins`: name -> the stand-in
    parameter installed there."""

    gm: fx.GraphModule | None = None
    params: dict[str, int] = field(default_factory=dict)
    buffers: dict[str, int] = field(default_factory=dict)
    inputs: list[int] = field(default_factory=list)
    standins: dict[str, nn.Parameter] = field(default_factory=dict)


def _source_text(node: fx.Node) -> str:
    """Dynamo's source of a placeholder as text (`L['self']._modules['fc1']._parameters[...]`)."""
    source = getattr(node, "_dynamo_source", None)
    text = source.name if source is not None else ""
    return text() if callable(text) else text


def source_name(node: fx.Node) -> str:
    """A dotted name from dynamo's source of a placeholder (module path and attribute), else
    the placeholder's own name."""
    parts = re.findall(r"\.(?:_modules|_parameters|_buffers)\['([^']+)'\]", _source_text(node))
    return ".".join(parts) if parts else node.name


def _is_buffer(node: fx.Node) -> bool:
    return "._buffers[" in _source_text(node)


def standin(param: torch.Tensor, shape) -> nn.Parameter:
    """A parameter of `shape` with `param`'s dtype and device holding no memory (one zero,
    expanded): what capture traces instead of a parameter whose storage may be gone."""
    zero = torch.zeros((), dtype=param.dtype, device=param.device).expand(shape)
    return nn.Parameter(zero, requires_grad=param.requires_grad)


def _symint_source(node: fx.Node, tensors: list[fx.Node]) -> tuple[fx.Node, int]:
    """(tensor placeholder, dim) whose size is the SymInt placeholder `node`."""
    symbol = node.meta["example_value"].node.expr
    for t in tensors:
        fake = t.meta.get("example_value")
        for d, size in enumerate(getattr(fake, "shape", ())):
            if isinstance(size, torch.SymInt) and size.node.expr == symbol:
                return t, d
    raise NotImplementedError(
        f"rtp_compile backend: size {symbol} of the compiled graph is not "
        "the size of any of its tensor inputs"
    )


def lift(gm: fx.GraphModule, example_inputs, full_shape) -> Lifted:
    """Lift dynamo's graph (see module doc). `full_shape(tensor)`: the full shape of an input
    that is a parameter of the model (a Parameter's own; a shard's, `rtp_compile.shard`'s,
    its parameter's), None for any other tensor."""
    graph = fx.Graph()
    root = nn.Module()
    lifted = Lifted()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_id: dict[int, str] = {}
    taken: set[str] = set()
    deferred = []
    for i, (node, example) in enumerate(zip(placeholders, example_inputs)):
        shape = full_shape(example) if isinstance(example, torch.Tensor) else None
        if isinstance(example, torch.Tensor) and (shape is not None or _is_buffer(node)):
            name = by_id.get(id(example))
            if name is None:
                name = by_id[id(example)] = _unique(source_name(node), taken)
                if shape is not None:
                    lifted.standins[name] = standin(example, shape)
                    _install(root, name, lifted.standins[name])
                    lifted.params[name] = i
                else:
                    _install(root, name, example)
                    lifted.buffers[name] = i
            deferred.append((node, name))
        elif isinstance(example, torch.Tensor):
            env[node] = graph.placeholder(node.name)
            env[node].meta.update(node.meta)
            lifted.inputs.append(i)
        else:
            deferred.append((node, None))
    tensors = [n for n in placeholders if n in env]
    for node, name in deferred:
        if name is not None:
            env[node] = graph.get_attr(name)
        else:
            t, d = _symint_source(node, tensors)
            env[node] = graph.call_method("size", (env[t], d))
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            env[node] = graph.node_copy(node, lambda a: env[a])
            # dynamo's module paths name the user's model, not this root (capture redoes them)
            env[node].meta.pop("nn_module_stack", None)
    lifted.gm = fx.GraphModule(root, graph, class_name="DynamoGraph")
    return lifted


def _unique(name: str, taken: set[str]) -> str:
    candidate, i = name, 1
    while candidate in taken:
        candidate, i = f"{name}_{i}", i + 1
    taken.add(candidate)
    return candidate


def _install(root: nn.Module, target: str, value: torch.Tensor) -> None:
    """Register a parameter or buffer at a dotted path, creating empty parent modules."""
    *path, leaf = target.split(".")
    module = root
    for part in path:
        if part not in module._modules:
            module.add_module(part, nn.Module())
        module = module._modules[part]
    if isinstance(value, nn.Parameter):
        module.register_parameter(leaf, value)
    else:
        module.register_buffer(leaf, value)
