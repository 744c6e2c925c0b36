"""More than one machine: `prog.module(mesh=...)` on a (replicas, ring) DeviceMesh, FSDP2's HSDP
convention, next to DDP over every rank of the job, float64.

Every rank trains on its own batch; each RTP group gathers its full gradients and compares them
with DDP's (mean over all ranks), and the parameters after AdamW steps with DDP's. Meshes of
2 x 2 (with gradient buckets small enough that their all-reduces start during backward), 2 x 1
(replicas of one-rank rings) and 1 x 2 and 1-D (the ring alone); models with widths no ring
size divides, BatchNorm statistics taken from the mesh's first rank, summed gradients
(`grad_reduction="sum"`); a backward that fails
half-way with replicas, or a reduction that fails, rolled back.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from jobs import (
    buffers_like_ddp,
    failed_backward_leaves_state,
    gathered_grads,
    grad_errors,
    loss_of,
    rel_err,
    train_next_to_ddp,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP
from zoo import batch, build

import rtp_compile
from rtp_compile.runtime.transaction import GradTransaction

TOL = 1e-9


def mesh_parity(
    rank: int,
    world_size: int,
    shape: tuple,
    names: list,
    seed: int,
    bucket_bytes: int | None = None,
) -> dict:
    """Per model: train_next_to_ddp's errors for the module of this rank's place in a mesh of
    `shape` (the last dim the ring), 3 AdamW steps; the module's job; and the errors a mesh
    that does not fit the program raises. `bucket_bytes`: the replicas' gradient buckets."""
    from rtp_compile.runtime import replicas
    from rtp_compile.runtime.job import job_of

    if bucket_bytes is not None:
        replicas.BUCKET_BYTES = bucket_bytes
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "rtp")[-len(shape) :])
    ring = mesh.get_group(len(shape) - 1)
    results = {}
    for name in names:
        model = build(name, seed)
        prog = rtp_compile.transform(model, shape[-1])
        gm = prog.module(mesh=mesh)
        batches = [batch(name, seed, rank, step) for step in range(3)]
        results[name] = train_next_to_ddp(
            prog, gm, model, batches, seed, lambda m, x: m(x), lambda o: o, ring
        )
    job = job_of(gm)
    errors = []
    for wrong in (
        lambda: rtp_compile.transform(model, shape[-1] + 1).module(mesh=mesh),
        lambda: prog.module(0, mesh=mesh),
    ):
        try:
            wrong()
        except ValueError as err:
            errors.append(str(err))
    return {
        "errors": results,
        "messages": errors,
        "job": (
            job.rank,
            job.world_size,
            job.replica,
            job.replicas,
            job.replica_group_name is not None,
        ),
        "place": (dist.get_rank(ring), mesh.get_local_rank(0) if len(shape) == 2 else 0),
    }


def _check(results, shape):
    for rank, result in enumerate(results):
        for name, errors in result["errors"].items():
            for what, err in errors.items():
                assert err <= TOL, f"rank {rank} {name} on {shape}: {what} rel. error {err:.2e}"
        ring_rank, replica = result["place"]
        replicas = shape[0] if len(shape) == 2 else 1
        assert result["job"] == (ring_rank, shape[-1], replica, replicas, len(shape) == 2)
        wrong_size, both = result["messages"]
        assert f"last dim has {shape[-1]} ranks" in wrong_size
        assert "either mesh=... or rank" in both


def summed_grads(rank: int, world_size: int, shape: tuple, seed: int) -> float:
    """grad_reduction="sum": the gathered gradients against DDP's (a mean) times the ranks."""
    mesh = init_device_mesh("cpu", shape)
    model = build("mlp", seed)
    prog = rtp_compile.transform(model, shape[-1], grad_reduction="sum")
    gm, ddp = prog.module(mesh=mesh), DDP(copy.deepcopy(model))
    x = batch("mlp", seed, rank, 0)
    loss_of(gm(x), seed).backward()
    loss_of(ddp(x), seed).backward()
    return grad_errors(
        gathered_grads(prog, gm, mesh.get_group(1)),
        {n: world_size * ddp.module.get_parameter(n).grad for n in prog.plan.params},
    )


def clipped_on_mesh(rank: int, world_size: int, shape: tuple, seed: int) -> float:
    """rtp_compile.clip_grad_norm_ on a mesh module against DDP's clip_grad_norm_: the largest
    relative error of the total norm and of the clipped gradients (gathered over the ring)."""
    mesh = init_device_mesh("cpu", shape)
    model = build("gpt", seed)  # widths 37 and 10 over a ring of 2: padded shards
    prog = rtp_compile.transform(model, shape[-1])
    gm, ddp = prog.module(mesh=mesh), DDP(copy.deepcopy(model))
    x = batch("gpt", seed, rank, 0)
    loss_of(gm(x), seed).backward()
    loss_of(ddp(x), seed).backward()
    total = rtp_compile.clip_grad_norm_(gm, 0.05)
    reference = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05)
    grads = grad_errors(
        gathered_grads(prog, gm, mesh.get_group(1)),
        {n: ddp.module.get_parameter(n).grad for n in prog.plan.params},
    )
    return max(rel_err(total, reference), grads)


def mesh_and_buffers(rank: int, world_size: int, seed: int) -> dict:
    """2 x 2: mesh_parity with buckets of 64 bytes (about one per parameter, so they
    all-reduce during backward, in an order the hooks do not decide), buffers_like_ddp and
    summed_grads; clipping as DDP clips (clipped_on_mesh)."""
    return {
        "parity": mesh_parity(rank, world_size, (2, 2), ["gpt", "tiedbias"], seed, 64),
        "buffers": buffers_like_ddp(rank, world_size, seed, True, (2, 2)),
        "sum": summed_grads(rank, world_size, (2, 2), seed),
        "clip": clipped_on_mesh(rank, world_size, (2, 2), seed),
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_2x2_mesh_equals_ddp_over_all_ranks(seed):
    """Gradients and AdamW steps equal DDP's over the 4 ranks; BatchNorm statistics too (every
    forward takes the mesh's first rank's, as DDP takes rank 0's)."""
    results = rtp_compile.launch(mesh_and_buffers, 4, args=(seed,), timeout=240)
    _check([r["parity"] for r in results], (2, 2))
    assert [r["parity"]["place"] for r in results] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    for rank, result in enumerate(r["buffers"] for r in results):
        assert result["buffers"] <= TOL and result["eval_output"] <= TOL, (rank, result)
        assert "bn.running_mean" in result["names"]
    assert all(r["sum"] <= TOL for r in results), [r["sum"] for r in results]
    assert all(r["clip"] <= TOL for r in results), [r["clip"] for r in results]


def degenerate_meshes(rank: int, world_size: int, seed: int) -> dict:
    return {
        shape: mesh_parity(rank, world_size, shape, ["mlp"], seed)
        for shape in [(2, 1), (1, 2), (2,)]
    }


@pytest.mark.timeout(300)
def test_degenerate_meshes_equal_ddp(seed):
    """2 x 1 (replicas of one-rank rings: data parallel alone), 1 x 2 and 1-D (the ring
    alone)."""
    results = rtp_compile.launch(degenerate_meshes, 2, args=(seed,), timeout=240)
    for shape in results[0]:
        _check([r[shape] for r in results], shape)


def failed_steps_on_mesh(rank: int, world_size: int, seed: int) -> dict:
    from rtp_compile.runtime import replicas

    replicas.BUCKET_BYTES = 64  # buckets start during backward, before the failure
    return {
        where: failed_backward_leaves_state(rank, world_size, seed, where, (2, 2))
        for where in ("user", "unit")
    }


@pytest.mark.timeout(300)
def test_failed_backward_on_a_mesh_leaves_gradients_unreduced(seed):
    """A backward that raises on every rank after some buckets' all-reduces started, in the
    model's own code (rolled back by the next forward) or in a unit: every `.grad` is as
    before it, nothing in flight, and training goes on equal to DDP."""
    results = rtp_compile.launch(failed_steps_on_mesh, 4, args=(seed,), timeout=240)
    for rank, per_where in enumerate(results):
        for where, result in per_where.items():
            assert result["raised"], (rank, where)
            assert result["unchanged"] and result["left_in_flight"] == 0, (rank, where, result)
            assert result["param"] <= TOL, (rank, where, result)


def test_a_failed_replica_reduction_rolls_back():
    """The replicas' all-reduce fails at the end of backward (a replica left): `.grad` is as
    before the backward, not this backward's unreduced gradient added to it."""

    class LostReplica:
        def begin(self):
            pass

        def finish(self):
            raise RuntimeError("a replica left")

        def abandon(self):
            pass

    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.full((3,), 5.0)
    transaction = GradTransaction(LostReplica())
    transaction.enter_forward([w])

    class OpensTransaction(torch.autograd.Function):  # what a unit's backward does first
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            transaction.open()
            return grad

    with pytest.raises(RuntimeError, match="a replica left"):
        (OpensTransaction.apply(w) * 2).sum().backward()
    assert torch.equal(w.grad, torch.full((3,), 5.0)) and transaction.set_aside is None
