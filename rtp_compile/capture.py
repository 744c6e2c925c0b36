"""Model (+ example inputs) -> one torch.fx graph whose parameters are read by their original names.

Two capture paths (DESIGN.md §2): `torch.fx.symbolic_trace` when no example inputs are given
(plain user models; torch.nn modules stay leaf calls, lowered later by `passes.lower_modules`),
and `torch.export.export(strict=False)` with them (what real models need), unlifted back to a
GraphModule. Either way every parameter is a `get_attr` node named by its canonical (first)
fully qualified name; tied aliases are listed so state dicts can restore every name.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn


class CaptureError(RuntimeError):
    """The model could not be captured by any path; the message says what to do."""


@dataclass
class Captured:
    """A captured model: the graph module, its capture level and the parameters by name."""
    gm: fx.GraphModule
    level: str                                   # "function" (fx) | "aten" (export)
    params: dict[str, torch.Tensor]              # canonical name -> the model's parameter
    aliases: dict[str, list[str]] = field(default_factory=dict)  # canonical -> every name
    state_keys: list[str] = field(default_factory=list)          # the model's state_dict keys

    @property
    def param_aliases(self) -> set[str]:
        return {alias for names in self.aliases.values() for alias in names}


def parameter_names(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """Parameters by canonical name (first occurrence), and every alias of each (tied weights)."""
    params, aliases, canonical_of = {}, {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canon = canonical_of.setdefault(id(p), name)
        if canon == name:
            params[name] = p
            aliases[name] = [name]
        else:
            aliases[canon].append(name)
    return params, aliases


def capture(model: nn.Module, example_inputs=None, example_kwargs=None) -> Captured:
    """Capture `model` by fx (no example inputs) or torch.export (with them)."""
    params, aliases = parameter_names(model)
    if example_inputs is None and example_kwargs is None:
        gm, level = _trace_fx(model), "function"
    else:
        gm, level = _export(model, example_inputs, example_kwargs), "aten"
    canonicalise_parameter_reads(gm, aliases)
    return Captured(gm, level, params, aliases, list(model.state_dict().keys()))


def _trace_fx(model: nn.Module) -> fx.GraphModule:
    try:
        return fx.symbolic_trace(model)
    except Exception as err:
        raise CaptureError(
            f"rtp_compile could not capture {type(model).__name__} with torch.fx.symbolic_trace "
            f"(the path used without example inputs): {type(err).__name__}: {err}\n"
            "Pass example inputs so torch.export is used instead, e.g. "
            "rtp_compile.transform(model, world_size, example_inputs=(x,))."
        ) from err


def _export(model: nn.Module, args, kwargs) -> fx.GraphModule:
    from torch.export import Dim, export

    args = tuple(args) if isinstance(args, (tuple, list)) else (args,) if args is not None else ()
    kwargs = dict(kwargs or {})

    def auto_dims(value):
        return {d: Dim.AUTO for d in range(value.dim())} if isinstance(value, torch.Tensor) else None

    dynamic = torch.utils._pytree.tree_map(auto_dims, (args, kwargs),
                                           is_leaf=lambda v: isinstance(v, torch.Tensor))
    errors = []
    for dynamic_shapes in (dynamic, None):  # sizes free where the model allows, else as given
        try:
            ep = export(model, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes)
            return ep.module()
        except Exception as err:
            errors.append(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    raise CaptureError(
        f"rtp_compile could not capture {type(model).__name__} with torch.export.export"
        f"(strict=False) from the given example inputs (tried with dynamic sizes, then static): "
        f"{errors[-1]}\nCheck that the example inputs are what the model's forward accepts; "
        "a model without data-dependent control flow can also be passed without example inputs "
        "(torch.fx.symbolic_trace)."
    )


def canonicalise_parameter_reads(gm: fx.GraphModule, aliases: dict[str, list[str]]) -> None:
    """Point every get_attr of a tied alias at its canonical name."""
    canonical = {alias: canon for canon, names in aliases.items() for alias in names}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in canonical:
            node.target = canonical[node.target]
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.op not in ("get_attr",))
    gm.recompile()
