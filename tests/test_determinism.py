"""Two runs of the same training from the same seeds give bitwise-equal parameters and
gradients on CPU at every world size 1-4 (separate jobs: fresh processes, fresh hash seeds)."""

import pytest
import torch
from jobs import trained_state
from zoo import build

import rtp_compile

MODELS = ["gpt", "conv"]  # a tied head and buckets; BatchNorm buffers (2 steps each)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_runs_are_bitwise_equal(seed):
    runs = [
        rtp_compile.launch(trained_state, 4, args=(MODELS, seed, 2), timeout=400) for _ in range(2)
    ]
    initial = build("gpt", seed).state_dict()
    for rank, (first, second) in enumerate(zip(*runs)):
        assert sorted(first) == sorted((k, name) for k in range(rank + 1, 5) for name in MODELS)
        for key, state in first.items():
            for part in ("full", "shards", "grads"):
                a, b = state[part], second[key][part]
                assert a.keys() == b.keys() and a, (rank, key, part)
                for name in a:
                    assert torch.equal(a[name], b[name]), f"rank {rank} {key} {part} {name}"
            if key[1] == "gpt":  # and training moved the weights: the runs compare something
                assert all(
                    not torch.equal(initial[n], v)
                    for n, v in state["full"].items()
                    if n.endswith("weight")
                ), (rank, key)
