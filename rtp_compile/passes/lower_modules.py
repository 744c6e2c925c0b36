"""Module calls -> the torch functions they compute, so parameters become visible graph inputs.

fx keeps torch.nn modules as leaf `call_module` nodes. This pass rewrites the ones whose
computation is a single torch function (Linear, Conv, Embedding, norms, dropout, activations)
into that function with `get_attr` reads of the module's parameters and buffers. Train/eval-
dependent modules read
`self.training` at run time, so `.eval()` on an emitted module switches them like on the original.

Invariant: the graph computes what the module calls computed; no call of a module in the
table is left (others, e.g. nn.MultiheadAttention, stay `call_module` and are gathered); every
parameter is read by its canonical name (a tied module's alias too). Function level only: an
exported graph has no module calls.
"""

from __future__ import annotations

import warnings

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from rtp_compile.core.graph_ops import batch_norm_module
from rtp_compile.passes.analysis.match import canonical_reads
from rtp_compile.passes.manager.pipeline import InvariantError, graph_pass


def _conv_fn(m):
    transposed = isinstance(m, nn.modules.conv._ConvTransposeNd)
    n = len(m.kernel_size)
    return getattr(F, f"conv_transpose{n}d" if transposed else f"conv{n}d")


def _lower_conv(m, x, read, emit):
    if isinstance(m, nn.modules.conv._ConvTransposeNd):
        if m.padding_mode != "zeros":
            return None
        return _conv_fn(m), (
            x,
            read("weight"),
            read("bias"),
            m.stride,
            m.padding,
            m.output_padding,
            m.groups,
            m.dilation,
        )
    if m.padding_mode != "zeros":
        padded = emit(F.pad, (x, m._reversed_padding_repeated_twice), {"mode": m.padding_mode})
        return _conv_fn(m), (
            padded,
            read("weight"),
            read("bias"),
            m.stride,
            (0,) * len(m.kernel_size),
            m.dilation,
            m.groups,
        )
    return _conv_fn(m), (x, read("weight"), read("bias"), m.stride, m.padding, m.dilation, m.groups)


def _lower(m: nn.Module, x, read, training, emit):
    """(function, args[, kwargs]) computing module `m` on `x`; None when `m` is not in the table."""
    if type(m) is nn.Linear:
        return F.linear, (x, read("weight"), read("bias"))
    if isinstance(m, nn.modules.conv._ConvNd):
        return _lower_conv(m, x, read, emit)
    if type(m) is nn.Embedding:
        return F.embedding, (
            x,
            read("weight"),
            m.padding_idx,
            m.max_norm,
            m.norm_type,
            m.scale_grad_by_freq,
            m.sparse,
        )
    if type(m) is nn.LayerNorm:
        return F.layer_norm, (x, m.normalized_shape, read("weight"), read("bias"), m.eps)
    if type(m) is nn.RMSNorm:
        return F.rms_norm, (x, m.normalized_shape, read("weight"), m.eps)
    if type(m) is nn.GroupNorm:
        return F.group_norm, (x, m.num_groups, read("weight"), read("bias"), m.eps)
    if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm):
        return batch_norm_module, (
            x,
            read("running_mean"),
            read("running_var"),
            read("num_batches_tracked"),
            read("weight"),
            read("bias"),
            training,
            m.momentum,
            m.eps,
            m.track_running_stats,
        )
    dropouts = {
        nn.Dropout: F.dropout,
        nn.Dropout1d: F.dropout1d,
        nn.Dropout2d: F.dropout2d,
        nn.Dropout3d: F.dropout3d,
    }
    if type(m) in dropouts:
        return dropouts[type(m)], (x, m.p, training, m.inplace)
    if type(m) is nn.GELU:
        return F.gelu, (x,), {"approximate": m.approximate}
    activations = {nn.ReLU: F.relu, nn.SiLU: F.silu, nn.Tanh: torch.tanh, nn.Sigmoid: torch.sigmoid}
    if type(m) in activations and not getattr(m, "inplace", False):
        return activations[type(m)], (x,)
    return None


def _lowerable(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
        return False
    nothing = lambda *args, **kwargs: None  # noqa: E731  (a dry run emits no node)
    return _lower(gm.get_submodule(node.target), None, nothing, None, nothing) is not None


def _check(gm: fx.GraphModule, ctx) -> None:
    left = [n.target for n in gm.graph.nodes if _lowerable(n, gm)]
    if left:
        raise InvariantError(f"lower_modules left module calls it lowers: {left}")
    canonical_reads(gm, ctx)


@graph_pass(check=_check)
def lower_modules(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Rewrite known torch.nn leaf calls into torch functions over get_attr'd tensors."""
    if ctx.level != "function":
        return gm
    canonical = ctx.canonical
    graph = gm.graph
    training = None
    for node in list(graph.nodes):
        if not _lowerable(node, gm):
            continue
        module = gm.get_submodule(node.target)
        with graph.inserting_before(node):
            if training is None:
                with warnings.catch_warnings():  # `training` is a plain attribute, read at run time
                    warnings.simplefilter("ignore", UserWarning)
                    training = graph.get_attr("training")

            def read(name, prefix=node.target, module=module):
                value = getattr(module, name, None)
                target = f"{prefix}.{name}"
                return graph.get_attr(canonical.get(target, target)) if value is not None else None

            new = graph.call_function(
                *_lower(module, node.args[0], read, training, graph.call_function)
            )
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    graph.eliminate_dead_code(is_impure_node=lambda n: n.op != "get_attr")
    gm.recompile()
    return gm
