"""A backward's shard gradients land in `.grad` only if the backward completes.

A rank module's backward runs many units, each of whose shard gradients autograd accumulates
into `.grad` as soon as the unit is done. A backward that raises half-way (user code, a failed
peer) would leave some shards' gradients accumulated and others not, and the next optimizer
step would apply them. So the first unit backward of a backward pass *opens* the module's
transaction: each shard's `.grad` is set aside and set to None, autograd accumulates into fresh
tensors, and an autograd engine callback at the end of the backward *commits*: the set-aside
gradient plus the new one (`old.add_(new)`, the sum AccumulateGrad would have made, bitwise).
A unit backward that raises (a failed hop, a failed step) rolls back at once (every `.grad` as
it was, no hop in flight); a backward that raised in the model's own code, where no unit runs,
is rolled back by the module's next forward. Either way the ring counts as broken (its peers
may be waiting on this rank) and the next forward re-forms it (`groups.recover`).

A module with data-parallel replicas (`runtime.replicas`) reduces this backward's gradients
over them inside the transaction: the reduction begins when it opens, finishes before the commit
adds the set-aside gradients, and a failed reduction rolls back like a failed unit backward.

A backward a compiler traced (`UnitRuntime.graph_backward`) opens the transaction by the graph
op `rtp::open_transaction`; a hop of it that fails rolls back the transactions open on its
ring at once (`ring.wait`), and any other error in it is rolled back by the next forward.

A `register_post_accumulate_grad_hook` on a shard sees only this backward's gradient where
`.grad` held one before it (gradient accumulation); `torch.autograd.grad` is unaffected.
"""

from __future__ import annotations

import functools

import torch

from rtp_compile.runtime import ring
from rtp_compile.runtime.groups import ring_state
from rtp_compile.runtime.registry import graph_op, lookup
from rtp_compile.runtime.replicas import ReplicaGradReduction


class GradTransaction:
    """The gradient transaction of one rank module's shards (kept on the module as `rtp_grads`,
    and by each of its runtime modules as `transaction`; `enter_forward` is its forward
    pre-hook's work). `replicas`: the all-reduce of the shards' gradients over the module's
    data-parallel replicas, None without any."""

    def __init__(self, replicas: ReplicaGradReduction | None = None, group_name: str = ""):
        self.params: list[torch.Tensor] = []
        self.set_aside: list[torch.Tensor | None] | None = None  # open while not None
        self.replicas, self.group_name = replicas, group_name

    def enter_forward(self, params: list[torch.Tensor]) -> None:
        """Called before every forward of the module: roll back a backward that raised without
        committing; `params`: the shards it keeps."""
        self.roll_back()
        self.params = params

    def open(self) -> None:
        """Called first by every unit backward; the first of a backward pass sets the shards'
        gradients aside and queues the commit."""
        if self.set_aside is not None:
            return
        self.set_aside = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        ring_state(self.group_name).open_transactions.append(self)
        if self.replicas is not None:
            self.replicas.begin()
        torch.autograd.Variable._execution_engine.queue_callback(self.commit)

    def _closed(self) -> None:
        self.set_aside = None
        opened = ring_state(self.group_name).open_transactions
        if self in opened:
            opened.remove(self)

    def commit(self) -> None:
        if self.replicas is not None:
            try:
                self.replicas.finish()
            except BaseException:
                self.roll_back()
                raise
        for p, old in zip(self.params, self.set_aside or ()):
            if old is not None:
                p.grad = old if p.grad is None else old.add_(p.grad)
        self._closed()
        self.params = []  # nothing left to roll back; keep no shard alive through this module

    def roll_back(self) -> None:
        """Every shard's .grad as the backward found it. A backward that opened and did not
        commit raised: its ring is broken (its peers may wait on this rank)."""
        if self.set_aside is not None:
            ring.mark_broken(self.group_name, "this rank's backward raised")
        if self.replicas is not None:
            self.replicas.abandon()
        for p, old in zip(self.params, self.set_aside or ()):
            p.grad = old
        self._closed()


def transactional(backward):
    """Wrap a runtime module's backward method: open the transaction of the rank module it runs
    in (`runtime.transaction`; None: none, e.g. a copy's); if the backward raises, roll it back,
    which breaks the ring (the next forward re-forms it) and abandons the hops left in flight."""

    @functools.wraps(backward)
    def wrapped(runtime, *args):
        transaction = runtime.transaction
        if transaction is None:
            return backward(runtime, *args)
        transaction.open()
        try:
            return backward(runtime, *args)
        except BaseException:
            transaction.roll_back()  # breaks the ring: what is in flight is abandoned
            raise

    return wrapped


@graph_op("open_transaction")
def open_transaction(key: str, grad: torch.Tensor) -> torch.Tensor:
    """Graph op, first in a backward a compiler traced: opens the gradient transaction of the
    rank module the runtime `key` runs in (none: a copy's). `grad`: the backward's incoming
    gradient, so the op runs once it exists (and, having a tensor argument, a tracer runs its
    fake). Returns an empty ticket: inductor moves layout kernels past an effectful op that
    returns no tensor (see `job.check_job`)."""
    transaction = lookup(key).transaction
    if transaction is not None:
        transaction.open()
    return grad.new_empty(0)


@open_transaction.op.register_fake
def _(key, grad):
    return grad.new_empty(0)
