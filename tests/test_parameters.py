"""`gm.parameters()` of a rank module is exactly that rank's shards, one per model parameter:
what an optimizer built on it steps (no placeholders, no copies, nothing left out). The
transformers models are checked the same way by `jobs.hf_parity`, on every rank they train."""
import pytest
import torch

import rtp_compile
from zoo import ZOO, build


def assert_exactly_the_shards(model: torch.nn.Module, prog, rank: int):
    gm = prog.module(rank)
    named = dict(gm.named_parameters(remove_duplicate=False))
    assert len(named) == len(list(gm.parameters())) == len(list(model.parameters()))
    assert set(named) == set(prog.plan.params)
    for name, p in named.items():
        assert not p.is_meta, name
        assert tuple(p.shape) == tuple(prog.plan.params[name].shard_shape), name


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("name", list(ZOO))
def test_rank_parameters_are_the_shards(name, world_size):
    model = build(name, 0)
    prog = rtp_compile.transform(model, world_size)
    for rank in range(world_size):
        assert_exactly_the_shards(model, prog, rank)

