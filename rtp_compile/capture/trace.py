"""Model (+ example inputs) -> one torch.fx graph whose parameters are read by their original names.

Two capture paths: `torch.fx.symbolic_trace` when no example inputs are given
(plain user models; torch.nn modules stay leaf calls, lowered later by `passes.lower_modules`),
and `torch.export.export(strict=False)` with them (what real models need), unlifted back to a
GraphModule. Either way every parameter is a `get_attr` node named by its canonical (first)
fully qualified name; tied aliases are listed so state dicts can restore every name.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from rtp_compile.capture.repeats import (
    AttributeRead,
    Copies,
    find_repeat,
    prefix_of,
    replicate,
)
from rtp_compile.core.ir import CHECKPOINT_KEY
from rtp_compile.core.lazy_graph import as_lazy, lazy_graph_module
from rtp_compile.core.state_keys import native_state_keys


class CaptureError(RuntimeError):
    """The model could not be captured by any path; the message says what to do."""


@dataclass
class Captured:
    """A captured model: the graph module, its capture level and the parameters by name."""

    gm: fx.GraphModule
    level: str  # "function" (fx) | "aten" (export)
    params: dict[str, torch.Tensor]  # canonical name -> the model's parameter
    aliases: dict[str, list[str]] = field(default_factory=dict)  # canonical -> every name
    native_keys: list[str] = field(default_factory=list)  # parameters, persistent buffers
    model: nn.Module | None = field(default=None, repr=False)  # what was captured (meta init)
    examples: tuple = field(default=(None, None), repr=False)  # (example_inputs, _kwargs) given
    copies: Copies | None = field(default=None, repr=False)  # `gm` is a prefix with copies


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


def capture(
    model: nn.Module,
    example_inputs=None,
    example_kwargs=None,
    compute_dtype: torch.dtype | None = None,
    cast_inputs: bool = True,
) -> Captured:
    """Capture `model`: torch.export with example inputs (or the `dummy_inputs` a transformers
    model carries), torch.fx.symbolic_trace without. Nodes computed inside an activation
    checkpoint are labelled with it (`checkpoint_region`).

    `compute_dtype` (mixed precision's `param_dtype`): the model is captured as it runs under
    FSDP2's policy, its floating parameters (and, with `cast_inputs`, its floating example
    inputs) in that dtype, so every dtype its code derives from them (`x.to(self.weight.dtype)`,
    an attention mask's `finfo(dtype).min`, a norm's cast back to its input's dtype) is the one
    it computes in; export records such dtypes as constants. Afterwards the parameters are the
    model's own again: the graph reads them through the casts the passes add."""
    params, aliases = parameter_names(model)
    if compute_dtype is not None:
        example_inputs, example_kwargs = _cast_floating(
            (example_inputs, example_kwargs), compute_dtype if cast_inputs else None
        )
    copies = None
    with _labelling_checkpoints(), _parameters_in(model, compute_dtype):
        if example_inputs is None and example_kwargs is None:
            dummy = _fitting_dummy_inputs(model)
            if dummy:
                gm, copies = _export_blocks_once(model, None, dummy, "its dummy_inputs")
                level = "aten"
            else:
                gm, level = as_lazy(_trace_fx(model)), "function"
        else:
            gm, copies = _export_blocks_once(
                model, example_inputs, example_kwargs, "the given example inputs"
            )
            level = "aten"
    _tidy(gm, aliases, copies)
    return Captured(
        gm,
        level,
        params,
        aliases,
        native_state_keys(model),
        model=model,
        examples=(example_inputs, example_kwargs),
        copies=copies,
    )


def _tidy(gm: fx.GraphModule, aliases: dict[str, list[str]], copies: Copies | None) -> None:
    """Canonical parameter reads and no metadata asserts in `gm` and in the prefix it was
    copied from (`gm` stays that prefix with its last block copied: each op is dropped from
    every block alike, and only unread parameter reads are dead code)."""
    for module in (gm,) if copies is None else (gm, copies.prefix):
        _canonicalise_parameter_reads(module, aliases)
        _drop_metadata_asserts(module)
    if copies is not None:  # the prefix reads what `gm` holds, under its canonical names
        copies.prefix = lazy_graph_module(gm, copies.prefix.graph)


@contextlib.contextmanager
def _parameters_in(model: nn.Module, dtype: torch.dtype | None):
    """The model's floating parameters hold `dtype` copies of their data meanwhile (the same
    Parameter objects, so ties and names hold); their own data is put back afterwards."""
    saved = []
    if dtype is not None:
        for p in {id(p): p for p in model.parameters()}.values():
            if p.is_floating_point() and p.dtype != dtype:
                saved.append((p, p.data))
                p.data = _in_dtype(p.data, dtype)
    try:
        yield
    finally:
        for p, data in saved:
            p.data = data


def _in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`; a stand-in that holds less than its extent (the compile backend's
    zero-byte parameters, an expanded scalar) stays one, rather than being materialised."""
    if not t.is_meta and t.untyped_storage().nbytes() < t.numel() * t.element_size():
        return torch.zeros((), dtype=dtype, device=t.device).expand(t.shape)
    return t.to(dtype)


def _cast_floating(tree, dtype: torch.dtype | None):
    """`tree` with every floating tensor cast to `dtype` (None: unchanged)."""
    if dtype is None:
        return tree
    return torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree
    )


# What export leaves in a graph to re-check what it saw: the dtype, device and layout of a
# tensor (`.to()` and friends assert their input's). They check the capture, not the program:
# the passes change what they would assert (mixed precision a dtype, a meta model's device).
_METADATA_ASSERTS = (torch.ops.aten._assert_tensor_metadata.default,)


def _drop_metadata_asserts(gm: fx.GraphModule) -> None:
    """Erase export's assertions of a tensor's captured dtype, device and layout (they return
    nothing and nothing reads them). Assertions on input sizes (`_assert_scalar`) stay: they
    are about the user's inputs, which no pass changes."""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in list(module.graph.nodes):
                if node.op == "call_function" and node.target in _METADATA_ASSERTS:
                    module.graph.erase_node(node)
            module.recompile()


@contextlib.contextmanager
def _labelling_checkpoints():
    """While capturing, `torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False)` runs
    `fn` inline (both capture paths would inline it anyway, dropping the checkpoint) with every
    node it makes labelled by the checkpoint's number (fx's `custom` node meta); a checkpoint
    inside another belongs to the outer one. A reentrant checkpoint is refused: it hides its
    function from both tracers."""
    import torch.fx.traceback as fx_traceback
    import torch.utils.checkpoint as torch_checkpoint

    entered = itertools.count()

    def labelled(fn, *args, **kwargs):
        if fx_traceback.current_meta.get("custom", {}).get(CHECKPOINT_KEY) is not None:
            yield  # nested: the outer checkpoint's label stays
            return
        with fx_traceback.annotate({CHECKPOINT_KEY: next(entered)}):
            yield

    def reentrant(*args, **kwargs):
        raise CaptureError(
            "rtp_compile cannot capture torch.utils.checkpoint.checkpoint(..., "
            "use_reentrant=True): pass use_reentrant=False (what torch recommends), which "
            "rtp_compile keeps as an activation checkpoint of the rank's program"
        )

    saved = (
        torch_checkpoint._checkpoint_without_reentrant_generator,
        torch_checkpoint.CheckpointFunction.apply,
    )
    torch_checkpoint._checkpoint_without_reentrant_generator = labelled
    torch_checkpoint.CheckpointFunction.apply = reentrant
    try:
        with fx_traceback.preserve_node_meta():
            yield
    finally:
        (
            torch_checkpoint._checkpoint_without_reentrant_generator,
            torch_checkpoint.CheckpointFunction.apply,
        ) = saved


def _named_inputs(model: nn.Module) -> list[str]:
    """The forward's parameters that can be passed by name (not *args / **kwargs)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in inspect.signature(model.forward).parameters.values() if p.kind in kinds]


def _fitting_dummy_inputs(model: nn.Module) -> dict | None:
    """A transformers model's `dummy_inputs`, when forward names every one of them (some models
    inherit text dummies they cannot take, e.g. input_ids for a vision model)."""
    dummy = getattr(model, "dummy_inputs", None)
    if isinstance(dummy, dict) and dummy and set(dummy) <= set(_named_inputs(model)):
        return dummy
    return None


def _trace_fx(model: nn.Module) -> fx.GraphModule:
    try:
        return fx.symbolic_trace(model)
    except CaptureError:
        raise
    except Exception as err:
        inputs = ", ".join(_named_inputs(model)[:6])
        raise CaptureError(
            f"rtp_compile could not capture {type(model).__name__} with torch.fx.symbolic_trace "
            f"(the path used without example inputs): {type(err).__name__}: {err}\n"
            f"Pass example inputs so torch.export is used instead: {type(model).__name__}."
            f"forward takes ({inputs}), e.g. rtp_compile.transform(model, world_size, "
            f"example_kwargs={{'{_named_inputs(model)[0] if inputs else 'x'}': tensor}})."
        ) from err


@contextlib.contextmanager
def _without_kv_cache(model: nn.Module):
    """transformers models return a KV cache (a generation-time structure training never reads,
    and not a pytree export can flatten): switch it off in every sub-config while capturing."""
    configs = {
        id(c): c for m in model.modules() if hasattr(c := getattr(m, "config", None), "use_cache")
    }
    saved = {key: c.use_cache for key, c in configs.items()}
    for c in configs.values():
        c.use_cache = False
    try:
        yield
    finally:
        for key, c in configs.items():
            c.use_cache = saved[key]


def _dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """Every dim of every tensor input free (Dim.AUTO: export keeps what the model allows),
    keyed by the forward's parameter names."""
    from torch.export import Dim

    def auto_dims(value):
        return (
            {d: Dim.AUTO for d in range(value.dim())} if isinstance(value, torch.Tensor) else None
        )

    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    return {
        name: torch.utils._pytree.tree_map(
            auto_dims, value, is_leaf=lambda v: isinstance(v, torch.Tensor)
        )
        for name, value in bound.items()
    }


def _sizes_of_one_doubled(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The example inputs with every dim of size 1 doubled (each tensor concatenated with
    itself there), or None when no dim is 1."""
    grown = False

    def grow(value):
        nonlocal grown
        if isinstance(value, torch.Tensor) and 1 in value.shape:
            grown = True
            for d, size in enumerate(value.shape):
                if size == 1:
                    value = torch.cat([value, value], dim=d)
        return value

    is_leaf = lambda v: isinstance(v, torch.Tensor)  # noqa: E731
    out = (
        torch.utils._pytree.tree_map(grow, args, is_leaf=is_leaf),
        torch.utils._pytree.tree_map(grow, kwargs, is_leaf=is_leaf),
    )
    return out if grown else None


def _runs(model: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether the model computes anything on these inputs (no meta tensor among them, its
    parameters and buffers)."""
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    return not any(
        t.is_meta
        for t in (
            *model.parameters(),
            *model.buffers(),
            *[v for v in leaves if isinstance(v, torch.Tensor)],
        )
    )


def _same_outputs(model: nn.Module, gm: fx.GraphModule, args: tuple, kwargs: dict) -> bool:
    """Whether the graph captured from other sizes gives the model's outputs on the example
    itself (same random state for both; the model must compute: `_runs`)."""
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        expected = torch.utils._pytree.tree_leaves(model(*args, **kwargs))
        torch.manual_seed(0)
        got = torch.utils._pytree.tree_leaves(gm(*args, **kwargs))
    return len(expected) == len(got) and all(map(_close, expected, got))


def _close(a, b) -> bool:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return type(a) is type(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
    return torch.equal(a, b)


def _export_blocks_once(
    model: nn.Module, args, kwargs, source: str
) -> tuple[fx.GraphModule, Copies | None]:
    """`_export`, a model's alike blocks exported once (`capture.repeats`): its first blocks
    exported and the last of them copied for the others (and what was copied: `Copies`); the
    model whole (and None) where the blocks are not alike, read what differs between them, or
    do not come out as copies."""
    repeat = find_repeat(model)
    if repeat is not None:
        try:
            with prefix_of(model, repeat):
                gm = as_lazy(_export(model, args, kwargs, source))
        except (CaptureError, AttributeRead):
            gm = None
        if gm is not None:
            prefix = lazy_graph_module(gm, copy.deepcopy(gm.graph))
            if replicate(gm, repeat):
                return gm, Copies(prefix, repeat.path, len(repeat.blocks))
    return as_lazy(_export(model, args, kwargs, source)), None


def _export(model: nn.Module, args, kwargs, source: str) -> fx.GraphModule:
    from torch.export import export

    args = tuple(args) if isinstance(args, (tuple, list)) else (args,) if args is not None else ()
    kwargs = dict(kwargs or {})
    errors = []
    with _without_kv_cache(model):
        try:
            dynamic = _dynamic_shapes(model, args, kwargs)
        except TypeError as err:
            raise CaptureError(
                f"rtp_compile: {source} do not fit {type(model).__name__}.forward: {err}"
            ) from err
        grown = _sizes_of_one_doubled(args, kwargs)
        # export fixes a size it sees as 1: trace at 2, check at 1 (a meta model cannot be
        # checked, so it is captured as given)
        if grown is not None and _runs(model, args, kwargs):
            try:
                gm = export(model, *grown, strict=False, dynamic_shapes=dynamic).module()
                if _same_outputs(model, gm, args, kwargs):
                    return gm
            except CaptureError:
                raise
            except Exception:
                pass  # the model needs those sizes to be 1: capture them fixed, as given
        for dynamic_shapes in (dynamic, None):  # sizes free where the model allows, else fixed
            try:
                return export(
                    model, args, kwargs, strict=False, dynamic_shapes=dynamic_shapes
                ).module()
            except CaptureError:
                raise
            except Exception as err:
                errors.append(
                    f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                )
    raise CaptureError(
        f"rtp_compile could not capture {type(model).__name__} with torch.export.export"
        f"(strict=False) from {source} (tried with dynamic sizes, then static): "
        f"{errors[-1]}\nCheck that the example inputs are what the model's forward accepts; "
        "a model without data-dependent control flow can also be passed without example inputs "
        "(torch.fx.symbolic_trace)."
    )


def _canonicalise_parameter_reads(gm: fx.GraphModule, aliases: dict[str, list[str]]) -> None:
    """Point every get_attr of a tied alias at its canonical name (and drop unread ones)."""
    canonical = {alias: canon for canon, names in aliases.items() for alias in names}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target in canonical:
            node.target = canonical[node.target]
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.op not in ("get_attr",))
    gm.recompile()
