"""Clipping, gradient accumulation and activation checkpointing behave as under DDP (issue 12),
float64, in real gloo jobs."""

import pytest
import torch
from jobs import checkpointed_like_ddp, clip_like_ddp, micro_batches_like_ddp

import rtp_compile

TOL = 1e-9


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_clip_grad_norm_is_global_like_ddps(world_size, seed):
    """The total norm over all ranks' shards (padding not counted) and the clipped gradients
    equal DDP's for norms 2, inf and 1; torch's own clip_grad_norm_ on the shards is a local
    norm (it differs as soon as the weights are split); a non-finite norm raises on every rank."""
    results = rtp_compile.launch(clip_like_ddp, world_size, args=(seed,), timeout=200)
    assert world_size == 1 or any(r["padded"] for r in results)  # widths 10 and 37: padded
    for rank, r in enumerate(results):
        assert r.pop("nonfinite") is not None, rank  # every rank raised, none hung
        r.pop("padded")
        for norm_type, e in r.items():
            assert e["total"] <= TOL and e["grad"] <= TOL, (rank, norm_type, e)
            if world_size > 1 and norm_type != float("inf"):
                assert e["local_vs_global"] > 1e-3, (rank, norm_type, e)


@pytest.mark.timeout(300)
def test_micro_batches_accumulate_like_ddp(seed):
    """Three micro-batches of different sizes per optimizer step, accumulated into gradients
    that are None (first step) or zero tensors (zero_grad(set_to_none=False), second step):
    the gradients and the parameters after each AdamW step equal DDP's."""
    for rank, r in enumerate(
        rtp_compile.launch(micro_batches_like_ddp, 3, args=(seed,), timeout=200)
    ):
        assert r["grad"] <= TOL and r["param"] <= TOL and r["grads_kept"], (rank, r)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size,capture,bucket_bytes", [(2, "fx", None), (3, "export", 0)])
def test_activation_checkpoints_recompute_by_rotation_like_ddp(
    world_size, capture, bucket_bytes, seed
):
    """Blocks under torch.utils.checkpoint(use_reentrant=False), captured by torch.fx or
    torch.export, bucketed or not: each becomes a checkpointed region of the rank's program;
    outputs, gradients and two AdamW steps equal DDP's on the same checkpointed model; the
    backward re-runs each region's forward hops (its weights fetched again by rotation, one
    message per step: each block is one fused unit) and leaves nothing in flight; the peak
    falls (benchmarks/checkpointing.py measures by how much)."""
    for rank, r in enumerate(
        rtp_compile.launch(
            checkpointed_like_ddp, world_size, args=(seed, capture, bucket_bytes), timeout=200
        )
    ):
        assert r["regions"] == [
            "rtp_checkpoints.region0",
            "rtp_checkpoints.region1",
            "rtp_checkpoints.region2",
        ], (rank, r)
        for what in ("output", "grad", "param"):
            assert r[what] <= TOL, (rank, what, r)
        (forward, backward), (plain_forward, plain_backward) = r["hops"][True], r["hops"][False]
        assert forward == plain_forward, (rank, r["hops"])
        assert backward == plain_backward + 3 * (world_size - 1), (rank, r["hops"])  # 3 blocks
        assert r["left_in_flight"] == 0 and r["pooled"] == 0, (rank, r)
        assert r["peak"][True] < 0.8 * r["peak"][False], (rank, r["peak"])


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_a_reentrant_checkpoint_is_refused_with_what_to_do(capture):
    class Reentrant(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.fc, x, use_reentrant=True)

    example = (torch.randn(2, 4),) if capture == "export" else None
    with pytest.raises(rtp_compile.CaptureError, match="pass use_reentrant=False"):
        rtp_compile.transform(Reentrant(), 2, example_inputs=example)


def _user_checkpointed_convnet(rank: int, world_size: int, seed: int) -> list:
    from matrix_cells import cell_ac_user
    from matrix_spec import FAMILY

    return cell_ac_user(FAMILY["convnet-fx"], rank, world_size, seed)


@pytest.mark.timeout(300)
def test_a_checkpointed_batchnorm_updates_its_statistics_like_ddp(seed):
    """User code checkpointing each layer of a ConvNet (BatchNorm inside a region): the region
    reads the statistics it updates in place itself, rather than taking them as checkpoint
    inputs (whose saved-tensor version check refused the update on recomputation); outputs,
    gradients and an AdamW step equal DDP's. The feature matrix's cell (tests/matrix_cells.py)."""
    from matrix_spec import unmet

    for rank, checks in enumerate(
        rtp_compile.launch(_user_checkpointed_convnet, 2, args=(seed,), timeout=240)
    ):
        assert checks and not unmet(checks), (rank, checks)
