"""Runtime modules found by a string key, so that the ops of a compiled graph can name them.

A rank module's units, buckets and job check are Python objects with state (schedules, layouts,
a bucket's per-forward states); a compiled graph cannot hold one, so its module calls a custom
op with the module's `rtp_key`, and the op's implementation looks the module up here. Keys are
unique per object in the process, also for copies (deepcopy and unpickling re-register); the
registry holds the modules weakly, so it never keeps a dropped rank module alive.

Non-tensor values a unit saves for its backward (sizes, a dtype) cross an op's boundary encoded
by `encode` / `decode`, since a custom op's schema only takes typed arguments.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from typing import Any

import torch
from torch import nn

_live: weakref.WeakValueDictionary[str, nn.Module] = weakref.WeakValueDictionary()
_serial = itertools.count()


class Keyed(nn.Module):
    """A runtime module an op can name: `rtp_key`, unique in the process while it lives.
    `transaction` (set by codegen, not copied: a copy belongs to no rank module's forward) is
    the gradient transaction of the rank module it runs in."""

    transaction: Any = None  # a runtime.transaction.GradTransaction once codegen sets it

    def register(self, name: str) -> None:
        self.rtp_key = f"{name}#{next(_serial)}"
        _live[self.rtp_key] = self

    def __getstate__(self):
        state = dict(super().__getstate__())
        state.pop("transaction", None)
        return state

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self.register(self.rtp_key.rpartition("#")[0])


def laid_out_like(tensors: list[torch.Tensor], refs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each of `tensors` with the strides `torch.empty_like` gives its ref, which is what a
    backward op's fake returns (inductor checks a custom op's outputs against its fake's):
    copied where they differ (the gradient of a permuted input, say)."""
    out = []
    for t, ref in zip(tensors, refs, strict=True):
        if t.stride() == ref.stride() and ref.is_contiguous():  # empty_like keeps them: no probe
            out.append(t)
            continue
        like = torch.empty_like(ref, dtype=t.dtype)
        out.append(t if t.stride() == like.stride() else like.copy_(t))
    return out


def distinct(tensors: list[torch.Tensor], inputs=()) -> list[torch.Tensor]:
    """`tensors`, as a custom op may return them: each that shares memory with an input or with
    a larger one of them copied (views of one ring message would), the larger kept as it is."""
    taken = {t.untyped_storage()._cdata for t in inputs if isinstance(t, torch.Tensor)}
    out = list(tensors)
    for i in sorted(range(len(out)), key=lambda i: -out[i].numel()):
        storage = out[i].untyped_storage()._cdata
        if storage in taken:
            out[i] = out[i].clone()
        else:
            taken.add(storage)
    return out


def lookup(key: str) -> Any:
    """The live runtime module registered under `key` (typed `Any`: whichever `Keyed` runtime
    registered it, each op knows which)."""
    module = _live.get(key)
    if module is None:
        raise RuntimeError(
            f"rtp_compile: runtime module {key} no longer exists; a compiled graph "
            "outlived the rank module it was compiled from"
        )
    return module


@contextlib.contextmanager
def autograd_in_op():
    """Autograd inside an op's implementation, which the dispatcher runs below autograd (a
    backward that recomputes a region differentiates it); grad mode stays as it is."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        yield


def effectful(*ops) -> None:
    """Mark graph ops that communicate or keep state: compilers must neither drop nor merge
    them, even where no value they return is used."""
    for op in ops:
        torch.fx.node.has_side_effect(op.default)


def graph_op(name: str, mutates_args=()):
    """Decorator: `fn` registered as the (effectful) custom op `rtp::name`, whose fake
    implementation goes on the result's `.op`; calling the result runs the op in a graph being
    compiled (opaque to the compiler), else `fn` itself: the same code, which dispatch modes
    such as MemTracker see into and which costs no dispatch."""

    def wrap(fn):
        op = torch.library.custom_op(f"rtp::{name}", fn, mutates_args=mutates_args)
        overload = getattr(torch.ops.rtp, name).default
        torch.fx.node.has_side_effect(overload)

        @functools.wraps(fn)
        def call(*args):
            if torch.compiler.is_compiling():
                return overload(*args)
            return fn(*args)

        call.op = op  # type: ignore[attr-defined]  # the op rides on its wrapper
        return call

    return wrap


# the kinds of values a unit saves for backward, as `encode` passes them to an op
_TENSOR, _INT, _BOOL, _FLOAT, _DTYPE, _NONE = range(6)


def encode(
    values,
) -> tuple[list[torch.Tensor], list[int | torch.SymInt], list[float], list[int]]:
    """`values` (tensors, ints or SymInts, bools, floats, dtypes, None) as typed op arguments:
    the tensors (a dtype as an empty tensor of it), the ints and bools, the floats, each in
    order, and every value's kind."""
    tensors: list[torch.Tensor] = []
    ints: list[int | torch.SymInt] = []
    floats: list[float] = []
    kinds: list[int] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            kinds.append(_TENSOR)
            tensors.append(v)
        elif isinstance(v, bool):
            kinds.append(_BOOL)
            ints.append(int(v))
        elif isinstance(v, (int, torch.SymInt)):
            kinds.append(_INT)
            ints.append(v)
        elif isinstance(v, float):
            kinds.append(_FLOAT)
            floats.append(v)
        elif isinstance(v, torch.dtype):
            kinds.append(_DTYPE)
            tensors.append(torch.empty(0, dtype=v))
        elif v is None:
            kinds.append(_NONE)
        else:
            raise TypeError(
                f"rtp_compile: a unit saves a {type(v).__name__} for its backward; "
                "only tensors, numbers, dtypes and None can be"
            )
    return tensors, ints, floats, kinds


def decode(tensors, ints, floats, kinds) -> list:
    """The values `encode` made these arguments of."""
    tensors, ints, floats, values = iter(tensors), iter(ints), iter(floats), []
    for kind in kinds:
        if kind == _TENSOR:
            values.append(next(tensors))
        elif kind == _INT:
            values.append(next(ints))
        elif kind == _BOOL:
            values.append(bool(next(ints)))
        elif kind == _FLOAT:
            values.append(next(floats))
        elif kind == _DTYPE:
            values.append(next(tensors).dtype)
        else:
            values.append(None)
    return values


def save_values(ctx, values) -> None:
    """save_for_backward for a mix of tensors and other values (sizes read from the graph)."""
    ctx.is_tensor = [isinstance(v, torch.Tensor) for v in values]
    ctx.others = [v for v in values if not isinstance(v, torch.Tensor)]
    ctx.save_for_backward(*[v for v in values if isinstance(v, torch.Tensor)])


def saved_values(ctx) -> list:
    tensors, others = iter(ctx.saved_tensors), iter(ctx.others)
    return [next(tensors) if t else next(others) for t in ctx.is_tensor]
