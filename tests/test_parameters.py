"""`gm.parameters()` of a rank module is exactly that rank's shards, one per model parameter:
what an optimizer built on it steps (no placeholders, no copies, nothing left out)."""
import pytest
import torch

import rtp_compile
from hf_zoo import HF_ZOO, build_hf, hf_batch
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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(HF_ZOO))
def test_rank_parameters_are_the_shards_on_transformers_models(name):
    example = hf_batch(name, 0, 0, 0) if HF_ZOO[name][3] else None
    model = build_hf(name, 0)
    prog = rtp_compile.transform(model, 2, example_kwargs=example)
    assert_exactly_the_shards(model, prog, 1)
