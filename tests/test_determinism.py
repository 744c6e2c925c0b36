"""Two runs of the same training from the same seeds give bitwise-equal parameters and
gradients on CPU at every world size (separate jobs: fresh processes, fresh hash seeds)."""
import pytest
import torch

import rtp_compile
from jobs import trained_state
from zoo import build

MODELS = ["gpt", "conv"]  # a tied head and buckets; BatchNorm buffers


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_two_runs_are_bitwise_equal(world_size, seed):
    runs = [rtp_compile.launch(trained_state, world_size, args=(MODELS, seed), timeout=300)
            for _ in range(2)]
    for rank, (first, second) in enumerate(zip(*runs)):
        for name in MODELS:
            for part in ("full", "shards", "grads"):
                a, b = first[name][part], second[name][part]
                assert a.keys() == b.keys() and a, (rank, name, part)
                for key in a:
                    assert torch.equal(a[key], b[key]), f"rank {rank} {name} {part} {key}"
        # and training moved the parameters: the runs compare something
        initial = build("gpt", seed).state_dict()
        assert all(not torch.equal(initial[k], v) for k, v in first["gpt"]["full"].items()
                   if k.endswith("weight")), rank
