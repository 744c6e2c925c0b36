"""Parity with the unsharded model and DDP on fresh random data, world sizes 1-4, float64.

Each rank's output equals the unsharded model's on that rank's batch; the gathered shard
gradients equal DDP's (mean over ranks); three AdamW steps equal DDP's three steps.
"""

import pytest
from jobs import parity

import rtp_compile

MODELS = ["mlp", "gpt", "conv", "norule", "shared", "tiedbias", "attention"]
TOL = 1e-9


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_parity_with_unsharded_model_and_ddp(world_size, seed):
    results = rtp_compile.launch(parity, world_size, args=(MODELS, seed), timeout=300)
    for rank, per_model in enumerate(results):
        for (name, capture), errors in per_model.items():
            for what, err in errors.items():
                assert err <= TOL, f"rank {rank} {name} ({capture}): {what} rel. error {err:.2e}"
    assert len(results[0]) == 2 * len(MODELS)
