"""What a rank module does when a step fails: hooks installed on every emitted module.

A forward that raises leaves no hop in flight (also when it raised between two hops) and its
ring broken, since its peers may be left waiting on it (`groups.recover` re-forms it at the
next forward); a backward that raises leaves every shard's `.grad` as it was
(`transaction.GradTransaction`). The hooks run eagerly around a compiled forward too: traced,
each would be a frame compiled per module, guarded on the hops in flight and the shards'
gradients.
"""

from __future__ import annotations

import torch
from torch import nn

from rtp_compile.runtime import ring
from rtp_compile.runtime.job import job_of
from rtp_compile.runtime.registry import Keyed
from rtp_compile.runtime.replicas import ReplicaGradReduction
from rtp_compile.runtime.transaction import GradTransaction


def install_failure_handling(
    gm: nn.Module, replicas: ReplicaGradReduction | None, group_name: str
) -> None:
    """Give `gm` (an emitted rank module) its gradient transaction (`gm.rtp_grads`, also the
    `transaction` of each of its runtime modules, whose backwards open it) and the forward
    hooks that end a failed forward cleanly."""
    gm.register_forward_hook(_forward_returned)
    gm.register_forward_hook(_finish_forward, always_call=True)
    transaction = GradTransaction(replicas, group_name)
    # nn.Module's stubs type a set attribute as Tensor | Module; any value is allowed at run time
    gm.rtp_grads = transaction  # type: ignore[assignment]
    for module in gm.modules():
        if isinstance(module, Keyed):
            module.transaction = transaction
    gm.register_forward_pre_hook(_enter_grad_transaction)


@torch.compiler.disable
def _forward_returned(module, args, output) -> None:
    module.rtp_forward_returned = True


@torch.compiler.disable
def _finish_forward(module, args, output) -> None:
    """After every forward, also one that raised: no hop left in flight; a forward that raised
    (`_forward_returned` did not run) breaks the ring, whose peers may wait on this rank."""
    if not module.rtp_forward_returned:
        ring.mark_broken(job_of(module).group_name, "this rank's forward raised")
    ring.finish_leftover_hops()


@torch.compiler.disable
def _enter_grad_transaction(module, args) -> None:
    module.rtp_forward_returned = False
    module.rtp_grads.enter_forward(list(module.parameters()))
