"""The runtime of a fused block (column-split linears -> region -> row-split linear).

Forward steps are emitted inline like any unit's; they also hand the unit each step's column
outputs (the block's hidden slice before its region: together the size of one hidden activation,
or of q, k and v in attention, what the unfused layers would save too) and the values the region
reads from outside (a mask, rotary tables, sizes). Backward recomputes the region of a step from
them under autograd (for attention: the attention of the shard's heads, as activation
checkpointing would), so its gradient needs no rule of its own.
"""

from __future__ import annotations

import torch

from rtp_compile.core.ir import Split
from rtp_compile.core.op_rules import LinearRule
from rtp_compile.runtime.rotated import UnitRuntime

LINEAR = LinearRule()


def head_groups(slots, tail_layout) -> tuple[int, int]:
    """(first group, groups held) of the cut axis (whole heads) in the shard with these slots."""
    slot = slots["tail.weight"]
    return slot.offset // tail_layout.granule, slot.valid // tail_layout.granule


def sub_roles(values: dict, prefix: str) -> dict:
    """{"weight": ..., "bias": ...} of one linear of the block, from its "prefix.role" keys."""
    return {r.split(".", 1)[1]: v for r, v in values.items() if r.split(".", 1)[0] == prefix}


class FusedBlockRuntime(UnitRuntime):
    def __init__(
        self,
        name,
        fusion,
        roles,
        layouts,
        body,
        rank,
        world_size,
        group_name,
        schedule,
        grad_scale,
        precision,
    ):
        super().__init__(
            name, roles, layouts, rank, world_size, group_name, schedule, grad_scale, precision
        )
        self.column_options = [h.call.options for h in fusion.columns]
        self.tail_options = fusion.tail.call.options
        self.hidden, self.body, self.attention = fusion.hidden, body, fusion.attention
        self.n_externals = len(fusion.externals)
        self.tail_weight = roles.index("tail.weight")

    def extra_repr(self) -> str:
        what = "attention heads" if self.attention else "pointwise"
        return (
            f"fused block: {len(self.column_options)} column-split linear(s) -> {what} -> "
            f"row-split linear, hidden {self.hidden}; rank {self.rank} of {self.world_size}"
        )

    def forward(self, y, x, *tensors, ticket=None):
        """As UnitRuntime's, after the rank's own shards: the region's externals, then the column
        outputs of each step that held real groups."""
        externals = tensors[len(self.roles) : len(self.roles) + self.n_externals]
        if torch.is_grad_enabled() and any(
            isinstance(e, torch.Tensor) and e.requires_grad for e in externals
        ):
            raise RuntimeError(
                f"rtp_compile: fused block {self.unit_name} reads a value that "
                "requires grad from outside the block (the planner only allows "
                "values that carry no gradient); compile with fuse=False"
            )
        return super().forward(y, x, *tensors, ticket=ticket)

    def _width(self, slots) -> int:
        return slots["tail.weight"].valid

    def _saved_columns(self, shard, saved):
        """This shard's column outputs among `saved` (all-padding shards saved none)."""
        index = sum(1 for s in range(shard) if self.layouts[self.tail_weight].slot(s).valid)
        k = len(self.column_options)
        cols = saved[self.n_externals :]
        return cols[index * k : (index + 1) * k]

    def _local(self, shard, dy, x, shards, slots, saved, scratch):
        """(region output h, column output grads) of one step, computed once per step."""
        if "h" not in scratch:
            width = self._width(slots)
            tail = sub_roles(shards, "tail")
            w_tail = LINEAR.weight_as_out_in(
                self.tail_options,
                tail["weight"],
                LINEAR.weight_dim(Split.ROW, self.tail_options),
                slots["tail.weight"],
            )
            if width == 0:
                scratch["h"], scratch["dcolumns"] = (
                    dy.new_zeros(*dy.shape[:-1], 0),
                    [dy.new_zeros(*dy.shape[:-1], 0)] * len(self.column_options),
                )
                return scratch
            groups = head_groups(slots, self.layouts[self.tail_weight])
            externals = saved[: self.n_externals]
            columns = self._saved_columns(shard, saved)
            if torch.compiler.is_compiling():
                # torch.func's vjp, which dynamo traces into the backward graph (autograd.grad
                # it does not); eager, autograd (functorch's wrappers hide storages from
                # dispatch modes such as MemTracker)
                h, region_vjp = torch.func.vjp(
                    lambda *cols: self.body(*groups, *cols, *externals), *columns
                )[:2]  # (no aux: two values; the stubs say three)
                scratch["h"], scratch["dcolumns"] = h, region_vjp(dy @ w_tail)
                return scratch
            cols = [h.detach().requires_grad_(True) for h in columns]
            with torch.enable_grad():
                h = self.body(*groups, *cols, *externals)
            scratch["h"] = h.detach()
            scratch["dcolumns"] = torch.autograd.grad(h, cols, dy @ w_tail)
        return scratch

    def step_input_grad(self, shard, dy, x, shards, slots, saved, dx, scratch):
        local = self._local(shard, dy, x, shards, slots, saved, scratch)
        if dx is None:
            return
        for i, (options, dh) in enumerate(zip(self.column_options, local["dcolumns"])):
            col = sub_roles(shards, f"col{i}")
            w = LINEAR.weight_as_out_in(
                options,
                col["weight"],
                LINEAR.weight_dim(Split.COL, options),
                slots[f"col{i}.weight"],
            )
            dx += dh @ w

    def step_weight_grads(self, shard, dy, x, shards, slots, saved, into, scratch):
        local = self._local(shard, dy, x, shards, slots, saved, scratch)
        LINEAR.row_weight_grads(
            self.tail_options, dy, local["h"], sub_roles(slots, "tail"), sub_roles(into, "tail")
        )
        for i, (options, dh) in enumerate(zip(self.column_options, local["dcolumns"])):
            LINEAR.col_weight_grads(options, dh, x, sub_roles(into, f"col{i}"))
