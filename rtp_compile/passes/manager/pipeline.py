"""The runner of the pass pipeline: each pass `(gm, ctx) -> gm` in order, its invariant checked
after it, what it changed recorded.

A pass is a plain function marked with `graph_pass(check=...)`: `check(gm, ctx)` raises
`InvariantError` when the graph or context it left breaks the invariant its docstring states
(cheap, always run). `required=True` marks a pass the program cannot do without (it cannot be
disabled); `plans_only=True` a planning pass, which only writes the plan in the context: the runner
checks that it left every node as it was. Every pass leaves a `PassRecord` in `ctx.pass_log`: op
counts before and after, the nodes it added and removed; with `Options.debug` it is also logged at
INFO through `logging.getLogger("rtp_compile")` and keeps the graph's code before and after
(`.diff()`).
"""

from __future__ import annotations

import collections
import difflib
import logging
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from rtp_compile.core.ir import target_name
from rtp_compile.core.tables import format_table

log = logging.getLogger("rtp_compile")


class InvariantError(AssertionError):
    """A pass left a graph or context that breaks its stated invariant (a compiler bug)."""


def graph_pass(*, check, required: bool = False, plans_only: bool = False):
    """Mark `fn(gm, ctx) -> gm` as a pass with its invariant `check(gm, ctx)`; `plans_only`:
    a planning pass, which writes the plan in `ctx` and leaves the graph as it was (the
    pipeline checks that too)."""

    def mark(fn):
        fn.check, fn.required, fn.plans_only = check, required, plans_only
        return fn

    return mark


def op_name(node: fx.Node) -> str:
    """What a node does, for op counts: its op and target."""
    if node.op in ("call_function", "call_method", "call_module"):
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            target = str(target)  # e.g. aten.linear.default, rtp.ring_shift_start.default
        else:
            target = target_name(node)
        if node.op == "call_module":
            target = target.rsplit(".", 1)[0] if target.startswith("rtp_units.") else target
        return f"{node.op}:{target}"
    return node.op


@dataclass
class PassRecord:
    """What one pass changed: op counts before/after, nodes added/removed (by name)."""

    name: str
    before: collections.Counter
    after: collections.Counter
    added: list[str]
    removed: list[str]
    skipped: bool = False
    code_before: str | None = field(default=None, repr=False)
    code_after: str | None = field(default=None, repr=False)

    def changed_ops(self) -> dict[str, tuple[int, int]]:
        """op -> (count before, count after), for the ops whose count changed."""
        ops = sorted(set(self.before) | set(self.after))
        return {
            op: (self.before[op], self.after[op]) for op in ops if self.before[op] != self.after[op]
        }

    def diff(self) -> str:
        """Unified diff of the graph's code (kept with `debug=True`)."""
        if self.code_before is None:
            return "(compile with debug=True to keep each pass's code)"
        return "".join(
            difflib.unified_diff(
                self.code_before.splitlines(True),
                self.code_after.splitlines(True),
                f"before {self.name}",
                f"after {self.name}",
            )
        )

    def __str__(self) -> str:
        if self.skipped:
            return f"{self.name}: disabled"
        ops = (
            ", ".join(
                f"{op} {a}->{b}" for op, a, b in ((op, *c) for op, c in self.changed_ops().items())
            )
            or "no op changed"
        )
        return (
            f"{self.name}: {sum(self.before.values())} -> {sum(self.after.values())} nodes "
            f"(+{len(self.added)} -{len(self.removed)}); {ops}"
        )


def pass_table(records: list[PassRecord], ops_shown: int = 3) -> str:
    """`records` (a program's `pass_log`) as a table: per pass its node count before and
    after, the nodes added and removed, and the ops whose count changed most (`ops_shown` of
    them, then how many more)."""
    rows = [("pass", "nodes", "added", "removed", "ops changed")]
    for r in records:
        if r.skipped:
            rows.append((r.name, "disabled", "", "", ""))
            continue
        changed = sorted(r.changed_ops().items(), key=lambda c: -abs(c[1][1] - c[1][0]))
        ops = ", ".join(f"{op.split(':', 1)[-1]} {a}->{b}" for op, (a, b) in changed[:ops_shown])
        more = f" (+{len(changed) - ops_shown} more)" if len(changed) > ops_shown else ""
        rows.append(
            (
                r.name,
                f"{sum(r.before.values())} -> {sum(r.after.values())}",
                f"+{len(r.added)}",
                f"-{len(r.removed)}",
                (ops + more) or "-",
            )
        )
    return format_table(rows, align="left")


def _census(gm: fx.GraphModule) -> tuple[collections.Counter, set[str]]:
    nodes = list(gm.graph.nodes)
    return collections.Counter(op_name(n) for n in nodes), {n.name for n in nodes}


def run_pipeline(passes, gm: fx.GraphModule, ctx, pipeline=None) -> fx.GraphModule:
    """Apply `passes` in order (skipping those in `ctx.options.disable`), check each one's
    invariant after it and record what it changed in `ctx.pass_log`. `pipeline`: the whole
    pipeline `passes` are a part of (default: `passes`), the names `disable` may give."""
    names = [p.__name__ for p in (pipeline or passes)]
    disable = set(ctx.options.disable)
    unknown = sorted(disable - set(names))
    if unknown:
        raise ValueError(
            f"rtp_compile.transform: disable names no pass: {unknown}; the passes are {names}"
        )
    needed = [p.__name__ for p in (pipeline or passes) if p.required and p.__name__ in disable]
    if needed:
        raise ValueError(
            f"rtp_compile.transform: pass(es) {needed} cannot be disabled: the "
            f"rank programs are made from what they produce; optional passes: "
            f"{[p.__name__ for p in (pipeline or passes) if not p.required]}"
        )
    debug = ctx.options.debug
    census = _census(gm)  # the graph's, as the last pass left it
    for p in passes:
        before, before_names = census
        if p.__name__ in disable:
            record = PassRecord(p.__name__, before, before, [], [], skipped=True)
        else:
            code = gm.code if debug else None
            gm = p(gm, ctx)
            p.check(gm, ctx)
            census = after, after_names = _census(gm)
            if p.plans_only and (after, after_names) != (before, before_names):
                raise InvariantError(f"{p.__name__} is a planning pass but changed the graph")
            record = PassRecord(
                p.__name__,
                before,
                after,
                sorted(after_names - before_names),
                sorted(before_names - after_names),
                code_before=code,
                code_after=gm.code if debug else None,
            )
        ctx.pass_log.append(record)
        log.log(logging.INFO if debug else logging.DEBUG, "%s", record)
    return gm
