"""Clipping, gradient accumulation and activation checkpointing behave as under DDP (issue 12),
float64, in real gloo jobs."""
import pytest

import rtp_compile
from jobs import clip_like_ddp, micro_batches_like_ddp

TOL = 1e-9


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_clip_grad_norm_is_global_like_ddps(world_size, seed):
    """The total norm over all ranks' shards (padding not counted) and the clipped gradients
    equal DDP's for norms 2, inf and 1; torch's own clip_grad_norm_ on the shards is a local
    norm (it differs as soon as the weights are split); a non-finite norm raises on every rank."""
    results = rtp_compile.launch(clip_like_ddp, world_size, args=(seed,), timeout=200)
    for rank, r in enumerate(results):
        assert r.pop("nonfinite") is not None, rank  # every rank raised, none hung
        for (name, norm_type), e in r.items():
            assert e["total"] <= TOL and e["grad"] <= TOL, (rank, name, norm_type, e)
            if world_size > 1 and norm_type != float("inf"):
                assert e["local_vs_global"] > 1e-3, (rank, name, norm_type, e)
    assert any(e["padded"] for r in results for e in r.values()) or world_size == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size,set_to_none", [(2, True), (3, False)])
def test_micro_batches_accumulate_like_ddp(world_size, set_to_none, seed):
    """Three micro-batches of different sizes per optimizer step, gradients zeroed to None or to
    zero tensors: accumulated gradients and the parameters after two AdamW steps equal DDP's."""
    for rank, r in enumerate(rtp_compile.launch(micro_batches_like_ddp, world_size,
                                                args=(seed, set_to_none), timeout=200)):
        assert r["grad"] <= TOL and r["param"] <= TOL and r["grads_kept"], (rank, r)
